"""Upload admission: may this header's payload be read at all?

A tier checks an upload's header against the open round before it reads a byte of
payload. The checks are pure functions of the header, the round's task, the caller's
role and the state of its assignment, so they are tested on their own
(``tests/server/test_admission.py``) and the coordinator only looks the state up and
reserves the slot when they pass. Every refusal is a named error that says what was
expected.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from orchard.errors import (
    DuplicateUploadError,
    FutureModelVersionError,
    NotSelectedError,
    PayloadTooLargeError,
    RoundClosedError,
    StaleUpdateError,
    UnknownModelVersionError,
    UpdateSchemaError,
)
from orchard.messages import PARTIAL_CODEC, UploadHeader, UploadKind
from orchard.server.round import RoundTask
from orchard.typing import Role, TensorSpec


@dataclass(frozen=True)
class SlotState:
    """What the tier knows of the caller's assignment in the open round."""

    task_id: str
    target: int  # updates expected from this child (1 for a client)
    delivered: bool = False
    in_flight: bool = False
    dropped: bool = False


def check_round(task: RoundTask | None, closed: bool, close_reason: str, run_id: str, rnd: int,
                attempt: int) -> RoundTask:
    """The open round, if ``(run_id, rnd, attempt)`` names it and it is still open."""
    if task is None:
        raise RoundClosedError("no round is open at this tier; this upload is stale")
    t = task
    if (run_id, rnd, attempt) != (t.run_id, t.round, t.attempt):
        when = "stale" if (run_id == t.run_id and (rnd, attempt) < (t.round, t.attempt)) else "unknown or future"
        raise RoundClosedError(
            f"upload for run {run_id!r} round {rnd} attempt {attempt} is {when}; "
            f"the open round is {t.run_id!r} round {t.round} attempt {t.attempt}")
    if closed:
        raise RoundClosedError(f"round {t.round} closed ({close_reason}); late uploads are refused")
    return t


def check_version(task: RoundTask | None, closed: bool, close_reason: str, run_id: str, version: int,
                  max_staleness: int, ahead: int = 0) -> tuple[RoundTask, int]:
    """Asynchronous mode's :func:`check_round`: the open buffer and the staleness of an
    update trained on model version ``version`` (a task's round: the model it carried).

    The open buffer serves version ``task.round``; an update of version ``v`` has
    staleness ``task.round + ahead - v`` and is taken when that is at most
    ``max_staleness``. ``ahead`` is 1 for the continuation of a full buffer: what it
    holds is applied after the next server step at the earliest. The attempt is not
    checked: a retried buffer serves the same model."""
    if task is None:
        raise RoundClosedError("no buffer is open at this tier; poll for a task")
    t = task
    if run_id != t.run_id or version < 1:
        raise UnknownModelVersionError(
            f"update for run {run_id!r} round {version} names no model version this tier served; "
            f"it serves run {t.run_id!r} round {t.round}: poll for a task and train on its model")
    if version > t.round:
        raise FutureModelVersionError(
            f"update for round {version} is from the future: this tier's buffer is round {t.round}; "
            "poll for a task and train on its model")
    s = t.round + ahead - version
    if s > max_staleness:
        raise StaleUpdateError(
            f"update trained in round {version} is {s} versions stale: this tier would apply it in round "
            f"{t.round + ahead} and takes updates at most {max_staleness} versions old; poll for the current model")
    if closed:
        raise RoundClosedError(f"buffer of version {t.round} closed ({close_reason}); poll for a task")
    return t, s


def check_assignment(slot: SlotState | None, node_id: str, task_id: str, rnd: int) -> SlotState:
    """The caller holds assignment ``task_id`` in round ``rnd``."""
    if slot is None or slot.task_id != task_id:
        raise NotSelectedError(f"node {node_id!r} holds no assignment {task_id!r} in round {rnd}")
    return slot


def check_schema(got_schema: tuple[TensorSpec, ...], schema: tuple[TensorSpec, ...]) -> None:
    """An upload's declared tensors against the round's: names, shapes, dtypes."""
    names = [s.name for s in schema]
    if [s.name for s in got_schema] != names:
        raise UpdateSchemaError(f"update names {[s.name for s in got_schema][:5]} do not match the round's {names[:5]}")
    for got, want in zip(got_schema, schema, strict=True):
        if tuple(got.shape) != tuple(want.shape):
            raise UpdateSchemaError(f"tensor {want.name!r} declared shape {got.shape}, expected {want.shape}")
        if got.dtype != want.dtype:
            raise UpdateSchemaError(f"tensor {want.name!r} declared dtype {got.dtype!r}, expected {want.dtype!r}")


