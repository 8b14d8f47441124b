"""Whole updates: ordered named arrays in, ordered named payloads out.

Each tensor gets its own shared seed, derived from the cohort's ``shared_seed`` and the
tensor's name, so random-k draws different coordinates for two tensors of one shape.
The caller must change ``shared_seed`` every round (the round number mixed into the
cohort's seed will do).

Codec state is one :data:`~orchard.compression.base.State` per tensor name.
:func:`states_to_bytes` / :func:`states_from_bytes` turn all of them into one blob a
device can persist between rounds.
"""

from __future__ import annotations

import functools
import struct
import zlib
from collections.abc import Callable, Mapping

import numpy as np

from orchard.compression.base import Codec, State, check_seed, check_shape
from orchard.compression.casts import CastCodec
from orchard.compression.errors import MalformedPayloadError, UpdateMismatchError
from orchard.compression.quantize import QuantCodec
from orchard.errors import CodecError

States = dict[str, State]


# Cached: a round encodes and decodes every update with the same (shared_seed, name)
# pairs, and a SeedSequence costs more than encoding a small tensor.
@functools.lru_cache(maxsize=4096)
def tensor_seed(shared_seed: int, name: str) -> int:
    """The shared seed of one tensor: the same on every client and on the server."""
    seq = np.random.SeedSequence(
        entropy=check_seed(shared_seed), spawn_key=(zlib.crc32(name.encode()),)
    )
    return int(seq.generate_state(1, dtype=np.uint64)[0])


def encode_update(
    codec: Codec,
    arrays: Mapping[str, np.ndarray],
    rng: np.random.Generator,
    states: Mapping[str, State] | None = None,
    shared_seed: int = 0,
) -> tuple[dict[str, bytes], States]:
    """Encode every tensor in order; new states hold only the tensors that have one."""
    payloads: dict[str, bytes] = {}
    new_states: States = {}
    for name, x in arrays.items():
        state = (states or {}).get(name)
        payloads[name], new = codec.encode(x, rng, state, tensor_seed(shared_seed, name))
        if new is not None:
            new_states[name] = new
    return payloads, new_states


def encode_packed(
    codec: Codec,
    arrays: Mapping[str, np.ndarray],
    names: list[str],
    rng: np.random.Generator,
    states: Mapping[str, State] | None = None,
    shared_seed: int = 0,
) -> tuple[bytes, tuple[int, ...], States]:
    """:func:`encode_update` of ``arrays`` (encoded in their own order), its payloads then
    joined in ``names`` order: (the joined payload, each tensor's size, the new states).
    A dense cast's payloads are a header and the values each, joined straight into the
    one buffer (the same bytes, without a payload object per tensor)."""
    if type(codec) is CastCodec and list(arrays) == names:
        check_seed(shared_seed)
        parts: list[bytes | memoryview] = []
        sizes = []
        for name in names:
            framed = codec.encode_framed(arrays[name])
            if framed is None:  # not a little-endian host: the general path below
                break
            head, values = framed
            parts += (head, values)
            sizes.append(len(head) + len(values))
        else:
            return b"".join(parts), tuple(sizes), {}
    payloads, new_states = encode_update(codec, arrays, rng, states, shared_seed)
    return b"".join(payloads[n] for n in names), tuple(len(payloads[n]) for n in names), new_states


def encode_packed_many(
    codec: Codec,
    rows: Mapping[str, np.ndarray],
    names: list[str],
    shared_seed: int = 0,
    as_bytes: Callable[[np.ndarray], bytes] = np.ndarray.tobytes,
    rngs: list[np.random.Generator] | None = None,
) -> tuple[list[bytes], tuple[int, ...]] | None:
    """:func:`encode_packed` of many updates at once, for a cast codec: ``rows[name][i]``
    is update ``i``'s tensor ``name`` (every update of the same shapes, ``rows`` in
    ``names`` order). Returns each update's joined payload, in row order, and the
    tensors' sizes (the same for every update): the same bytes as :func:`encode_packed`
    gives update by update (a cast draws nothing and keeps no state). The payloads are
    written into one (updates, bytes) buffer, tensor by tensor, each tensor's rows cast
    at once, and each payload is made from its row by ``as_bytes`` (a bytes type that
    copies a buffer, such as :class:`bytes`; the default is ``tobytes``). None for any
    other codec, or where a row would not take the cast's framed path: then encode the
    updates one by one.

    A quantiser (``qsgd``) takes the same path given ``rngs``, update ``i``'s encoder
    randomness (``rngs[i]``, drawn tensor by tensor in ``names`` order as
    :func:`encode_packed` draws it): :meth:`QuantCodec.encode_many` gives each update's
    payloads, the rounding of all updates computed at once."""
    if type(codec) is QuantCodec and rngs is not None and list(rows) == names and names:
        return _quant_packed_many(codec, rows, names, shared_seed, as_bytes, rngs)
    if type(codec) is not CastCodec or list(rows) != names or not names:
        return None
    check_seed(shared_seed)
    parts: list[tuple[bytes, np.ndarray]] = []
    for name in names:
        framed = codec.encode_framed_many(rows[name])
        if framed is None:
            return None
        parts.append(framed)
    count = parts[0][1].shape[0]
    if any(values.shape[0] != count for _, values in parts):
        return None
    sizes = tuple(len(head) + values.shape[1] * values.itemsize for head, values in parts)
    buf = np.empty((count, sum(sizes)), dtype=np.uint8)
    at = 0
    for head, values in parts:
        buf[:, at:at + len(head)] = np.frombuffer(head, dtype=np.uint8)
        at += len(head)
        nbytes = values.shape[1] * values.itemsize
        buf[:, at:at + nbytes] = values.view(np.uint8).reshape(count, nbytes)
        at += nbytes
    return [as_bytes(row) for row in buf], sizes


