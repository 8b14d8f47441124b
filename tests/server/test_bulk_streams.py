"""The bulk streams' fast paths: data parts read as views of the received message, model
chunks serialised once. Each must give exactly what the protobuf parser and serializer give."""

from __future__ import annotations

import pytest

from orchard import wire
from orchard.errors import IntegrityError, PayloadTooLargeError
from orchard.server.downlink import ModelReply, full_reply
from orchard.server.servicer import ChunkCache
from orchard.v1 import orchard_pb2 as pb


@pytest.mark.parametrize("n", [0, 1, 127, 128, 16_383, 16_384, (1 << 20) + 7])
def test_data_part_is_a_view_of_its_bytes(n: int) -> None:
    data = bytes(range(256)) * (n // 256) + bytes(n % 256)
    raw = pb.UploadPart(data=data).SerializeToString()
    got = wire.parse_upload_part(raw)
    assert isinstance(got, memoryview) and got.obj is raw
    assert bytes(got) == pb.UploadPart.FromString(raw).data == data


def test_other_parts_go_through_the_parser() -> None:
    header = pb.UploadPart(header=pb.UploadHeader(node_id="n", payload_sizes=[3])).SerializeToString()
    assert wire.upload_part_data(header) is None
    part = wire.parse_upload_part(header)
    assert isinstance(part, pb.UploadPart) and part.WhichOneof("part") == "header" and part.header.node_id == "n"


def test_data_with_anything_beside_it_goes_through_the_parser() -> None:
    raw = pb.UploadPart(data=b"abc").SerializeToString()
    unknown = bytes([15 << 3 | 0, 1])  # field 15, varint 1: a field this schema does not know
    twice = raw + pb.UploadPart(data=b"xyz").SerializeToString()  # protobuf: the last one wins
    for msg, want in ((raw + unknown, b"abc"), (twice, b"xyz")):
        assert wire.upload_part_data(msg) is None
        part = wire.parse_upload_part(msg)
        assert isinstance(part, pb.UploadPart) and part.data == want


def test_truncated_data_part_is_not_taken_as_data() -> None:
    raw = pb.UploadPart(data=b"x" * 300).SerializeToString()
    for cut in (raw[:-1], raw[:2], raw[:1]):
        assert wire.upload_part_data(cut) is None


def test_serialize_chunk_passes_serialised_chunks_through() -> None:
    msg = pb.Chunk(data=b"abc", offset=3, total_bytes=6, blob_sha256="h")
    raw = msg.SerializeToString()
    assert wire.serialize_chunk(raw) is raw
    assert wire.serialize_chunk(msg) == raw


def _reply(blob: bytes) -> ModelReply:
    return full_reply(blob, wire.sha256_hex(blob))


def test_chunk_cache_serialises_each_reply_once() -> None:
    blob = bytes(range(256)) * 40  # 10,240 bytes: three 4 KiB chunks
    cache = ChunkCache(entries=2)
    chunks = cache.get(_reply(blob), 4096)
    parsed = [pb.Chunk.FromString(m) for _, m in chunks]
    assert [c.offset for c in parsed] == [0, 4096, 8192]
    assert [n for n, _ in chunks] == [len(c.data) for c in parsed] == [4096, 4096, 2048]
    assert b"".join(c.data for c in parsed) == blob
    assert all(c.total_bytes == len(blob) and c.blob_sha256 == wire.sha256_hex(blob) for c in parsed)
    assert cache.get(_reply(blob), 4096) is chunks  # the same reply: served from the cache
    assert cache.get(_reply(blob), 2048) is not chunks  # another chunk size: its own entry
    cache.get(_reply(b"other"), 4096)  # a third entry evicts the least recently used
    assert cache.get(_reply(blob), 2048) is not None
    assert cache.get(_reply(blob), 4096) is not chunks


def test_chunk_cache_keeps_a_delta_apart_from_the_full_model() -> None:
    blob = b"d" * 5000
    full = _reply(blob)
    delta = ModelReply(blob=blob, sha256=full.sha256, target_hash="t", delta_from="b", result_sha256="r",
                       encoding="{}")
    cache = ChunkCache()
    a, b = cache.get(full, 4096), cache.get(delta, 4096)
    assert a is not b
    head = pb.Chunk.FromString(b[0][1])
    assert (head.delta_from, head.target_hash, head.result_sha256, head.encoding) == ("b", "t", "r", "{}")
    assert pb.Chunk.FromString(a[0][1]).delta_from == ""


def test_assembler_joins_chunks_once_and_keeps_a_single_chunk() -> None:
    payload = bytes(range(256)) * 1024  # 256 KiB
    sha = wire.sha256_hex(payload)
    one = wire.ChunkAssembler(len(payload), sha, 1 << 20)
    view = memoryview(b"xx" + payload)[2:]
    one.add(view)
    assert one.finish() is view  # one chunk: the payload is that chunk, not a copy
    for size in (wire.KEEP_CHUNK_BYTES, 1000, 100_000, 7):  # kept, copied, kept with a copied tail, mixed
        many = wire.ChunkAssembler(len(payload), sha, 1 << 20)
        for off, data in wire.iter_chunks(payload, size):
            many.add(memoryview(data), off)
        assert bytes(many.finish()) == payload


def test_assembler_holds_tiny_chunks_in_one_buffer() -> None:
    """A stream of one-byte chunks must not cost an object per chunk: they are copied
    together, so the assembler holds its bytes in one buffer."""
    payload = bytes(range(256)) * 64
    asm = wire.ChunkAssembler(len(payload), None, 1 << 20)
    for i in range(len(payload)):
        asm.add(payload[i : i + 1])
    assert len(asm._parts) == 1
    assert asm.finish() == payload


@pytest.mark.parametrize("sha", ["declared", None])
def test_assembler_refuses_what_the_header_did_not_declare(sha: str | None) -> None:
    payload = b"p" * 3000
    declared = wire.sha256_hex(payload) if sha else None
    over = wire.ChunkAssembler(100, declared, 1 << 20)
    with pytest.raises(PayloadTooLargeError, match="more than its declared"):
        over.add(payload)
    short = wire.ChunkAssembler(len(payload), declared, 1 << 20)
    short.add(payload[:10])
    with pytest.raises(IntegrityError, match="truncated"):
        short.finish()
    with pytest.raises(PayloadTooLargeError, match="accepts at most"):
        wire.ChunkAssembler(len(payload), declared, 100)


def test_assembler_checks_the_hash_only_when_given_one() -> None:
    payload = b"q" * 3000
    bad = wire.ChunkAssembler(len(payload), "0" * 64, 1 << 20)
    bad.add(payload)
    with pytest.raises(IntegrityError, match="sha256"):
        bad.finish()
    deferred = wire.ChunkAssembler(len(payload), None, 1 << 20)
    deferred.add(payload)
    got = deferred.finish()
    wire.check_payload(got, len(payload), wire.sha256_hex(payload))  # the caller's check passes...
    with pytest.raises(IntegrityError, match="sha256"):
        wire.check_payload(got, len(payload), "0" * 64)  # ...and refuses a wrong hash
    with pytest.raises(IntegrityError, match="declares"):
        wire.check_payload(got, len(payload) + 1, wire.sha256_hex(payload))


def test_hashed_bytes_carry_the_sha256_of_their_content() -> None:
    """A payload made as HashedBytes is hashed once, as it is made: its digest is the
    content's, a tier's check still compares it with the header's, and a copy that crosses
    a process (pickled) is plain bytes, hashed again where it is checked."""
    import hashlib
    import pickle

    import numpy as np

    row = np.arange(3000, dtype=np.uint8)
    payload = wire.HashedBytes(row)
    assert payload == row.tobytes() and payload.sha256 == hashlib.sha256(row.tobytes()).hexdigest()
    assert wire.sha256_hex(payload) == wire.sha256_hex(row.tobytes())
    wire.check_payload(payload, len(payload), hashlib.sha256(row.tobytes()).hexdigest())
    with pytest.raises(IntegrityError, match="sha256"):
        wire.check_payload(payload, len(payload), hashlib.sha256(b"another payload").hexdigest())
    copy = pickle.loads(pickle.dumps(payload))
    assert type(copy) is bytes and copy == payload
