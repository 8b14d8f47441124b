"""Asynchronous buffered aggregation (FedBuff) in one inline coordinator: buffers close at
K, clients still training move into the next buffer, their updates are weighted by their
staleness or refused past S, and the journal gives a restarted tier every update once."""

from __future__ import annotations

import math
import time
from dataclasses import replace

import numpy as np
import pytest

from orchard.aggregation.staleness import histogram_quantile, staleness_weight
from orchard.client.update import build_upload
from orchard.compression import build_codec
from orchard.config import CodecSpec, CohortConfig, ModeConfig, RunConfig, ServerConfig
from orchard.errors import (
    DuplicateUploadError,
    FutureModelVersionError,
    StaleUpdateError,
    UnknownModelVersionError,
)
from orchard.server.ackjournal import AckJournal
from orchard.server.buffer import BufferState
from orchard.server.coordinator import Coordinator
from orchard.server.decoding import ClientUpdateDecoder
from orchard.server.round import RoundTask, round_seed
from orchard.trainer import TrainResult
from orchard.typing import DeviceState, Role, TensorSpec

SCHEMA = (TensorSpec("w", (4,), "float32"),)
NODES = ("a", "b", "c", "d")


def _cfg(k: int = 2, s: int = 1, weighting: str = "polynomial", over: float = 2.0) -> RunConfig:
    return RunConfig(cohort=CohortConfig(target=k, over_selection=over),
                     mode=ModeConfig(kind="async", buffer_size=k, max_staleness=s, staleness=weighting))


def _tier(cfg: RunConfig) -> Coordinator:
    coord = Coordinator("tier", ServerConfig(node_timeout_s=600), np.random.default_rng(0), ClientUpdateDecoder(),
                        inline=True)
    for n in NODES:
        coord.join(n, Role.CLIENT, "tok", DeviceState())
    return coord


def _task(cfg: RunConfig, rnd: int) -> RoundTask:
    return RoundTask(run_id="run", round=rnd, attempt=0, config=cfg, config_json=cfg.model_dump_json(),
                     model_blob=b"m%d" % rnd, model_hash=f"h{rnd}", schema=SCHEMA,
                     deadline_unix=time.time() + 600, target=cfg.buffer_target,
                     shared_seed=round_seed(cfg.seed, rnd, 0))


def _upload(coord: Coordinator, t, node: str, value: float, weight: float = 2.0) -> tuple:
    cfg = RunConfig.model_validate_json(t.config_json)
    res = TrainResult(arrays={}, weight=weight, num_examples=int(weight), num_steps=1)
    h, p, _ = build_upload(t, cfg, cfg.train, build_codec(cfg.codec), node, {"w": np.full(4, value, np.float32)},
                           res, seed=0, states=None)
    return h, p


def test_staleness_weights() -> None:
    assert [staleness_weight(s, "constant") for s in (0, 3)] == [1.0, 1.0]
    assert staleness_weight(0, "polynomial", 0.5) == 1.0
    assert staleness_weight(3, "polynomial", 0.5) == pytest.approx(0.5)
    assert [staleness_weight(s, "hinge", 1.0, 2) for s in (0, 2, 3, 6)] == [1.0, 1.0, 0.5, 0.2]
    with pytest.raises(ValueError):
        staleness_weight(-1, "constant")
    assert histogram_quantile({0: 2, 1: 1, 3: 1}, 0.5) == 0.0 and histogram_quantile({0: 2, 1: 1, 3: 1}, 1.0) == 3.0
    assert math.isnan(histogram_quantile({}, 0.5))


