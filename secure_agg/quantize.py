"""Fixed-point encoding of float updates into Z_{2^b} (Bonawitz et al., 2017, §3 assume
integer inputs; Kairouz et al., 2021, "The distributed discrete Gaussian", §4 describe
clipping and stochastic rounding for secure aggregation).

``quantize`` clips to [-c, c], maps affinely onto [0, 2^bits - 1] and rounds
stochastically (up with probability equal to the fractional part), so
E[dequantize(quantize(x))] = clip(x) exactly. Each encoded value is < 2^bits, so the
sum of n of them is < n 2^bits: it never wraps modulo 2^modulus_bits as long as
n 2^bits <= 2^modulus_bits (:func:`check_headroom`). The encoding is affine, not linear,
so ``dequantize`` must be told how many summands it decodes: every summand carries an
offset of c.
"""

from __future__ import annotations

import numpy as np

from orchard.secure_agg.errors import SecAggConfigError

__all__ = ["check_headroom", "dequantize", "quantize"]


def _check(clip: float, bits: int) -> None:
    problems = []
    if not clip > 0 or not np.isfinite(clip):
        problems.append(f"clip must be a positive finite number, got {clip}")
    if not 1 <= bits <= 32:
        problems.append(f"bits must be in 1..32, got {bits}")
    if problems:
        raise SecAggConfigError(problems)


def check_headroom(num_summands: int, bits: int, modulus_bits: int = 32) -> None:
    """Refuse a configuration whose sum could wrap: need n * 2^bits <= 2^modulus_bits."""
    if num_summands < 1:
        raise SecAggConfigError(f"num_summands must be >= 1, got {num_summands}")
    if num_summands * (1 << bits) > (1 << modulus_bits):
        max_bits = modulus_bits - (num_summands - 1).bit_length()
        raise SecAggConfigError(
            f"{num_summands} summands of {bits}-bit values can reach "
            f"{num_summands} * 2^{bits} > 2^{modulus_bits}: the sum would wrap modulo the "
            f"field; use bits <= {max_bits}, a larger modulus_bits, or a smaller cohort"
        )


def quantize(x: np.ndarray, clip: float, bits: int, rng: np.random.Generator) -> np.ndarray:
    """Clip to [-clip, clip] and round stochastically to a uint32 in [0, 2^bits - 1]."""
    _check(clip, bits)
    levels = float((1 << bits) - 1)
    v = (np.clip(np.asarray(x, dtype=np.float64), -clip, clip) + clip) * (levels / (2.0 * clip))
    floor = np.floor(v)
    up = rng.random(v.shape) < (v - floor)
    return np.minimum(floor + up, levels).astype(np.uint32)


def dequantize(total: np.ndarray, clip: float, bits: int, num_summands: int) -> np.ndarray:
    """The float sum of ``num_summands`` quantised vectors whose integer sum is ``total``."""
    _check(clip, bits)
    if num_summands < 1:
        raise SecAggConfigError(f"num_summands must be >= 1, got {num_summands}")
    levels = float((1 << bits) - 1)
    return np.asarray(total, dtype=np.float64) * (2.0 * clip / levels) - num_summands * clip
