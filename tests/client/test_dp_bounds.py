"""Under DP, what a tier sums from one client is within the clip norm the noise is
calibrated to, after the codec (error feedback's residual included), after secure
aggregation's scaling and rounding, for every codec secure aggregation takes and either
session size (a cohort's, or the whole tree's)."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest

from orchard.aggregation.privacy import clip_factor, session_params
from orchard.client.secure import masked_vector
from orchard.client.update import build_upload
from orchard.compression import UpdateSum, build_codec, validate_codec_for_secure_aggregation
from orchard.config import RunConfig
from orchard.messages import TaskAssignment
from orchard.server.secagg import decode_total
from orchard.trainer import TrainConfig, TrainResult
from orchard.typing import TensorSpec

SCHEMA = (TensorSpec("w", (200, 50), "float32"), TensorSpec("b", (50,), "float32"))
CLIP = 0.3
CODECS = {
    "float32": {"name": "float32"},
    "qsgd-fixed": {"name": "qsgd", "params": {"bits": 8, "scale": 0.05}},
    "randk-1%": {"name": "randk", "params": {"fraction": 0.01}},
    "randk+qsgd-fixed": {"name": "pipeline", "params": {"stages": [
        {"name": "randk", "params": {"fraction": 0.05}}, {"name": "qsgd", "params": {"bits": 8, "scale": 0.05}}]}},
    "ef-randk": {"name": "error_feedback", "params": {"codec": {"name": "randk", "params": {"fraction": 0.01}}}},
}


def _run(codec: dict, mode: str, scope: str) -> RunConfig:
    privacy = {"mode": mode, "noise_multiplier": 1.0, "clip_norm": CLIP, "population": 10_000}
    return RunConfig.model_validate({"cohort": {"target": 10, "weighting": "uniform"}, "codec": codec,
                                     "secure_aggregation": {"enabled": True, "scope": scope}, "privacy": privacy})


def _task(rnd: int) -> TaskAssignment:
    return TaskAssignment(run_id="r", round=rnd, attempt=0, task_id=f"t{rnd}", model_hash="h", model_bytes=0,
                          config_json="{}", schema=SCHEMA, deadline_unix=0.0, cohort_target=10, shared_seed=77 + rnd)


def _delta(rng: np.random.Generator, scale: float) -> dict[str, np.ndarray]:
    return {s.name: (scale * rng.standard_normal(s.shape)).astype(np.float32) for s in SCHEMA}


@pytest.mark.parametrize("scope", ["cohort", "tree"])
@pytest.mark.parametrize("mode", ["central", "distributed"])
@pytest.mark.parametrize("name", list(CODECS))
def test_a_decoded_secure_contribution_is_within_the_accounted_bound(name: str, mode: str, scope: str,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    if mode == "distributed":  # the bound is on the rounded update, before its noise share
        import orchard.client.secure as client_secure

        def noiseless(*args: object) -> object:
            return dataclasses.replace(session_params(*args), share_sigma=0.0)  # type: ignore[arg-type]

        monkeypatch.setattr(client_secure, "session_params", noiseless)
    cfg = _run(CODECS[name], mode, scope)
    validate_codec_for_secure_aggregation(cfg.codec)
    codec = build_codec(cfg.codec)
    participants = 5 if scope == "cohort" else 60  # a cohort's session, or one over the whole tree
    dim = sum(math.prod(s.shape) for s in SCHEMA)
    rng = np.random.default_rng(1)
    states = None
    for rnd in range(3):  # error feedback carries a residual into later rounds
        t = _task(rnd)
        # Updates far above the clip (and within it): what is summed must be bounded either way.
        delta = _delta(rng, 0.5 if rnd != 1 else 1e-4)
        result = TrainResult(arrays={}, weight=1.0, num_examples=10, num_steps=1)
        header, payload, states = build_upload(t, cfg, TrainConfig(), codec, "n0", delta, result, seed=rnd, states=states)
        p = session_params(cfg, participants, dim)
        assert p is not None
        vec = masked_vector(cfg, codec, t, header, payload, np.random.default_rng(rnd), participants)
        got = float(np.linalg.norm(decode_total(cfg, vec, 1, p)))  # what the tier folds
        accounted = CLIP if mode == "central" else p.gamma * p.delta2  # the noise is z times this
        assert got <= accounted * (1 + 1e-9), (name, mode, scope, rnd, got, accounted)
        if mode == "distributed":  # the accountant's sensitivity, in field units, is delta2 (noise z x delta2)
            assert p.delta2 * p.gamma <= CLIP * 1.01


@pytest.mark.parametrize("name", ["float32", "randk-1%", "ef-randk"])
def test_a_tier_that_sums_compressed_adds_each_update_within_the_clip(name: str) -> None:
    """Without secure aggregation a tier clips what it decodes or, summing compressed,
    scales each payload by the norm of what it decodes to."""
    cfg = RunConfig.model_validate({"cohort": {"weighting": "uniform"}, "codec": CODECS[name],
                                    "privacy": {"mode": "central", "noise_multiplier": 1.0, "clip_norm": CLIP}})
    codec = build_codec(cfg.codec)
    shapes = {s.name: s.shape for s in SCHEMA}
    rng = np.random.default_rng(2)
    states = None
    for rnd in range(3):
        t = _task(rnd)
        result = TrainResult(arrays={}, weight=1.0, num_examples=10, num_steps=1)
        header, payload, states = build_upload(t, cfg, TrainConfig(), codec, "n0", _delta(rng, 0.5), result,
                                               seed=rnd, states=states)
        sums = UpdateSum(codec, shapes, t.shared_seed)
        checked = sums.check_packed(payload, header.payload_sizes)
        sums.add(checked, header.weight, clip_factor(sums.norm(checked), CLIP))
        added = math.sqrt(sum(float(np.sum(np.asarray(v, np.float64) ** 2)) for v in sums.result().values()))
        assert added <= CLIP * (1 + 1e-6), (name, rnd, added)