def test_a_buffer_closes_at_k_and_its_stragglers_fold_into_the_next_with_their_weight() -> None:
    cfg = _cfg(k=2, s=1)
    coord = _tier(cfg)
    cr1 = coord.open_round(_task(cfg, 1))
    tasks = {n: coord.assign(n) for n in NODES}  # concurrency ceil(2 * 2.0) = 4: everyone trains
    assert all(t is not None and t.round == 1 for t in tasks.values())
    for n, v in (("a", 1.0), ("b", 3.0)):
        coord.upload_now(n, *_upload(coord, tasks[n], n, v))
    assert cr1.closed and cr1.close_reason == "target reached"
    out1 = coord.outcome(cr1)
    np.testing.assert_array_equal(out1.partial.sums["w"], np.full(4, 2.0 * 1.0 + 2.0 * 3.0))
    assert out1.staleness == {0: 2}
    # c finishes while the root applies the step: its update waits in the continuation,
    # one version stale (it is applied after the step at the earliest).
    coord.upload_now("c", *_upload(coord, tasks["c"], "c", 5.0))
    cr2 = coord.open_round(_task(cfg, 2))
    # c's update moved in; d is still training on version 1 and was carried over; a, b
    # and c were free and picked again (concurrency 4).
    assert cr2.received == 1 and cr2.staleness == {1: 1}
    assert cr2.assignments["d"].round == 1 and not cr2.assignments["d"].delivered
    assert {n for n, a in cr2.assignments.items() if a.round == 2} == {"a", "b", "c"}
    coord.upload_now("d", *_upload(coord, tasks["d"], "d", 7.0))
    out2 = coord.outcome(cr2)
    f = staleness_weight(1, "polynomial", 0.5)
    # FedBuff: sum_i w_i f(s_i) x_i over the plain weights sum_i w_i.
    np.testing.assert_allclose(out2.partial.sums["w"], np.full(4, 2.0 * f * 5.0 + 2.0 * f * 7.0))
    assert out2.partial.weight == pytest.approx(4.0) and out2.staleness == {1: 2}
    assert coord.staleness == {0: 2, 1: 2}


def test_unknown_future_and_too_stale_updates_are_refused_each_by_name() -> None:
    cfg = _cfg(k=1, s=1, over=4.0)
    coord = _tier(cfg)
    coord.open_round(_task(cfg, 1))
    tasks = {n: coord.assign(n) for n in NODES}
    coord.upload_now("a", *_upload(coord, tasks["a"], "a", 1.0))  # closes version 1
    coord.open_round(_task(cfg, 2))
    coord.open_round(_task(cfg, 3))  # no update for 2: b, c, d were carried while within S = 1 ... then dropped
    h, p = _upload(coord, tasks["b"], "b", 1.0)
    with pytest.raises(StaleUpdateError, match="2 versions stale"):
        coord.upload_now("b", h, p)
    with pytest.raises(FutureModelVersionError, match="from the future"):
        coord.upload_now("b", replace(h, round=4), p)
    with pytest.raises(UnknownModelVersionError, match="no model version this tier served"):
        coord.upload_now("b", replace(h, run_id="other"), p)
    assert coord.current.received == 0 and coord.counters["uploads_rejected"] == 3


def test_k_equal_target_and_s_zero_is_the_synchronous_round() -> None:
    def run(mode: ModeConfig) -> np.ndarray:
        cfg = RunConfig(cohort=CohortConfig(target=2, over_selection=2.0), mode=mode)
        coord = _tier(cfg)
        sums = []
        for rnd in (1, 2):
            cr = coord.open_round(_task(cfg, rnd))
            got = {n: coord.assign(n) for n in NODES}
            order = [n for n in NODES if got[n] is not None]
            for k, n in enumerate(order):
                try:
                    coord.upload_now(n, *_upload(coord, got[n], n, float(rnd * 10 + k), weight=1.0 + k))
                except Exception as err:  # late: refused in both modes
                    assert "closed" in str(err) or "stale" in str(err)
            sums.append(coord.outcome(cr).partial.sums["w"])
        return np.stack(sums)

    np.testing.assert_array_equal(run(ModeConfig()), run(ModeConfig(kind="async", buffer_size=2, max_staleness=0)))


