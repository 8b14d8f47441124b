"""What a tier needs to sum payloads without decoding them: a bound on what a payload
decodes to (checked as decode would), weighted sums that equal the weighted sum of the
decodes, sums that refuse a bad payload and change nothing, memory that stays one dense
tensor, and the run-level decision to sum codes at all."""

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
    encode_update,
    sums_compressed,
)
from orchard.compression.aggregate import FLOAT32_MAX, UINT32_MAX, add_weighted
from orchard.compression.update import tensor_seed
from orchard.compression.wire import EncodedTensor, Field, parse_payload
from orchard.config import CodecSpec, CohortConfig, RunConfig, SecureAggregationConfig
from orchard.errors import CodecError, UpdateSchemaError

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


@pytest.mark.parametrize("name", list(SPECS))
@given(xs=cohorts())
def test_a_norm_read_from_the_payload_is_the_norm_of_its_decode(name: str, xs: list[np.ndarray]) -> None:
    """``UpdateSum.norm`` (what a tier clips by without decoding, through the codec's
    ``coordinate_scale`` where it declares one) equals the L2 norm of what the payload
    decodes to, for every codec; and only codecs with float coordinates declare a scale."""
    codec = build_codec(SPECS[name])
    shape = xs[0].shape
    sums = UpdateSum(codec, {"t": shape}, shared_seed=5)
    seed = tensor_seed(5, "t")
    for p in _encode(name, xs, seed):
        checked = sums.check({"t": p})
        want = float(np.linalg.norm(codec.decode(p, shape, 1, seed).astype(np.float64)))
        assert sums.norm(checked) == pytest.approx(want, rel=1e-6, abs=1e-30)
        coords = checked["t"].coords
        if codec.coordinate_scale(shape) is not None:
            assert coords is not None and coords.dtype.kind == "f"
    declares = name in ("float32", "randk", "randk-biased")
    assert (codec.coordinate_scale((12, 9)) is not None) == declares


def test_an_update_scaled_by_its_clip_counts_at_its_full_weight() -> None:
    """``add(checked, weight, scale)``: the sum gets ``scale * weight * x``, the weight sum
    gets ``weight``; a scale outside (0, 1] is refused and changes nothing."""
    codec = build_codec(SPECS["float32"])
    x = np.arange(6, dtype=np.float32).reshape(2, 3)
    sums = UpdateSum(codec, {"t": (2, 3)})
    checked = sums.check({"t": codec.encode(x, np.random.default_rng(0), None, tensor_seed(0, "t"))[0]})
    sums.add(checked, 4.0, 0.25)
    assert sums.weight == 4.0 and sums.count == 1
    for bad in (0.0, 1.5, float("nan")):
        with pytest.raises(CodecError, match="scale"):
            sums.add(checked, 1.0, bad)
    assert sums.weight == 4.0 and sums.count == 1
    np.testing.assert_array_equal(sums.result()["t"], x)  # 0.25 * 4 * x


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


def _sums_in_three_orders(
    name: str, xs: list[np.ndarray], weights: list[float] | None, rng: np.random.Generator
) -> list[np.ndarray]:
    """The (weighted) sum of ``xs``' payloads, accumulated forwards, backwards and shuffled."""
    payloads = _encode(name, xs)
    codec = build_codec(SPECS[name])
    n = len(xs)
    results = []
    for order in (range(n), reversed(range(n)), rng.permutation(n)):
        acc = PayloadSum(codec, (30, 20), 11)
        for i in order:
            if weights is None:
                acc.accumulate(payloads[i])
            else:
                acc.accumulate(payloads[i], weights[i])
        results.append(acc.result())
    return results


@pytest.mark.parametrize("name", ["float32", "randk", "qsgd8-fixed", "randk+qsgd-fixed", "powersgd"])
def test_a_sum_does_not_depend_on_the_order_of_its_payloads(name: str) -> None:
    """Integer codes add exactly; float values and decoded tensors add in float64 and are
    rounded once: any order gives the same float32 result, as a float64 accumulator does."""
    rng = np.random.default_rng(4)
    xs = [(rng.standard_normal((30, 20)) * 10.0 ** rng.integers(-3, 3)).astype(np.float32) for _ in range(40)]
    results = _sums_in_three_orders(name, xs, None, rng)
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


