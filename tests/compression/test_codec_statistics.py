"""Statistical tests of the stochastic codecs: unbiased where claimed, with fixed seeds.

Tolerance: each coordinate's empirical mean over T draws must lie within 5 standard
errors of x (per-coordinate false-alarm rate < 6e-7 under the null). Each test also
runs a biased variant through the same statistic to show it can fail.
"""

from __future__ import annotations

import numpy as np
import pytest

from orchard.compression import build_codec
from orchard.compression.quantize import QuantCodec, qsgd_variance_bound
from orchard.config import CodecSpec

Z = 5.0
X = np.linspace(-1.0, 1.0, 64, dtype=np.float32) ** 3  # includes +-1 (= the scale) and 0


def qsgd_bias_in_standard_errors(codec: QuantCodec, draws: int = 20_000) -> float:
    """max_i |mean_T x_hat_i - x_i| in units of the variance bound's standard error."""
    # One encode of X tiled T times, one scale per copy: T independent draws per element.
    tiled = np.tile(X, draws)
    payload, _ = codec.encode(tiled, np.random.default_rng(1234))
    mean = codec.decode(payload, tiled.shape).reshape(draws, X.size).mean(axis=0, dtype=np.float64)
    se = np.sqrt(qsgd_variance_bound(float(np.abs(X).max()), codec.bits) / draws)
    return float(np.abs(mean - X).max() / se)


@pytest.mark.parametrize("bits", [1, 2, 4, 8])
def test_qsgd_is_unbiased(bits: int) -> None:
    codec = build_codec(CodecSpec(name="qsgd", params={"bits": bits, "block": X.size}))
    assert codec.algebra.unbiased
    assert qsgd_bias_in_standard_errors(codec) < Z


@pytest.mark.parametrize("bits", [2, 4])
def test_the_statistic_rejects_nearest_rounding(bits: int) -> None:
    # The same skeleton with deterministic rounding is biased; the test above must see it.
    biased = QuantCodec("qsgd", bits, block=X.size, stochastic=False)
    assert qsgd_bias_in_standard_errors(biased) > 10 * Z


def test_qsgd_with_fixed_scale_is_unbiased_inside_the_scale() -> None:
    codec = build_codec(CodecSpec(name="qsgd", params={"bits": 2, "scale": 1.0}))
    assert qsgd_bias_in_standard_errors(codec) < Z


def randk_bias_in_standard_errors(spec: CodecSpec, seeds: int = 3000) -> float:
    codec = build_codec(spec)
    x = X[::4].copy()  # d = 16
    rng = np.random.default_rng(0)
    total = np.zeros(x.size)
    for seed in range(seeds):  # the shared seed is the randomness of randk
        payload, _ = codec.encode(x, rng, None, seed)
        total += codec.decode(payload, x.shape, 1, seed)
    # Per coordinate: x_i d/k with probability k/d, else 0 -> variance x_i^2 (d/k - 1).
    d, k = x.size, 4
    se = np.abs(x) * np.sqrt(d / k - 1) / np.sqrt(seeds)
    nonzero = se > 0
    return float((np.abs(total / seeds - x)[nonzero] / se[nonzero]).max())


def test_randk_is_unbiased_over_the_shared_seed() -> None:
    assert randk_bias_in_standard_errors(CodecSpec(name="randk", params={"k": 4})) < Z


def test_the_statistic_rejects_unscaled_randk() -> None:
    spec = CodecSpec(name="randk", params={"k": 4, "unbiased": False})
    assert not build_codec(spec).algebra.unbiased
    # E = (k/d) x = x / 4 here: at least 3/4 |x| away, ~25 standard errors at 3000 seeds.
    assert randk_bias_in_standard_errors(spec) > 3 * Z
