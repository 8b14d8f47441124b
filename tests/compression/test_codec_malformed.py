"""Malformed payloads are refused with a CodecError that says what was expected and what came.

One test (or one row of a table) per case, then a fuzz test: no mutation of a valid payload may escape as
anything but a CodecError (in particular never a numpy IndexError/ValueError).
"""

from __future__ import annotations

import struct

import numpy as np
import pytest
from codec_cases import SPECS
from hypothesis import given
from hypothesis import strategies as st

from orchard.compression import CodecMismatchError, MalformedPayloadError, build_codec
from orchard.compression.wire import EncodedTensor, Field
from orchard.config import CodecSpec
from orchard.errors import CodecError

X = np.random.default_rng(0).standard_normal((6, 10)).astype(np.float32)
FIRST_FIELD = 6 + 4 * X.ndim + 1  # magic, versions, id, ndim; dims; nfields


def payload_of(name: str, x: np.ndarray = X, shared_seed: int = 0) -> bytes:
    return build_codec(SPECS[name]).encode(x, np.random.default_rng(1), None, shared_seed)[0]


def decode(name: str, payload: bytes, shape: tuple[int, ...] = X.shape, **kw) -> np.ndarray:
    return build_codec(SPECS[name]).decode(payload, shape, **kw)


def topk_payload(gaps: list[int], width: int, size: int = 10) -> bytes:
    """A hand-made topk payload: these index gaps, float32 ones as values."""
    codec = build_codec(SPECS["topk-k3"])
    values, _ = build_codec(SPECS["float32"]).encode(np.ones(len(gaps)), np.random.default_rng(0))
    enc = EncodedTensor(
        codec.codec_id,
        1,
        (size,),
        (Field(np.array(gaps, np.uint32), bits=width), Field(np.frombuffer(values, np.uint8))),
    )
    return enc.to_bytes()


def _replace(name: str, at: int, byte: bytes) -> bytes:
    """A valid ``name`` payload with the byte at ``at`` replaced."""
    p = payload_of(name)
    return p[:at] + byte + p[at + 1:]


# (decoder, payload, shape asked for, error, message): the framing every codec shares.
FRAMING = [
    pytest.param("float32", lambda: payload_of("float32")[:4], X.shape, MalformedPayloadError,
                 "truncated header: expected at least 6 bytes, got 4", id="truncated-header"),
    pytest.param("float32", lambda: payload_of("float32")[:9], X.shape, MalformedPayloadError,
                 "truncated header: a 2-d shape needs 15 header bytes, got 9", id="truncated-inside-the-shape"),
    pytest.param("float32", lambda: b"PK" + payload_of("float32")[2:], X.shape, MalformedPayloadError,
                 r"expected magic b'OZ', got b'PK'", id="bad-magic"),
    pytest.param("float32", lambda: _replace("float32", 2, b"\x09"), X.shape, CodecMismatchError,
                 "wire-format version: expected 1, got 9", id="unsupported-wire-version"),
    pytest.param("qsgd8", lambda: payload_of("float32"), X.shape, CodecMismatchError,
                 r"this decoder is 'qsgd' \(id 4\), the payload was made by 'float32' \(id 1\)", id="wrong-codec-id"),
    pytest.param("sign", lambda: _replace("sign", 4, b"\x02"), X.shape, CodecMismatchError,
                 "payload version 2, this decoder reads version 1", id="wrong-codec-version"),
    pytest.param("float32", lambda: payload_of("float32"), (10, 6), MalformedPayloadError,
                 r"payload is for shape \(6, 10\), decode was asked for \(10, 6\)", id="wrong-shape"),
    pytest.param("qsgd8", lambda: payload_of("qsgd8") + b"abc", X.shape, MalformedPayloadError,
                 r"wrong payload length: the header describes \d+ bytes, got \d+ \(3 trailing bytes\)",
                 id="trailing-bytes"),
    pytest.param("qsgd8", lambda: payload_of("qsgd8")[:-1], X.shape, MalformedPayloadError,
                 r"truncated payload: field 1 declares 60 elements \(60 bytes\), only 59 bytes remain",
                 id="truncated-body"),
]


@pytest.mark.parametrize(("decoder", "payload", "shape", "error", "match"), FRAMING)
def test_framing_refusals(decoder: str, payload, shape: tuple[int, ...], error: type[CodecError],
                          match: str) -> None:
    with pytest.raises(error, match=match):
        decode(decoder, payload(), shape)


def test_wrong_element_count() -> None:
    # A well-framed float32 payload for shape (6, 10) whose values hold 59 elements.
    enc = EncodedTensor(1, 1, (6, 10), (Field(np.zeros(59, np.float32)),))
    with pytest.raises(MalformedPayloadError, match="field 'values': expected 60 elements, got 59"):
        decode("float32", enc.to_bytes())


def test_wrong_number_of_fields() -> None:
    enc = EncodedTensor(4, 1, (6, 10), (Field(np.ones(1, np.float32)),))
    with pytest.raises(MalformedPayloadError, match=r"expected 2 fields \(scales, codes\), got 1"):
        decode("qsgd8", enc.to_bytes())


def test_wrong_bit_width() -> None:
    with pytest.raises(
        MalformedPayloadError, match="field 'codes': expected 8-bit packed, got 60 x 4-bit packed"
    ):
        build_codec(SPECS["qsgd8"]).decode(
            build_codec(CodecSpec(name="qsgd", params={"bits": 4})).encode(
                X, np.random.default_rng(0)
            )[0],
            X.shape,
        )


