"""What a tier needs to sum payloads without decoding them: a bound on what a payload
decodes to (checked as decode would), sums that refuse a bad payload and change nothing,
memory that stays one dense tensor, and the run-level decision to sum codes at all."""

from __future__ import annotations

import numpy as np
import pytest
from codec_cases import SPECS, tensors
from hypothesis import given
from hypothesis import strategies as st

from orchard.compression import (
    NonFiniteError,
    PayloadSum,
    UpdateMismatchError,
    UpdateSum,
    build_codec,
    compressed_weight_scale,
    encode_update,
)
from orchard.compression.aggregate import FLOAT32_MAX, UINT32_MAX
from orchard.compression.update import tensor_seed
from orchard.compression.wire import EncodedTensor, Field, parse_payload
from orchard.config import CodecSpec, CohortConfig, RunConfig, SecureAggregationConfig
from orchard.errors import CodecError

LINEAR = [n for n, s in SPECS.items() if build_codec(s).algebra.linear]


@st.composite
def cohorts(draw: st.DrawFn) -> list[np.ndarray]:
    shape = draw(st.sampled_from([(), (7,), (3, 5), (12, 9), (2, 3, 4)]))
    n = draw(st.integers(1, 4))
    return [draw(tensors(shape=st.just(shape))).astype(np.float32) for _ in range(n)]


def _encode(name: str, xs: list[np.ndarray], seed: int = 11) -> list[bytes]:
    codec = build_codec(SPECS[name])
    rng = np.random.default_rng(0)
    return [codec.encode(x, rng, None, seed)[0] for x in xs]


@pytest.mark.parametrize("name", list(SPECS))
@given(xs=cohorts())
def test_bound_holds_for_every_payload_and_for_compressed_sums(name: str, xs: list[np.ndarray]) -> None:
    codec = build_codec(SPECS[name])
    shape = xs[0].shape
    payloads = _encode(name, xs)
    for p in payloads:
        enc = codec.parse(p, shape)
        decoded = codec.decode_parsed(enc, 1, 11)
        assert np.abs(decoded).max(initial=0.0) <= codec.bound(enc, 1, 11) * (1 + 1e-6) + 1e-30
    acc = PayloadSum(codec, shape, 11)
    for p in payloads:
        acc.accumulate(p)
    if acc.encoded() is not None and acc.compressed_count == len(xs):
        b = codec.bound(acc.encoded(), len(xs), 11)
        assert np.abs(acc.result()).max(initial=0.0) <= b * (1 + 1e-6) + 1e-30
    assert acc.bound >= np.abs(acc.result()).max(initial=0.0) * (1 - 1e-6)


def _nan_payload(name: str, shape: tuple[int, ...]) -> bytes:
    """A well-formed payload of ``name`` carrying a NaN (built by hand where encode refuses)."""
    codec = build_codec(SPECS[name])
    x = np.random.default_rng(1).standard_normal(shape).astype(np.float32)
    enc = codec.parse(codec.encode(x, np.random.default_rng(0), None, 11)[0], shape)
    fields = list(enc.fields)
    if name in ("float32", "powersgd"):
        data = np.array(fields[0].data)
        data[0] = np.nan
        fields[0] = Field(data)
    elif name == "randk":  # the kept values travel as a nested float32 payload
        values = parse_payload(fields[-1].data.tobytes())
        v = np.array(values.fields[0].data)
        v[0] = np.inf
        nested = EncodedTensor(values.codec_id, values.codec_version, values.shape, (Field(v),))
        fields[-1] = Field(np.frombuffer(nested.to_bytes(), np.uint8))
    else:
        raise KeyError(name)
    return codec.header(enc.shape, fields).to_bytes()


@pytest.mark.parametrize("name", ["float32", "randk", "powersgd"])
def test_a_payload_with_nan_or_inf_is_refused_and_the_sum_is_unchanged(name: str) -> None:
    codec = build_codec(SPECS[name])
    shape = (12, 9)
    good = _encode(name, [np.ones(shape, np.float32)])[0]
    bad = _nan_payload(name, shape)
    assert not np.isfinite(codec.decode(bad, shape, 1, 11)).all()  # the oracle agrees it is bad
    acc = PayloadSum(codec, shape, 11)
    acc.accumulate(good)
    before, count, bound = acc.result(), acc.count, acc.bound
    with pytest.raises(NonFiniteError, match="NaN or Inf"):
        acc.accumulate(bad)
    assert acc.count == count and acc.bound == bound
    np.testing.assert_array_equal(acc.result(), before)


