"""Round trips for every codec over random shapes and dtypes, with the bound each one states."""

from __future__ import annotations

import math

import numpy as np
import pytest
from codec_cases import SPECS, matrices, tensors
from hypothesis import given
from hypothesis import strategies as st

from orchard.compression import build_codec
from orchard.compression.quantize import FLUSH_SCALE
from orchard.compression.wire import parse_payload

F32 = np.float32
TINY = float(FLUSH_SCALE)  # blocks whose max |x| is below this are sent as zeros


def roundtrip(name: str, x: np.ndarray, seed: int = 0, shared_seed: int = 3):
    codec = build_codec(SPECS[name])
    payload, state = codec.encode(x, np.random.default_rng(seed), None, shared_seed)
    y = codec.decode(payload, x.shape, 1, shared_seed)
    assert isinstance(payload, bytes)
    assert y.dtype == np.float32 and y.shape == x.shape
    return x.astype(F32), y, payload, state


@pytest.mark.parametrize("name", list(SPECS))
@given(x=tensors())
def test_every_codec_round_trips_shape_and_dtype(name: str, x: np.ndarray) -> None:
    x32, y, payload, _ = roundtrip(name, x)
    assert parse_payload(payload).shape == x.shape
    assert np.isfinite(y).all()


@given(x=tensors())
def test_float32_is_exact(x: np.ndarray) -> None:
    x32, y, _, _ = roundtrip("float32", x)
    np.testing.assert_array_equal(y, x32)


@given(x=tensors())
def test_float16_error_within_half_an_ulp(x: np.ndarray) -> None:
    # Round to nearest: |err| <= 2^-11 |x| for normal float16, <= 2^-25 in the subnormal range.
    x32, y, _, _ = roundtrip("float16", x)
    assert np.all(np.abs(y - x32) <= np.maximum(np.abs(x32) * 2.0**-11, 2.0**-25))


@given(x=tensors())
def test_bfloat16_error_within_half_an_ulp(x: np.ndarray) -> None:
    # bfloat16 keeps 8 significand bits: |err| <= 2^-8 |x| (float32's exponent range).
    x32, y, _, _ = roundtrip("bfloat16", x)
    assert np.all(np.abs(y - x32) <= np.abs(x32) * 2.0**-8)


def test_bfloat16_rounds_to_nearest_even_and_keeps_specials() -> None:
    # bfloat16's ulp at 1 is 2^-7: two ties (to even: down, up), one just above a tie.
    x = np.array([1 + 2**-8, 1 + 3 * 2**-8, 1 + 2**-8 + 2**-10, np.inf, -np.inf, np.nan], F32)
    y = build_codec(SPECS["bfloat16"]).decode(
        build_codec(SPECS["bfloat16"]).encode(x, np.random.default_rng(0))[0], x.shape
    )
    np.testing.assert_array_equal(y[:5], [1.0, 1 + 2**-6, 1 + 2**-7, np.inf, -np.inf])
    assert np.isnan(y[5])


@pytest.mark.parametrize(
    ("name", "bits", "block"),
    [("qsgd8", 8, None), ("qsgd4-block16", 4, 16), ("qsgd2", 2, None), ("qsgd1-block7", 1, 7)],
)
@given(x=tensors())
def test_qsgd_error_below_one_step(name: str, bits: int, block: int | None, x: np.ndarray) -> None:
    # Stochastic rounding moves each element by less than one level step 2 s / L, where s
    # is the max |x| of its block (blocks whose max is below FLUSH_SCALE are flushed to zero).
    x32, y, _, _ = roundtrip(name, x)
    flat, err = x32.reshape(-1), np.abs(y - x32).reshape(-1)
    b = block or max(flat.size, 1)
    for start in range(0, flat.size, b):
        s = np.abs(flat[start : start + b]).max()
        step = 2 * s / (2**bits - 1)
        assert err[start : start + b].max() <= step * (1 + 1e-5) + TINY


@given(x=tensors())
def test_sign_sends_the_sign_scaled_by_mean_abs(x: np.ndarray) -> None:
    x32, y, _, _ = roundtrip("sign", x)
    if x32.size == 0:
        return
    scale = np.abs(x32).astype(np.float64).mean()
    np.testing.assert_allclose(np.abs(y), scale, rtol=1e-5, atol=TINY)
    # The level map x / s + 1 is float32: an element within 2^-23 s of zero may take
    # either sign (its error then differs from the exact sign's by < 2^-22 s).
    clear = np.abs(x32) > scale * 2.0**-22
    assert np.all(np.where(x32 >= 0, y > 0, y < 0)[clear])


@given(x=tensors(), k=st.integers(1, 20))
def test_topk_keeps_exactly_the_k_largest_magnitudes(x: np.ndarray, k: int) -> None:
    from orchard.config import CodecSpec

    codec = build_codec(CodecSpec(name="topk", params={"k": k}))
    x32 = x.astype(F32)
    y = codec.decode(codec.encode(x, np.random.default_rng(0))[0], x.shape)
    kept = min(k, x32.size)
    mask = np.zeros(x32.size, bool)
    mask[np.flatnonzero(y.reshape(-1) != 0)] = True
    # Kept values are exact; everything dropped is no larger than anything kept.
    np.testing.assert_array_equal(y.reshape(-1)[mask], x32.reshape(-1)[mask])
    assert mask.sum() <= kept
    if kept and (~mask).any() and mask.any():
        assert np.abs(x32.reshape(-1)[~mask]).max() <= np.abs(x32.reshape(-1)[mask]).min()
    assert np.count_nonzero(x32) < kept or mask.sum() == kept


