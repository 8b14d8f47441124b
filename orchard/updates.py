"""Update payload layout: per-tensor byte strings concatenated in schema order.

The header declares each tensor's payload size, so a tier can split the stream without
parsing codec internals, and check every size against the schema before decoding.
"""

from __future__ import annotations

import numpy as np

from orchard.errors import UpdateSchemaError
from orchard.typing import NDArrays, TensorSpec


def pack(payloads: list[bytes]) -> tuple[bytes, tuple[int, ...]]:
    return b"".join(payloads), tuple(len(p) for p in payloads)


def split(blob: bytes | bytearray | memoryview, sizes: tuple[int, ...]) -> list[memoryview]:
    """Per-tensor views into ``blob`` (no copies)."""
    mv = memoryview(blob).cast("B")
    if sum(sizes) != len(mv):
        raise UpdateSchemaError(f"payload is {len(mv)} bytes but the header declares {sum(sizes)}")
    out, off = [], 0
    for s in sizes:
        out.append(mv[off : off + s])
        off += s
    return out


def encode_partial(sums: NDArrays) -> tuple[bytes, tuple[int, ...]]:
    """A partial sum travels as raw little-endian float64, losslessly."""
    return pack([np.ascontiguousarray(v, dtype="<f8").tobytes() for v in sums.values()])


def decode_partial(blob: bytes | bytearray | memoryview, schema: tuple[TensorSpec, ...] | list[TensorSpec],
                   sizes: tuple[int, ...]) -> NDArrays:
    parts = split(blob, sizes)
    out: NDArrays = {}
    for spec, p in zip(schema, parts, strict=True):
        if len(p) != spec.numel * 8:
            raise UpdateSchemaError(
                f"partial tensor {spec.name!r} has {len(p)} bytes, expected {spec.numel * 8} (float64 x {spec.shape})")
        out[spec.name] = np.frombuffer(p, dtype="<f8").reshape(spec.shape)
    return out
