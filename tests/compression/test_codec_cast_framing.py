"""Dense casts parse a payload framed exactly as they frame it -- the per-shape header
their encoder writes, then the values -- without the general parser, and a tier's sum
checks such a payload reading its values once. Both must be invisible: the same parsed
payload, bound and coordinates as the general path (``BaseCodec.parse``, ``bound``,
``coordinates``) for every payload, and for any other payload -- one byte of the header
changed, a byte too few or too many, a buffer that is not bytes -- the general parser's
own error, word for word.

Also here: the small-array shortcuts under the checks and the sum (``peak``,
``add_weighted``) give exactly what the general form gives.
"""

from __future__ import annotations

import math

import hypothesis.extra.numpy as hnp
import numpy as np
import pytest
from codec_cases import SPECS
from hypothesis import given
from hypothesis import strategies as st

from orchard.compression import PayloadSum, UpdateSum, build_codec
from orchard.compression.aggregate import add_weighted
from orchard.compression.base import BaseCodec, peak
from orchard.compression.wire import EncodedTensor, framed_values, raw_head
from orchard.errors import CodecError

CASTS = ["float32", "float16", "bfloat16"]
SEED = 3

shapes = hnp.array_shapes(min_dims=0, max_dims=3, min_side=0, max_side=9)


@st.composite
def payloads(draw: st.DrawFn) -> tuple[str, tuple[int, ...], bytes]:
    """A cast, a shape and that cast's payload of an array of that shape (NaN and Inf
    included: a payload may carry them, and the check must see them)."""
    name = draw(st.sampled_from(CASTS))
    shape = draw(shapes)
    x = draw(
        hnp.arrays(
            np.float32,
            shape,
            elements=st.floats(-1e3, 1e3, width=32)
            | st.sampled_from([np.nan, np.inf, -np.inf, 0.0, -0.0]),
        )
    )
    return name, shape, build_codec(SPECS[name]).encode(x, np.random.default_rng(0))[0]


def _general_parse(codec: BaseCodec, payload: object, shape: tuple[int, ...]) -> EncodedTensor:
    return BaseCodec.parse(codec, payload, shape)  # type: ignore[arg-type]


def _general_for_sum(codec: BaseCodec, payload: object, shape: tuple[int, ...]) -> tuple:
    enc = _general_parse(codec, payload, shape)
    return enc, codec.bound(enc, 1, SEED), codec.coordinates(enc, SEED)


def _outcome(f, *args) -> tuple:
    """What a call returns, or the type and message of the CodecError it raises."""
    try:
        return ("ok", f(*args))
    except CodecError as err:
        return ("error", type(err), str(err))


def _same_enc(a: EncodedTensor, b: EncodedTensor) -> None:
    assert (a.codec_id, a.codec_version, a.shape) == (b.codec_id, b.codec_version, b.shape)
    assert len(a.fields) == len(b.fields)
    for fa, fb in zip(a.fields, b.fields, strict=True):
        assert fa.bits == fb.bits and fa.data.dtype == fb.data.dtype
        assert fa.data.tobytes() == fb.data.tobytes()


def _same_outcome(fast: tuple, general: tuple) -> None:
    assert fast[0] == general[0], (fast, general)
    if fast[0] == "error":
        assert fast[1:] == general[1:]
        return
    got, want = fast[1], general[1]
    if isinstance(want, EncodedTensor):
        _same_enc(got, want)
        return
    _same_enc(got[0], want[0])
    assert got[1] == want[1] or (math.isnan(got[1]) and math.isnan(want[1]))
    assert (got[2] is None) == (want[2] is None)
    if want[2] is not None:
        assert got[2].dtype == want[2].dtype and got[2].tobytes() == want[2].tobytes()


class _Bytes(bytes):
    """A bytes subclass: immutable bytes all the same."""


@given(case=payloads())
def test_a_cast_payload_parses_as_the_general_parser_parses_it(case) -> None:
    name, shape, payload = case
    codec = build_codec(SPECS[name])
    head = raw_head(codec.codec_id, codec.version, shape, codec._wire, math.prod(shape))
    assert framed_values(payload, head, codec._wire, math.prod(shape)) is not None  # taken
    # ... by a bytes subclass too (a simulator's uploads carry their hash: orchard.wire.HashedBytes)
    assert framed_values(_Bytes(payload), head, codec._wire, math.prod(shape)) is not None
    for buf in (payload, _Bytes(payload), bytearray(payload), memoryview(payload), memoryview(b"x" + payload)[1:]):
        _same_outcome(
            _outcome(codec.parse, buf, shape), _outcome(_general_parse, codec, buf, shape)
        )
        _same_outcome(
            _outcome(codec.parse_for_sum, buf, shape, SEED),
            _outcome(_general_for_sum, codec, buf, shape),
        )