def _quant_packed_many(codec: QuantCodec, rows: Mapping[str, np.ndarray], names: list[str], shared_seed: int,
                       as_bytes: Callable[[np.ndarray], bytes],
                       rngs: list[np.random.Generator]) -> tuple[list[bytes], tuple[int, ...]] | None:
    check_seed(shared_seed)
    per_tensor = []
    for name in names:
        got = codec.encode_many(rows[name], rngs)
        if got is None:
            return None
        per_tensor.append(got)
    sizes = tuple(len(p[0]) for p in per_tensor)
    if any(len(payload) != size for p, size in zip(per_tensor, sizes, strict=True) for payload in p):
        return None  # every update of one shape has payloads of one size; anything else: one by one
    joined = [b"".join(parts) for parts in zip(*per_tensor, strict=True)]
    return [as_bytes(np.frombuffer(j, dtype=np.uint8)) for j in joined], sizes


def decode_update(
    codec: Codec,
    payloads: Mapping[str, bytes],
    shapes: Mapping[str, tuple[int, ...]],
    num_summands: int = 1,
    shared_seed: int = 0,
) -> dict[str, np.ndarray]:
    """Decode every tensor of ``shapes`` (its order wins); names must match exactly."""
    check_names(payloads, shapes, "payloads")
    return {
        name: codec.decode(
            payloads[name], check_shape(shape), num_summands, tensor_seed(shared_seed, name)
        )
        for name, shape in shapes.items()
    }


def check_names(got: Mapping[str, object], expected: Mapping[str, object], what: str) -> None:
    missing = [n for n in expected if n not in got]
    extra = [n for n in got if n not in expected]
    if missing or extra:
        raise UpdateMismatchError(
            f"{what} do not match the expected tensors: missing {missing}, unexpected {extra}"
        )


_STATE_MAGIC = b"OS"
_STATE_HEAD = struct.Struct("<2sBI")  # magic, version, entry count
_ENTRY = struct.Struct("<HB")  # name length, ndim


def states_to_bytes(states: Mapping[str, State]) -> bytes:
    """All codec states as one blob: entries ``tensor/key`` -> float32 array."""
    flat = {
        f"{t}/{k}": np.ascontiguousarray(v, dtype="<f4")
        for t, s in states.items()
        for k, v in s.items()
    }
    parts = [_STATE_HEAD.pack(_STATE_MAGIC, 1, len(flat))]
    for key, arr in flat.items():
        name = key.encode()
        parts += [_ENTRY.pack(len(name), arr.ndim), name, struct.pack(f"<{arr.ndim}I", *arr.shape)]
        parts.append(arr.tobytes())
    return b"".join(parts)


def states_from_bytes(blob: bytes) -> States:
    """Inverse of :func:`states_to_bytes`; refuses a truncated or foreign blob."""
    buf = memoryview(blob).cast("B")
    if len(buf) < _STATE_HEAD.size:
        raise MalformedPayloadError(
            f"truncated codec state: expected at least {_STATE_HEAD.size} bytes, got {len(buf)}"
        )
    magic, version, count = _STATE_HEAD.unpack_from(buf, 0)
    if magic != _STATE_MAGIC or version != 1:
        raise MalformedPayloadError(
            f"not a codec state blob: expected magic {_STATE_MAGIC!r} version 1, "
            f"got {bytes(magic)!r} version {version}"
        )
    off = _STATE_HEAD.size
    states: States = {}
    for _ in range(count):  # one entry per tensor and key
        key, arr, off = _state_entry(buf, off)
        tensor, _, name = key.rpartition("/")
        states.setdefault(tensor, {})[name] = arr
    if off != len(buf):
        raise MalformedPayloadError(f"codec state: {len(buf) - off} trailing bytes")
    return states


def _state_entry(buf: memoryview, off: int) -> tuple[str, np.ndarray, int]:
    def need(n: int, what: str) -> None:
        if len(buf) < off + n:
            raise MalformedPayloadError(
                f"truncated codec state: {what} needs {n} bytes at offset {off}, "
                f"only {len(buf) - off} remain"
            )

    need(_ENTRY.size, "an entry header")
    name_len, ndim = _ENTRY.unpack_from(buf, off)
    off += _ENTRY.size
    need(name_len + 4 * ndim, "a name and shape")
    try:
        key = bytes(buf[off : off + name_len]).decode()
    except UnicodeDecodeError:
        raise CodecError("codec state: an entry name is not UTF-8") from None
    off += name_len
    shape = struct.unpack_from(f"<{ndim}I", buf, off)
    off += 4 * ndim
    size = int(np.prod(shape, dtype=np.int64)) * 4
    need(size, f"entry {key!r}")
    arr = np.frombuffer(buf[off : off + size], dtype="<f4").reshape(shape).copy()
    return key, arr, off + size
