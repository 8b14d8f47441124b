"""Bit packing of unsigned integers at any width from 1 to 32 bits.

Widths that divide 8 (the quantiser codes: 1, 2, 4, 8 bits) take a fast path of
whole-byte shifts; other widths (delta-coded indices) go through ``np.unpackbits`` /
``np.packbits``, which costs 32 bytes of scratch per value and is used only on the
k kept indices of a sparsifier, never on a dense tensor.

Bit order is little-endian throughout: value ``i`` occupies bits
``[i*width, (i+1)*width)`` of the stream, least significant bit first.
"""

from __future__ import annotations

import numpy as np


def packed_nbytes(count: int, width: int) -> int:
    """Bytes taken by ``count`` values packed at ``width`` bits (the last byte zero-padded)."""
    return (count * width + 7) // 8


def pack_uint(values: np.ndarray, width: int) -> bytes:
    """Pack non-negative integers ``< 2**width`` into a little-endian bit stream."""
    if width == 8:
        return np.ascontiguousarray(values, dtype=np.uint8).tobytes()
    if width == 1:
        return np.packbits(np.asarray(values, dtype=np.uint8), bitorder="little").tobytes()
    if width in (2, 4):
        return _pack_sub_byte(np.asarray(values, dtype=np.uint8), width)
    v = np.ascontiguousarray(values, dtype="<u4")
    bitmat = np.unpackbits(v.view(np.uint8).reshape(-1, 4), axis=1, bitorder="little")
    return np.packbits(bitmat[:, :width], bitorder="little").tobytes()


def unpack_uint(data: bytes | memoryview, width: int, count: int) -> np.ndarray:
    """Inverse of :func:`pack_uint`: ``uint8`` for widths up to 8 bits, else ``uint32``.

    ``data`` must hold at least ``packed_nbytes(count, width)`` bytes (the caller checks).
    """
    raw = np.frombuffer(data, dtype=np.uint8, count=packed_nbytes(count, width))
    if width == 8:
        return raw
    if width == 1:
        return np.unpackbits(raw, count=count, bitorder="little")
    if width in (2, 4):
        per, mask = 8 // width, np.uint8((1 << width) - 1)
        lanes = np.empty((raw.size, per), dtype=np.uint8)
        for lane in range(per):  # per <= 4 passes over the packed bytes
            np.bitwise_and(raw >> np.uint8(lane * width), mask, out=lanes[:, lane])
        return lanes.reshape(-1)[:count]
    bitmat = np.unpackbits(raw, count=count * width, bitorder="little").reshape(count, width)
    full = np.zeros((count, 32), dtype=np.uint8)
    full[:, :width] = bitmat
    return np.packbits(full, axis=1, bitorder="little").view("<u4").reshape(count)


def _pack_sub_byte(values: np.ndarray, width: int) -> bytes:
    per = 8 // width
    pad = (-values.size) % per
    if pad:
        values = np.concatenate([values, np.zeros(pad, dtype=np.uint8)])
    lanes = values.reshape(-1, per)
    out = lanes[:, 0].copy()
    for lane in range(1, per):  # per <= 4 passes over the packed bytes, not over coordinates
        out |= lanes[:, lane] << np.uint8(lane * width)
    return out.tobytes()