def test_the_journal_gives_a_restarted_tier_every_acknowledged_update_once() -> None:
    cfg = _cfg(k=3, s=2, over=4 / 3)
    coord = _tier(cfg)
    states: list[BufferState] = []
    coord.journal = states.append
    cr = coord.open_round(_task(cfg, 1))
    tasks = {n: coord.assign(n) for n in NODES}
    uploads = {n: _upload(coord, tasks[n], n, v) for n, v in zip(NODES, (1.0, 2.0, 4.0, 8.0), strict=True)}
    coord.upload_now("a", *uploads["a"])
    coord.upload_now("b", *uploads["b"])
    assert [s.seq for s in states] == [1, 2] and cr.received == 2
    # The tier dies; a new one takes the journal back.
    blob, sums = states[-1].to_bytes()
    back = BufferState.from_bytes(blob, sums, SCHEMA)
    fresh = Coordinator("tier", ServerConfig(node_timeout_s=600), np.random.default_rng(1), ClientUpdateDecoder(),
                        inline=True)
    cr2 = fresh.open_round(_task(cfg, 1), restore=back)
    assert cr2.received == 2 and set(fresh.children) >= {"c", "d"}  # still training: registered again
    fresh.join("b", Role.CLIENT, "tok", DeviceState())  # b reconnects and retries: its acknowledgement was lost
    with pytest.raises(DuplicateUploadError):
        fresh.upload_now("b", *uploads["b"])  # not counted twice
    fresh.upload_now("c", *uploads["c"])
    out = fresh.outcome(cr2)
    np.testing.assert_array_equal(out.partial.sums["w"], np.full(4, 2.0 * (1.0 + 2.0 + 4.0)))
    assert out.partial.count == 3 and out.partial.weight == 6.0


def test_validate_refuses_impossible_async_configs_with_every_reason() -> None:
    from orchard.config import parse_run_config
    from orchard.errors import ConfigError
    from orchard.validation import data_problems

    bad = {"task": "digits", "cohort": {"target": 1, "over_selection": 1.0},
           "secure_aggregation": {"enabled": True},
           "mode": {"kind": "async", "buffer_size": 1, "max_staleness": 2, "staleness": "hinge", "hinge_after": 3}}
    problems = data_problems({"run": bad})
    assert len(problems) == 2, problems
    assert "one SecAgg+ session" in problems[0] and "at least 2" in problems[0]
    assert "hinge_after = 3 is not below max_staleness = 2" in problems[1]
    with pytest.raises(ConfigError, match="buffer_size only applies to kind"):
        parse_run_config({"mode": {"buffer_size": 4}})
    ok = parse_run_config({"mode": {"kind": "async", "buffer_size": 4}})
    assert data_problems({"run": ok.model_dump(mode="json")}) == []
    assert (ok.buffer_target, ok.mode.max_stale, ok.mode.weighting) == (4, 4, "polynomial")
    assert RunConfig().mode.kind == "sync" and RunConfig().buffer_target == RunConfig().cohort.target


# The codecs whose algebra says linear (tests/compression/codec_cases.py lists them all).
LINEAR = {
    "float32": CodecSpec(name="float32"),
    "qsgd8-fixed": CodecSpec(name="qsgd", params={"bits": 8, "scale": 2000.0}),
    "randk": CodecSpec(name="randk", params={"fraction": 0.5}),
    "randk-biased": CodecSpec(name="randk", params={"k": 2, "unbiased": False}),
    "powersgd": CodecSpec(name="powersgd", params={"rank": 1}),
    "randk+qsgd-fixed": CodecSpec(name="pipeline", params={"stages": [
        {"name": "randk", "params": {"fraction": 0.5}}, {"name": "qsgd", "params": {"bits": 8, "scale": 2000.0}}]}),
    "ef-powersgd": CodecSpec(name="error_feedback", params={"codec": {"name": "powersgd"}}),
}