# ---------------------------------------------------------------------- weighted sums

WEIGHTED = [n for n, s in SPECS.items() if build_codec(s).algebra.weighted_sums]
INTEGER_CODES = [n for n in LINEAR if n not in WEIGHTED]


def test_which_codecs_add_with_weights() -> None:
    """Float coordinates and decoded payloads take real weights; integer codes do not."""
    assert set(WEIGHTED) == {"float32", "randk", "randk-biased", "powersgd", "ef-powersgd"}
    assert set(INTEGER_CODES) == {"qsgd8-fixed", "randk+qsgd-fixed"}


@pytest.mark.parametrize("name", WEIGHTED)
@given(xs=cohorts(), raw=st.lists(st.floats(0.01, 5000.0), min_size=4, max_size=4))
def test_a_weighted_sum_is_the_weighted_sum_of_the_decodes(
    name: str, xs: list[np.ndarray], raw: list[float]
) -> None:
    codec = build_codec(SPECS[name])
    shape = xs[0].shape
    weights = raw[: len(xs)]
    payloads = _encode(name, xs)
    acc = PayloadSum(codec, shape, 11)
    for p, w in zip(payloads, weights, strict=True):
        acc.accumulate(p, w)
    want = sum(w * codec.decode(p, shape, 1, 11).astype(np.float64)
               for p, w in zip(payloads, weights, strict=True))
    scale = float(np.abs(want).max(initial=0.0))
    # One float32 rounding of the sum (the compressed sum's payload holds float32 values).
    np.testing.assert_allclose(acc.result(np.float64), want, rtol=0, atol=2e-7 * scale + 1e-30)
    assert acc.weight == pytest.approx(sum(weights)) and acc.count == len(xs)
    assert acc.bound >= scale * (1 - 1e-6)


def test_weighted_float_coordinates_match_the_decode_paths_accumulator() -> None:
    """The float64 coordinate sum is the accumulator's sum: each product w * x in float64,
    added in the same order -- bit for bit before the one rounding to float32."""
    codec = build_codec(SPECS["float32"])
    rng = np.random.default_rng(6)
    xs = [rng.standard_normal(500).astype(np.float32) for _ in range(7)]
    weights = [3.0, 5000.0, 0.37, 1234.5, 1.0, 77.0, 1e-3]
    acc = PayloadSum(codec, (500,))
    ref = np.zeros(500, np.float64)
    for x, w in zip(xs, weights, strict=True):
        acc.accumulate(codec.encode(x, rng)[0], w)
        np.add(ref, np.multiply(x, w, dtype=np.float64), out=ref)
    assert acc.coords is not None
    np.testing.assert_array_equal(acc.coords, ref)
    np.testing.assert_array_equal(acc.result(), ref.astype(np.float32))


@pytest.mark.parametrize("name", ["float32", "randk", "powersgd"])
def test_a_weighted_sum_does_not_depend_on_the_order_of_its_payloads(name: str) -> None:
    rng = np.random.default_rng(8)
    xs = [(rng.standard_normal((30, 20)) * 10.0 ** rng.integers(-3, 3)).astype(np.float32) for _ in range(30)]
    weights = [float(w) for w in rng.integers(1, 5000, 30)]
    results = _sums_in_three_orders(name, xs, weights, rng)
    for r in results[1:]:
        np.testing.assert_allclose(r, results[0], rtol=2e-7, atol=0)


@pytest.mark.parametrize("name", INTEGER_CODES)
def test_integer_codes_refuse_a_weight_and_the_sum_is_unchanged(name: str) -> None:
    codec = build_codec(SPECS[name])
    shape = (12, 9)
    rng = np.random.default_rng(2)
    p1, p2 = _encode(name, [rng.standard_normal(shape).astype(np.float32) for _ in range(2)])
    acc = PayloadSum(codec, shape, 11)
    acc.accumulate(p1)
    before = acc.result()
    with pytest.raises(CodecError, match="only unweighted"):
        acc.accumulate(p2, 2.0)
    assert (acc.count, acc.weight, acc.compressed_count) == (1, 1.0, 1)
    np.testing.assert_array_equal(acc.result(), before)
    acc.accumulate(p2, 1.0)  # weight 1 adds exactly, as before
    assert acc.compressed_count == 2


