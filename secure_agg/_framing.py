"""The byte-level framing under the protocol messages of
:mod:`orchard.secure_agg.messages`: integers big-endian, a str as ``u16 length + UTF-8``,
bytes as ``u32 length + raw``, lists as ``u32 count + items``, and the (node id, blob)
pair lists most stages carry. Kept apart from the messages so the layout of a field is
written once, whichever message holds it; anything that does not parse exactly is
refused with :class:`~orchard.secure_agg.errors.MalformedMessage`.
"""

from __future__ import annotations

import functools
import itertools
import struct

from orchard.secure_agg.crypto import KEY_BYTES
from orchard.secure_agg.errors import MalformedMessage


class _Writer:
    def __init__(self) -> None:
        self.parts: list[bytes | memoryview] = []

    def raw(self, b: bytes | memoryview) -> None:
        self.parts.append(b)

    def u8(self, v: int) -> None:
        self.parts.append(struct.pack(">B", v))

    def u16(self, v: int) -> None:
        self.parts.append(struct.pack(">H", v))

    def u32(self, v: int) -> None:
        self.parts.append(struct.pack(">I", v))

    def u64(self, v: int) -> None:
        self.parts.append(struct.pack(">Q", v))

    def string(self, s: str) -> None:
        self.parts.append(encoded_id(s))

    def getvalue(self) -> bytes:
        return b"".join(self.parts)


class _Reader:
    def __init__(self, data: bytes | bytearray | memoryview) -> None:
        self.buf = memoryview(data).cast("B")
        self.pos = 0
        self.version = 1  # the message's header version, once the header is read

    def _need(self, n: int) -> None:
        if n < 0 or self.pos + n > len(self.buf):
            raise MalformedMessage(
                f"message truncated: needed {n} bytes at offset {self.pos}, "
                f"{len(self.buf) - self.pos} left"
            )

    def take(self, n: int) -> memoryview:
        self._need(n)
        out = self.buf[self.pos:self.pos + n]
        self.pos += n
        return out

    def _unpack(self, fmt: struct.Struct) -> int:
        self._need(fmt.size)
        (v,) = fmt.unpack_from(self.buf, self.pos)
        self.pos += fmt.size
        return int(v)

    def u8(self) -> int:
        return self._unpack(_U8)

    def u16(self) -> int:
        return self._unpack(_U16)

    def u32(self) -> int:
        return self._unpack(_U32)

    def u64(self) -> int:
        return self._unpack(_U64)

    def fixed(self, n: int) -> bytes:
        return bytes(self.take(n))

    def string(self) -> str:
        raw = self.take(self.u16())
        try:
            return str(raw, "utf-8")
        except UnicodeDecodeError:
            raise MalformedMessage("a node id is not valid UTF-8") from None

    def strings(self, n: int) -> list[str]:
        """``n`` node ids in a row (a hot path: inlined bounds checks, no helper calls)."""
        buf, pos, end = self.buf, self.pos, len(self.buf)
        out = []
        try:
            for _ in range(n):
                if pos + 2 > end:
                    raise MalformedMessage(f"message truncated at offset {pos}")
                ln = (buf[pos] << 8) | buf[pos + 1]
                pos += 2
                if pos + ln > end:
                    raise MalformedMessage(f"message truncated at offset {pos}")
                out.append(str(buf[pos:pos + ln], "utf-8"))
                pos += ln
        except UnicodeDecodeError:
            raise MalformedMessage("a node id is not valid UTF-8") from None
        self.pos = pos
        return out

    def pairs(self, n: int) -> list[tuple[str, bytes]]:
        """``n`` (node id, blob) pairs in a row."""
        names, blobs = self.pair_columns(n)
        return list(zip(names, blobs, strict=True))

    def pair_columns(self, n: int) -> tuple[list[str], list[bytes]]:
        """``n`` (node id, blob) pairs in a row, as a list of ids and a list of blobs (a
        server takes n k of them per stage: no tuple per pair).

        Works on one bytes copy of the message (slicing bytes is cheaper than slicing a
        memoryview and copying each blob out); offsets only grow, so one check that the
        blob ends inside the message also covers both length fields before it.

        The usual list has one record size: node ids of one length (a session's ids
        usually are) and blobs of one length (share ciphertexts, shares). Then every
        record's two length fields are the first record's, which strided slices check at
        once, and ids and blobs are cut at fixed offsets; what that parses is exactly what
        the record-by-record walk below parses, and any other list takes the walk.
        """
        raw, pos = bytes(self.buf), self.pos
        end = len(raw)
        from_bytes = int.from_bytes
        if n and pos + 2 <= end:
            name_len = from_bytes(raw[pos:pos + 2], "big")
            blob_len_at = pos + 2 + name_len
            if blob_len_at + 4 <= end:
                blob_len = from_bytes(raw[blob_len_at:blob_len_at + 4], "big")
                size = 6 + name_len + blob_len
                stop = pos + n * size
                if stop <= end and all(
                        raw[at:stop:size] == raw[at:at + 1] * n
                        for at in (pos, pos + 1, *range(blob_len_at, blob_len_at + 4))):
                    try:
                        names = [raw[at:at + name_len].decode()
                                 for at in range(pos + 2, stop, size)]
                    except UnicodeDecodeError:
                        raise MalformedMessage("a node id is not valid UTF-8") from None
                    first = blob_len_at + 4
                    blobs = [raw[at:at + blob_len] for at in range(first, first + n * size, size)]
                    self.pos = stop
                    return names, blobs
        names, blobs = [], []
        try:
            for _ in range(n):
                name_at = pos + 2
                name_end = name_at + from_bytes(raw[pos:name_at], "big")
                blob_at = name_end + 4
                blob_end = blob_at + from_bytes(raw[name_end:blob_at], "big")
                if blob_end > end:
                    raise MalformedMessage(f"message truncated at offset {pos}")
                names.append(raw[name_at:name_end].decode())
                blobs.append(raw[blob_at:blob_end])
                pos = blob_end
        except UnicodeDecodeError:
            raise MalformedMessage("a node id is not valid UTF-8") from None
        self.pos = pos
        return names, blobs

    def count(self, min_item_bytes: int) -> int:
        n = self.u32()
        if n * min_item_bytes > len(self.buf) - self.pos:
            raise MalformedMessage(f"list of {n} items cannot fit in the remaining bytes")
        return n

    def end(self) -> None:
        if self.pos != len(self.buf):
            raise MalformedMessage(f"{len(self.buf) - self.pos} trailing bytes after the message")


