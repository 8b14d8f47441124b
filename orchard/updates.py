"""Update payload layout: per-tensor byte strings concatenated in schema order.

The header declares each tensor's payload size, so a tier can split the stream without
parsing codec internals, and check every size against the schema before decoding.
Also the one squared norm that clipping uses, wherever an update's norm is taken (from
decoded arrays in ``aggregation.privacy``, from payload coordinates in
``compression.aggregate``).
"""

from __future__ import annotations

import numpy as np

from orchard.errors import UpdateSchemaError
from orchard.typing import NDArrays, TensorSpec


def squared_norm(x: np.ndarray) -> float:
    """``||x||^2`` in float64 arithmetic, whatever float dtype ``x`` has. einsum casts a
    block at a time: no float64 copy of a large ``x``, and no BLAS call (a threaded BLAS
    dot costs milliseconds on a busy host, for what is a 100 microsecond sum)."""
    v = x.reshape(-1)
    return float(np.einsum("i,i->", v, v, dtype=np.float64))


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
    if len(sizes) != len(schema):
        raise UpdateSchemaError(f"a partial sum declares {len(sizes)} payload sizes for a schema of "
                                f"{len(schema)} tensors")
    parts = split(blob, sizes)
    out: NDArrays = {}
    for spec, p in zip(schema, parts, strict=True):
        if len(p) != spec.numel * 8:
            raise UpdateSchemaError(
                f"partial tensor {spec.name!r} has {len(p)} bytes, expected {spec.numel * 8} (float64 x {spec.shape})")
        out[spec.name] = np.frombuffer(p, dtype="<f8").reshape(spec.shape)
    return out