@pytest.mark.parametrize("weight", [0.0, -1.0, float("nan"), float("inf")])
def test_a_weight_that_is_not_positive_and_finite_is_refused(weight: float) -> None:
    codec = build_codec(SPECS["float32"])
    acc = PayloadSum(codec, (4,))
    with pytest.raises(CodecError, match="positive and finite"):
        acc.accumulate(codec.encode(np.ones(4, np.float32), np.random.default_rng(0))[0], weight)
    assert acc.count == 0 and acc.coords is None


@pytest.mark.parametrize("name", ["float32", "powersgd"])
def test_the_overflow_guard_weighs_the_summand(name: str) -> None:
    """A payload within float32's range is refused once its weight could take the sum out."""
    codec = build_codec(SPECS[name])
    shape = (4, 3)
    big = _encode(name, [np.full(shape, 1e36, np.float32)])[0]
    acc = PayloadSum(codec, shape, 11)
    acc.accumulate(big, 10.0)  # up to ~1e37 (PowerSGD: its bound r |P| |Q| is looser)
    before, bound = acc.result(), acc.bound
    with pytest.raises(CodecError, match="float32's range"):
        acc.accumulate(big, 1e3)
    assert acc.count == 1 and acc.bound == bound
    np.testing.assert_array_equal(acc.result(), before)


def test_update_sum_weighs_a_whole_update_or_refuses_it_whole() -> None:
    codec = build_codec(SPECS["float32"])
    shapes = {"a": (5,), "b": (2, 2)}
    ups = [{"a": np.ones(5, np.float32), "b": np.ones((2, 2), np.float32)},
           {"a": np.ones(5, np.float32), "b": np.full((2, 2), 3e36, np.float32)}]
    total = UpdateSum(codec, shapes, 5)
    total.add(total.check(encode_update(codec, ups[0], np.random.default_rng(0), None, 5)[0]), 4.0)
    with pytest.raises(CodecError, match="tensor 'b'.*float32's range"):
        total.add(total.check(encode_update(codec, ups[1], np.random.default_rng(0), None, 5)[0]), 500.0)
    assert (total.count, total.weight) == (1, 4.0)
    np.testing.assert_array_equal(total.result()["a"], np.full(5, 4.0, np.float32))
    drained = dict(total.drain())
    np.testing.assert_array_equal(drained["b"], np.full((2, 2), 4.0))
    assert (total.count, total.weight) == (1, 4.0)  # both stay after a drain


def test_a_weighted_add_allocates_no_temporary_the_size_of_the_tensor() -> None:
    import tracemalloc

    x = np.random.default_rng(0).standard_normal(1 << 20).astype(np.float32)  # 4 MiB
    acc = np.zeros(x.size, np.float64)  # 8 MiB
    add_weighted(acc, x, 3.5)  # the per-thread scratch is allocated once, here
    tracemalloc.start()
    try:
        add_weighted(acc, x, 0.25)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 1 << 20, peak  # far below one float64 copy (8 MiB)
    np.testing.assert_array_equal(acc, 3.75 * x.astype(np.float64))
    with pytest.raises(ValueError, match="contiguous"):  # a strided view would be added into a copy
        add_weighted(np.zeros((4, 4))[:, ::2], np.ones((4, 2)), 2.0)


# ---------------------------------------------------------------------- the run's decision

def _cfg(codec: dict, weighting: str = "examples", **kw: object) -> RunConfig:
    return RunConfig(codec=CodecSpec(**codec), cohort=CohortConfig(weighting=weighting), **kw)  # type: ignore[arg-type]


