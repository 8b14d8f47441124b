"""The self-describing payload every codec emits.

Layout (little-endian)::

    magic      2s   b"OZ"
    wire       u8   wire-format version (WIRE_VERSION)
    codec      u8   codec id (CODEC_NAMES)
    version    u8   that codec's payload version
    ndim       u8
    dims       ndim x u32
    nfields    u8
    then nfields times:
        kind   u8   0 = unsigned ints bit-packed at `bits`; else a raw dtype (RAW_KINDS)
        bits   u8   1..32 for kind 0, 0 otherwise
        count  u32  number of elements
        data        packed_nbytes(count, bits) or count * itemsize bytes

A payload's reported size is ``len(payload)``, header included: there is no other
accounting. The header costs ``7 + 4*ndim + 6*nfields`` bytes. Nested payloads (the
kept values of a sparsifier, encoded by another codec) travel as a ``uint8`` field
holding a complete payload with its own header, so every layer can refuse what it
did not make.
"""

from __future__ import annotations

import functools
import struct
from dataclasses import dataclass

import numpy as np

from orchard.compression.bits import pack_uint, packed_nbytes, unpack_uint
from orchard.compression.errors import CodecMismatchError, MalformedPayloadError

MAGIC = b"OZ"
WIRE_VERSION = 1
MAX_COUNT = 2**32 - 1  # a u32 field count; larger tensors must be split by the caller

# Codec ids are part of the wire format: never renumber, only append.
CODEC_NAMES: dict[int, str] = {
    1: "float32",
    2: "float16",
    3: "bfloat16",
    4: "qsgd",
    5: "topk",
    6: "randk",
    7: "powersgd",
    8: "sign",
}
CODEC_IDS = {name: cid for cid, name in CODEC_NAMES.items()}

PACKED = 0
RAW_KINDS: dict[int, np.dtype] = {
    1: np.dtype("<f4"),
    2: np.dtype("<f2"),
    3: np.dtype("<u2"),
    4: np.dtype("<u4"),
    5: np.dtype("u1"),
}
_KIND_OF = {dt: kind for kind, dt in RAW_KINDS.items()}

_HEAD = struct.Struct("<2sBBBB")
_NFIELDS = struct.Struct("<B")
_FIELD = struct.Struct("<BBI")


# Field and EncodedTensor are frozen, and a tier makes one of each per tensor per upload:
# their __init__ writes the instance dict directly instead of calling object.__setattr__
# per field as the generated one does (half their cost). Same fields, same defaults.


@dataclass(frozen=True)
class Field:
    """One 1-D array of a payload. ``bits > 0``: unsigned ints packed at that width."""

    data: np.ndarray
    bits: int = 0

    def __init__(self, data: np.ndarray, bits: int = 0) -> None:
        d = self.__dict__
        d["data"] = data
        d["bits"] = bits

    def describe(self) -> str:
        kind = f"{self.bits}-bit packed" if self.bits else str(self.data.dtype)
        return f"{self.data.size} x {kind}"


@dataclass(frozen=True)
class EncodedTensor:
    """A parsed payload: which codec made it, for what shape, and its fields."""

    codec_id: int
    codec_version: int
    shape: tuple[int, ...]
    fields: tuple[Field, ...]

    def __init__(
        self, codec_id: int, codec_version: int, shape: tuple[int, ...], fields: tuple[Field, ...]
    ) -> None:
        d = self.__dict__
        d["codec_id"] = codec_id
        d["codec_version"] = codec_version
        d["shape"] = shape
        d["fields"] = fields

    @property
    def codec_name(self) -> str:
        return CODEC_NAMES.get(self.codec_id, f"<unknown codec id {self.codec_id}>")

    def to_bytes(self) -> bytes:
        parts: list[bytes | memoryview] = [
            _frame(self.codec_id, self.codec_version, self.shape, len(self.fields))
        ]
        for f in self.fields:
            parts += _field_bytes(f)
        return b"".join(parts)


def _frame(codec_id: int, codec_version: int, shape: tuple[int, ...], nfields: int) -> bytes:
    """Magic, versions, codec id, shape and field count: a payload's first bytes."""
    return (
        _HEAD.pack(MAGIC, WIRE_VERSION, codec_id, codec_version, len(shape))
        + struct.pack(f"<{len(shape)}I", *shape)
        + _NFIELDS.pack(nfields)
    )


def _raw_kind(dtype: np.dtype) -> tuple[int, np.dtype]:
    """A raw field's wire kind and its little-endian dtype."""
    dt = dtype.newbyteorder("<") if dtype.byteorder == ">" else dtype
    kind = _KIND_OF.get(np.dtype(dt))
    if kind is None:
        raise MalformedPayloadError(
            f"field dtype {dtype} has no wire kind; expected one of "
            f"{sorted(str(d) for d in _KIND_OF)}"
        )
    return kind, dt


def _field_bytes(f: Field) -> list[bytes | memoryview]:
    if f.data.ndim != 1 or f.data.size > MAX_COUNT:
        raise MalformedPayloadError(
            f"a field must be 1-D with at most {MAX_COUNT} elements, got shape {f.data.shape}"
        )
    if f.bits:
        return [_FIELD.pack(PACKED, f.bits, f.data.size), pack_uint(f.data, f.bits)]
    kind, dt = _raw_kind(f.data.dtype)
    # A memoryview, not .tobytes(): bytes.join then copies the data once, not twice.
    data = np.ascontiguousarray(f.data, dtype=dt)
    return [_FIELD.pack(kind, 0, f.data.size), memoryview(data).cast("B")]  # type: ignore[arg-type]