@pytest.mark.parametrize("codec", sorted(LINEAR))
def test_every_linear_codec_folds_a_stale_update_decoded_with_its_own_versions_seed(codec: str) -> None:
    """An update of round 1 folded into round 2's buffer is decoded with round 1's shared
    seed (random-k's indices), then weighted by f(1): exactly what decoding it alone gives."""
    from orchard.compression import decode_update
    from orchard.updates import split

    spec = LINEAR[codec]
    assert build_codec(spec).algebra.linear
    cfg = RunConfig(codec=spec, cohort=CohortConfig(target=1, over_selection=2.0),
                    mode=ModeConfig(kind="async", buffer_size=1, max_staleness=2, staleness="polynomial",
                                    staleness_exponent=1.0))
    coord = Coordinator("tier", ServerConfig(node_timeout_s=600), np.random.default_rng(0), ClientUpdateDecoder(),
                        inline=True)
    for n in ("a", "b"):
        coord.join(n, Role.CLIENT, "tok", DeviceState())
    t1 = _task(cfg, 1)
    coord.open_round(t1)
    tasks = {n: coord.assign(n) for n in ("a", "b")}
    x = np.linspace(-1.0, 1.0, 4).astype(np.float32)
    res = TrainResult(arrays={}, weight=3.0, num_examples=3, num_steps=1)
    h_b, p_b, _ = build_upload(tasks["b"], cfg, cfg.train, build_codec(spec), "b", {"w": x}, res, seed=7, states=None)
    coord.upload_now("a", *_upload(coord, tasks["a"], "a", 0.5))  # fills round 1
    cr2 = coord.open_round(_task(cfg, 2))
    coord.upload_now("b", h_b, p_b)  # trained on round 1: staleness 1
    out = coord.outcome(cr2)
    alone = decode_update(build_codec(spec), dict(zip(["w"], split(p_b, h_b.payload_sizes), strict=True)),
                          {"w": (4,)}, num_summands=1, shared_seed=t1.shared_seed)["w"]
    np.testing.assert_allclose(out.partial.sums["w"], 3.0 * 0.5 * alone.astype(np.float64), rtol=1e-6, atol=1e-9)
    assert out.partial.weight == pytest.approx(3.0) and out.staleness == {1: 1}


def test_a_short_buffer_tops_up_instead_of_dropping_what_it_accepted() -> None:
    """K = 2, concurrency 2: a delivers, b vanishes. A synchronous round would close short
    and be retried without a's update; the buffer chooses another client and keeps it."""
    cfg = RunConfig(cohort=CohortConfig(target=2, over_selection=1.0, min_fraction=1.0),
                    mode=ModeConfig(kind="async", buffer_size=2, max_staleness=1))
    clock = [1000.0]
    coord = Coordinator("tier", ServerConfig(node_timeout_s=5), np.random.default_rng(0), ClientUpdateDecoder(),
                        monotonic=lambda: clock[0], wall=lambda: clock[0], inline=True)
    for n in NODES:
        coord.join(n, Role.CLIENT, "tok", DeviceState())
    t = _task(cfg, 1)
    t.deadline_unix = clock[0] + 60
    cr = coord.open_round(t)
    first = [n for n in NODES if coord.assign(n) is not None]
    assert len(first) == 2
    done, gone = first
    coord.upload_now(done, *_upload(coord, coord.assign(done), done, 1.0))
    coord.leave(gone)  # vanished
    for n in NODES:
        if n not in (gone,):
            coord.touch(n)
    coord.sweep()  # gone is dropped; the buffer is short: it chooses from the free clients
    assert not cr.closed and cr.received == 1
    more = [n for n in NODES if n not in first and coord.assign(n) is not None]
    assert more, "no client was chosen to top the buffer up"
    coord.upload_now(more[0], *_upload(coord, coord.assign(more[0]), more[0], 3.0))
    out = coord.outcome(cr)
    assert cr.closed and out.reason == "target reached"
    np.testing.assert_array_equal(out.partial.sums["w"], np.full(4, 2.0 * 1.0 + 2.0 * 3.0))
    # And at the deadline a short buffer waits another deadline_s instead of closing.
    t3 = _task(cfg, 3)
    t3.deadline_unix = clock[0] + 60
    cr3 = coord.open_round(t3)
    clock[0] += 61
    for n in NODES:
        if n in coord.children:
            coord.touch(n)
    coord.sweep()
    assert not cr3.closed and cr3.task.deadline_unix == pytest.approx(clock[0] + cfg.cohort.deadline_s)


