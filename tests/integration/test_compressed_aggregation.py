"""Tiers that sum payloads in the compressed domain give the model that decoding every
update gives, refuse what decoding would refuse without touching the sum, weight
exactly (capped at ``weight_scale``), and leave non-linear codecs on the decode path.

Most tests drive one coordinator in-process (``submit_local``, the simulator's entry),
with uploads built by the client's own ``build_upload``; the last ones run the
simulator's tree and a real gRPC tree (root -> aggregator -> clients).
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from orchard import wire
from orchard.aggregation import finalize
from orchard.client.update import build_upload
from orchard.compression import build_codec, decode_update, encode_update
from orchard.config import CodecSpec, CohortConfig, RunConfig, SecureAggregationConfig, ServerConfig
from orchard.errors import CodecError, RoundClosedError, UpdateSchemaError
from orchard.messages import TaskAssignment, UploadHeader
from orchard.server.coordinator import Coordinator, RoundOutcome, RoundTask
from orchard.server.decoding import ClientUpdateDecoder
from orchard.trainer import TrainResult
from orchard.typing import DeviceState, NDArrays, Role, TensorSpec
from orchard.updates import pack, split

SHAPES: dict[str, tuple[int, ...]] = {"w": (40, 30), "b": (30,), "k": (6, 5, 3)}
SCHEMA = tuple(TensorSpec(k, s, "float32") for k, s in SHAPES.items())
SEED = 987_654

QSGD_SCALE = 0.1  # the updates below (standard deviation 0.01) stay well inside it
CODECS: dict[str, dict[str, Any]] = {
    "float32": {"name": "float32"},
    "randk": {"name": "randk", "params": {"fraction": 0.2}},
    "qsgd8-fixed": {"name": "qsgd", "params": {"bits": 8, "scale": QSGD_SCALE}},
    "randk+qsgd-fixed": {"name": "pipeline", "params": {"stages": [
        {"name": "randk", "params": {"fraction": 0.3}}, {"name": "qsgd", "params": {"scale": QSGD_SCALE}}]}},
    "powersgd": {"name": "powersgd", "params": {"rank": 2}},
    "ef-randk": {"name": "error_feedback", "params": {"codec": {"name": "randk", "params": {"fraction": 0.2}}}},
}
NOT_LINEAR: dict[str, dict[str, Any]] = {
    "qsgd8": {"name": "qsgd", "params": {"bits": 8}},
    "qsgd4-block64": {"name": "qsgd", "params": {"bits": 4, "block": 64}},
    "topk": {"name": "topk", "params": {"fraction": 0.1}},
    "float16": {"name": "float16"},
    "ef-topk": {"name": "error_feedback", "params": {"codec": {"name": "topk", "params": {"fraction": 0.1}}}},
}


def _cfg(codec: dict[str, Any], mode: str = "auto", weighting: str = "examples", n: int = 8,
         **kw: Any) -> RunConfig:
    return RunConfig(codec=CodecSpec(**codec), compressed_aggregation=mode,  # type: ignore[arg-type]
                     cohort=CohortConfig(target=n, over_selection=1.0, weighting=weighting),  # type: ignore[arg-type]
                     **kw)


def _updates(n: int, seed: int = 0) -> list[NDArrays]:
    rng = np.random.default_rng(seed)
    return [{k: (0.01 * rng.standard_normal(s)).astype(np.float32) for k, s in SHAPES.items()} for _ in range(n)]


class Tier:
    """One coordinator with ``n`` direct clients and one open round."""

    def __init__(self, cfg: RunConfig, n: int, attempt: int = 0) -> None:
        self.cfg = cfg
        self.codec = build_codec(cfg.codec)
        self.coord = Coordinator("tier", ServerConfig(node_timeout_s=600), np.random.default_rng(0),
                                 ClientUpdateDecoder())
        self.nodes = [f"c{i}" for i in range(n)]
        for node in self.nodes:
            self.coord.join(node, Role.CLIENT, "tok", DeviceState())
        self.open(attempt)

    def open(self, attempt: int) -> None:
        task = RoundTask(run_id="run", round=1, attempt=attempt, config=self.cfg,
                         config_json=self.cfg.model_dump_json(), model_blob=b"", model_hash="h", schema=SCHEMA,
                         deadline_unix=time.time() + 600, target=len(self.nodes), shared_seed=SEED + attempt)
        self.cr = self.coord.open_round(task)
        self.tasks: dict[str, TaskAssignment] = {}
        for node in self.nodes:
            t = self.coord._try_assign(node)
            assert t is not None
            self.tasks[node] = t

    def upload(self, i: int, delta: NDArrays, weight: float, steps: int = 1) -> tuple[UploadHeader, bytes]:
        node = self.nodes[i]
        result = TrainResult(arrays={}, weight=weight, num_examples=max(1, int(weight)), num_steps=steps,
                             metrics={"train_loss": float(i)})
        h, p, _ = build_upload(self.tasks[node], self.cfg, self.codec, node, delta, result, seed=i, states=None)
        return h, p

    def submit(self, h: UploadHeader, p: bytes) -> None:
        self.coord.submit_local(h.node_id, h, p)

    def run(self, deltas: list[NDArrays], weights: list[float]) -> RoundOutcome:
        for i, (d, w) in enumerate(zip(deltas, weights, strict=True)):
            self.submit(*self.upload(i, d, w))
        assert self.cr.closed, self.cr.close_reason
        return self.coord.outcome(self.cr)


def _mean(out: RoundOutcome) -> NDArrays:
    return finalize(out.partial)[0]


def _assert_close(got: NDArrays, want: NDArrays, rel: float) -> None:
    for k in want:
        scale = float(np.abs(want[k]).max())
        np.testing.assert_allclose(got[k], want[k], rtol=0, atol=rel * scale, err_msg=k)


def _weighted_mean(deltas: list[NDArrays], weights: list[float]) -> NDArrays:
    w = np.asarray(weights, np.float64)
    return {k: sum(wi * d[k].astype(np.float64) for wi, d in zip(w, deltas, strict=True)) / w.sum()
            for k in SHAPES}


# ---------------------------------------------------------------------- same model either way

WEIGHTS = [12.0, 40.0, 7.0, 150.0, 33.0, 90.0, 5.0, 61.0]


@pytest.mark.parametrize("name", list(CODECS))
@pytest.mark.parametrize("weighting", ["examples", "uniform"])
def test_compressed_sum_equals_decode_then_accumulate(name: str, weighting: str) -> None:
    """Same uploads (the clients' own build_upload), both paths: equal to 2e-6 of the
    largest mean element -- float32 summation -- except quantised values pre-scaled by
    different weights, which are within their quantisation steps (below)."""
    deltas = _updates(8)
    weights = WEIGHTS if weighting == "examples" else [1.0] * 8
    on, off = Tier(_cfg(CODECS[name], "auto", weighting), 8), Tier(_cfg(CODECS[name], "off", weighting), 8)
    assert on.cr.compressed is not None and off.cr.compressed is None
    got, want = on.run(deltas, weights), off.run(deltas, weights)
    assert got.partial.count == want.partial.count == 8
    assert got.partial.weight == pytest.approx(want.partial.weight)
    assert got.partial.metrics.means() == pytest.approx(want.partial.metrics.means())
    quantised = "qsgd" in name
    if not quantised or weighting == "uniform":  # uniform: S = 1, the very same payloads
        _assert_close(_mean(got), _mean(want), 2e-6)
    else:
        # Each client's quantisation error is below one step 2s/L (scaled by d/k for randk);
        # pre-scaled by c_i = w_i / S, the cohort's errors add up to at most S n step / W.
        step = 2 * QSGD_SCALE / 255 * (1 / 0.3 if "randk" in name else 1.0)
        bound = step * (1 + 1000.0 * 8 / sum(weights))
        exact = _weighted_mean(deltas, weights)
        for k in SHAPES:
            assert np.abs(_mean(got)[k] - _mean(want)[k]).max() <= bound
            assert np.abs(_mean(got)[k] - exact[k]).max() <= step * 1000.0 * 8 / sum(weights)


@pytest.mark.parametrize("name", ["float32", "randk", "powersgd"])
def test_weighted_mean_is_exact_with_weights_capped_at_weight_scale(name: str) -> None:
    """Clients with different example counts: the mean weights each by min(w, S), S = 1000."""
    deltas = _updates(6, seed=3)
    weights = [3.0, 250.0, 999.0, 4000.0, 1000.0, 17.5]
    capped = [min(w, 1000.0) for w in weights]
    on, off = Tier(_cfg(CODECS[name], "auto", n=6), 6), Tier(_cfg(CODECS[name], "off", n=6), 6)
    got = on.run(deltas, weights)
    off_cfg_capped = off.run(deltas, capped)  # the decode path with the capped weights
    assert got.partial.weight == pytest.approx(sum(capped))
    _assert_close(_mean(got), _mean(off_cfg_capped), 2e-6)
    if name == "float32":
        _assert_close(_mean(got), _weighted_mean(deltas, capped), 2e-6)
        # and not the uncapped mean: the 4000-example client counts for 1000
        uncapped = _weighted_mean(deltas, weights)
        assert max(np.abs(_mean(got)[k] - uncapped[k]).max() for k in SHAPES) > 1e-4


def test_steps_weighting_weights_by_steps() -> None:
    deltas = _updates(4, seed=5)
    steps = [1, 7, 20, 3]
    tier = Tier(_cfg(CODECS["float32"], "auto", "steps", n=4), 4)
    for i, (d, s) in enumerate(zip(deltas, steps, strict=True)):
        tier.submit(*tier.upload(i, d, weight=100.0, steps=s))
    out = tier.coord.outcome(tier.cr)
    assert out.partial.weight == sum(steps)
    _assert_close(_mean(out), _weighted_mean(deltas, [float(s) for s in steps]), 2e-6)


# ---------------------------------------------------------------------- non-linear codecs

@pytest.mark.parametrize("name", list(NOT_LINEAR))
def test_non_linear_codecs_take_the_decode_path_and_still_work(name: str) -> None:
    deltas = _updates(8, seed=1)
    tier = Tier(_cfg(NOT_LINEAR[name], "auto"), 8)
    assert tier.cr.compressed is None
    uploads = [tier.upload(i, d, w) for i, (d, w) in enumerate(zip(deltas, WEIGHTS, strict=True))]
    for h, p in uploads:
        tier.submit(h, p)
    # Reference: decode every payload as sent, weight by the header's (uncapped) weight.
    decoded = [decode_update(tier.codec, dict(zip(SHAPES, split(p, h.payload_sizes), strict=True)), SHAPES,
                             1, SEED) for h, p in uploads]
    _assert_close(_mean(tier.coord.outcome(tier.cr)), _weighted_mean(decoded, WEIGHTS), 1e-6)


def test_secure_aggregation_and_fednova_runs_keep_the_decode_path() -> None:
    assert Tier(_cfg(CODECS["float32"], weighting="fednova"), 2).cr.compressed is None
    secure = _cfg(CODECS["float32"], secure_aggregation=SecureAggregationConfig(enabled=True))
    assert Tier(secure, 4).cr.compressed is None


# ---------------------------------------------------------------------- bad uploads

def _raw_upload(tier: Tier, i: int, payloads: dict[str, bytes], weight: float = 10.0) -> tuple[UploadHeader, bytes]:
    h, _ = tier.upload(i, _updates(1)[0], weight)
    payload, sizes = pack([payloads[s.name] for s in SCHEMA])
    return dataclasses.replace(h, payload_sizes=sizes, payload_sha256=wire.sha256_hex(payload)), payload


def _encoded(tier: Tier, arrays: NDArrays, codec: dict[str, Any] | None = None, seed: int = SEED) -> dict[str, bytes]:
    c = build_codec(CodecSpec(**codec)) if codec else tier.codec
    return encode_update(c, arrays, np.random.default_rng(0), None, seed)[0]


def _state(tier: Tier) -> tuple[int, float, dict[str, np.ndarray], dict[str, int]]:
    c = tier.cr.compressed
    assert c is not None
    return c.count, c.weight, {k: v.copy() for k, v in c.sums.result().items()}, dict(tier.cr.rejected)


def _bad_cases(tier: Tier) -> list[tuple[str, type[Exception], str, dict[str, bytes]]]:
    ones = {k: np.ones(s, np.float32) for k, s in SHAPES.items()}
    nan = {k: v.copy() for k, v in ones.items()}
    nan["w"][3:5] = np.nan  # rows of them, so that randk keeps some
    inf = {k: v.copy() for k, v in ones.items()}
    inf["k"][2] = -np.inf
    good = _encoded(tier, ones)
    truncated = dict(good, w=good["w"][:-5])
    wrong_shape = dict(good, b=_encoded(tier, {**ones, "b": np.ones(31, np.float32)})["b"])
    foreign = dict(good, w=_encoded(tier, ones, {"name": "float16"})["w"])
    huge = {k: np.full(s, 3.0e38, np.float32) for k, s in SHAPES.items()}
    cases = [
        ("NaN", UpdateSchemaError, "NaN or Inf", _encoded(tier, nan)),
        ("Inf", UpdateSchemaError, "NaN or Inf", _encoded(tier, inf)),
        ("truncated", CodecError, "tensor 'w'", truncated),
        ("wrong shape", CodecError, r"shape \(31,\)", wrong_shape),
        ("another codec", CodecError, "codec", foreign),
        ("float32 overflow", CodecError, "float32's range", _encoded(tier, huge)),
    ]
    if tier.cfg.codec.name == "randk":
        other_round = _encoded(tier, ones, seed=SEED + 1)
        cases.append(("another round's coordinates", CodecError, "another shared seed", other_round))
    return cases


@pytest.mark.parametrize("name", ["float32", "randk"])
def test_bad_payloads_are_refused_by_name_and_leave_the_sum_untouched(name: str) -> None:
    tier = Tier(_cfg(CODECS[name], "auto", n=12), 12)
    deltas = _updates(3, seed=9)
    tier.submit(*tier.upload(0, deltas[0], 20.0))
    edge = 1.5e38 if name == "float32" else 1.5e38 * 0.2  # randk decodes kept values times d / k
    big = {k: np.full(s, edge, np.float32) for k, s in SHAPES.items()}  # finite, but near the edge
    tier.submit(*_raw_upload(tier, 1, _encoded(tier, big), weight=1000.0))
    i = 2
    for label, err, match, payloads in _bad_cases(tier):
        count, weight, sums, rejected = _state(tier)
        with pytest.raises(err, match=match) as raised:
            tier.submit(*_raw_upload(tier, i, payloads))
        c2, w2, s2, r2 = _state(tier)
        assert (c2, w2) == (count, weight), label
        for k in SHAPES:
            np.testing.assert_array_equal(s2[k], sums[k], err_msg=label)
        named = type(raised.value).__name__  # the rejection is counted under the error's name
        assert sum(r2.values()) == sum(rejected.values()) + 1, label
        assert r2.get(named, 0) == rejected.get(named, 0) + 1, label
        assert not tier.cr.assignments[tier.nodes[i]].in_flight
        i += 1
    # The tier goes on: the next good upload is folded.
    tier.submit(*tier.upload(i, deltas[2], 30.0))
    assert tier.cr.compressed is not None and tier.cr.compressed.count == 3


def test_a_bad_payload_on_the_decode_path_is_refused_the_same_way() -> None:
    """The same bad inputs, compression off: the same error types (the guarantees match)."""
    on, off = Tier(_cfg(CODECS["float32"], "auto", n=12), 12), Tier(_cfg(CODECS["float32"], "off", n=12), 12)
    for (label, err, match, p_on), (_, _, _, p_off) in zip(_bad_cases(on), _bad_cases(off), strict=True):
        if label == "float32 overflow":
            continue  # the float64 accumulator takes it; a float32 compressed sum must not
        for tier, p in ((on, p_on), (off, p_off)):
            with pytest.raises(err, match=match if label != "truncated" else None):
                tier.submit(*_raw_upload(tier, 0, p))
    assert off.cr.received == on.cr.received == 0


# ---------------------------------------------------------------------- concurrency, retries

def test_concurrent_uploads_fold_one_at_a_time() -> None:
    """The gRPC path: uploads checked in the decode pool side by side, folded serially."""
    n = 40
    deltas = _updates(n, seed=11)
    weights = [float(5 + 3 * i) for i in range(n)]
    tier = Tier(_cfg(CODECS["randk"], "auto", n=n), n)

    async def main() -> RoundOutcome:
        uploads = [tier.upload(i, d, w) for i, (d, w) in enumerate(zip(deltas, weights, strict=True))]
        slots = [tier.coord.begin_upload(h.node_id, h) for h, _ in uploads]
        await asyncio.gather(*(tier.coord.complete_upload(s, p) for s, (_, p) in zip(slots, uploads, strict=True)))
        return await tier.coord.wait_round(tier.cr)

    out = asyncio.run(main())
    tier.coord.shutdown()
    assert out.partial.count == n and out.reason == "target reached"
    ref = Tier(_cfg(CODECS["randk"], "off", n=n), n).run(deltas, weights)
    _assert_close(_mean(out), _mean(ref), 2e-6)


def test_a_retried_round_starts_a_fresh_compressed_sum() -> None:
    deltas = _updates(4, seed=13)
    tier = Tier(_cfg(CODECS["qsgd8-fixed"], "auto", "uniform", n=4), 4)
    for i in range(2):
        tier.submit(*tier.upload(i, deltas[i], 1.0))
    first = tier.cr
    tier.open(attempt=1)  # the round failed and is retried: a new attempt supersedes it
    assert first.closed and tier.cr is not first and tier.cr.received == 0
    out = tier.run([{k: -v for k, v in d.items()} for d in deltas], [1.0] * 4)
    assert out.partial.count == 4
    want = _weighted_mean([{k: -v for k, v in d.items()} for d in deltas], [1.0] * 4)
    step = 2 * QSGD_SCALE / 255
    for k in SHAPES:
        assert np.abs(_mean(out)[k] - want[k]).max() <= step
    # Reading the outcome twice does not fold the compressed sum twice.
    assert tier.coord.outcome(tier.cr).partial.count == 4


def test_nothing_joins_the_sum_after_the_outcome_was_read() -> None:
    """The simulator reads a root's outcome before it closes the round: an upload after
    that is refused rather than lost."""
    deltas = _updates(3, seed=17)
    tier = Tier(_cfg(CODECS["float32"], "auto", n=3), 3)
    for i in range(2):
        tier.submit(*tier.upload(i, deltas[i], 10.0))
    first = tier.coord.outcome(tier.cr)
    assert not tier.cr.closed and first.partial.count == 2
    with pytest.raises(RoundClosedError, match="outcome was already read"):
        tier.submit(*tier.upload(2, deltas[2], 10.0))
    assert tier.coord.outcome(tier.cr).partial.count == 2 and tier.cr.received == 2
    _assert_close(_mean(first), _weighted_mean(deltas[:2], [10.0, 10.0]), 2e-6)


# ---------------------------------------------------------------------- trees

def _sim(codec: dict[str, Any], mode: str, aggregators: object, weighting: str, rounds: int) -> Any:
    from orchard.simulation import DeviceProfile, SimulationConfig, run_simulation

    always = DeviceProfile(gflops=10.0, battery=False, availability=[1.0] * 24, dropout=0.0, latency_s=0.05)
    run = RunConfig.model_validate(dict(
        task="digits", task_params={"with_replacement": True, "samples_per_client": 20},
        train={"epochs": 1, "batch_size": 10, "learning_rate": 0.1}, codec=codec, compressed_aggregation=mode,
        cohort=CohortConfig(target=24, over_selection=1.0, min_fraction=1.0, deadline_s=600.0,
                            weighting=weighting)))  # type: ignore[arg-type]
    return run_simulation(SimulationConfig.model_validate(dict(
        clients=24, clients_per_round=24, rounds=rounds, progress=False, profiles={"box": always},
        devices={"box": 1.0}, run=run, aggregators=aggregators, vectorize=False)))


@pytest.mark.parametrize("name, weighting", [("float32", "examples"), ("randk", "examples"),
                                             ("qsgd8-fixed", "uniform")])
def test_simulated_tree_gives_the_same_model_either_way(name: str, weighting: str) -> None:
    """Simulator (submit_local at every tier), root -> 2 aggregators -> clients. Quantised:
    one round, so that both paths quantise the very same updates (a float-rounding
    difference in a later round's model may move a stochastic rounding by one step)."""
    codec = dict(CODECS[name])
    rounds = 2
    if name == "qsgd8-fixed":
        codec, rounds = {"name": "qsgd", "params": {"bits": 8, "scale": 0.5}}, 1
    on = _sim(codec, "auto", [2], weighting, rounds)
    off = _sim(codec, "off", [2], weighting, rounds)
    assert [r["participants"] for r in on.rounds] == [r["participants"] for r in off.rounds] == [24] * rounds
    for k, v in off.final_arrays.items():
        scale = float(np.abs(v).max())
        np.testing.assert_allclose(on.final_arrays[k], v, rtol=0, atol=1e-5 * scale, err_msg=k)


def test_grpc_tree_gives_the_same_model_either_way(tmp_path: Path) -> None:
    """Real gRPC, root -> aggregator -> 4 clients, randk: the aggregator sums the clients'
    payloads without decoding them and pushes one partial up."""
    from fed_harness import start_run, tree, wait_status

    from orchard.ops import ControlClient

    def _global(fed: Any) -> NDArrays:
        ctl = ControlClient(fed.root.address, insecure=True)
        try:
            return wire.blob_to_arrays(ctl.pull_global())
        finally:
            ctl.close()

    async def one(mode: str, where: Path) -> tuple[dict[str, Any], NDArrays]:
        fed = await tree(where, depth=2, clients_per_leaf=4)
        try:
            all_in = CohortConfig(target=4, over_selection=1.0, min_fraction=1.0, deadline_s=60)
            cfg = RunConfig(task="digits", rounds=2, cohort=all_in, seed=7, compressed_aggregation=mode,  # type: ignore[arg-type]
                            codec=CodecSpec(**CODECS["randk"]))
            await start_run(fed.root, cfg)
            st = await wait_status(fed.root, lambda s: s.get("status") in ("completed", "failed"), 90)
            used = fed.aggregators[0].coordinator.current
            assert used is not None and (used.compressed is not None) == (mode == "auto")
            return st, await asyncio.to_thread(_global, fed)
        finally:
            await fed.stop()

    st_on, on = asyncio.run(one("auto", tmp_path / "on"))
    st_off, off = asyncio.run(one("off", tmp_path / "off"))
    assert st_on["status"] == st_off["status"] == "completed", (st_on, st_off)
    assert [r["participants"] for r in st_on["rounds"]] == [4, 4]
    for k, v in off.items():
        scale = float(np.abs(v).max()) + 1e-12
        assert np.abs(on[k] - v).max() <= 1e-5 * scale, k