def admit_header(h: UploadHeader, caller: str, role: Role, task: RoundTask, slot: SlotState,
                 max_upload_bytes: int) -> UploadKind:
    """Raise the named error that refuses ``h``, or return the upload's kind.

    ``caller`` is the node the connection authenticated as; ``slot`` its assignment in
    ``task``'s round (see :func:`check_round` and :func:`check_assignment`)."""
    if h.node_id != caller:
        raise UpdateSchemaError(f"header names node {h.node_id!r} but the caller is {caller!r}")
    if slot.delivered:
        raise DuplicateUploadError(f"node {caller!r} already delivered its update for round {task.round}")
    if slot.in_flight:
        raise DuplicateUploadError(f"an upload from {caller!r} for round {task.round} is already in progress")
    if slot.dropped:
        raise RoundClosedError(f"node {caller!r} was dropped from round {task.round} after missing heartbeats")
    want_kind = UploadKind.PARTIAL_SUM if role is Role.AGGREGATOR else UploadKind.CLIENT_UPDATE
    if want_kind is UploadKind.CLIENT_UPDATE and task.config.secure_aggregation.enabled:
        raise UpdateSchemaError("this round uses secure aggregation: send the update masked, through SecAgg")
    if h.kind != want_kind:
        raise UpdateSchemaError(f"{'an aggregator' if role is Role.AGGREGATOR else 'a client'} must upload {want_kind.name}, got {h.kind.name}")
    if h.schema != task.schema:  # equal specs pass every check below: compare them one by one only when not
        check_schema(h.schema, task.schema)
    if len(h.payload_sizes) != len(task.schema):
        raise UpdateSchemaError(f"{len(h.payload_sizes)} payload sizes for {len(task.schema)} tensors")
    if min(h.payload_sizes, default=0) < 0:
        raise UpdateSchemaError(f"payload sizes must be >= 0, got {list(h.payload_sizes)[:5]}")
    if h.total_bytes > max_upload_bytes:
        raise PayloadTooLargeError(f"upload declares {h.total_bytes} bytes; the limit is {max_upload_bytes}")
    if want_kind is UploadKind.PARTIAL_SUM:
        if h.codec != PARTIAL_CODEC:
            raise UpdateSchemaError(f"partial sums travel as {PARTIAL_CODEC!r}, got codec {h.codec!r}")
        if not (0 <= h.count <= slot.target * 10 + 10**6):
            raise UpdateSchemaError(f"partial count {h.count} is out of range")
        if h.count > 0 and not (math.isfinite(h.weight) and h.weight > 0):
            raise UpdateSchemaError(f"partial weight must be positive and finite, got {h.weight}")
        if not (0 <= h.dropped <= slot.target * 10 + 10**6):
            raise UpdateSchemaError(f"partial's dropped count {h.dropped} is out of range (0 to its share's bound)")
    else:
        if h.codec != task.config.codec.name:
            raise UpdateSchemaError(f"update encoded with {h.codec!r}; this round uses {task.config.codec.name!r}")
        if h.count != 1:
            raise UpdateSchemaError(f"a client update counts 1, header says {h.count}")
        if h.dropped:
            raise UpdateSchemaError(f"a client update drops no one below it, header says {h.dropped}")
        if not (math.isfinite(h.weight) and h.weight > 0):
            raise UpdateSchemaError(f"update weight must be positive and finite, got {h.weight}")
    if h.staleness and (want_kind is not UploadKind.PARTIAL_SUM or any(k < 0 or v < 0 for k, v in h.staleness.items())
                        or sum(h.staleness.values()) > h.count):
        raise UpdateSchemaError(f"staleness histogram {dict(list(h.staleness.items())[:5])} is not one of a partial's "
                                f"{h.count} updates (staleness >= 0, counts >= 0, at most count in all)")
    for metrics in (h.metric_sums, h.metric_weights):
        for k, v in metrics.items():
            if not math.isfinite(v):
                raise UpdateSchemaError(f"metric {k!r} is not finite ({v})")
    return want_kind
