"""Sums: compressed-domain where the algebra claims it, a plain-sum oracle for everything,
and payload sizes that match the wire format's arithmetic."""

from __future__ import annotations

import math

import numpy as np
import pytest
from codec_cases import SPECS, tensors
from hypothesis import given
from hypothesis import strategies as st

from orchard.compression import PayloadSum, build_codec, sum_encoded, sum_payloads
from orchard.compression.update import decode_update, encode_update
from orchard.compression.wire import Field
from orchard.config import CodecSpec
from orchard.errors import CodecError

LINEAR = [n for n, s in SPECS.items() if build_codec(s).algebra.linear]
NOT_LINEAR = [n for n in SPECS if n not in LINEAR]


def test_the_declared_algebra() -> None:
    assert set(LINEAR) == {
        "float32", "qsgd8-fixed", "randk", "randk-biased", "powersgd",
        "randk+qsgd-fixed", "ef-powersgd",
    }  # fmt: skip
    field = {n for n, s in SPECS.items() if build_codec(s).algebra.field_linear}
    assert field == {"float32", "qsgd8-fixed", "randk", "randk-biased", "randk+qsgd-fixed"}


def encode_all(name: str, xs: list[np.ndarray], shared_seed: int = 11) -> list[bytes]:
    codec = build_codec(SPECS[name])
    rng = np.random.default_rng(0)
    return [codec.encode(x, rng, None, shared_seed)[0] for x in xs]


@st.composite
def cohorts(draw: st.DrawFn) -> list[np.ndarray]:
    shape = draw(st.sampled_from([(), (7,), (3, 5), (12, 9), (2, 3, 4)]))
    n = draw(st.integers(1, 4))
    return [draw(tensors(shape=st.just(shape))).astype(np.float32) for _ in range(n)]


@pytest.mark.parametrize("name", LINEAR)
@given(xs=cohorts())
def test_linear_codecs_decode_the_sum_of_encodings_to_the_sum_of_decodes(
    name: str, xs: list[np.ndarray]
) -> None:
    codec = build_codec(SPECS[name])
    payloads = encode_all(name, xs)
    summed = sum_encoded(codec, payloads, xs[0].shape)
    together = codec.decode(summed, xs[0].shape, len(xs), 11)
    apart = sum(codec.decode(p, xs[0].shape, 1, 11).astype(np.float64) for p in payloads)
    scale = max(1.0, float(np.abs(apart).max()))
    np.testing.assert_allclose(together, apart, rtol=1e-5, atol=1e-5 * scale)


@pytest.mark.parametrize("name", ["float16", "bfloat16", "qsgd8", "sign", "topk", "topk+qsgd"])
def test_codecs_that_do_not_claim_linearity_refuse_a_compressed_sum(name: str) -> None:
    rng = np.random.default_rng(0)
    xs = [rng.standard_normal(50).astype(np.float32) for _ in range(2)]
    with pytest.raises(CodecError, match="cannot be added to the others without decoding"):
        sum_encoded(build_codec(SPECS[name]), encode_all(name, xs), (50,))


def test_qsgd_payloads_that_share_their_scale_add_as_integer_codes() -> None:
    codec = build_codec(SPECS["qsgd8"])  # data-dependent scale, but here the max is equal
    a = np.array([1.0, 0.25, -0.5, 0.0], np.float32)
    b = np.array([-1.0, 0.5, 0.125, 0.75], np.float32)
    pa, pb = encode_all("qsgd8", [a, b])
    total = codec.decode(sum_encoded(codec, [pa, pb], (4,)), (4,), 2)
    np.testing.assert_allclose(total, codec.decode(pa, (4,)) + codec.decode(pb, (4,)), atol=1e-6)


def test_qsgd_field_sum_wraps_like_the_secure_aggregation_field() -> None:
    # Integer codes summed modulo 2^32 (what a masked sum delivers) decode to the sum.
    codec = build_codec(SPECS["qsgd8-fixed"])
    rng = np.random.default_rng(2)
    xs = [rng.uniform(-2000, 2000, 30).astype(np.float32) for _ in range(5)]
    payloads = encode_all("qsgd8-fixed", xs)
    parsed = [codec.parse(p, (30,)) for p in payloads]
    masks = [rng.integers(0, 2**32, 30, dtype=np.uint64) for _ in range(4)]
    masks.append((-sum(masks)) % 2**32)  # masks cancel in the field
    masked = [e.fields[1].data.astype(np.uint64) + m for e, m in zip(parsed, masks, strict=True)]
    field_sum = sum(masked) % 2**32

    summed = codec.header((30,), [parsed[0].fields[0], Field(field_sum.astype(np.uint32))])
    got = codec.decode_parsed(summed, 5)
    want = sum(codec.decode(p, (30,)) for p in payloads)
    np.testing.assert_allclose(got, want, atol=1e-2)