def raw_head(
    codec_id: int, codec_version: int, shape: tuple[int, ...], dtype: np.dtype, count: int
) -> bytes:
    """The bytes before the values of a payload whose one field is ``count`` raw elements of
    ``dtype``: what :meth:`EncodedTensor.to_bytes` writes ahead of them (dense casts send
    this header, the same for every payload of a shape, and then the values)."""
    if not 0 <= count <= MAX_COUNT:
        raise MalformedPayloadError(f"a field holds 0..{MAX_COUNT} elements, got {count}")
    kind, _ = _raw_kind(np.dtype(dtype))
    return _frame(codec_id, codec_version, shape, 1) + _FIELD.pack(kind, 0, count)


def framed_values(
    payload: bytes | bytearray | memoryview, head: bytes, dtype: np.dtype, count: int
) -> np.ndarray | None:
    """The values of a payload that is exactly ``head`` (:func:`raw_head` for ``dtype`` and
    ``count``) followed by ``count`` elements of little-endian ``dtype``, as a view of the
    payload (read-only when it is); None for any other payload.

    For such a payload, :func:`parse_payload` returns the header ``head`` describes with
    these values as its one field: every byte it checks is compared here, and the length
    is exact. Anything else -- a byte of the header changed, a short or long payload, an
    object that is not a byte buffer -- gets None, and the caller parses it with
    :func:`parse_payload`, which names what is wrong."""
    if isinstance(payload, memoryview):  # a tensor's slice of an update (orchard.updates.split)
        if payload.ndim != 1 or payload.format != "B" or not payload.c_contiguous:
            return None
    elif not isinstance(payload, (bytes, bytearray)):
        return None
    n = len(head)
    if len(payload) != n + count * dtype.itemsize or payload[:n] != head:
        return None
    return np.frombuffer(payload, dtype, count, n)


_BUFFERS = (bytes, bytearray, memoryview)


def parse_payload(payload: bytes | bytearray | memoryview) -> EncodedTensor:
    """Parse and bounds-check a payload. Never raises anything but a CodecError subclass."""
    if not isinstance(payload, _BUFFERS):
        raise MalformedPayloadError(f"a payload must be bytes, got {type(payload).__name__}")
    buf = memoryview(payload)
    if buf.format != "B" or buf.ndim != 1 or not buf.c_contiguous:
        # The common case (bytes, a slice of them) is a byte view already; only a
        # contiguous view casts, so a strided one is copied first.
        buf = (buf if buf.c_contiguous else memoryview(buf.tobytes())).cast("B")
    n = len(buf)
    if n < _HEAD.size:
        raise MalformedPayloadError(
            f"truncated header: expected at least {_HEAD.size} bytes, got {n}"
        )
    magic, wire, codec_id, codec_version, ndim = _HEAD.unpack_from(buf, 0)
    if magic != MAGIC:
        raise MalformedPayloadError(
            f"not an orchard codec payload: expected magic {MAGIC!r}, got {bytes(magic)!r}"
        )
    if wire != WIRE_VERSION:
        raise CodecMismatchError(
            f"unsupported wire-format version: expected {WIRE_VERSION}, got {wire}"
        )
    off = _HEAD.size
    need = off + 4 * ndim + _NFIELDS.size
    if n < need:
        raise MalformedPayloadError(
            f"truncated header: a {ndim}-d shape needs {need} header bytes, got {n}"
        )
    shape = _dims(ndim).unpack_from(buf, off)
    off += 4 * ndim
    (nfields,) = _NFIELDS.unpack_from(buf, off)
    off += _NFIELDS.size
    fields = []
    for i in range(nfields):  # a handful of fields per payload, never one per coordinate
        field, off = _parse_field(buf, off, i)
        fields.append(field)
    if off != n:
        raise MalformedPayloadError(
            f"wrong payload length: the header describes {off} bytes, got {n} "
            f"({n - off} trailing bytes)"
        )
    return EncodedTensor(codec_id, codec_version, tuple(shape), tuple(fields))


@functools.lru_cache(maxsize=256)
def _dims(ndim: int) -> struct.Struct:
    return struct.Struct(f"<{ndim}I")


def _parse_field(buf: memoryview, off: int, i: int) -> tuple[Field, int]:
    n = len(buf)
    if n < off + _FIELD.size:
        raise MalformedPayloadError(
            f"truncated header: field {i} needs {_FIELD.size} header bytes at offset {off}, "
            f"only {max(n - off, 0)} remain"
        )
    kind, bits, count = _FIELD.unpack_from(buf, off)
    off += _FIELD.size
    if kind == PACKED:
        if not 1 <= bits <= 32:
            raise MalformedPayloadError(f"field {i}: packed width must be 1..32 bits, got {bits}")
        size = packed_nbytes(count, bits)
    elif kind in RAW_KINDS:
        if bits != 0:
            raise MalformedPayloadError(f"field {i}: raw field with bit width {bits}, expected 0")
        size = count * RAW_KINDS[kind].itemsize
    else:
        raise MalformedPayloadError(
            f"field {i}: unknown field kind {kind}, expected 0 (packed) or one of "
            f"{sorted(RAW_KINDS)}"
        )
    if n < off + size:
        raise MalformedPayloadError(
            f"truncated payload: field {i} declares {count} elements ({size} bytes), "
            f"only {n - off} bytes remain"
        )
    chunk = buf[off : off + size]
    if kind == PACKED:
        data = unpack_uint(chunk, bits, count)
    else:
        data = np.frombuffer(chunk, dtype=RAW_KINDS[kind], count=count)
    return Field(data, bits), off + size