@pytest.mark.parametrize("name", list(SPECS))
def test_the_run_sums_in_the_compressed_domain_when_the_codec_is_linear(name: str) -> None:
    """Under every weighting for float coordinates and decoded payloads; integer codes
    only under uniform weighting (every weight 1); never for non-linear codecs."""
    spec = SPECS[name].model_dump()
    for weighting in ("examples", "steps", "uniform", "fednova"):
        want = name in WEIGHTED or (name in INTEGER_CODES and weighting == "uniform")
        assert sums_compressed(_cfg(spec, weighting)) is want, weighting


def test_secure_aggregation_and_off_decode_every_update() -> None:
    f32 = {"name": "float32"}
    assert sums_compressed(_cfg(f32, compressed_aggregation="off")) is False
    secure = SecureAggregationConfig(enabled=True)
    assert sums_compressed(_cfg(f32, secure_aggregation=secure)) is False
    # The secure aggregation's weight scale no longer has a say outside it.
    assert sums_compressed(_cfg(f32, secure_aggregation=SecureAggregationConfig(weight_scale=64.0))) is True


def test_the_setting_validates_and_travels_in_the_run_config() -> None:
    from orchard.validation import data_problems

    assert data_problems({"task": "digits", "compressed_aggregation": "off"}) == []
    assert data_problems({"task": "digits", "compressed_aggregation": "auto"}) == []
    problems = data_problems({"task": "digits", "compressed_aggregation": "always"})
    assert any("compressed_aggregation" in p for p in problems)
    cfg = RunConfig(compressed_aggregation="off")
    assert RunConfig.model_validate_json(cfg.model_dump_json()).compressed_aggregation == "off"


@st.composite
def flat_cohorts(draw: st.DrawFn) -> tuple[dict[str, tuple[int, ...]], list[tuple[dict[str, np.ndarray], float, float]]]:
    shapes = dict(zip("abcd", draw(st.lists(st.sampled_from([(), (1,), (7,), (3, 5), (2, 3, 4), (40, 3)]),
                                            min_size=1, max_size=4)), strict=False))
    ups = []
    for _ in range(draw(st.integers(1, 5))):
        u = {k: draw(tensors(shape=st.just(s))).astype(np.float32) for k, s in shapes.items()}
        ups.append((u, draw(st.sampled_from([1.0, 0.5, 2.5, 1e-3, 7.25])), draw(st.sampled_from([1.0, 0.3, 1e-2]))))
    return shapes, ups


@given(case=flat_cohorts(), poison=st.integers(0, 3), mid=st.booleans())
def test_a_small_float32_update_sums_flat_exactly_as_its_tensors_sum_alone(
        case: tuple[dict[str, tuple[int, ...]], list[tuple[dict[str, np.ndarray], float, float]]],
        poison: int, mid: bool) -> None:
    """The flat path of UpdateSum (a small float32 update checked and added as one vector)
    against one PayloadSum per tensor fed the same payloads: every tensor's sum equal to
    the bit, the same bounds, a NaN refused with the same tensor named, and a sum read in
    the middle (``result``) changing nothing of what comes after."""
    shapes, ups = case
    codec = build_codec(SPECS["float32"])
    flat = UpdateSum(codec, shapes, 9)
    assert flat._layout is not None  # the path under test
    ref = {k: PayloadSum(codec, s, tensor_seed(9, k)) for k, s in shapes.items()}
    rng = np.random.default_rng(0)
    for i, (u, w, scale) in enumerate(ups):
        parts = {k: codec.encode(v, rng, None, tensor_seed(9, k))[0] for k, v in u.items()}
        checked = flat.check(parts)
        for k, acc in ref.items():
            one = acc.check(parts[k])
            assert checked[k].bound == one.bound
            assert checked[k].coords.tobytes() == one.coords.tobytes()
            acc.add(one, w * scale)
        flat.add(checked, w, scale)
        if mid and i == 0:
            got = flat.result()
            for k, acc in ref.items():
                assert got[k].tobytes() == acc.result().tobytes()
    assert flat.count == len(ups)
    assert [float(b) for b in flat._bounds] == [acc.bound for acc in ref.values()]
    drained = dict(flat.drain())
    for k, acc in ref.items():
        assert drained[k].tobytes() == acc.take().tobytes()
    assert all(not v.any() for v in flat.result().values())  # drained: empty again
    # A NaN in one tensor: refused, that tensor named, nothing changed.
    bad = sorted(shapes)[poison % len(shapes)]
    u = {k: np.zeros(s, np.float32) for k, s in shapes.items()}
    u[bad] = np.full(shapes[bad], np.nan, np.float32)
    with pytest.raises(NonFiniteError, match=f"tensor '{bad}'.*NaN or Inf"):
        flat.check({k: codec.encode(v, rng)[0] for k, v in u.items()})