@pytest.mark.parametrize("name", list(SPECS))
@given(xs=cohorts(), split=st.integers(0, 4))
def test_payload_sum_matches_the_plain_sum_oracle(
    name: str, xs: list[np.ndarray], split: int
) -> None:
    codec = build_codec(SPECS[name])
    payloads = encode_all(name, xs)
    shape = xs[0].shape
    oracle = sum(codec.decode(p, shape, 1, 11).astype(np.float64) for p in payloads)
    left, right = PayloadSum(codec, shape, 11), PayloadSum(codec, shape, 11)
    for i, p in enumerate(payloads):
        (left if i < split else right).accumulate(p)
    left.merge(right)
    assert left.count == len(payloads)
    tol = 1e-5 * max(1.0, float(np.abs(oracle).max()))
    np.testing.assert_allclose(left.result(), oracle, rtol=1e-5, atol=tol)
    np.testing.assert_allclose(
        sum_payloads(codec, payloads, shape, 11), oracle, rtol=1e-5, atol=tol
    )


def test_a_bad_payload_leaves_the_running_sum_unchanged() -> None:
    codec = build_codec(SPECS["topk"])
    good, _ = codec.encode(np.arange(10, dtype=np.float32), np.random.default_rng(0))
    acc = PayloadSum(codec, (10,))
    acc.accumulate(good)
    with pytest.raises(CodecError):
        acc.accumulate(good[:-3])
    assert acc.count == 1
    np.testing.assert_array_equal(acc.result(), codec.decode(good, (10,)))


HEAD = 7  # magic 2, wire 1, codec 1, version 1, ndim 1, nfields 1; then 4 per dim, 6 per field


def expected_size(name: str, shape: tuple[int, ...]) -> int:
    d, nd = math.prod(shape), len(shape)
    head = HEAD + 4 * nd

    def f32(k: int) -> int:  # a nested float32 payload of k values
        return HEAD + 4 + 6 + 4 * k

    if name == "float32":
        return head + 6 + 4 * d
    if name in ("float16", "bfloat16"):
        return head + 6 + 2 * d
    if name == "qsgd8":
        return head + 12 + 4 + d
    if name == "qsgd4-block16":
        return head + 12 + 4 * math.ceil(d / 16) + math.ceil(d * 4 / 8)
    if name == "sign":
        return head + 12 + 4 + math.ceil(d / 8)
    if name == "randk":
        k = math.ceil(0.4 * d)
        return head + 12 + 4 + f32(k)
    if name == "powersgd":  # rank 2; dense float32 unless the factors are smaller
        n, m = shape[0], d // shape[0]
        factored = nd >= 2 and (n + m) * 2 < n * m
        return head + 12 + 4 * (n + m) * 2 if factored else head + 6 + 4 * d
    raise KeyError(name)


@pytest.mark.parametrize(
    "name",
    ["float32", "float16", "bfloat16", "qsgd8", "qsgd4-block16", "sign", "randk", "powersgd"],
)
@pytest.mark.parametrize("shape", [(1000,), (40, 30), (3, 7, 11)])
def test_payload_bytes_match_the_wire_format_arithmetic(name: str, shape: tuple[int, ...]) -> None:
    x = np.random.default_rng(0).standard_normal(shape).astype(np.float32)
    (payload,) = encode_all(name, [x])
    assert len(payload) == expected_size(name, shape)


def test_topk_index_bytes_are_delta_coded_at_the_widest_gap() -> None:
    x = np.zeros(100_000, np.float32)
    kept = np.array([5, 40, 1000, 1003, 99_999])
    x[kept] = 1.0
    codec = build_codec(CodecSpec(name="topk", params={"k": 5}))
    payload, _ = codec.encode(x, np.random.default_rng(0))
    width = int(np.diff(kept).max()).bit_length()  # 99_999 - 1003 needs 17 bits
    assert len(payload) == HEAD + 4 + 12 + math.ceil(5 * width / 8) + HEAD + 4 + 6 + 4 * 5
    np.testing.assert_array_equal(np.flatnonzero(codec.decode(payload, x.shape)), kept)


def test_update_helpers_report_sizes_and_give_each_tensor_its_own_seed() -> None:
    codec = build_codec(SPECS["randk"])
    arrays = {"a": np.arange(1, 101, dtype=np.float32), "b": np.arange(1, 101, dtype=np.float32)}
    payloads, states = encode_update(codec, arrays, np.random.default_rng(0), None, 9)
    assert states == {}
    out = decode_update(codec, payloads, {"a": (100,), "b": (100,)}, 1, 9)
    assert list(out) == ["a", "b"]
    assert not np.array_equal(np.flatnonzero(out["a"]), np.flatnonzero(out["b"]))
    assert all(len(p) == expected_size("randk", (100,)) for p in payloads.values())
