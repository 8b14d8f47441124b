"""orchard.client.update: seeds, the encoder's lazily built randomness, and uploads that
carry the plain update with its weight in the header."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from orchard.client.update import (
    build_upload,
    build_uploads,
    delta_of,
    deltas_of,
    train_seed,
    upload_rng,
)
from orchard.compression import build_codec, decode_update, encode_update
from orchard.config import CodecSpec, CohortConfig, RunConfig
from orchard.messages import TaskAssignment
from orchard.seeds import derive_seed
from orchard.trainer import TrainResult
from orchard.typing import TensorSpec
from orchard.updates import split

SHAPES = {"w": (20, 8), "b": (8,)}
SCHEMA = tuple(TensorSpec(k, s, "float32") for k, s in SHAPES.items())


def test_train_seed_is_deterministic_in_range_and_distinct() -> None:
    assert train_seed(3, 1, 7) == train_seed(3, 1, 7)
    seeds = {train_seed(s, r, p) for s in range(3) for r in range(5) for p in range(200)}
    assert len(seeds) == 3 * 5 * 200
    assert all(0 <= v < 2**31 - 1 for v in seeds)
    assert train_seed(3, 1, 7) == derive_seed(3, 1, 7, bits=31) % (2**31 - 1)


def test_the_lazy_generator_gives_the_eager_generators_stream() -> None:
    lazy, eager = upload_rng(42), np.random.default_rng([42, 0xC0DEC])
    np.testing.assert_array_equal(lazy.random(5), eager.random(5))
    np.testing.assert_array_equal(lazy.standard_normal((2, 3), dtype=np.float32),
                                  eager.standard_normal((2, 3), dtype=np.float32))
    out_l, out_e = np.empty(4, np.float32), np.empty(4, np.float32)
    lazy.random(out=out_l, dtype=np.float32)
    eager.random(out=out_e, dtype=np.float32)
    np.testing.assert_array_equal(out_l, out_e)


def test_a_codec_that_draws_nothing_builds_no_generator() -> None:
    rng = upload_rng(1)
    encode_update(build_codec(CodecSpec(name="float32")), {"x": np.ones(3, np.float32)}, rng)
    assert rng._rng is None  # type: ignore[attr-defined]


def _task(cfg: RunConfig) -> TaskAssignment:
    return TaskAssignment(run_id="r", round=1, attempt=0, task_id="t", model_hash="h", model_bytes=0,
                          config_json=cfg.model_dump_json(), schema=SCHEMA, deadline_unix=0.0,
                          cohort_target=1, shared_seed=99)


def _delta(seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {k: (0.01 * rng.standard_normal(s)).astype(np.float32) for k, s in SHAPES.items()}


CODECS: list[dict[str, Any]] = [
    {"name": "qsgd", "params": {"bits": 4}},  # stochastic rounding: draws from the encoder's rng
    {"name": "powersgd", "params": {"rank": 2}},  # draws its first Q
    {"name": "randk", "params": {"fraction": 0.3}},
]


@pytest.mark.parametrize("codec", CODECS)
def test_stochastic_codecs_encode_as_with_an_eager_generator(codec: dict[str, Any]) -> None:
    cfg = RunConfig(codec=CodecSpec(**codec))
    c = build_codec(cfg.codec)
    delta = _delta(1)
    result = TrainResult(arrays={}, weight=10.0, num_examples=10, num_steps=2)
    _, payload, _ = build_upload(_task(cfg), cfg, cfg.train, c, "n", delta, result, seed=5, states=None)
    eager, _ = encode_update(c, delta, np.random.default_rng([5, 0xC0DEC]), None, 99)
    assert payload == b"".join(eager[s.name] for s in SCHEMA)


@pytest.mark.parametrize("weighting", ["examples", "steps", "uniform"])
def test_an_upload_carries_the_plain_update_and_its_weight(weighting: str) -> None:
    """Nothing is pre-scaled or capped on the client, whatever the weight: the tier weighs."""
    cfg = RunConfig(codec=CodecSpec(name="float32"), cohort=CohortConfig(weighting=weighting))  # type: ignore[arg-type]
    c = build_codec(cfg.codec)
    delta = _delta(2)
    result = TrainResult(arrays={}, weight=5000.0, num_examples=5000, num_steps=7)
    h, payload, _ = build_upload(_task(cfg), cfg, cfg.train, c, "n", delta, result, seed=0, states=None)
    assert h.weight == {"examples": 5000.0, "steps": 7.0, "uniform": 1.0}[weighting]
    got = decode_update(c, dict(zip(SHAPES, split(payload, h.payload_sizes), strict=True)), SHAPES, 1, 99)
    for k in SHAPES:
        np.testing.assert_array_equal(got[k], delta[k])


@settings(max_examples=60, deadline=None)
@given(
    clients=st.integers(1, 5),
    codec=st.sampled_from(["float32", "float16", "bfloat16", "qsgd", "topk"]),
    weighting=st.sampled_from(["examples", "steps", "uniform", "fednova"]),
    scale=st.sampled_from([0.01, 1.0, 3e4, 1e5]),  # float16 holds |x| < 65520: larger rows are refused
    special=st.sampled_from([None, np.nan, np.inf]),
    seed=st.integers(0, 2**16),
    quant=st.sampled_from([{"bits": 4}, {"bits": 8}, {"bits": 2, "block": 7}, {"bits": 1, "block": 64},
                           {"bits": 8, "scale": 0.5}]),
)
def test_uploads_built_together_are_those_built_one_by_one(clients: int, codec: str, weighting: str, scale: float,
                                                           special: float | None, seed: int, quant: dict) -> None:
    """build_uploads (a simulator's batch) gives each client the header and bytes that
    build_upload gives it alone, from deltas taken together (deltas_of) as delta_of takes
    them; where it cannot (a codec that draws or keeps state, FedNova, a row a cast
    refuses) it says so with None."""
    params = quant if codec == "qsgd" else {"fraction": 0.3} if codec == "topk" else {}
    cfg = RunConfig(codec=CodecSpec(name=codec, params=params), cohort=CohortConfig(weighting=weighting))  # type: ignore[arg-type]
    c = build_codec(cfg.codec)
    rng = np.random.default_rng(seed)
    start = {k: rng.standard_normal(s).astype(np.float32) for k, s in SHAPES.items()}
    results = []
    for i in range(clients):
        arrays = {k: (v + scale * rng.standard_normal(v.shape)).astype(np.float32) for k, v in start.items()}
        if special is not None and i == clients - 1:
            arrays["b"][0] = special
        n = int(rng.integers(1, 50))
        results.append(TrainResult(arrays=arrays, weight=float(n), num_examples=n, num_steps=int(rng.integers(1, 9)),
                                   metrics={"train_loss": float(rng.random()), "odd": float("nan")}))
    t = _task(cfg)
    deltas = deltas_of(t, start, results)
    assert deltas is not None
    for i, r in enumerate(results):
        for k, v in delta_of(t, start, r).items():
            np.testing.assert_array_equal(deltas[k][i], v)
    # Each client's encoder randomness comes from its training seed (here i), as build_upload's.
    got = build_uploads([t] * clients, cfg, c, [f"n{i}" for i in range(clients)], deltas, results,
                        seeds=list(range(clients)))
    if got is None:  # then every client goes through build_upload; nothing to compare
        assert (codec == "topk" or weighting == "fednova" or (codec == "float16" and scale > 1e4)
                or (codec == "qsgd" and special is not None and "scale" not in quant))
        return
    assert codec in ("float32", "float16", "bfloat16", "qsgd") and weighting != "fednova"
    for i, (r, (header, payload)) in enumerate(zip(results, got, strict=True)):
        h1, p1, states = build_upload(t, cfg, cfg.train, c, f"n{i}", delta_of(t, start, r), r, seed=i, states=None)
        assert payload == p1 and header == h1 and states == {}


def test_deltas_of_says_none_for_a_result_of_another_shape() -> None:
    cfg = RunConfig()
    good = TrainResult(arrays=_delta(1), weight=1.0, num_examples=1, num_steps=1)
    bad = TrainResult(arrays={"w": np.zeros((8, 20), np.float32), "b": np.zeros(8, np.float32)}, weight=1.0,
                      num_examples=1, num_steps=1)
    missing = TrainResult(arrays={"w": np.zeros((20, 8), np.float32)}, weight=1.0, num_examples=1, num_steps=1)
    start = {k: np.zeros(s, np.float32) for k, s in SHAPES.items()}
    assert deltas_of(_task(cfg), start, [good, bad]) is None
    assert deltas_of(_task(cfg), start, [good, missing]) is None
    assert deltas_of(_task(cfg), start, [good, good]) is not None