def test_a_sum_refuses_a_summand_that_could_overflow_float32_and_stays_finite() -> None:
    codec = build_codec(SPECS["float32"])
    big = codec.encode(np.full(4, FLOAT32_MAX * 0.75, np.float32), np.random.default_rng(0))[0]
    acc = PayloadSum(codec, (4,))
    acc.accumulate(big)
    with pytest.raises(CodecError, match="float32's range"):
        acc.accumulate(big)
    assert acc.count == 1 and np.isfinite(acc.result()).all()


def test_a_sum_never_aliases_the_callers_buffer() -> None:
    codec = build_codec(SPECS["float32"])
    x = np.arange(6, dtype=np.float32)
    buf = bytearray(codec.encode(x, np.random.default_rng(0))[0])
    acc = PayloadSum(codec, (6,))
    acc.accumulate(buf)
    acc.accumulate(bytes(buf))  # the second add runs in place on the sum's own arrays
    buf[-4:] = np.float32(1e9).tobytes()  # the caller reuses its buffer
    np.testing.assert_array_equal(acc.result(), 2 * x)


@pytest.mark.parametrize("name", list(SPECS))
def test_exactly_the_field_linear_codecs_add_coordinate_wise(name: str) -> None:
    codec = build_codec(SPECS[name])
    x = np.random.default_rng(2).standard_normal((12, 9)).astype(np.float32)
    enc = codec.parse(_encode(name, [x])[0], (12, 9))
    assert (codec.coordinates(enc, 11) is not None) == codec.algebra.field_linear


FIELD_LINEAR = [n for n, s in SPECS.items() if build_codec(s).algebra.field_linear]


@pytest.mark.parametrize("name", FIELD_LINEAR)
@given(xs=cohorts())
def test_the_compressed_sum_is_a_payload_that_decodes_to_the_sum(name: str, xs: list[np.ndarray]) -> None:
    codec = build_codec(SPECS[name])
    shape = xs[0].shape
    payloads = _encode(name, xs)
    acc = PayloadSum(codec, shape, 11)
    for p in payloads:
        acc.accumulate(p)
    enc = acc.encoded()
    assert enc is not None and acc.compressed_count == len(xs) and acc.dense is None
    together = codec.decode(enc.to_bytes(), shape, len(xs), 11)  # travels like any payload
    apart = sum(codec.decode(p, shape, 1, 11).astype(np.float64) for p in payloads)
    scale = max(1.0, float(np.abs(apart).max()))
    np.testing.assert_allclose(together, apart, rtol=1e-5, atol=1e-5 * scale)


@pytest.mark.parametrize("name", ["float32", "randk", "qsgd8-fixed", "randk+qsgd-fixed", "powersgd"])
def test_a_sum_does_not_depend_on_the_order_of_its_payloads(name: str) -> None:
    """Integer codes add exactly; float values and decoded tensors add in float64 and are
    rounded once: any order gives the same float32 result, as a float64 accumulator does."""
    rng = np.random.default_rng(4)
    xs = [(rng.standard_normal((30, 20)) * 10.0 ** rng.integers(-3, 3)).astype(np.float32) for _ in range(40)]
    payloads = _encode(name, xs)
    codec = build_codec(SPECS[name])
    results = []
    for order in (range(40), reversed(range(40)), rng.permutation(40)):
        acc = PayloadSum(codec, (30, 20), 11)
        for i in order:
            acc.accumulate(payloads[i])
        results.append(acc.result())
    for r in results[1:]:
        np.testing.assert_array_equal(r, results[0])


@pytest.mark.parametrize("name", ["powersgd", "ef-powersgd"])
def test_powersgd_is_decoded_on_arrival_into_one_dense_sum(name: str) -> None:
    """Its factors add only by concatenation (growing per summand): each payload is
    decoded into the float64 dense sum instead, so memory is one dense tensor."""
    codec = build_codec(SPECS[name])
    shape = (20, 30)
    rng = np.random.default_rng(3)
    xs = [rng.standard_normal(shape).astype(np.float32) for _ in range(60)]
    payloads = _encode(name, xs)
    acc = PayloadSum(codec, shape, 11)
    for p in payloads:
        acc.accumulate(p)
        assert acc.coords is None and acc.dense is not None and acc.dense.shape == shape
    oracle = sum(codec.decode(p, shape, 1, 11).astype(np.float64) for p in payloads)
    np.testing.assert_allclose(acc.result(np.float64), oracle, rtol=1e-12, atol=1e-12)


