"""One round, as data: what a tier is asked to do, what it ends with, what is recorded.

These are the records every execution of a round shares: the gRPC root and its
aggregators (``orchard.server.root``, ``orchard.server.aggregator``) and the simulator
(``orchard.simulation.engine``) build a tier's :class:`RoundTask` with the same
functions, push a closed tier's partial upstream as the same :func:`partial_upload`, and
describe a finished attempt with one :class:`RoundRecord`. Nothing here does I/O.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

import numpy as np

from orchard.aggregation import Partial
from orchard.config import RunConfig
from orchard.messages import PARTIAL_CODEC, TaskAssignment, UploadHeader, UploadKind
from orchard.typing import NDArrays, TensorSpec, schema_of
from orchard.updates import encode_partial
from orchard.wire import sha256_hex


@dataclass
class RoundTask:
    """What a tier is asked to do for one round (from the run at the root, from upstream below)."""

    run_id: str
    round: int
    attempt: int
    config: RunConfig
    config_json: str
    model_blob: bytes
    model_hash: str
    schema: tuple[TensorSpec, ...]
    deadline_unix: float
    target: int
    shared_seed: int
    # Central DP: the stddev of the Gaussian noise the root adds to the round's sum (0 at
    # every other tier, and without central DP).
    noise_stddev: float = 0.0


def round_seed(run_seed: int, rnd: int, attempt: int) -> int:
    """The seed every tier and client of one attempt shares (random-k's indices, ...)."""
    return int(np.random.default_rng([run_seed, rnd, attempt]).integers(0, 2**63 - 1))


def root_task(run_id: str, rnd: int, attempt: int, config: RunConfig, config_json: str, arrays: NDArrays,
              blob: bytes, blob_hash: str, now_unix: float, noise_stddev: float = 0.0) -> RoundTask:
    """The root's task for attempt ``attempt`` of round ``rnd`` of a run. ``arrays`` is the
    global model in its blob's order (``wire.blob_to_arrays``): that order is the schema's."""
    return RoundTask(run_id=run_id, round=rnd, attempt=attempt, config=config, config_json=config_json,
                     model_blob=blob, model_hash=blob_hash, schema=tuple(schema_of(arrays)),
                     deadline_unix=now_unix + config.cohort.deadline_s, target=config.buffer_target,
                     shared_seed=round_seed(config.seed, rnd, attempt), noise_stddev=noise_stddev)


def task_from_assignment(a: TaskAssignment, blob: bytes, config: RunConfig | None = None) -> RoundTask:
    """An aggregator's task: its parent's assignment, for its own cohort.

    ``config``: the parsed ``a.config_json`` when the caller has it already."""
    cfg = config if config is not None else RunConfig.model_validate_json(a.config_json)
    return RoundTask(run_id=a.run_id, round=a.round, attempt=a.attempt, config=cfg, config_json=a.config_json,
                     model_blob=blob, model_hash=a.model_hash, schema=a.schema, deadline_unix=a.deadline_unix,
                     target=max(1, a.cohort_target), shared_seed=a.shared_seed)


@dataclass
class RoundOutcome:
    """How a tier's round ended: its partial sum and what it cost. ``dropped``: the
    tier's own selected children dropped, plus those its partials reported from below."""

    task: RoundTask
    partial: Partial
    selected: int
    dropped: int
    bytes_up: int
    bytes_down: int
    tier_participants: dict[str, int]
    reason: str
    seconds: float
    rejected: dict[str, int]
    measurements: dict[str, float] = field(default_factory=dict)  # the aggregator's (clipped, noise, ...)
    staleness: dict[int, int] = field(default_factory=dict)  # asynchronous mode: updates by staleness


def partial_upload(a: TaskAssignment, node_id: str, out: RoundOutcome) -> tuple[UploadHeader, bytes]:
    """A closed tier's partial sum as the PARTIAL_SUM upload its parent folds (float64,
    lossless), with the tier's byte counts and participants for the root's record."""
    p = out.partial
    payload, sizes = encode_partial(p.sums)
    header = UploadHeader(
        node_id=node_id, run_id=a.run_id, round=a.round, attempt=a.attempt, task_id=a.task_id,
        kind=UploadKind.PARTIAL_SUM, schema=a.schema, payload_sizes=sizes, codec=PARTIAL_CODEC,
        payload_sha256=sha256_hex(payload), weight=p.weight, count=p.count,
        metric_sums=dict(p.metrics.sums), metric_weights=dict(p.metrics.weights),
        bytes_up=out.bytes_up, bytes_down=out.bytes_down, tier_participants=dict(out.tier_participants),
        staleness=dict(out.staleness), dropped=out.dropped)
    return header, payload


class RoundStatus(StrEnum):
    RUNNING = "running"
    COMPLETED = "completed"
    FAILED = "failed"  # too few updates: the global model is unchanged and the round is retried
    STOPPED = "stopped"
    INTERRUPTED = "interrupted"  # the root stopped while the round was open


@dataclass
class SimulatedCounts:
    """What only a simulation knows about a round: the fate of every device. ``selected``
    and ``rejected`` count clients (the record's own fields count the root's children
    and refusals), and go into those fields."""

    checked_in: int = 0
    selected: int = 0
    trained: int = 0
    late: int = 0
    vanished: int = 0
    stopped_by_governor: int = 0  # stopped before its first step: no upload
    stopped_early: int = 0  # stopped after some steps: uploads fewer steps' work
    failed_clients: int = 0
    simulated_seconds: float = 0.0
    rejected: dict[str, int] = field(default_factory=dict)  # client uploads refused, by error
    # Wall seconds of a synchronous round's steps in the simulating process (Engine.round):
    # where its time went, for whoever tunes the simulator.
    phase_seconds: dict[str, float] = field(default_factory=dict)


@dataclass
class RoundRecord:
    """One attempt of one round, as the root's store, ``run status``, the simulator's
    ``rounds.jsonl`` and the demo report show it (:meth:`as_dict` keeps the key names
    those have always used)."""

    round: int
    attempt: int
    status: RoundStatus
    participants: int = 0
    selected: int = 0
    dropped: int = 0
    weight: float = 0.0
    bytes_up: int = 0
    bytes_down: int = 0
    seconds: float = 0.0
    closed_because: str = ""
    reason: str = ""  # why a round failed
    tier_participants: dict[str, int] = field(default_factory=dict)
    rejected: dict[str, int] = field(default_factory=dict)
    metrics: dict[str, float] = field(default_factory=dict)
    simulated: SimulatedCounts | None = None
    privacy: dict[str, Any] | None = None  # epsilon spent after this round, delta, clip norm
    staleness: dict[int, int] = field(default_factory=dict)  # asynchronous mode: updates by staleness

    @classmethod
    def from_outcome(cls, out: RoundOutcome, status: RoundStatus, seconds: float | None = None) -> RoundRecord:
        return cls(round=out.task.round, attempt=out.task.attempt, status=status, participants=out.partial.count,
                   selected=out.selected, dropped=out.dropped, weight=out.partial.weight, bytes_up=out.bytes_up,
                   bytes_down=out.bytes_down, seconds=round(out.seconds if seconds is None else seconds, 3),
                   closed_because=out.reason, tier_participants=dict(out.tier_participants),
                   rejected=dict(out.rejected), metrics=out.partial.metrics.means(),
                   staleness=dict(sorted(out.staleness.items())))

    def as_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {
            "round": self.round, "attempt": self.attempt, "status": self.status.value,
            "participants": self.participants, "selected": self.selected, "dropped": self.dropped,
            "weight": self.weight, "bytes_up": self.bytes_up, "bytes_down": self.bytes_down,
            "seconds": self.seconds, "closed_because": self.closed_because,
            "tier_participants": self.tier_participants, "rejected": self.rejected, "metrics": self.metrics,
        }
        if self.reason:
            d["reason"] = self.reason
        if self.privacy is not None:
            d["privacy"] = dict(self.privacy)
        if self.staleness:
            d["staleness"] = {str(k): v for k, v in self.staleness.items()}
        if self.simulated is not None:
            s = self.simulated
            d["selected"] = s.selected
            d["rejected"] = {**self.rejected}
            for name, n in s.rejected.items():
                d["rejected"][name] = d["rejected"].get(name, 0) + n
            d.update(checked_in=s.checked_in, trained=s.trained, late=s.late, vanished=s.vanished,
                     stopped_by_governor=s.stopped_by_governor, stopped_early=s.stopped_early,
                     failed_clients=s.failed_clients, simulated_seconds=s.simulated_seconds)
            if s.phase_seconds:
                d["phase_seconds"] = dict(s.phase_seconds)
        return d