def test_unknown_field_kind() -> None:
    p = bytearray(payload_of("float32"))
    p[FIRST_FIELD] = 77  # the first field's kind byte
    with pytest.raises(
        MalformedPayloadError, match=r"field 0: unknown field kind 77, expected 0 \(packed\)"
    ):
        decode("float32", bytes(p))


def test_packed_width_out_of_range() -> None:
    p = bytearray(payload_of("sign"))
    p[FIRST_FIELD + 6 + 4 + 1] = 40  # after the scale field (6 + 4 bytes): codes' width byte
    with pytest.raises(
        MalformedPayloadError, match="field 1: packed width must be 1..32 bits, got 40"
    ):
        decode("sign", bytes(p))


def test_index_out_of_range() -> None:
    with pytest.raises(
        MalformedPayloadError,
        match=r"index 12 out of range for shape \(10,\) \(10 elements, valid indices 0..9\)",
    ):
        decode("topk-k3", topk_payload([2, 3, 7], width=3), (10,))


def test_repeated_index() -> None:
    with pytest.raises(MalformedPayloadError, match="repeated index"):
        decode("topk-k3", topk_payload([2, 0, 1], width=2), (10,))


def test_more_indices_than_elements() -> None:
    with pytest.raises(MalformedPayloadError, match="11 indices for a tensor of 10 elements"):
        decode("topk-k3", topk_payload([0] + [1] * 10, width=1), (10,))


def test_nested_values_of_the_wrong_length() -> None:
    # Three indices but a values payload for four numbers.
    good = topk_payload([1, 1, 1], width=1)
    values, _ = build_codec(SPECS["float32"]).encode(np.ones(4), np.random.default_rng(0))
    enc = build_codec(SPECS["topk-k3"]).parse(good, (10,))
    bad = EncodedTensor(
        enc.codec_id, 1, (10,), (enc.fields[0], Field(np.frombuffer(values, np.uint8)))
    )
    with pytest.raises(
        MalformedPayloadError,
        match=r"values of a topk payload: float32 payload is for shape \(4,\), decode was asked for \(3,\)",
    ):
        decode("topk-k3", bad.to_bytes(), (10,))


def test_randk_decoded_with_another_shared_seed() -> None:
    p = payload_of("randk", shared_seed=5)
    with pytest.raises(
        CodecMismatchError, match="randk payload was drawn with another shared seed"
    ):
        decode("randk", p, shared_seed=6)


def test_fixed_scale_mismatch() -> None:
    other = build_codec(CodecSpec(name="qsgd", params={"bits": 8, "scale": 3.0}))
    p, _ = other.encode(X, np.random.default_rng(0))
    with pytest.raises(
        CodecMismatchError,
        match="uses scale 3, this decoder is configured for a fixed scale of 2000",
    ):
        decode("qsgd8-fixed", p)


def test_summed_codes_beyond_num_summands() -> None:
    codec = build_codec(SPECS["qsgd8-fixed"])
    enc = codec.parse(payload_of("qsgd8-fixed"), X.shape)
    summed = codec.add(codec.add(enc, enc), enc)  # three summands
    assert summed is not None
    big = codec.header(X.shape, [summed.fields[0], Field(np.full(60, 600, np.uint32))])
    with pytest.raises(
        MalformedPayloadError,
        match="summed codes reach 600, but 2 summands of 8-bit codes reach at most 510: wrong num_summands",
    ):
        codec.decode(big.to_bytes(), X.shape, num_summands=2)


def test_powersgd_factors_of_inconsistent_rank() -> None:
    enc = EncodedTensor(
        7, 1, (20, 12), (Field(np.zeros(40, np.float32)), Field(np.zeros(36, np.float32)))
    )
    with pytest.raises(
        MalformedPayloadError,
        match=r"expected factors of 20 x r and 12 x r floats for one r >= 1, got 40 and 36",
    ):
        decode("powersgd", enc.to_bytes(), (20, 12))


def test_payload_that_is_not_bytes() -> None:
    with pytest.raises(MalformedPayloadError, match="a payload must be bytes, got str"):
        decode("float32", "OZ")  # type: ignore[arg-type]


def test_bad_num_summands() -> None:
    with pytest.raises(CodecError, match="num_summands must be an int >= 1, got 0"):
        decode("float32", payload_of("float32"), num_summands=0)


@pytest.mark.parametrize("name", list(SPECS))
@given(data=st.data())
def test_no_mutation_escapes_as_anything_but_a_codec_error(name: str, data: st.DataObject) -> None:
    payload = bytearray(payload_of(name, X[:3], shared_seed=2))
    kind = data.draw(st.sampled_from(["flip", "truncate", "extend", "splice"]))
    if kind == "flip":
        for _ in range(data.draw(st.integers(1, 4))):
            i = data.draw(st.integers(0, len(payload) - 1))
            payload[i] = data.draw(st.integers(0, 255))
    elif kind == "truncate":
        payload = payload[: data.draw(st.integers(0, len(payload) - 1))]
    elif kind == "extend":
        payload += data.draw(st.binary(min_size=1, max_size=8))
    else:
        i = data.draw(st.integers(0, len(payload)))
        payload[i:i] = struct.pack("<I", data.draw(st.integers(0, 2**32 - 1)))
    try:
        out = decode(name, bytes(payload), X[:3].shape, shared_seed=2)
    except CodecError:
        return
    assert out.shape == X[:3].shape and out.dtype == np.float32  # a mutation that still parses
