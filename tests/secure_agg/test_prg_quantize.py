"""Mask PRG, quantisation and headroom."""

from __future__ import annotations

import functools

import numpy as np
import pytest
from harness import one_shot_sum
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
from orchard.secure_agg.prg import DEFAULT_CHUNK_BYTES, MaskExpander, MaskFolder


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


@settings(max_examples=60, deadline=None)
@given(length=st.integers(0, 5000), bits=st.sampled_from([32, 64]),
       signs=st.lists(st.sampled_from([1, -1]), max_size=12),
       threads=st.integers(1, 3), batch=st.integers(1, 5),
       chunk_bytes=st.sampled_from([16, 48, 100, 1024, 4096, 1 << 18]))
def test_folder_equals_one_shot_masks(length: int, bits: int, signs: list[int], threads: int,
                                      batch: int, chunk_bytes: int) -> None:
    # Chunks that do not divide the length, chunks that are not whole AES blocks (100),
    # chunks larger than the vector, batches split over threads: always the same words.
    terms = [(bytes([i + 1]) * 16, s) for i, s in enumerate(signs)]
    acc = np.arange(length, dtype=np.uint32 if bits <= 32 else np.uint64)
    start = acc.copy()
    with MaskFolder(acc, threads=threads, batch=batch, chunk_bytes=chunk_bytes) as folder:
        for seed, sign in terms:
            folder.add(seed, sign)
        out = folder.finish()
    assert out is acc
    assert np.array_equal(acc - start, one_shot_sum(terms, length, bits))
    assert folder.expansions == len(terms)


def test_folder_on_a_long_vector_matches_expand_mask() -> None:
    # Several default-size chunks and a ragged last chunk, on two threads.
    length = 3 * DEFAULT_CHUNK_BYTES // 4 + 12_345
    terms = [(bytes([7, i]) * 8, 1 if i % 3 else -1) for i in range(9)]
    acc = np.zeros(length, dtype=np.uint32)
    with MaskFolder(acc, threads=2, batch=2) as folder:
        for seed, sign in terms:
            folder.add(seed, sign)
        folder.finish()
    want = np.zeros(length, dtype=np.uint32)
    for seed, sign in terms:
        want += expand_mask(seed, length) if sign > 0 else -expand_mask(seed, length)
    assert np.array_equal(acc, want)


def test_folder_masks_cancel_and_refuses_misuse() -> None:
    acc = np.arange(1000, dtype=np.uint32)
    with MaskFolder(acc, threads=2, batch=1) as folder:
        folder.add(b"\x05" * 16, 1)
        folder.add(b"\x05" * 16, -1)
        folder.finish()
        with pytest.raises(RuntimeError):
            folder.add(b"\x05" * 16)
    assert np.array_equal(acc, np.arange(1000))
    with pytest.raises(ValueError, match="seed"):
        MaskFolder(np.zeros(4, np.uint32)).add(b"short")
    for bad in (np.zeros(4, np.int32), np.zeros((2, 2), np.uint32), np.zeros(8, np.uint32)[::2],
                np.zeros(4, ">u4")):
        with pytest.raises(ValueError, match="accumulator"):
            MaskFolder(bad)
    with pytest.raises(ValueError, match="threads"):
        MaskFolder(np.zeros(4, np.uint32), threads=0)


def test_folder_error_in_a_thread_surfaces_in_finish() -> None:
    acc = np.zeros(100, dtype=np.uint32)
    folder = MaskFolder(acc, threads=2, batch=1)
    acc.flags.writeable = False  # the first batch folds into acc: its in-place add fails
    folder.add(b"\x01" * 16)
    with pytest.raises(ValueError, match="read-only"):
        folder.finish()


@pytest.mark.parametrize("length", [0, 1000, DEFAULT_CHUNK_BYTES // 4 + 5])
def test_folder_derives_seeds_given_as_functions(length: int) -> None:
    # A seed may be a derivation run on the folding thread: same sum as the seed itself,
    # each derivation called once, and one that fails (or returns a bad seed) fails finish.
    calls: list[int] = []

    def derive(i: int) -> bytes:
        calls.append(i)
        return bytes([i + 1]) * 16

    terms = [(bytes([i + 1]) * 16, 1 if i % 2 else -1) for i in range(7)]
    for threads in (1, 2):
        calls.clear()
        lazy = np.zeros(length, dtype=np.uint32)
        with MaskFolder(lazy, threads=threads, batch=3) as folder:
            for i, (_, sign) in enumerate(terms):
                folder.add(functools.partial(derive, i), sign)
            folder.finish()
        assert sorted(calls) == list(range(7))
        assert np.array_equal(lazy, one_shot_sum(terms, length, 32))

    def broken() -> bytes:
        raise ArithmeticError("derivation failed")

    for bad, err in ((broken, ArithmeticError), (lambda: b"short", ValueError)):
        with MaskFolder(np.zeros(length, np.uint32), threads=2, batch=1) as folder:
            folder.add(b"\x01" * 16)
            folder.add(bad)
            with pytest.raises(err):
                folder.finish()
