"""Tiers that sum payloads in the compressed domain give the model that decoding every
update gives, weight every update exactly by its header's weight (nothing is capped),
refuse what decoding would refuse without touching the sum, and leave non-linear codecs
-- and integer codes under weighted modes -- on the decode path.

Most tests drive one coordinator in-process (``upload_now``, the simulator's entry),
with uploads built by the client's own ``build_upload``; the last ones run the
simulator's tree and a real gRPC tree (root -> aggregator -> clients).
"""

from __future__ import annotations

import asyncio
import dataclasses
import math
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
from orchard.server.coordinator import Coordinator
from orchard.server.decoding import ClientUpdateDecoder
from orchard.server.round import RoundOutcome, RoundTask
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
# Integer codes add exactly only unweighted: compressed under uniform weighting only.
INTEGER_CODES = ("qsgd8-fixed", "randk+qsgd-fixed")
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
                                 ClientUpdateDecoder(), inline=True)
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
            t = self.coord.assign(node)
            assert t is not None
            self.tasks[node] = t

    def upload(self, i: int, delta: NDArrays, weight: float, steps: int = 1) -> tuple[UploadHeader, bytes]:
        """What client ``i`` sends (as the client runtime builds it, FedNova included)."""
        node = self.nodes[i]
        result = TrainResult(arrays={}, weight=weight, num_examples=max(1, int(weight)), num_steps=steps,
                             metrics={"train_loss": float(i)})
        h, p, _ = build_upload(self.tasks[node], self.cfg, self.cfg.train, self.codec, node, delta, result, seed=i,
                               states=None)
        return h, p

    def submit(self, h: UploadHeader, p: bytes) -> None:
        self.coord.upload_now(h.node_id, h, p)

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


def _compressed(name: str, weighting: str) -> bool:
    """The path a tier takes for ``CODECS[name]`` under ``weighting`` (compression "auto")."""
    return name not in INTEGER_CODES or weighting == "uniform"


def _decoded(tier: Tier, uploads: list[tuple[UploadHeader, bytes]]) -> list[NDArrays]:
    """Every payload decoded as sent: the reference for a lossy codec."""
    return [decode_update(tier.codec, dict(zip(SHAPES, split(p, h.payload_sizes), strict=True)), SHAPES,
                          1, SEED) for h, p in uploads]


@pytest.mark.parametrize("name", list(CODECS))
@pytest.mark.parametrize("weighting", ["examples", "steps", "uniform"])
def test_compressed_sum_equals_decode_then_accumulate(name: str, weighting: str) -> None:
    """Same uploads (the clients' own build_upload: unscaled), both paths: equal to 1e-6
    of the largest mean element (the compressed sum is rounded to float32 once). Float
    coordinates and PowerSGD take the compressed path under every weighting; integer
    codes only under uniform weighting, and are decoded then accumulated otherwise."""
    deltas = _updates(8)
    weights = WEIGHTS if weighting == "examples" else [1.0] * 8
    steps = [3, 1, 8, 2, 5, 13, 1, 4] if weighting == "steps" else [1] * 8
    on, off = Tier(_cfg(CODECS[name], "auto", weighting), 8), Tier(_cfg(CODECS[name], "off", weighting), 8)
    assert (on.cr.compressed is not None) == _compressed(name, weighting) and off.cr.compressed is None
    for i in range(8):
        for tier in (on, off):
            tier.submit(*tier.upload(i, deltas[i], weights[i], steps[i]))
    got, want = on.coord.outcome(on.cr), off.coord.outcome(off.cr)
    if on.cr.compressed is not None:
        assert on.cr.compressed.count == 8  # every upload went through the compressed sum
    assert got.partial.count == want.partial.count == 8
    assert got.partial.weight == want.partial.weight
    assert got.partial.metrics.means() == pytest.approx(want.partial.metrics.means())
    _assert_close(_mean(got), _mean(want), 1e-6)


@pytest.mark.parametrize("name", ["float32", "randk", "powersgd", "ef-randk"])
def test_weights_are_not_capped(name: str) -> None:
    """Clients with very different example counts: each counts with its own weight, a
    client with 5000 examples counts 5000 (the secure aggregation's weight_scale, 1000
    by default, has no say here)."""
    deltas = _updates(7, seed=3)
    weights = [3.0, 250.0, 999.0, 5000.0, 1000.0, 17.5, 12_000.0]
    on, off = Tier(_cfg(CODECS[name], "auto", n=7), 7), Tier(_cfg(CODECS[name], "off", n=7), 7)
    uploads = [on.upload(i, d, w) for i, (d, w) in enumerate(zip(deltas, weights, strict=True))]
    for h, p in uploads:
        assert h.weight in weights
        on.submit(h, p)
    got = on.coord.outcome(on.cr)
    assert on.cr.compressed is not None and on.cr.compressed.count == 7
    assert got.partial.weight == sum(weights)
    # A plain numpy reference: the exact weighted mean of what the clients sent.
    want = _weighted_mean(deltas if name == "float32" else _decoded(on, uploads), weights)
    _assert_close(_mean(got), want, 3e-7)
    _assert_close(_mean(got), _mean(off.run(deltas, weights)), 1e-6)
    capped = _weighted_mean(deltas if name == "float32" else _decoded(on, uploads),
                            [min(w, 1000.0) for w in weights])
    assert max(np.abs(_mean(got)[k] - capped[k]).max() for k in SHAPES) > 1e-4


