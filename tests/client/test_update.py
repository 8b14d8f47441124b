"""orchard.client.update: seeds, the encoder's lazily built randomness, and uploads that
carry the plain update with its weight in the header."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from orchard.client.update import build_upload, train_seed, upload_rng
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