def test_prometheus_counts_updates_by_staleness() -> None:
    from prometheus_client import CollectorRegistry, generate_latest

    from orchard.server.metrics import TierCollector

    coord = _tier(_cfg())
    coord.staleness.update({0: 3, 2: 1})
    reg = CollectorRegistry()
    reg.register(TierCollector(coord, "root"))
    text = generate_latest(reg).decode()
    assert 'orchard_updates_by_staleness_total{role="root",staleness="0",tier="tier"} 3.0' in text
    assert 'orchard_updates_by_staleness_total{role="root",staleness="2",tier="tier"} 1.0' in text


def test_asynchronous_mode_takes_clipping_and_central_dp_but_no_robust_statistic_or_distributed_dp() -> None:
    from orchard.config import PrivacyConfig, RobustConfig

    uniform = CohortConfig(target=2, weighting="uniform")
    mode = ModeConfig(kind="async", buffer_size=2)
    RunConfig(cohort=uniform, mode=mode, robust=RobustConfig(norm_bound=1.0),
              privacy=PrivacyConfig(mode="central", target_epsilon=5.0, clip_norm=1.0))
    with pytest.raises(ValueError, match="takes fresh updates only"):
        RunConfig(cohort=uniform, mode=mode, robust=RobustConfig(statistic="median"))
    with pytest.raises(ValueError, match="'distributed' is not supported in asynchronous mode"):
        RunConfig(cohort=uniform, mode=mode, secure_aggregation={"enabled": True},
                  privacy=PrivacyConfig(mode="distributed", target_epsilon=5.0, clip_norm=1.0))


class JournalAcks:
    """An aggregator's AckLog (as ``orchard.server.aggregator.UpstreamLink`` keeps it)."""

    def __init__(self, journal: AckJournal) -> None:
        self.journal = journal

    def acked(self, cr, up) -> None:
        self.journal.acked(cr, cr.task.run_id, cr.task.round, cr.task.attempt, up)

    def moved(self, prev, cr) -> None:
        self.journal.moved(prev, cr, cr.task.run_id, cr.task.round, cr.task.attempt)

    def dropped(self, cr, reason: str) -> None:
        self.journal.drop(cr, reason)


@pytest.mark.parametrize("next_mode", ["sync", "async"])
def test_what_a_continuation_took_is_journaled_dropped_when_another_runs_round_supersedes_it(
        tmp_path, next_mode: str) -> None:
    cfg = _cfg(k=2, s=1)
    coord = _tier(cfg)
    journal = AckJournal(tmp_path / "acks")
    coord.acks = JournalAcks(journal)
    cr1 = coord.open_round(_task(cfg, 1))
    tasks = {n: coord.assign(n) for n in NODES}
    for n in ("a", "b"):
        coord.upload_now(n, *_upload(coord, tasks[n], n, 1.0))
    assert cr1.closed
    journal.forwarded(cr1)  # the full buffer went up (the aggregator's push)
    coord.upload_now("c", *_upload(coord, tasks["c"], "c", 1.0))  # into the continuation
    assert coord.current.continuation and journal.pending(10) == []
    nxt = RunConfig(cohort=CohortConfig(target=2), mode=ModeConfig(kind=next_mode))
    coord.open_round(replace(_task(nxt, 1), run_id="next-run"))
    assert [(d.node_id, d.task_id) for d in journal.pending(10)] == [("c", tasks["c"].task_id)]
    assert journal.pending(10)[0].reason.startswith("round over before applied: its continuation was superseded")