def test_a_client_with_5000_examples_counts_5000() -> None:
    tier = Tier(_cfg(CODECS["float32"], "auto", n=2), 2)
    ones = {k: np.ones(s, np.float32) for k, s in SHAPES.items()}
    out = tier.run([ones, {k: np.zeros(s, np.float32) for k, s in SHAPES.items()}], [5000.0, 1.0])
    assert out.partial.weight == 5001.0
    for v in _mean(out).values():
        np.testing.assert_allclose(v, np.float32(5000.0 / 5001.0), rtol=1e-7)


@pytest.mark.parametrize("name", INTEGER_CODES)
@pytest.mark.parametrize("weighting", ["examples", "steps", "fednova"])
def test_integer_codes_under_weighted_modes_take_the_decode_path(name: str, weighting: str) -> None:
    """Their codes cannot be weighted exactly: each upload is decoded and accumulated with
    its full weight, as with compression off."""
    deltas = _updates(8, seed=2)
    tier = Tier(_cfg(CODECS[name], "auto", weighting), 8)
    assert tier.cr.compressed is None
    uploads = [tier.upload(i, d, w, steps=i + 1) for i, (d, w) in enumerate(zip(deltas, WEIGHTS, strict=True))]
    for h, p in uploads:
        tier.submit(h, p)
    out = tier.coord.outcome(tier.cr)
    ws = [h.weight for h, _ in uploads]
    assert out.partial.weight == pytest.approx(sum(ws))
    _assert_close(_mean(out), _weighted_mean(_decoded(tier, uploads), ws), 1e-6)


@pytest.mark.parametrize("name", list(CODECS))
@pytest.mark.parametrize("weighting", ["examples", "uniform"])
def test_clipping_in_the_compressed_domain_equals_decode_then_clip(name: str, weighting: str) -> None:
    """A run that bounds update norms (robust.norm_bound; DP's clip is the same stage):
    codecs with real weights sum compressed, each update times ``w min(1, C / ||x||)``
    with its norm read from the payload, counted at ``w``; equal to decoding, clipping
    and accumulating every update, to 1e-6 of the largest mean element. The clip stage
    reports the same clients, clips and norms either way. Integer codes stay on the
    decode path (their codes add only unweighted)."""
    deltas = _updates(8, seed=5)
    for i in (1, 4, 6):  # well over the bound; the rest straddle it
        deltas[i] = {k: v * np.float32(20.0) for k, v in deltas[i].items()}
    weights = WEIGHTS if weighting == "examples" else [1.0] * 8
    kw: dict[str, Any] = {"robust": {"norm_bound": 0.5}}
    on, off = Tier(_cfg(CODECS[name], "auto", weighting, **kw), 8), Tier(_cfg(CODECS[name], "off", weighting, **kw), 8)
    assert (on.cr.compressed is not None) == (name not in INTEGER_CODES) and off.cr.compressed is None
    uploads = [on.upload(i, d, w) for i, (d, w) in enumerate(zip(deltas, weights, strict=True))]
    for h, p in uploads:
        on.submit(h, p)
        off.submit(h, p)
    got, want = on.coord.outcome(on.cr), off.coord.outcome(off.cr)
    assert got.partial.weight == want.partial.weight == sum(weights)
    assert got.partial.metrics.means() == pytest.approx(want.partial.metrics.means())
    assert got.partial.metrics.means()["clip_below"] == pytest.approx(want.partial.metrics.means()["clip_below"])
    for m in ("clipped", "clip_clients", "mean_norm"):
        assert got.measurements[m] == pytest.approx(want.measurements[m], rel=1e-9), m
    sent = _decoded(on, uploads)
    norms = [math.sqrt(sum(float(np.sum(d[k].astype(np.float64) ** 2)) for k in SHAPES)) for d in sent]
    assert got.measurements["clipped"] == sum(n > 0.5 for n in norms) >= 3
    if name == "float32":
        assert sum(n > 0.5 for n in norms) == 3  # and five within the bound, untouched
    _assert_close(_mean(got), _mean(want), 1e-6)
    # The plain reference: each decoded update scaled to the bound, then the weighted mean.
    clipped = [{k: d[k].astype(np.float64) * min(1.0, 0.5 / n) for k in SHAPES} for d, n in zip(sent, norms,
                                                                                                strict=True)]
    _assert_close(_mean(got), _weighted_mean(clipped, weights), 2e-6)


