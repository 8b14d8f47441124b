"""Downlink deltas: smaller than the dense model, within one quantisation step, no drift."""

from __future__ import annotations

import numpy as np
import pytest

from orchard.compression import UpdateMismatchError, apply_model_delta, encode_model_delta
from orchard.config import CodecSpec


def model(rng: np.random.Generator) -> dict[str, np.ndarray]:
    return {
        "w": rng.standard_normal((64, 100)).astype(np.float32),
        "b": rng.standard_normal(100).astype(np.float32),
    }


def test_a_quantised_delta_is_smaller_and_applies_within_one_step() -> None:
    rng = np.random.default_rng(0)
    old = model(rng)
    new = {k: v + 0.01 * rng.standard_normal(v.shape).astype(np.float32) for k, v in old.items()}
    delta = encode_model_delta(old, new, rng, from_version=3)
    assert delta.smaller and delta.encoded_bytes * 3 < delta.dense_bytes
    assert delta.encoded_bytes == sum(len(p) for p in delta.payloads.values())
    assert (delta.from_version, delta.to_version) == (3, 4)
    applied = apply_model_delta(old, delta.payloads, from_version=3)
    for k in old:
        np.testing.assert_array_equal(applied[k], delta.reconstructed[k])
        step = 2 * np.abs(new[k] - old[k]).max() / 255  # 8-bit, per 4096-element block at most
        assert np.abs(applied[k] - new[k]).max() <= step * (1 + 1e-4)


def test_dense_codec_is_reported_as_not_smaller() -> None:
    rng = np.random.default_rng(1)
    old = model(rng)
    delta = encode_model_delta(old, model(rng), rng, from_version=0, spec=CodecSpec(name="float32"))
    assert not delta.smaller


def test_error_does_not_drift_across_versions() -> None:
    # The server keeps `reconstructed` as its reference, so each delta re-sends what the
    # previous one rounded away: the client's error stays one step, not k steps.
    rng = np.random.default_rng(2)
    truth = model(rng)
    client = {k: v.copy() for k, v in truth.items()}
    reference = {k: v.copy() for k, v in truth.items()}
    for version in range(10):
        truth = {
            k: v + 0.01 * rng.standard_normal(v.shape).astype(np.float32) for k, v in truth.items()
        }
        delta = encode_model_delta(reference, truth, rng, from_version=version)
        client = apply_model_delta(client, delta.payloads, from_version=version)
        reference = delta.reconstructed
    for k in truth:
        np.testing.assert_allclose(client[k], reference[k], atol=1e-6)
        assert np.abs(client[k] - truth[k]).max() < 0.01 * 4 * 2 / 255 * 2


def test_renamed_or_reshaped_tensors_are_refused() -> None:
    rng = np.random.default_rng(3)
    old = model(rng)
    with pytest.raises(UpdateMismatchError, match=r"missing \['b'\], unexpected \['bias'\]"):
        encode_model_delta(old, {"w": old["w"], "bias": old["b"]}, rng, from_version=0)
    with pytest.raises(UpdateMismatchError, match="tensor shapes changed"):
        encode_model_delta(old, {"w": old["w"].T, "b": old["b"]}, rng, from_version=0)
