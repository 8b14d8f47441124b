"""Mask PRG, quantisation and headroom."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from uniformity import chi_square_uniform_bytes

from orchard.secure_agg import (
    SecAggConfigError,
    check_headroom,
    dequantize,
    expand_mask,
    quantize,
)
from orchard.secure_agg.prg import MaskExpander


def test_mask_is_deterministic_and_seed_dependent() -> None:
    a = expand_mask(b"\x01" * 16, 1000)
    assert a.dtype == np.uint32
    assert np.array_equal(a, expand_mask(b"\x01" * 16, 1000))
    assert not np.array_equal(a, expand_mask(b"\x02" + b"\x01" * 15, 1000))
    # A prefix of a longer mask is the shorter mask (counter mode).
    assert np.array_equal(a[:10], expand_mask(b"\x01" * 16, 10))


def test_mask_is_uniform() -> None:
    ok, stat, crit = chi_square_uniform_bytes(expand_mask(b"\x07" * 16, 200_000))
    assert ok, (stat, crit)


@pytest.mark.parametrize("bits", [1, 16, 31, 32, 33, 48, 64])
def test_mask_range_and_dtype(bits: int) -> None:
    m = expand_mask(b"\x03" * 16, 5000, bits)
    assert m.dtype == (np.uint32 if bits <= 32 else np.uint64)
    if bits < 8 * m.dtype.itemsize:
        assert int(m.max()) < 1 << bits
    # Enough spread to rule out a stuck stream.
    assert len(np.unique(m)) > min(2 ** bits, 5000) // 2


def test_expander_add_and_subtract_cancel() -> None:
    exp = MaskExpander(1000, 32)
    acc = np.arange(1000, dtype=np.uint32)
    exp.add_into(acc, b"\x09" * 16, 1)
    assert not np.array_equal(acc, np.arange(1000))
    exp.add_into(acc, b"\x09" * 16, -1)
    assert np.array_equal(acc, np.arange(1000))
    assert exp.expansions == 2


@settings(max_examples=40, deadline=None)
@given(bits=st.integers(2, 24), clip=st.floats(0.01, 100.0), n=st.integers(1, 200))
def test_quantize_range_and_roundtrip_error(bits: int, clip: float, n: int) -> None:
    rng = np.random.default_rng(bits)
    x = rng.normal(0, clip, size=n) * 2  # some values are clipped
    q = quantize(x, clip, bits, rng)
    assert q.dtype == np.uint32 and int(q.max()) < 1 << bits
    back = dequantize(q.astype(np.uint64), clip, bits, num_summands=1)
    step = 2 * clip / ((1 << bits) - 1)
    assert np.all(np.abs(back - np.clip(x, -clip, clip)) <= step * (1 + 1e-9))


def test_stochastic_rounding_is_unbiased() -> None:
    # Mean of m roundings of a value between two levels: standard error step/(2 sqrt m);
    # the bound is 5 standard errors, i.e. a false failure rate below 1e-6.
    rng = np.random.default_rng(0)
    clip, bits, m = 1.0, 4, 20_000
    step = 2 * clip / ((1 << bits) - 1)
    for x in (0.01, -0.33, 0.5 + step / 3):
        q = quantize(np.full(m, x), clip, bits, rng)
        est = dequantize(q.astype(np.uint64), clip, bits, 1).mean()
        assert abs(est - x) < 5 * step / (2 * np.sqrt(m)), (x, est)


def test_sum_of_quantised_vectors_decodes_with_num_summands() -> None:
    rng = np.random.default_rng(1)
    xs = rng.uniform(-1, 1, size=(50, 300))
    qs = [quantize(x, 1.0, 16, rng) for x in xs]
    total = np.sum(np.stack(qs).astype(np.uint64), axis=0).astype(np.uint32)
    got = dequantize(total, 1.0, 16, num_summands=50)
    assert np.allclose(got, xs.sum(axis=0), atol=50 * 2 / 65535)


def test_headroom() -> None:
    check_headroom(1 << 16, 16, 32)
    with pytest.raises(SecAggConfigError, match="wrap"):
        check_headroom((1 << 16) + 1, 16, 32)
    with pytest.raises(SecAggConfigError, match="use bits <= 22"):
        check_headroom(1000, 24, 32)
    with pytest.raises(SecAggConfigError):
        quantize(np.zeros(3), 0.0, 8, np.random.default_rng(0))