@given(case=payloads(), data=st.data())
def test_any_changed_header_byte_gets_the_general_parsers_answer(case, data) -> None:
    name, shape, payload = case
    codec = build_codec(SPECS[name])
    head = raw_head(codec.codec_id, codec.version, shape, codec._wire, math.prod(shape))
    assert payload.startswith(head)
    i = data.draw(st.integers(0, len(head) - 1), label="byte")
    flip = data.draw(st.integers(1, 255), label="xor")
    bad = bytearray(payload)
    bad[i] ^= flip
    bad = bytes(bad)
    assert framed_values(bad, head, codec._wire, math.prod(shape)) is None
    _same_outcome(_outcome(codec.parse, bad, shape), _outcome(_general_parse, codec, bad, shape))
    _same_outcome(
        _outcome(codec.parse_for_sum, bad, shape, SEED),
        _outcome(_general_for_sum, codec, bad, shape),
    )


@pytest.mark.parametrize("name", CASTS)
@pytest.mark.parametrize("shape", [(), (5,), (3, 4), (2, 3, 4)])
def test_every_header_byte_changed_gets_the_general_parsers_answer(name: str, shape) -> None:
    """Exhaustively, for a few shapes: each header byte, flipped three ways."""
    codec = build_codec(SPECS[name])
    x = np.random.default_rng(2).standard_normal(shape).astype(np.float32)
    payload = codec.encode(x, np.random.default_rng(0))[0]
    n = len(raw_head(codec.codec_id, codec.version, shape, codec._wire, math.prod(shape)))
    errors = 0
    for i in range(n):
        for flip in (0x01, 0x80, 0xFF):
            bad = bytearray(payload)
            bad[i] ^= flip
            fast = _outcome(codec.parse_for_sum, bytes(bad), shape, SEED)
            _same_outcome(fast, _outcome(_general_for_sum, codec, bytes(bad), shape))
            errors += fast[0] == "error"
    assert errors == 3 * n  # no header but the codec's own describes this shape's values


@pytest.mark.parametrize("name", CASTS)
@pytest.mark.parametrize("cut", [-5, -1, 1, 4])
def test_a_payload_a_byte_short_or_long_gets_the_general_parsers_error(name: str, cut: int) -> None:
    codec = build_codec(SPECS[name])
    payload = codec.encode(np.ones((3, 4), np.float32), np.random.default_rng(0))[0]
    bad = payload[:cut] if cut < 0 else payload + bytes(cut)
    fast = _outcome(codec.parse, bad, (3, 4))
    assert fast[0] == "error"
    assert fast == _outcome(_general_parse, codec, bad, (3, 4))


@pytest.mark.parametrize("name", CASTS)
@pytest.mark.parametrize(
    "buf",
    [
        "a str",
        memoryview(np.ones(12, np.float32)),  # format "f", not bytes
        memoryview(np.zeros((2, 40), np.uint8)),  # 2-d
        memoryview(bytes(100))[::2],  # not contiguous
    ],
    ids=["str", "float-view", "2d-view", "strided-view"],
)
def test_a_buffer_that_is_not_plain_bytes_takes_the_general_path(name: str, buf: object) -> None:
    codec = build_codec(SPECS[name])
    assert _outcome(codec.parse, buf, (3, 4)) == _outcome(_general_parse, codec, buf, (3, 4))


@pytest.mark.parametrize("name", CASTS)
def test_the_kept_header_is_what_the_general_encoder_writes(name: str) -> None:
    codec = build_codec(SPECS[name])
    for shape in [(), (0,), (5,), (64, 64), (2, 3, 4)]:
        x = np.random.default_rng(1).standard_normal(shape).astype(np.float32)
        general = codec.encode_parsed(x, np.random.default_rng(0), None, 0)[0].to_bytes()
        assert codec.encode(x, np.random.default_rng(0))[0] == general
        n = math.prod(shape)
        assert general[: len(general) - n * codec._wire.itemsize] == raw_head(
            codec.codec_id, codec.version, shape, codec._wire, n
        )


def test_a_shape_is_checked_as_the_general_parser_checks_it() -> None:
    """A kept header is found by a shape equal to the one it was made for; anything that
    is not a shape still gets check_shape's error."""
    codec = build_codec(SPECS["float32"])
    payload = codec.encode(np.ones(4, np.float32), np.random.default_rng(0))[0]
    for shape in [(4,), (np.int64(4),), [4], (4, 1), (-4,), ([4],), (None,), "4", (2**40,)]:
        fast = _outcome(codec.parse, payload, shape)
        _same_outcome(fast, _outcome(_general_parse, codec, payload, shape))
    with pytest.raises(CodecError, match="shape must"):
        codec.parse(payload, ([4],))  # type: ignore[arg-type]