@given(x=tensors(), shared_seed=st.integers(0, 2**40))
def test_randk_sends_k_scaled_coordinates_drawn_from_the_shared_seed(
    x: np.ndarray, shared_seed: int
) -> None:
    x32, y, _, _ = roundtrip("randk", x, shared_seed=shared_seed)
    d = x32.size
    k = max(1, math.ceil(0.4 * d)) if d else 0
    chosen = np.flatnonzero((y.reshape(-1) != 0) | (x32.reshape(-1) == 0))
    np.testing.assert_allclose(
        y.reshape(-1)[chosen], (x32.reshape(-1) * (d / max(k, 1)))[chosen], rtol=1e-6
    )
    assert np.count_nonzero(y) <= k


@given(x=matrices(min_side=3), seed=st.integers(0, 100))
def test_powersgd_is_a_projection_and_exact_on_rank_r(x: np.ndarray, seed: int) -> None:
    codec = build_codec(SPECS["powersgd"])
    rng = np.random.default_rng(seed)
    n, m = x.shape[0], x.size // x.shape[0]
    y = codec.decode(codec.encode(x, rng)[0], x.shape)
    # decode = P_hat P_hat^T M with orthonormal P_hat: the error never exceeds |M|.
    assert np.linalg.norm(y - x) <= np.linalg.norm(x) * (1 + 1e-4) + 1e-4
    # A rank-2 matrix is recovered exactly from one power step with a random start.
    low = (rng.standard_normal((n, 2)) @ rng.standard_normal((2, m))).astype(F32)
    y2 = codec.decode(codec.encode(low.reshape(x.shape), rng)[0], x.shape).reshape(n, m)
    np.testing.assert_allclose(y2, low, atol=1e-3 * max(1.0, np.abs(low).max()))


def test_powersgd_sends_factors_only_when_smaller() -> None:
    codec = build_codec(SPECS["powersgd"])  # rank 2
    rng = np.random.default_rng(0)
    big, _ = codec.encode(np.ones((40, 50), F32), rng)
    vec, _ = codec.encode(np.ones(50, F32), rng)
    assert len(big) < 4 * 40 * 50 / 4  # 4 (n + m) r bytes plus a header
    assert len(vec) >= 4 * 50  # vectors go dense


def test_powersgd_warm_start_converges_on_a_fixed_matrix() -> None:
    # Vogels et al. section 3.2: reusing Q makes repeated steps a subspace iteration, so
    # the error on a fixed matrix falls to that of the best rank-r approximation.
    rng = np.random.default_rng(1)
    spectrum = np.array([10, 5, 1, 0.5, 0.1, 0.05])
    u, _ = np.linalg.qr(rng.standard_normal((30, 6)))
    v, _ = np.linalg.qr(rng.standard_normal((20, 6)))
    mat = ((u * spectrum) @ v.T).astype(F32)
    codec, state, errs = build_codec(SPECS["powersgd"]), None, []
    for _ in range(8):
        payload, state = codec.encode(mat, rng, state)
        errs.append(np.linalg.norm(codec.decode(payload, mat.shape) - mat))
    best = np.sqrt((spectrum[2:] ** 2).sum())
    assert errs[-1] <= best * 1.01 < errs[0]


@given(x=tensors())
def test_topk_then_qsgd_is_topk_support_with_quantised_values(x: np.ndarray) -> None:
    x32, y, _, _ = roundtrip("topk+qsgd", x)
    _, y_topk, _, _ = roundtrip("topk", x, shared_seed=3)  # fraction 0.3 vs 0.25: bound only
    flat = x32.reshape(-1)
    kept = max(1, math.ceil(0.25 * flat.size)) if flat.size else 0
    top = (
        np.sort(np.argpartition(np.abs(flat), flat.size - kept)[flat.size - kept :]) if kept else []
    )
    s = np.abs(flat[top]).max() if kept else 0.0
    err = np.abs(y.reshape(-1) - flat)
    outside = np.ones(flat.size, bool)
    outside[top] = False
    assert np.all(y.reshape(-1)[outside] == 0)
    assert np.all(err[~outside] <= 2 * s / 255 * (1 + 1e-5) + TINY)
    del y_topk


@pytest.mark.parametrize("name", ["float32", "float16", "bfloat16"])
@given(x=tensors())
def test_cast_fast_encode_is_byte_identical_to_the_general_framing(name: str, x: np.ndarray) -> None:
    """Casts build their header once per shape and append the values; the bytes must be
    exactly what EncodedTensor.to_bytes frames (twice: the second call hits the cache)."""
    codec = build_codec({"name": name})
    rng = np.random.default_rng(0)
    general = codec.encode_parsed(np.asarray(x, dtype=np.float32), rng, None, 0)[0].to_bytes()
    for _ in range(2):
        payload, state = codec.encode(x, rng)
        assert state is None and bytes(payload) == general