_U8, _U16, _U32, _U64 = (struct.Struct(f) for f in (">B", ">H", ">I", ">Q"))


def _pair_list(ids: list[bytes], blobs: list[bytes]) -> bytes:
    """A pair list in wire form (u32 count, then id, u32 length, blob per pair) from ids
    already in wire form; one length field serves every pair when the blobs share a length."""
    if len(ids) != len(blobs):
        raise ValueError(f"{len(ids)} ids for {len(blobs)} blobs")
    count = len(blobs).to_bytes(4, "big")
    lengths = set(map(len, blobs))
    if len(lengths) == 1:  # the usual case
        length = lengths.pop().to_bytes(4, "big")
        return count + b"".join(itertools.chain.from_iterable(
            zip(ids, itertools.repeat(length), blobs, strict=False)))
    parts = [count]
    for name, blob in zip(ids, blobs, strict=True):
        parts += (name, len(blob).to_bytes(4, "big"), blob)
    return b"".join(parts)


def _key(r: _Reader) -> bytes:
    return r.fixed(KEY_BYTES)


def _check_key(name: str, key: bytes) -> None:
    if len(key) != KEY_BYTES:
        raise MalformedMessage(f"{name} must be {KEY_BYTES} bytes, got {len(key)}")


@functools.lru_cache(maxsize=1 << 16)
def encoded_id(name: str) -> bytes:
    """A node id in wire form (u16 length + UTF-8). Cached: a session's ids recur in
    every pair list (a server writes n k of them per stage)."""
    enc = name.encode("utf-8")
    if len(enc) > 0xFFFF:
        raise MalformedMessage(f"node id too long ({len(enc)} bytes)")
    return len(enc).to_bytes(2, "big") + enc


def _write_pairs(w: _Writer, pairs: tuple[tuple[str, bytes], ...]) -> None:
    w.raw(_pair_list([encoded_id(name) for name, _ in pairs], [blob for _, blob in pairs]))


def _read_pairs(r: _Reader) -> tuple[tuple[str, bytes], ...]:
    return tuple(r.pairs(r.count(6)))