@pytest.mark.parametrize("name", ["float32", "bfloat16"])
def test_a_sum_of_fast_parsed_payloads_equals_the_general_paths_sum(name: str) -> None:
    """The whole check-and-add, general parser and all, against the fast path: the same
    float64 sum to the bit, and a NaN refused by both."""
    codec = build_codec(SPECS[name])
    shapes_ = {"w": (16, 8), "b": (8,)}
    rng = np.random.default_rng(5)
    ups = [
        {k: rng.standard_normal(s).astype(np.float32) for k, s in shapes_.items()} for _ in range(6)
    ]
    weights = [1.0, 2.5, 0.125, 7.0, 1.0, 3.3]
    fast = UpdateSum(codec, shapes_, SEED)
    general = {k: PayloadSum(codec, s, 0) for k, s in shapes_.items()}
    for u, w in zip(ups, weights, strict=True):
        parts = {k: codec.encode(v, rng)[0] for k, v in u.items()}
        fast.add(fast.check(parts), w)
        for k, acc in general.items():
            enc = _general_parse(codec, parts[k], shapes_[k])
            acc.add(type(fast.check(parts)[k])(enc, codec.bound(enc), codec.coordinates(enc)), w)
    got = dict(fast.drain())
    for k, acc in general.items():
        assert got[k].tobytes() == acc.take().tobytes()
    nan = {k: np.full(s, np.nan, np.float32) for k, s in shapes_.items()}
    with pytest.raises(CodecError, match="NaN or Inf"):
        fast.check({k: codec.encode(v, rng)[0] for k, v in nan.items()})


@given(
    x=hnp.arrays(
        st.sampled_from([np.float16, np.float32, np.float64]),
        hnp.array_shapes(min_dims=0, max_dims=2, min_side=0, max_side=40),
        elements=st.floats(-1e4, 1e4, width=16) | st.sampled_from([np.nan, np.inf, -np.inf, -0.0]),
    )
)
def test_peak_is_max_abs_exactly_with_nan_kept(x: np.ndarray) -> None:
    want = 0.0 if not x.size else max(float(x.max()), -float(x.min()))
    got = peak(x)
    assert got == want or (math.isnan(got) and math.isnan(want))


@given(
    n=st.integers(1, 5000),
    weight=st.floats(1e-3, 1e3) | st.just(1.0),
    seed=st.integers(0, 2**16),
)
def test_a_small_weighted_add_forms_the_same_float64_products(
    n: int, weight: float, seed: int
) -> None:
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(n).astype(np.float32)
    acc = rng.standard_normal(n)
    want = acc + x.astype(np.float64) * weight
    add_weighted(acc, x, weight)
    assert acc.tobytes() == want.tobytes()


@pytest.mark.parametrize("name", list(SPECS))
@given(
    xs=st.lists(
        hnp.arrays(np.float32, hnp.array_shapes(min_dims=0, max_dims=2, min_side=1, max_side=12),
                   elements=st.floats(-1e4, 1e4, width=32)),
        min_size=1, max_size=4),
    seed=st.integers(0, 2**32),
)
def test_an_update_encoded_packed_is_its_payloads_joined(name: str, xs: list[np.ndarray], seed: int) -> None:
    """encode_packed (a client's upload: a dense cast joins each tensor's header and values
    straight into one buffer) against encode_update and the payloads joined in the
    schema's order: the same bytes, sizes and states, for every codec."""
    from orchard.compression import encode_packed, encode_update

    codec = build_codec(SPECS[name])
    arrays = {f"t{i}": x for i, x in enumerate(xs)}
    names = list(arrays)
    payloads, states = encode_update(codec, arrays, np.random.default_rng(seed), None, seed)
    blob, sizes, got_states = encode_packed(codec, arrays, names, np.random.default_rng(seed), None, seed)
    assert blob == b"".join(payloads[n] for n in names)
    assert sizes == tuple(len(payloads[n]) for n in names)
    assert got_states.keys() == states.keys()


@given(
    name=st.sampled_from([*CASTS, "qsgd"]),
    rows=st.integers(1, 4),
    shapes=st.lists(st.lists(st.integers(1, 5), min_size=0, max_size=2).map(tuple), min_size=1, max_size=3),
    values=st.sampled_from([1.0, 7e4, math.nan, -math.inf]),
    seed=st.integers(0, 2**16),
)
def test_many_updates_encode_as_each_alone(name: str, rows: int, shapes: list[tuple[int, ...]], values: float,
                                          seed: int) -> None:
    """encode_packed_many gives each row the bytes encode_packed gives it alone; None for
    a codec that is not a cast, or when a cast refuses a row (float16 past its range)."""
    from orchard.compression import encode_packed, encode_packed_many
    from orchard.config import CodecSpec

    codec = build_codec(CodecSpec(name=name, params={"bits": 4} if name == "qsgd" else {}))
    rng = np.random.default_rng(seed)
    names = [f"t{i}" for i in range(len(shapes))]
    stacked = {n: rng.standard_normal((rows, *s)).astype(np.float32) for n, s in zip(names, shapes, strict=True)}
    stacked[names[-1]].reshape(rows, -1)[-1, 0] = values  # one odd value in the last row
    got = encode_packed_many(codec, stacked, names, shared_seed=3)
    if got is None:
        assert name == "qsgd" or (name == "float16" and values == 7e4)
        return
    payloads, sizes = got
    assert len(payloads) == rows
    for i, p in enumerate(payloads):
        alone, alone_sizes, states = encode_packed(codec, {n: stacked[n][i] for n in names}, names,
                                                   np.random.default_rng(0), None, 3)
        assert p == alone and sizes == alone_sizes and states == {}
