"""Dense casts: float32 (identity), float16 and bfloat16. One skeleton, three wire dtypes.

Cost: 4, 2 and 2 bytes per element plus the header. float32 is exact and linear
(payloads add element-wise), so it is field-linear: secure aggregation embeds the
values in its field itself. float16 and bfloat16 round to nearest even, which is
neither linear (the sum of two roundings is not the rounding of the sum) nor unbiased.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from orchard.compression.base import (
    Algebra,
    BaseCodec,
    State,
    as_float32,
    check_seed,
    check_shape,
    expect_field,
    expect_fields,
    numel,
    peak,
)
from orchard.compression.wire import (
    CODEC_IDS,
    MAX_COUNT,
    EncodedTensor,
    Field,
    framed_values,
    raw_head,
)
from orchard.errors import CodecError

FLOAT16_MAX = float(np.finfo(np.float16).max)


FLOAT16_OVERFLOW = 65520.0  # the smallest |x| that float16 round-to-nearest sends to inf


def _peak(x: np.ndarray) -> float:
    """max |x| in two reductions (no |x| temporary); NaN when x holds a NaN."""
    return max(float(x.max()), -float(x.min())) if x.size else 0.0


def _to_float16(x: np.ndarray) -> np.ndarray:
    # A silent cast turns |x| >= 65520 into inf, which would poison the whole sum.
    peak = _peak(x)
    if not peak < FLOAT16_OVERFLOW:  # also true for NaN: look closer
        overflow = (np.abs(x) >= FLOAT16_OVERFLOW) & np.isfinite(x)
        if overflow.any():
            raise CodecError(
                f"float16 holds |x| <= {FLOAT16_MAX:g}, the tensor has |x| = "
                f"{float(np.abs(x[overflow]).max()):g}; use bfloat16 (float32 range) or "
                "scale the update"
            )
    return x.astype(np.float16)


def _to_bfloat16(x: np.ndarray) -> np.ndarray:
    """Round float32 to bfloat16 bits (the top 16 bits), nearest-even like hardware does."""
    u = x.view(np.uint32)
    t = u >> np.uint32(16)
    t &= np.uint32(1)
    t += np.uint32(0x7FFF)
    t += u
    t >>= np.uint32(16)
    out = t.astype(np.uint16)
    if np.isnan(_peak(x)):  # the rounding carry could turn a NaN's payload into inf
        out[np.isnan(x)] = np.uint16(0x7FC0)
    return out


def _from_bfloat16(bits: np.ndarray) -> np.ndarray:
    out = bits.astype(np.uint32)
    out <<= np.uint32(16)
    return out.view(np.float32)


class CastCodec(BaseCodec):
    """Send every element in a wire dtype; decode casts back to float32.

    A cast's payload is a header that depends only on the shape (and the codec), then
    the values. The header is built once per shape and kept (``_heads``, at most 1024
    shapes): :meth:`encode` writes it ahead of the values, and :meth:`parse` takes a
    payload that starts with exactly those bytes, and has exactly the values' length, as
    the header plus a view of its values -- what the general parser would return for it
    -- and hands every other payload to the general parser, which says what is wrong.
    :meth:`parse_for_sum` does the same and then reads those values once, for both the
    bound and the coordinates. ``_heads`` is a memo that several threads may fill at
    once (checks run in a pool): every writer of a key writes the same value, and a
    dict item is set whole, so readers never see a partial one."""

    def __init__(
        self,
        name: str,
        wire_dtype: str,
        to_wire: Callable[[np.ndarray], np.ndarray],
        from_wire: Callable[[np.ndarray], np.ndarray],
        exact: bool,
    ) -> None:
        self.name = name
        self.codec_id = CODEC_IDS[name]
        self._wire_dtype = wire_dtype
        self._native = np.dtype(wire_dtype)  # what _values accepts (expect_field's dtype)
        self._wire = (
            self._native.newbyteorder("<") if self._native.byteorder == ">" else self._native
        )
        # shape -> (the checked shape, its header (raw_head), its element count)
        self._heads: dict[tuple[int, ...], tuple[tuple[int, ...], bytes, int]] = {}
        self._to_wire = to_wire
        self._from_wire = from_wire
        self.algebra = Algebra(
            linear=exact,
            field_linear=exact,
            stateful=False,
            unbiased=exact,
            needs_num_summands=False,
        )

    def encode_parsed(
        self, x: np.ndarray, rng: np.random.Generator, state: State | None, shared_seed: int
    ) -> tuple[EncodedTensor, State | None]:
        return self.header(x.shape, [Field(self._to_wire(x.reshape(-1)))]), None

    def encode(
        self,
        x: np.ndarray,
        rng: np.random.Generator,
        state: State | None = None,
        shared_seed: int = 0,
    ) -> tuple[bytes, State | None]:
        # A cast's payload is a fixed header for (shape, wire dtype) and the values: build
        # the header once per shape and append the values (the same bytes as
        # EncodedTensor.to_bytes; a client encodes one payload per tensor per round).
        check_seed(shared_seed)
        framed = self.encode_framed(x)
        if framed is None:  # not little-endian (a big-endian host): the general path
            return self.encode_parsed(as_float32(x), rng, state, shared_seed)[0].to_bytes(), None
        return framed[0] + framed[1], None

    def encode_framed(self, x: np.ndarray) -> tuple[bytes, memoryview] | None:
        """:meth:`encode`'s payload in its two parts, the header and a view of the values
        (``head + bytes(values)`` is that payload), for a caller that joins many payloads
        into one buffer; None on a host whose wire dtype is not native (there, encode)."""
        x32 = as_float32(x)
        values = np.ascontiguousarray(self._to_wire(x32.reshape(-1)))
        if values.dtype != self._wire:
            return None
        return self._frame(x32.shape)[1], memoryview(values).cast("B")  # type: ignore[arg-type]

    def encode_framed_many(self, x: np.ndarray) -> tuple[bytes, np.ndarray] | None:
        """:meth:`encode_framed` of every row of ``x`` (``x[i]`` one tensor, all of one
        shape): the header, and every row's values as a C-contiguous (rows, count) array
        of the wire dtype, whose row ``i`` holds the bytes of ``encode_framed(x[i])[1]``.
        A cast is elementwise, so the rows are cast as one vector. None where
        :meth:`encode_framed` would give None, or where a row would be refused (encode
        the rows one by one: each one's error is its own)."""
        if x.ndim < 1 or x.shape[0] == 0 or x[0].size > MAX_COUNT:
            return None
        try:
            x32 = as_float32(x)
            values = np.ascontiguousarray(self._to_wire(x32.reshape(-1)))
        except CodecError:
            return None
        if values.dtype != self._wire:
            return None
        return self._frame(x32.shape[1:])[1], values.reshape(x32.shape[0], -1)

    def _frame(self, shape: tuple[int, ...]) -> tuple[tuple[int, ...], bytes, int]:
        """``shape`` checked (CodecError if it is not a shape), the header of every payload
        of that shape (``raw_head``) and its element count; kept per shape. A shape equal
        to a kept one is that shape, as for check_shape's own cache."""
        try:
            hit = self._heads.get(shape) if type(shape) is tuple else None
        except TypeError:  # unhashable elements: check_shape says what is wrong
            hit = None
        if hit is None:
            dims = check_shape(shape)
            hit = self._heads.get(dims)
            if hit is None:
                n = numel(dims)
                hit = (dims, raw_head(self.codec_id, self.version, dims, self._wire, n), n)
                if len(self._heads) < 1024:
                    self._heads[dims] = hit
        return hit

    def framing(self, shape: tuple[int, ...]) -> tuple[bytes, np.dtype, int] | None:
        """For a linear cast (float32): what every payload of ``shape`` framed as
        :meth:`encode` frames it is -- its header, then that many elements of that
        little-endian dtype, which are the payload's coordinates (see
        :func:`~orchard.compression.wire.framed_values`). None for a cast that is not
        linear (its values are no coordinates). CodecError if ``shape`` is not a shape."""
        if not self.algebra.linear:
            return None
        _, head, count = self._frame(shape)
        return head, self._wire, count

    def parse(self, payload: bytes, shape: tuple[int, ...]) -> EncodedTensor:
        """:meth:`BaseCodec.parse`, and the same result, taking a payload framed exactly as
        this codec frames ``shape`` without parsing its header field by field."""
        return self._parse(payload, shape)[0]

    def _parse(
        self, payload: bytes, shape: tuple[int, ...]
    ) -> tuple[EncodedTensor, np.ndarray | None]:
        """The parsed payload, and its values when it is framed exactly as this codec frames
        ``shape`` (then they are its one field, of the layout :meth:`_values` accepts)."""
        try:
            dims, head, count = self._heads[shape]
        except (KeyError, TypeError):  # not kept yet, or not a shape: _frame checks it
            dims, head, count = self._frame(shape)
        values = framed_values(payload, head, self._wire, count)
        if values is None:  # any other payload: the general parser names what is wrong
            return super().parse(payload, dims), None
        return EncodedTensor(self.codec_id, self.version, dims, (Field(values),)), values

    def _values(self, enc: EncodedTensor) -> np.ndarray:
        fields = enc.fields
        if len(fields) == 1:  # the one well-formed layout, checked inline
            f = fields[0]
            if not f.bits and f.data.dtype == self._native and f.data.size == numel(enc.shape):
                return f.data
        (f,) = expect_fields(enc, 1, "values")
        return expect_field(enc, f, "values", count=numel(enc.shape), dtype=self._wire_dtype)

    def decode_parsed(
        self, enc: EncodedTensor, num_summands: int = 1, shared_seed: int = 0
    ) -> np.ndarray:
        return np.array(self._from_wire(self._values(enc)), dtype=np.float32).reshape(enc.shape)

    def bound(self, enc: EncodedTensor, num_summands: int = 1, shared_seed: int = 0) -> float:
        return peak(self._from_wire(self._values(enc)))

    def parse_for_sum(
        self, payload: bytes, shape: tuple[int, ...], shared_seed: int = 0
    ) -> tuple[EncodedTensor, float, np.ndarray | None]:
        enc, values = self._parse(payload, shape)
        if values is None:
            values = self._values(enc)  # as bound and coordinates check it
        return enc, peak(self._from_wire(values)), values if self.algebra.linear else None

    def add(self, a: EncodedTensor, b: EncodedTensor) -> EncodedTensor | None:
        if not self.algebra.linear:
            return None
        return self.header(a.shape, [Field(self._values(a) + self._values(b))])

    def coordinates(self, enc: EncodedTensor, shared_seed: int = 0) -> np.ndarray | None:
        """float32's values themselves (a view of the payload)."""
        return self._values(enc) if self.algebra.linear else None

    def coordinate_scale(self, shape: tuple[int, ...]) -> float | None:
        """float32's coordinates are its values."""
        return 1.0 if self.algebra.linear else None

    def from_coordinates(
        self, shape: tuple[int, ...], coords: np.ndarray, shared_seed: int = 0
    ) -> EncodedTensor:
        if not self.algebra.linear:
            return super().from_coordinates(shape, coords, shared_seed)
        return self.header(shape, [Field(np.asarray(coords, dtype=np.float32).reshape(-1))])


def float32_codec() -> CastCodec:
    return CastCodec("float32", "float32", lambda x: x, lambda v: v, exact=True)


def float16_codec() -> CastCodec:
    return CastCodec("float16", "float16", _to_float16, lambda v: v, exact=False)


def bfloat16_codec() -> CastCodec:
    return CastCodec("bfloat16", "uint16", _to_bfloat16, _from_bfloat16, exact=False)
