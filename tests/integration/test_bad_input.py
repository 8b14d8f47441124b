"""Bad input never crashes a tier or reaches the accumulator; each case gets its own status.

One root runs in a background event loop for the module; each test speaks raw gRPC to
it as a misbehaving node would, then checks the round's accumulator is untouched.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace

import grpc
import numpy as np
import pytest
from fed_harness import BackgroundRoot, poll_together

from orchard import wire
from orchard.compression import build_codec, encode_update
from orchard.config import CodecSpec, CohortConfig, RunConfig, ServerConfig
from orchard.messages import TaskAssignment, UploadHeader, UploadKind
from orchard.tasks import get_task
from orchard.updates import pack
from orchard.v1 import orchard_pb2 as pb
from orchard.v1 import orchard_pb2_grpc as pbg

MAX_UPLOAD = 200_000
CHUNK = 4096  # the tier's pull chunks: a model of several


@pytest.fixture(scope="module")
def env(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict]:
    srv = BackgroundRoot(tmp_path_factory.mktemp("root"),
                         ServerConfig(max_upload_bytes=MAX_UPLOAD, node_timeout_s=600, long_poll_s=1.0,
                                      chunk_bytes=CHUNK))
    ch = grpc.insecure_channel(srv.root.address)
    fleet = pbg.FleetStub(ch)
    for n in ("good", "other"):
        fleet.Join(pb.JoinRequest(node_id=n, role="client"))
    task = get_task("digits")
    init = task.initial_arrays(0)
    cfg = RunConfig(task="digits", rounds=1, cohort=CohortConfig(target=2, over_selection=1.0, deadline_s=600))
    from orchard.ops import ControlClient

    got = poll_together(fleet, ["good", "other"],
                        lambda: ControlClient(srv.root.address, insecure=True).start_run(cfg, wire.arrays_to_blob(init)))
    tasks = {}
    for n, r in got.items():
        assert r.WhichOneof("kind") == "task", r
        tasks[n] = wire.task_from_proto(r.task)
    # Joins after selection filled the quota: never selected this round.
    fleet.Join(pb.JoinRequest(node_id="outsider", role="client"))
    r = fleet.Poll(pb.PollRequest(node_id="outsider", wait_s=0.2))
    assert r.WhichOneof("kind") == "idle" and "not selected" in r.idle.reason
    yield {"srv": srv, "fleet": fleet, "tasks": tasks, "init": init, "cfg": cfg, "channel": ch}
    ch.close()
    srv.stop()


def make_upload(t: TaskAssignment, node: str, arrays: dict[str, np.ndarray], codec: str = "float32") -> tuple[UploadHeader, bytes]:
    payloads, _ = encode_update(build_codec(CodecSpec(name=codec)), arrays, np.random.default_rng(0), None,
                                t.shared_seed)
    payload, sizes = pack([payloads[s.name] for s in t.schema])
    h = UploadHeader(node_id=node, run_id=t.run_id, round=t.round, attempt=t.attempt, task_id=t.task_id,
                     kind=UploadKind.CLIENT_UPDATE, schema=t.schema, payload_sizes=sizes, codec="float32",
                     payload_sha256=wire.sha256_hex(payload), weight=10.0, count=1, num_examples=10,
                     metric_sums={"train_loss": 12.0}, metric_weights={"train_loss": 10.0})
    return h, payload


def zeros(t: TaskAssignment) -> dict[str, np.ndarray]:
    return {s.name: np.zeros(s.shape, np.float32) for s in t.schema}


def push(env: dict, header: UploadHeader | None, payload: bytes, chunk: int = 4096) -> pb.UploadReply:
    def parts():
        if header is not None:
            yield pb.UploadPart(header=wire.header_to_proto(header))
        for _, d in wire.iter_chunks(payload, chunk):
            yield pb.UploadPart(data=d)

    return env["fleet"].PushUpdate(parts())


def refused(env: dict, code: grpc.StatusCode, match: str, header: UploadHeader | None, payload: bytes) -> None:
    before = env["srv"].root.coordinator.current.received
    with pytest.raises(grpc.RpcError) as ei:
        push(env, header, payload)
    assert ei.value.code() == code, ei.value.details()
    assert match in ei.value.details()
    cr = env["srv"].root.coordinator.current
    assert cr.received == before and not cr.closed
    # The tier keeps serving.
    assert env["fleet"].Poll(pb.PollRequest(node_id="outsider", wait_s=0)).WhichOneof("kind") == "idle"


def good(env: dict) -> tuple[UploadHeader, bytes]:
    return make_upload(env["tasks"]["good"], "good", zeros(env["tasks"]["good"]))


def test_wrong_names(env):
    h, p = good(env)
    h = replace(h, schema=tuple(replace(s, name="x" + s.name) for s in h.schema))
    refused(env, grpc.StatusCode.INVALID_ARGUMENT, "names", h, p)


def test_wrong_shape(env):
    h, p = good(env)
    s0 = h.schema[0]
    h = replace(h, schema=(replace(s0, shape=(s0.shape[0] + 1, *s0.shape[1:])), *h.schema[1:]))
    refused(env, grpc.StatusCode.INVALID_ARGUMENT, "shape", h, p)


def test_wrong_dtype(env):
    h, p = good(env)
    h = replace(h, schema=(replace(h.schema[0], dtype="float64"), *h.schema[1:]))
    refused(env, grpc.StatusCode.INVALID_ARGUMENT, "dtype", h, p)


@pytest.mark.parametrize("bad", [np.nan, np.inf])
def test_non_finite_values(env, bad):
    t = env["tasks"]["good"]
    arrays = zeros(t)
    first = next(iter(arrays))
    arrays[first].flat[3] = bad
    h, p = make_upload(t, "good", arrays)
    refused(env, grpc.StatusCode.INVALID_ARGUMENT, "NaN or Inf", h, p)


def test_oversize_payload(env):
    h, p = good(env)
    big = bytes(MAX_UPLOAD + 1)
    h = replace(h, payload_sizes=(len(big), *([0] * (len(h.schema) - 1))), payload_sha256=wire.sha256_hex(big))
    refused(env, grpc.StatusCode.RESOURCE_EXHAUSTED, "limit", h, b"")


@pytest.mark.parametrize("rnd, word", [(0, "stale"), (7, "future")])
def test_stale_or_future_round(env, rnd, word):
    h, p = good(env)
    refused(env, grpc.StatusCode.FAILED_PRECONDITION, word, replace(h, round=rnd), p)


def test_unknown_node(env):
    h, p = good(env)
    refused(env, grpc.StatusCode.NOT_FOUND, "has not joined", replace(h, node_id="ghost"), p)


def test_not_selected(env):
    h, p = good(env)
    refused(env, grpc.StatusCode.PERMISSION_DENIED, "no assignment", replace(h, node_id="outsider"), p)


def test_payload_hash_mismatch(env):
    h, p = good(env)
    corrupt = bytearray(p)
    corrupt[len(corrupt) // 2] ^= 0xFF
    refused(env, grpc.StatusCode.DATA_LOSS, "sha256", h, bytes(corrupt))


def test_truncated_stream(env):
    h, p = good(env)
    refused(env, grpc.StatusCode.DATA_LOSS, "truncated", h, p[: len(p) // 2])


def test_stream_longer_than_declared(env):
    h, p = good(env)
    refused(env, grpc.StatusCode.RESOURCE_EXHAUSTED, "more than its declared", h, p + b"extra")


def test_wrong_codec_name(env):
    h, p = good(env)
    refused(env, grpc.StatusCode.INVALID_ARGUMENT, "this round uses", replace(h, codec="topk"), p)


def test_payload_from_another_codec(env):
    t = env["tasks"]["good"]
    _, p = make_upload(t, "good", zeros(t), codec="float16")
    h, _ = good(env)
    payloads, _ = encode_update(build_codec(CodecSpec(name="float16")), zeros(t), np.random.default_rng(0))
    _, sizes = pack([payloads[s.name] for s in t.schema])
    h = replace(h, payload_sizes=sizes, payload_sha256=wire.sha256_hex(p))
    refused(env, grpc.StatusCode.INVALID_ARGUMENT, "codec", h, p)


def test_bad_weight(env):
    h, p = good(env)
    refused(env, grpc.StatusCode.INVALID_ARGUMENT, "weight", replace(h, weight=float("nan")), p)


def test_stream_without_header(env):
    _, p = good(env)
    refused(env, grpc.StatusCode.INVALID_ARGUMENT, "must start with its header", None, p)


def test_pull_from_any_offset(env):
    """Pulls from the start, from a chunk boundary (the tier's serialised chunks) and from
    mid-chunk (a resumption) all give the model's bytes from there, chunk by chunk."""
    t = env["tasks"]["good"]
    blob = env["srv"].root.coordinator.model_blob(t.model_hash)
    assert len(blob) > 3 * CHUNK
    for offset in (0, 2 * CHUNK, CHUNK + 5, len(blob)):
        chunks = list(env["fleet"].PullModel(pb.PullModelRequest(node_id="good", model_hash=t.model_hash,
                                                                  offset=offset)))
        assert b"".join(c.data for c in chunks) == blob[offset:]
        assert [c.offset for c in chunks] == list(range(offset, len(blob), CHUNK))
        assert all(c.total_bytes == len(blob) and c.blob_sha256 == t.model_hash for c in chunks)
    with pytest.raises(grpc.RpcError) as ei:
        list(env["fleet"].PullModel(pb.PullModelRequest(node_id="good", model_hash=t.model_hash,
                                                        offset=len(blob) + 1)))
    assert ei.value.code() == grpc.StatusCode.DATA_LOSS


def test_data_part_with_unknown_field_is_still_data(env):
    """A data part carrying a field this schema does not know is parsed by protobuf (not
    taken as a view) and its bytes count like any other: the hash mismatch shows they arrived."""
    h, p = good(env)
    h = replace(h, payload_sha256="0" * 64)
    unknown = bytes([15 << 3 | 0, 1])
    parts = [pb.UploadPart(header=wire.header_to_proto(h)).SerializeToString(),
             pb.UploadPart(data=p).SerializeToString() + unknown]
    push_raw = env["channel"].stream_unary("/orchard.v1.Fleet/PushUpdate", request_serializer=None,
                                           response_deserializer=pb.UploadReply.FromString)
    before = env["srv"].root.coordinator.current.received
    with pytest.raises(grpc.RpcError) as ei:
        push_raw(iter(parts))
    assert ei.value.code() == grpc.StatusCode.DATA_LOSS and "sha256" in ei.value.details()
    assert env["srv"].root.coordinator.current.received == before


def test_zz_duplicate_then_late(env):
    """Valid upload accepted once; a duplicate is refused; after close, uploads are late."""
    h, p = good(env)
    assert push(env, h, p).accepted
    assert env["srv"].root.coordinator.current.received == 1
    with pytest.raises(grpc.RpcError) as ei:
        push(env, h, p)
    assert ei.value.code() == grpc.StatusCode.ALREADY_EXISTS
    t = env["tasks"]["other"]
    h2, p2 = make_upload(t, "other", zeros(t))
    assert push(env, h2, p2).accepted  # target 2 reached: the round closes
    with pytest.raises(grpc.RpcError) as ei:
        push(env, h2, p2)
    assert ei.value.code() in (grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.ALREADY_EXISTS)
