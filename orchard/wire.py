"""Wire format helpers: model blobs, chunked streams, and proto <-> domain conversion.

A model travels as one safetensors blob identified by its sha256; streams split it into
chunks of at most :data:`MAX_CHUNK_BYTES`. Servicers call only these helpers to turn
protos into domain objects, so protobuf types never reach the round logic or the math.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator, Mapping

import numpy as np
from safetensors import SafetensorError
from safetensors.numpy import load as st_load
from safetensors.numpy import save as st_save

from orchard.errors import IntegrityError, PayloadTooLargeError, UpdateSchemaError
from orchard.messages import DroppedUpload, TaskAssignment, UploadHeader, UploadKind
from orchard.typing import DeviceState, NDArrays, TensorSpec
from orchard.v1 import orchard_pb2 as pb

MAX_CHUNK_BYTES = 4 << 20  # 4 MiB: a chunk plus its envelope fits gRPC's default 4 MiB limit + margin
# The largest chunk, by default: an update or model of up to 4 MiB travels as one message,
# which a tier takes as it came (no join of its chunks: a copy of the payload) and gRPC
# handles once (its cost per message dominates at 1 MiB chunks).
DEFAULT_CHUNK_BYTES = MAX_CHUNK_BYTES
# The server accepts messages a little over 4 MiB so that a full 4 MiB chunk and its
# protobuf envelope always fit; nothing larger is ever needed.
GRPC_MAX_MESSAGE_BYTES = MAX_CHUNK_BYTES + (64 << 10)
GRPC_OPTIONS = [
    ("grpc.max_receive_message_length", GRPC_MAX_MESSAGE_BYTES),
    ("grpc.max_send_message_length", GRPC_MAX_MESSAGE_BYTES),
    ("grpc.keepalive_time_ms", 30_000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),
]
# Servers keep each stream's receive window at its default size instead of growing it by
# BDP probing: an upload waiting for one of the tier's staging slots then buffers at most
# one window inside gRPC, so a thousand waiting uploads cost tens of MiB, not a GiB.
SERVER_GRPC_OPTIONS = [*GRPC_OPTIONS, ("grpc.http2.bdp_probe", 0),
                       # gRPC binds with SO_REUSEPORT by default: a second server on a port a
                       # live one holds would bind too and take part of its connections.
                       ("grpc.so_reuseport", 0)]


class HashedBytes(bytes):
    """Bytes that carry their sha256 (hex), computed once, as they are made.

    A payload built and checked in the same process (a simulator's clients and tiers)
    is then hashed once, where it is made, not again where a tier checks it against its
    header: bytes are immutable, so the digest stays the content's. :func:`sha256_hex`
    returns it. A copy that crosses a process (pickled) or a network is plain bytes again
    and is hashed where it is checked."""

    sha256: str

    def __new__(cls, data: bytes | bytearray | memoryview | np.ndarray) -> HashedBytes:
        self = super().__new__(cls, data)
        self.sha256 = hashlib.sha256(self).hexdigest()
        return self

    def __reduce__(self) -> tuple[type[bytes], tuple[bytes]]:
        return bytes, (bytes(self),)


def sha256_hex(data: bytes | bytearray | memoryview) -> str:
    """The hex sha256 of ``data`` (carried, not recomputed, by :class:`HashedBytes`)."""
    if type(data) is HashedBytes:
        return data.sha256
    return hashlib.sha256(data).hexdigest()


def arrays_to_blob(arrays: NDArrays) -> bytes:
    """Serialise named arrays as safetensors. The bytes do not depend on the order of
    ``arrays`` (safetensors lays tensors out by dtype and name), so equal models have
    equal hashes however they were built."""
    return st_save({k: np.ascontiguousarray(v) for k, v in arrays.items()})


def blob_to_arrays(blob: bytes) -> NDArrays:
    """The named arrays of a blob, in the order of their data in the file.

    That order is the model's canonical order: it is the round's schema order at every
    tier and client, and it is the same however the blob was built. (safetensors itself
    hands tensors back in no fixed order.)"""
    blob = bytes(blob)
    try:
        loaded = st_load(blob)
        n = int.from_bytes(blob[:8], "little")
        header = json.loads(blob[8:8 + n])
    except (SafetensorError, ValueError, OSError) as err:
        raise UpdateSchemaError(f"model blob is not a valid safetensors file: {err}") from None
    offsets = {k: v["data_offsets"][0] for k, v in header.items() if k in loaded}
    return {k: loaded[k] for k in sorted(loaded, key=lambda k: (offsets.get(k, 0), k))}


def payloads_to_blob(payloads: Mapping[str, bytes]) -> bytes:
    """Encoded per-tensor payloads (a model delta) as one safetensors blob of uint8 vectors."""
    return st_save({k: np.frombuffer(v, dtype=np.uint8).copy() for k, v in payloads.items()})


def blob_to_payloads(blob: bytes) -> dict[str, bytes]:
    return {k: np.asarray(v, dtype=np.uint8).tobytes() for k, v in blob_to_arrays(blob).items()}


def downlink_seed(base_hash: str) -> int:
    """The shared seed of a model delta taken from the model blob with this sha256.

    Both ends derive it from the base's hash, so it never travels and a delta decodes
    only against the base it was encoded from.
    """
    return int(base_hash[:15], 16)


def iter_chunks(blob: bytes, chunk_bytes: int = DEFAULT_CHUNK_BYTES, offset: int = 0) -> Iterator[tuple[int, bytes]]:
    if not 0 < chunk_bytes <= MAX_CHUNK_BYTES:
        raise ValueError(f"chunk_bytes must be in (0, {MAX_CHUNK_BYTES}], got {chunk_bytes}")
    mv = memoryview(blob)
    for off in range(offset, len(blob), chunk_bytes):
        yield off, bytes(mv[off : off + chunk_bytes])
    if len(blob) == 0 and offset == 0:
        yield 0, b""


# A serialised UploadPart that carries data starts with this tag: field 2, length-delimited.
_DATA_TAG = 0x12


def upload_part_data(raw: bytes) -> memoryview | None:
    """The bytes of a serialised ``UploadPart`` that holds its ``data`` field and nothing
    else, as a view of ``raw`` (no copy); None for any other message (a header, or data
    with other fields beside it), which the protobuf parser then reads.

    Such a message is exactly one record: the tag, a varint length, and that many bytes
    to the end. Parsing it with protobuf would copy the bytes twice (into the message,
    then out of it); a tier takes a thousand megabyte-sized parts per round."""
    if len(raw) < 2 or raw[0] != _DATA_TAG:
        return None
    n, shift, i = 0, 0, 1
    while True:
        if i >= len(raw) or shift > 35:  # a length needs at most 5 varint bytes here
            return None
        b = raw[i]
        i += 1
        n |= (b & 0x7F) << shift
        if b < 0x80:
            break
        shift += 7
    if i + n != len(raw):
        return None
    return memoryview(raw)[i:]


def parse_upload_part(raw: bytes) -> pb.UploadPart | memoryview:
    """gRPC's request deserializer for PushUpdate: a data part's bytes as a view of the
    received message (:func:`upload_part_data`), any other part as a parsed message."""
    data = upload_part_data(raw)
    return data if data is not None else pb.UploadPart.FromString(raw)


def serialize_chunk(chunk: pb.Chunk | bytes) -> bytes:
    """gRPC's response serializer for PullModel: a chunk, or one serialised already
    (a tier serialises each chunk of a model once, however many nodes pull it)."""
    return chunk if isinstance(chunk, bytes) else chunk.SerializeToString()


def check_payload(payload: bytes | bytearray | memoryview, expected_bytes: int, expected_sha256: str) -> None:
    """IntegrityError unless ``payload`` has the size and sha256 its header declared."""
    if len(payload) != expected_bytes:
        raise IntegrityError(f"payload of {len(payload)} bytes, the header declares {expected_bytes}")
    _check_digest(sha256_hex(payload), expected_sha256)


def _check_digest(got: str, expected_sha256: str) -> None:
    if got != expected_sha256.lower():
        raise IntegrityError(f"payload sha256 {got[:16]}... does not match the declared {expected_sha256[:16]}...")


# An assembler keeps a chunk this large as it came, and copies smaller ones together.
KEEP_CHUNK_BYTES = 64 << 10


class ChunkAssembler:
    """Reassembles a stream into one payload, checking offsets, sizes and the final sha256.

    ``expected_bytes`` is declared up front (header) and every chunk is checked against it
    as it arrives, so a stream can never hold more than it declared. Chunks of at least
    :data:`KEEP_CHUNK_BYTES` are kept as they came (gRPC's message buffers, or views of
    them) and joined once at the end: one copy, and none for a payload that came in one
    chunk. Smaller chunks are copied together as they come, so a stream of tiny chunks
    holds its bytes and a few objects, not an object per chunk. With ``expected_sha256=None``
    the hash is left to the caller (:func:`check_payload`): a tier checks uploads where it
    decodes them, off its event loop.
    """

    def __init__(self, expected_bytes: int, expected_sha256: str | None, max_bytes: int) -> None:
        if expected_bytes < 0:
            raise IntegrityError(f"declared size must be >= 0, got {expected_bytes}")
        if expected_bytes > max_bytes:
            raise PayloadTooLargeError(
                f"stream declares {expected_bytes} bytes; this server accepts at most {max_bytes}"
            )
        self._parts: list[bytes | bytearray | memoryview] = []
        self._n = 0
        self._hash = hashlib.sha256() if expected_sha256 is not None else None
        self.expected_bytes = expected_bytes
        self.expected_sha256 = expected_sha256.lower() if expected_sha256 is not None else None

    @property
    def received(self) -> int:
        return self._n

    def add(self, data: bytes | memoryview, offset: int | None = None) -> None:
        """Take one chunk. It is kept, not copied: the caller must not change it."""
        if len(data) > MAX_CHUNK_BYTES:
            raise PayloadTooLargeError(f"chunk of {len(data)} bytes exceeds the {MAX_CHUNK_BYTES}-byte chunk limit")
        if offset is not None and offset != self._n:
            raise IntegrityError(f"chunk at offset {offset}, expected offset {self._n}: chunks must arrive in order")
        end = self._n + len(data)
        if end > self.expected_bytes:
            raise PayloadTooLargeError(
                f"stream sent more than its declared {self.expected_bytes} bytes (at least {end})"
            )
        if len(data) >= KEEP_CHUNK_BYTES:
            self._parts.append(data)
        elif data:
            tail = self._parts[-1] if self._parts else None
            if not isinstance(tail, bytearray):
                tail = bytearray()
                self._parts.append(tail)
            tail += data
        if self._hash is not None:
            self._hash.update(data)
        self._n = end

    def finish(self) -> bytes | bytearray | memoryview:
        """The payload: the one chunk itself, or the chunks joined (read-only either way)."""
        if self._n != self.expected_bytes:
            raise IntegrityError(
                f"stream ended after {self._n} of {self.expected_bytes} declared bytes (truncated); send it again"
            )
        if self._hash is not None and self.expected_sha256 is not None:
            _check_digest(self._hash.hexdigest(), self.expected_sha256)
        parts, self._parts = self._parts, []
        if len(parts) == 1:
            return parts[0]
        return b"".join(parts)


# ------------------------------------------------------------------ proto conversions


def device_to_proto(d: DeviceState | None) -> pb.DeviceState:
    msg = pb.DeviceState()
    if d is None:
        return msg
    if d.battery_percent is not None:
        msg.battery_percent = float(d.battery_percent)
    if d.charging is not None:
        msg.charging = bool(d.charging)
    if d.temperature_c is not None:
        msg.temperature_c = float(d.temperature_c)
    if d.unmetered_network is not None:
        msg.unmetered_network = bool(d.unmetered_network)
    if d.idle is not None:
        msg.idle = bool(d.idle)
    msg.extra.update({k: float(v) for k, v in d.extra.items()})
    return msg


def device_from_proto(m: pb.DeviceState) -> DeviceState:
    def opt(name: str):  # proto3 optional: absent means unknown
        return getattr(m, name) if m.HasField(name) else None

    return DeviceState(
        battery_percent=opt("battery_percent"),
        charging=opt("charging"),
        temperature_c=opt("temperature_c"),
        unmetered_network=opt("unmetered_network"),
        idle=opt("idle"),
        extra=dict(m.extra),
    )


def specs_to_proto(specs: list[TensorSpec]) -> list[pb.TensorSpec]:
    return [pb.TensorSpec(name=s.name, shape=list(s.shape), dtype=s.dtype) for s in specs]


def specs_from_proto(specs) -> list[TensorSpec]:
    out = []
    for s in specs:
        if any(d < 0 for d in s.shape):
            raise UpdateSchemaError(f"tensor {s.name!r} declares a negative dimension {list(s.shape)}")
        out.append(TensorSpec(s.name, tuple(int(d) for d in s.shape), s.dtype))
    return out


def task_to_proto(t: TaskAssignment) -> pb.TaskSpec:
    return pb.TaskSpec(run_id=t.run_id, round=t.round, attempt=t.attempt, task_id=t.task_id,
                       model_hash=t.model_hash, model_bytes=t.model_bytes, config_json=t.config_json,
                       schema=specs_to_proto(list(t.schema)), deadline_unix=t.deadline_unix,
                       cohort_target=t.cohort_target, shared_seed=t.shared_seed)


def task_from_proto(m: pb.TaskSpec) -> TaskAssignment:
    return TaskAssignment(run_id=m.run_id, round=m.round, attempt=m.attempt, task_id=m.task_id,
                          model_hash=m.model_hash, model_bytes=m.model_bytes, config_json=m.config_json,
                          schema=tuple(specs_from_proto(m.schema)), deadline_unix=m.deadline_unix,
                          cohort_target=m.cohort_target, shared_seed=m.shared_seed)


def dropped_to_proto(d: DroppedUpload) -> pb.DroppedUpload:
    return pb.DroppedUpload(run_id=d.run_id, round=d.round, attempt=d.attempt, node_id=d.node_id,
                            task_id=d.task_id, reason=d.reason)


def dropped_from_proto(m: pb.DroppedUpload) -> DroppedUpload:
    return DroppedUpload(m.run_id, m.round, m.attempt, m.node_id, m.task_id, m.reason)


def header_to_proto(h: UploadHeader) -> pb.UploadHeader:
    return pb.UploadHeader(
        node_id=h.node_id, run_id=h.run_id, round=h.round, attempt=h.attempt, task_id=h.task_id,
        kind=h.kind.name, schema=specs_to_proto(list(h.schema)), payload_sizes=list(h.payload_sizes),
        codec=h.codec, payload_sha256=h.payload_sha256, weight=h.weight, count=h.count,
        num_examples=h.num_examples, num_steps=h.num_steps, metric_sums=h.metric_sums,
        metric_weights=h.metric_weights, bytes_up=h.bytes_up, bytes_down=h.bytes_down,
        tier_participants=h.tier_participants, staleness=h.staleness, dropped=h.dropped)


def header_from_proto(m: pb.UploadHeader) -> UploadHeader:
    if m.kind not in (UploadKind.CLIENT_UPDATE, UploadKind.PARTIAL_SUM):
        raise UpdateSchemaError(f"unknown upload kind {m.kind}; expected CLIENT_UPDATE (0) or PARTIAL_SUM (1)")
    if any(s < 0 for s in m.payload_sizes):
        raise UpdateSchemaError("payload_sizes must be non-negative")
    return UploadHeader(
        node_id=m.node_id, run_id=m.run_id, round=m.round, attempt=m.attempt, task_id=m.task_id,
        kind=UploadKind(m.kind), schema=tuple(specs_from_proto(m.schema)),
        payload_sizes=tuple(int(s) for s in m.payload_sizes), codec=m.codec, payload_sha256=m.payload_sha256,
        weight=m.weight, count=m.count, num_examples=m.num_examples, num_steps=m.num_steps,
        metric_sums=dict(m.metric_sums), metric_weights=dict(m.metric_weights), bytes_up=m.bytes_up,
        bytes_down=m.bytes_down, tier_participants=dict(m.tier_participants),
        staleness={int(k): int(v) for k, v in m.staleness.items()}, dropped=m.dropped)