def test_the_flat_path_keeps_the_per_tensor_guards_and_falls_back_to_the_general_parser() -> None:
    codec = build_codec(SPECS["float32"])
    shapes = {"w": (3, 2), "b": (2,)}
    flat = UpdateSum(codec, shapes, 0)
    assert flat._layout is not None
    big = {"w": np.full((3, 2), 3e38, np.float32), "b": np.ones(2, np.float32)}
    parts = {k: codec.encode(v, np.random.default_rng(0))[0] for k, v in big.items()}
    flat.add(flat.check(parts))
    before = {k: v.copy() for k, v in flat.result().items()}
    with pytest.raises(CodecError, match="tensor 'w': a summand of magnitude up to 3e\\+38 .* past float32's range"):
        flat.add(flat.check(parts))
    assert flat.count == 1 and all(np.array_equal(flat.result()[k], before[k]) for k in shapes)
    # A payload framed otherwise: the general parser's answer, with the tensor named.
    with pytest.raises(CodecError, match="tensor 'b'"):
        flat.check({"w": parts["w"], "b": parts["b"] + b"\0"})
    # A per-tensor mapping of checked payloads adds as the flat kind does.
    other = UpdateSum(codec, shapes, 0)
    per_tensor = {k: PayloadSum(codec, s, 0).check(parts[k]) for k, s in shapes.items()}
    other.add(per_tensor)
    assert all(other.result()[k].tobytes() == before[k].tobytes() for k in shapes)
    # A large update keeps the per-tensor path (no flat copy of a big model per check).
    assert UpdateSum(codec, {"w": (300, 300)}, 0)._layout is None


@given(case=flat_cohorts(), cut=st.integers(0, 3), flip=st.integers(0, 10**6))
def test_a_packed_update_checks_as_its_split_tensors_do(
        case: tuple[dict[str, tuple[int, ...]], list[tuple[dict[str, np.ndarray], float, float]]],
        cut: int, flip: int) -> None:
    """check_packed (a tier reading a whole upload in place) against split and check: the
    same coordinates and bounds for a well-framed upload, and for a damaged one (a header
    byte changed, sizes that do not add up) the same error, or the same result."""
    from orchard.updates import pack, split

    shapes, ups = case
    codec = build_codec(SPECS["float32"])
    total = UpdateSum(codec, shapes, 3)
    payload, sizes = pack([codec.encode(ups[0][0][k], np.random.default_rng(0))[0] for k in shapes])
    got = total.check_packed(payload, sizes)
    want = total.check(dict(zip(shapes, split(payload, sizes), strict=True)))
    for k in shapes:
        assert got[k].coords.tobytes() == want[k].coords.tobytes() and got[k].bound == want[k].bound
    damaged = bytearray(payload)
    damaged[flip % len(payload)] ^= 0xFF
    bad_sizes = sizes if cut == 0 else (sizes[0] + 1, *sizes[1:])
    outcomes = []
    for check in (lambda: total.check_packed(bytes(damaged), bad_sizes),
                  lambda: total.check(dict(zip(shapes, split(bytes(damaged), bad_sizes), strict=True)))):
        try:
            r = check()
            outcomes.append(("ok", [(r[k].coords.tobytes(), r[k].bound) for k in shapes]))
        except (CodecError, UpdateSchemaError) as err:
            outcomes.append((type(err).__name__, str(err)))
    assert outcomes[0] == outcomes[1]
