"""The coordinator's public API as in-process callers (the simulator, tests) use it:
assign, upload as one context that owns the reservation, secure aggregation without the
wait, leave."""

from __future__ import annotations

import time

import numpy as np
import pytest

from orchard.client.update import build_upload
from orchard.compression import build_codec
from orchard.config import CohortConfig, RunConfig, ServerConfig
from orchard.errors import DuplicateUploadError, IntegrityError, NotSelectedError, UpdateSchemaError
from orchard.server.coordinator import Coordinator
from orchard.server.decoding import ClientUpdateDecoder
from orchard.server.round import RoundTask
from orchard.trainer import TrainResult
from orchard.typing import DeviceState, Role, TensorSpec

SCHEMA = (TensorSpec("w", (4,), "float32"),)


def _tier(inline: bool = True, target: int = 2) -> tuple[Coordinator, RoundTask]:
    cfg = RunConfig(cohort=CohortConfig(target=target, over_selection=1.0))
    coord = Coordinator("tier", ServerConfig(node_timeout_s=600), np.random.default_rng(0), ClientUpdateDecoder(),
                        inline=inline)
    for n in ("a", "b"):
        coord.join(n, Role.CLIENT, "tok", DeviceState())
    task = RoundTask(run_id="run", round=1, attempt=0, config=cfg, config_json=cfg.model_dump_json(),
                     model_blob=b"", model_hash="h", schema=SCHEMA, deadline_unix=time.time() + 600, target=target,
                     shared_seed=1)
    return coord, task


def _upload(coord: Coordinator, task: RoundTask, node: str, value: float) -> tuple:
    t = coord.assign(node)
    assert t is not None
    res = TrainResult(arrays={}, weight=2.0, num_examples=2, num_steps=1)
    h, p, _ = build_upload(t, task.config, task.config.train, build_codec(task.config.codec), node,
                           {"w": np.full(4, value, np.float32)}, res, seed=0, states=None)
    return h, p


def test_a_failed_upload_releases_its_slot_and_a_retry_folds() -> None:
    coord, task = _tier()
    cr = coord.open_round(task)
    h, p = _upload(coord, task, "a", 1.0)
    with pytest.raises(IntegrityError):
        coord.upload_now("a", h, p[:-1] + bytes([p[-1] ^ 1]))
    a = cr.assignments["a"]
    assert not a.in_flight and not a.delivered and cr.received == 0 and cr.rejected == {"IntegrityError": 1}
    coord.upload_now("a", h, p)
    assert a.delivered and cr.received == 1
    with pytest.raises(DuplicateUploadError):
        coord.upload_now("a", h, p)
    h2, p2 = _upload(coord, task, "b", 3.0)
    coord.upload_now("b", h2, p2)
    out = coord.outcome(cr)
    assert cr.closed and out.reason == "target reached"
    np.testing.assert_array_equal(out.partial.sums["w"], np.full(4, 2.0 * 1.0 + 2.0 * 3.0))
    assert out.partial.weight == 4.0


def test_a_refused_header_reserves_nothing() -> None:
    coord, task = _tier()
    cr = coord.open_round(task)
    h, p = _upload(coord, task, "a", 1.0)
    with pytest.raises(UpdateSchemaError):
        coord.upload_now("a", h.__class__(**{**h.__dict__, "weight": -1.0}), p)
    assert not cr.assignments["a"].in_flight and coord.counters["uploads_rejected"] == 1
    coord.upload_now("a", h, p)
    assert cr.assignments["a"].delivered


def test_an_upload_whose_body_fails_is_released_counted_and_may_be_retried() -> None:
    # The upload context: a payload that fails its check (the named error) or a stream
    # that breaks (any other exception) releases the slot and counts the refusal by reason.
    coord, task = _tier()
    cr = coord.open_round(task)
    h, p = _upload(coord, task, "a", 1.0)
    with pytest.raises(IntegrityError):
        coord.upload_now("a", h, p[:-1] + bytes([p[-1] ^ 1]))  # one bit flipped: not the header's sha256
    with pytest.raises(ConnectionResetError), coord.upload("a", h):
        raise ConnectionResetError("peer went away")
    assert not cr.assignments["a"].in_flight and coord.counters["uploads_rejected"] == 2
    assert cr.rejected == {"IntegrityError": 1, "stream broken": 1}
    coord.upload_now("a", h, p)
    assert cr.assignments["a"].delivered


def test_only_inline_coordinators_run_in_process() -> None:
    coord, task = _tier(inline=False)
    coord.open_round(task)
    h, p = _upload(coord, task, "a", 1.0)
    with pytest.raises(RuntimeError, match="inline"):
        coord.upload_now("a", h, p)