def test_integer_codes_refuse_a_weight_other_than_1_and_the_sum_is_untouched() -> None:
    tier = Tier(_cfg(CODECS["qsgd8-fixed"], "auto", "uniform", n=3), 3)
    deltas = _updates(3, seed=4)
    tier.submit(*tier.upload(0, deltas[0], 1.0))
    count, weight, sums, _ = _state(tier)
    h, p = tier.upload(1, deltas[1], 1.0)
    with pytest.raises(UpdateSchemaError, match="uniform weighting"):
        tier.submit(dataclasses.replace(h, weight=2.0), p)
    c2, w2, s2, r2 = _state(tier)
    assert (c2, w2) == (count, weight) == (1, 1.0) and r2 == {"UpdateSchemaError": 1}
    for k in SHAPES:
        np.testing.assert_array_equal(s2[k], sums[k])


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


def test_secure_aggregation_keeps_the_decode_path() -> None:
    secure = _cfg(CODECS["float32"], secure_aggregation=SecureAggregationConfig(enabled=True))
    assert Tier(secure, 4).cr.compressed is None


@pytest.mark.parametrize("name", ["float32", "randk", "powersgd"])
def test_fednova_sums_in_the_compressed_domain_and_gives_the_same_step(name: str) -> None:
    """FedNova's tiers fold sum_i p_i d_i with p_i the header's weight, and the metric
    fednova_tau from the header: the compressed path folds exactly that, so the root's
    step (mean update times tau_eff) is the decode path's."""
    from orchard.aggregation import fednova_rescale

    deltas = _updates(6, seed=21)
    weights, steps = [40.0, 7.0, 2500.0, 90.0, 12.0, 300.0], [5, 1, 20, 8, 3, 11]
    on, off = (Tier(_cfg(CODECS[name], mode, "fednova", n=6), 6) for mode in ("auto", "off"))
    assert on.cr.compressed is not None and off.cr.compressed is None
    for i in range(6):
        for tier in (on, off):
            tier.submit(*tier.upload(i, deltas[i], weights[i], steps[i]))
    got, want = on.coord.outcome(on.cr), off.coord.outcome(off.cr)
    assert on.cr.compressed.count == 6 and got.partial.weight == want.partial.weight == sum(weights)
    (m_on, x_on), (m_off, x_off) = finalize(got.partial), finalize(want.partial)
    assert x_on["fednova_tau"] == pytest.approx(x_off["fednova_tau"])
    assert x_on["fednova_tau"] == pytest.approx(sum(w * s for w, s in zip(weights, steps, strict=True)) / sum(weights))
    _assert_close(fednova_rescale(m_on, x_on), fednova_rescale(m_off, x_off), 1e-6)


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
    tier.submit(*_raw_upload(tier, 1, _encoded(tier, big), weight=1.0))
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


@pytest.mark.parametrize("change, match", [
    ("name", r"update names \['w', 'x', 'k'\] do not match the round's \['w', 'b', 'k'\]"),
    ("missing", r"update names \['w', 'b'\] do not match"),
    ("shape", r"tensor 'b' declared shape \(31,\), expected \(30,\)"),
    ("dtype", r"tensor 'b' declared dtype 'float16', expected 'float32'"),
])
def test_a_header_whose_schema_differs_is_refused_by_tensor_before_any_payload(change: str, match: str) -> None:
    """An upload's declared schema is compared with the round's (one comparison when they
    are equal); a difference is named tensor by tensor, nothing is folded, and the client
    may send its update again with the right header."""
    tier = Tier(_cfg(CODECS["float32"], n=2), 2)
    deltas = _updates(2, seed=4)
    h, p = tier.upload(0, deltas[0], 3.0)
    specs = list(h.schema)
    b = specs[1]
    if change == "name":
        specs[1] = TensorSpec("x", b.shape, b.dtype)
    elif change == "missing":
        specs = specs[:2]
    elif change == "shape":
        specs[1] = TensorSpec(b.name, (31,), b.dtype)
    else:
        specs[1] = TensorSpec(b.name, b.shape, "float16")
    with pytest.raises(UpdateSchemaError, match=match):
        tier.submit(dataclasses.replace(h, schema=tuple(specs)), p)
    assert tier.cr.compressed is not None and tier.cr.compressed.count == 0
    assert not tier.cr.assignments[tier.nodes[0]].in_flight
    tier.submit(dataclasses.replace(h, schema=tuple(TensorSpec(s.name, list(s.shape), s.dtype) for s in h.schema)), p)
    tier.submit(*tier.upload(1, deltas[1], 0.5))
    sums = tier.coord.outcome(tier.cr).partial.sums
    for k in SHAPES:  # the weighted sum in float64, in arrival order, rounded to float32 once
        want = 3.0 * deltas[0][k].astype(np.float64)
        want += 0.5 * deltas[1][k].astype(np.float64)
        np.testing.assert_array_equal(sums[k], want.astype(np.float32))


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
    """Simulator (upload_now at every tier), root -> 2 aggregators -> clients. Quantised:
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