def test_summed_codes_never_wrap_past_uint32() -> None:
    codec = build_codec(SPECS["qsgd8-fixed"])
    x = np.linspace(-1000, 1000, 10, dtype=np.float32)
    p = _encode("qsgd8-fixed", [x])[0]
    acc = PayloadSum(codec, (10,), 11)
    acc.accumulate(p)
    before = acc.result()
    acc.code_bound = UINT32_MAX - 100  # as if 16.8 million 8-bit payloads were in
    with pytest.raises(CodecError, match="2\\*\\*32"):
        acc.accumulate(p)
    assert acc.count == 1
    np.testing.assert_array_equal(acc.result(), before)


def test_update_sum_folds_a_whole_update_or_nothing() -> None:
    codec = build_codec(SPECS["randk"])
    shapes = {"a": (50,), "b": (4, 5)}
    rng = np.random.default_rng(0)
    ups = [{k: rng.standard_normal(s).astype(np.float32) for k, s in shapes.items()} for _ in range(3)]
    enc = [encode_update(codec, u, rng, None, 5)[0] for u in ups]
    total = UpdateSum(codec, shapes, 5)
    for e in enc[:2]:
        total.add(total.check(e))
    before = total.result()
    other_seed, _ = encode_update(codec, ups[2], rng, None, 6)  # another round's coordinates
    mixed = {"a": enc[2]["a"], "b": other_seed["b"]}
    with pytest.raises(CodecError, match="tensor 'b'.*another shared seed"):
        total.check(mixed)
    with pytest.raises(UpdateMismatchError, match="missing \\['b'\\]"):
        total.check({"a": enc[2]["a"]})
    assert total.count == 2
    for k in shapes:
        np.testing.assert_array_equal(total.result()[k], before[k])
    total.add(total.check(enc[2]))
    for k, s in shapes.items():
        want = sum(codec.decode(e[k], s, 1, tensor_seed(5, k)).astype(np.float64) for e in enc)
        np.testing.assert_allclose(total.result()[k], want, rtol=1e-5, atol=1e-6)


def _cfg(codec: dict, weighting: str = "examples", **kw: object) -> RunConfig:
    return RunConfig(codec=CodecSpec(**codec), cohort=CohortConfig(weighting=weighting), **kw)  # type: ignore[arg-type]


@pytest.mark.parametrize("name", list(SPECS))
def test_the_run_sums_codes_exactly_when_the_codec_is_linear(name: str) -> None:
    spec = SPECS[name].model_dump()
    want = 1000.0 if name in LINEAR else None
    assert compressed_weight_scale(_cfg(spec)) == want
    assert compressed_weight_scale(_cfg(spec, "steps")) == want
    assert compressed_weight_scale(_cfg(spec, "uniform")) == (None if want is None else 1.0)


def test_fednova_secure_aggregation_and_off_decode_every_update() -> None:
    f32 = {"name": "float32"}
    assert compressed_weight_scale(_cfg(f32, "fednova")) is None
    assert compressed_weight_scale(_cfg(f32, compressed_aggregation="off")) is None
    secure = SecureAggregationConfig(enabled=True)
    assert compressed_weight_scale(_cfg(f32, secure_aggregation=secure)) is None
    scaled = SecureAggregationConfig(weight_scale=64.0)
    assert compressed_weight_scale(_cfg(f32, secure_aggregation=scaled)) == 64.0


def test_the_setting_validates_and_travels_in_the_run_config() -> None:
    from orchard.validation import data_problems

    assert data_problems({"task": "digits", "compressed_aggregation": "off"}) == []
    assert data_problems({"task": "digits", "compressed_aggregation": "auto"}) == []
    problems = data_problems({"task": "digits", "compressed_aggregation": "always"})
    assert any("compressed_aggregation" in p for p in problems)
    cfg = RunConfig(compressed_aggregation="off")
    assert RunConfig.model_validate_json(cfg.model_dump_json()).compressed_aggregation == "off"