def test_assign_and_leave() -> None:
    coord, task = _tier(target=1)
    cr = coord.open_round(task)
    chosen = [n for n in ("a", "b") if n in cr.assignments]
    other = ({"a", "b"} - set(chosen)).pop()
    assert coord.assign(chosen[0]) is not None
    # The other client is not selected and may not fill in: the quota is taken.
    assert coord.assign(other) is None
    coord.leave(other)
    assert other not in coord.children
    h, p = _upload(coord, task, chosen[0], 1.0)
    with pytest.raises(NotSelectedError):
        coord.upload_now(chosen[0], h.__class__(**{**h.__dict__, "task_id": "forged"}), p)


def test_a_tier_starts_mask_workers_for_large_secure_sessions_only() -> None:
    from orchard.config import SecureAggregationConfig
    from orchard.server.secagg import MASK_WORKERS_MIN_BYTES, mask_bytes

    run = RunConfig(secure_aggregation=SecureAggregationConfig(enabled=True))
    big = (TensorSpec("w", (1 << 20,), "float32"),)
    n_big = -(-MASK_WORKERS_MIN_BYTES // mask_bytes(run, big, 1))
    assert mask_bytes(run, big, n_big) >= MASK_WORKERS_MIN_BYTES > mask_bytes(run, big, n_big - 1)
    tier = Coordinator("tier", ServerConfig(mask_workers=1), np.random.default_rng(0), ClientUpdateDecoder())
    try:
        assert tier.executor.mask_workers(run, big, n_big - 1) is None  # too small to gain: threads
        workers = tier.executor.mask_workers(run, big, n_big)
        assert workers is not None and workers.processes == 1
        assert tier.executor.mask_workers(run, big, n_big) is workers  # started once, kept
    finally:
        tier.shutdown()
    assert workers.closed
    for coord in (Coordinator("tier", ServerConfig(mask_workers=0), np.random.default_rng(0), ClientUpdateDecoder()),
                  Coordinator("tier", ServerConfig(), np.random.default_rng(0), ClientUpdateDecoder(), inline=True)):
        assert coord.executor.mask_workers(run, big, 10 * n_big) is None
        coord.shutdown()
    with pytest.raises(ValueError, match="mask_workers"):
        ServerConfig(mask_workers=-1)


def test_a_tier_that_cannot_start_mask_workers_unmasks_on_threads(monkeypatch: pytest.MonkeyPatch,
                                                                    caplog: pytest.LogCaptureFixture) -> None:
    from orchard.config import SecureAggregationConfig
    from orchard.server.secagg import MASK_WORKERS_MIN_BYTES
    from orchard.server.tier import executor as executor_module

    tries: list[int | None] = []

    def refuse(processes: int | None = None) -> None:
        tries.append(processes)
        raise OSError("Resource temporarily unavailable")

    monkeypatch.setattr(executor_module, "MaskWorkers", refuse)
    run = RunConfig(secure_aggregation=SecureAggregationConfig(enabled=True))
    big = (TensorSpec("w", (MASK_WORKERS_MIN_BYTES // 4,), "float32"),)
    tier = Coordinator("tier", ServerConfig(), np.random.default_rng(0), ClientUpdateDecoder())
    with caplog.at_level("WARNING", logger="orchard.server.coordinator"):
        assert tier.executor.mask_workers(run, big, 2) is None
        assert tier.executor.mask_workers(run, big, 2) is None
    assert tries == [None]  # tried once, then threads for good
    assert "could not start mask worker processes" in caplog.text
    tier.shutdown()


def test_a_secure_cohort_takes_nothing_while_its_unmasking_closes() -> None:
    """While the unmasking stage closes on another thread, the cohort refuses messages
    (the stage is over), writes no broadcast and does not move; a fault there ends the
    session with the fault as its reason."""
    from orchard.config import SecureAggregationConfig
    from orchard.secure_agg import Stage, WrongStage
    from orchard.server.secagg import new_cohort

    run = RunConfig(secure_aggregation=SecureAggregationConfig(enabled=True))
    sc = new_cohort(run, SCHEMA, [f"c{i}" for i in range(6)], 1, time.time() + 60)
    assert sc.broadcast("c0")  # the session's setup, before
    sc.closing = True
    assert sc.broadcast("c0") == b""
    with pytest.raises(WrongStage, match="unmasking stage closes"):
        sc.receive("c0", Stage.ADVERTISE_KEYS, b"\x00", None)
    assert not sc.advance(time.time() + 3600, defer_unmasking=True)
    assert sc.stage is Stage.ADVERTISE_KEYS and not sc.finished
    sc.closing = False
    sc.failure = "unmasking failed: MemoryError: "
    assert sc.finished and sc.abort_reason == "unmasking failed: MemoryError: "
