"""The native client (orchard-device, over the C ABI) against a Fleet server that
misbehaves on purpose: one that breaks the model stream part way (the pull resumes at
the byte it broke at), one that stops for good mid-stream or in the middle of a long
poll (a status and a message, no crash), and tasks and bundles of another schema (each
refused with a message that says what was expected).

The server is a scripted Fleet servicer on loopback, port 0: only the misbehaviour is
scripted, the model, task, config and the decoding of the update are Orchard's own."""

from __future__ import annotations

import json
import subprocess
import threading
from concurrent import futures
from dataclasses import dataclass, field
from pathlib import Path

import device_native
import device_vectors
import grpc
import numpy as np
import pytest

from orchard import wire
from orchard.compression import build_codec, decode_update
from orchard.config import CodecSpec, CohortConfig, RunConfig
from orchard.trainer import TrainConfig
from orchard.v1 import orchard_pb2 as pb
from orchard.v1 import orchard_pb2_grpc as pbg

REASON = device_native.skip_reason()
pytestmark = [pytest.mark.skipif(REASON is not None, reason=REASON or ""), pytest.mark.timeout(1200)]

# include/orchard_device.h
ERR_PROGRAM, ERR_UNAVAILABLE, ERR_REFUSED, ERR_PROTOCOL = 6, 11, 13, 14
CHUNK = 512


@pytest.fixture(scope="module")
def command() -> Path:
    return device_native.build_or_fail().path("orchard-device")


@dataclass
class LoraBundle:
    path: Path
    arrays: dict[str, np.ndarray]
    text: Path
    params: dict[str, object]


@pytest.fixture(scope="module")
def lora(tmp_path_factory: pytest.TempPathFactory) -> LoraBundle:
    from orchard.edge_runtime.task_bundle import write_task_bundle
    from orchard.tasks import get_task

    tmp = tmp_path_factory.mktemp("faults")
    task = get_task("shakespeare", **{**device_vectors.SMALL_TASK, "lora_variant": "full"})
    arrays = task.initial_arrays(0)
    b = tmp / "bundle"
    write_task_bundle(b, task=task, server_address="127.0.0.1:1", global_arrays=arrays,
                      enrollment_token="scripted-server-token", micro_batch=4)
    chars = json.loads((b / "tokenizer.json").read_text())["chars"]
    (tmp / "text.txt").write_text("".join(np.random.default_rng(3).choice(chars, size=1500)))
    return LoraBundle(b, arrays, tmp / "text.txt", dict(task.params))


@dataclass
class Script:
    """What the server does wrong: break the model stream after `break_after` chunks,
    `breaks` times (-1: every time); `stop`: stop the whole server at that point, or
    during the first long poll (`stop_in_poll`)."""

    break_after: int = 1
    breaks: int = 0
    stop: bool = False
    stop_in_poll: bool = False
    offsets: list[int] = field(default_factory=list)
    uploads: list[tuple[pb.UploadHeader, bytes]] = field(default_factory=list)


class ScriptedFleet(pbg.FleetServicer):
    def __init__(self, task: pb.TaskSpec, blob: bytes, script: Script, stop: threading.Event) -> None:
        self.task, self.blob, self.script, self._stop = task, blob, script, stop
        self.handed = False

    def Join(self, request, context):  # noqa: N802 (gRPC's names)
        return pb.JoinReply(node_id=request.node_id or "scripted-1", heartbeat_s=5, long_poll_s=2,
                            max_chunk_bytes=CHUNK)

    def Poll(self, request, context):  # noqa: N802
        if self.script.stop_in_poll:
            self._stop.set()
            threading.Event().wait(request.wait_s or 2)
            return pb.PollReply(idle=pb.Idle(retry_after_s=1))
        if self.handed:
            return pb.PollReply(idle=pb.Idle(retry_after_s=1, reason="no task"))
        self.handed = True
        return pb.PollReply(task=self.task)

    def Heartbeat(self, request, context):  # noqa: N802
        return pb.HeartbeatReply(task_still_wanted=True)

    def PullModel(self, request, context):  # noqa: N802
        s = self.script
        s.offsets.append(request.offset)
        sha = wire.sha256_hex(self.blob)
        for n, (off, data) in enumerate(wire.iter_chunks(self.blob, CHUNK, request.offset)):
            if n == s.break_after and s.breaks != 0:
                s.breaks -= 1
                if s.stop:
                    self._stop.set()
                    threading.Event().wait(5)
                context.abort(grpc.StatusCode.UNAVAILABLE, "the server is going away")
            yield pb.Chunk(data=data, offset=off, total_bytes=len(self.blob), blob_sha256=sha)

    def PushUpdate(self, request_iterator, context):  # noqa: N802
        header, data = None, bytearray()
        for part in request_iterator:
            if part.HasField("header"):
                header = part.header
            else:
                data += part.data
        self.script.uploads.append((header, bytes(data)))
        return pb.UploadReply(accepted=True)


def _task(lora: LoraBundle, codec: CodecSpec, schema: list[pb.TensorSpec] | None = None) -> tuple[pb.TaskSpec, bytes]:
    blob = wire.arrays_to_blob(lora.arrays)
    cfg = RunConfig(task="shakespeare", task_params=lora.params, rounds=1, codec=codec,
                    cohort=CohortConfig(target=1, min_fraction=1.0),
                    train=TrainConfig(batch_size=4, steps=2, learning_rate=0.5))
    arrays = wire.blob_to_arrays(blob)
    specs = schema or [pb.TensorSpec(name=k, shape=list(v.shape), dtype="float32") for k, v in arrays.items()]
    return pb.TaskSpec(run_id="run-faults", round=1, attempt=0, task_id="task-1", model_hash=wire.sha256_hex(blob),
                       model_bytes=len(blob), config_json=cfg.model_dump_json(), schema=specs,
                       deadline_unix=4e9), blob


def _serve(command: Path, lora: LoraBundle, script: Script, *, codec: CodecSpec | None = None,
           schema: list[pb.TensorSpec] | None = None, attempts: int = 3) -> subprocess.CompletedProcess[str]:
    task, blob = _task(lora, codec or CodecSpec(name="float32"), schema)
    stop = threading.Event()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    pbg.add_FleetServicer_to_server(ScriptedFleet(task, blob, script, stop), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    stopper = threading.Thread(target=lambda: (stop.wait(), server.stop(0)), daemon=True)
    stopper.start()
    try:
        return subprocess.run([str(command), str(lora.path), "--server", f"127.0.0.1:{port}", "--insecure",
                               "--attempts", str(attempts), "--data", str(lora.text), "--wait", "30"],
                              capture_output=True, text=True, timeout=300)
    finally:
        stop.set()
        stopper.join(10)


def _decoded(header: pb.UploadHeader, payload: bytes, codec: CodecSpec) -> dict[str, np.ndarray]:
    payloads, at = {}, 0
    for spec, size in zip(header.schema, header.payload_sizes, strict=True):
        payloads[spec.name] = payload[at:at + size]
        at += size
    assert at == len(payload)
    shapes = {s.name: tuple(s.shape) for s in header.schema}
    return decode_update(build_codec(codec), payloads, shapes)


@pytest.mark.parametrize("codec", [CodecSpec(name="float32"),
                                   CodecSpec(name="qsgd", params={"bits": 8, "block": 256})], ids=["float32", "qsgd8"])
def test_a_broken_model_stream_resumes_where_it_broke(command: Path, lora: LoraBundle, codec: CodecSpec) -> None:
    script = Script(break_after=2, breaks=2)
    res = _serve(command, lora, script, codec=codec)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "uploaded steps=2" in res.stdout, res.stdout
    # Two breaks after two chunks each: the pull asked from 0, then from where each broke.
    assert script.offsets == [0, 2 * CHUNK, 4 * CHUNK], script.offsets
    (header, payload), = script.uploads
    assert header.codec == codec.name and header.num_steps == 2
    update = _decoded(header, payload, codec)
    assert set(update) == set(lora.arrays)
    assert all(np.isfinite(v).all() for v in update.values())
    assert any(np.abs(v).max() > 0 for v in update.values())  # it trained from the model it pulled


def test_a_server_that_stops_mid_stream_is_reported(command: Path, lora: LoraBundle) -> None:
    script = Script(break_after=1, breaks=-1, stop=True)
    res = _serve(command, lora, script, attempts=2)
    assert res.returncode == ERR_UNAVAILABLE, res.stdout + res.stderr
    assert "ORCHARD_ERR_UNAVAILABLE: pull model: the server is unreachable or stopped answering" in res.stderr
    assert script.uploads == []


def test_a_server_that_stops_during_the_long_poll_is_reported(command: Path, lora: LoraBundle) -> None:
    res = _serve(command, lora, Script(stop_in_poll=True), attempts=2)
    assert res.returncode == ERR_UNAVAILABLE, res.stdout + res.stderr
    assert "ORCHARD_ERR_UNAVAILABLE: poll: the server is unreachable or stopped answering" in res.stderr


def test_a_task_whose_schema_does_not_match_the_program_is_refused(command: Path, lora: LoraBundle) -> None:
    """A run of another model: its schema and model agree with each other, not with the
    bundle's program (one tensor one element longer)."""
    name = next(iter(lora.arrays))
    other = dict(lora.arrays)
    other[name] = np.zeros(other[name].size + 1, np.float32)
    script = Script()
    res = _serve(command, LoraBundle(lora.path, other, lora.text, lora.params), script)
    assert res.returncode == ERR_REFUSED, res.stdout + res.stderr
    assert f"tensor '{name}' shape [{other[name].size}], the bundle's training program trains" in res.stderr
    assert script.uploads == []


def test_a_schema_that_does_not_describe_the_model_sent_is_refused(command: Path, lora: LoraBundle) -> None:
    name, value = next(iter(lora.arrays.items()))
    wrong = [pb.TensorSpec(name=k, shape=list(v.shape), dtype="float32") for k, v in lora.arrays.items()]
    wrong[0] = pb.TensorSpec(name=name, shape=[value.size + 1], dtype="float32")
    script = Script()
    res = _serve(command, lora, script, schema=wrong)
    assert res.returncode == ERR_PROTOCOL, res.stdout + res.stderr
    assert f"the task's schema gives tensor '{name}' shape [{value.size + 1}], the model blob holds" in res.stderr
    assert script.uploads == []


@pytest.mark.parametrize(("file", "key"), [("client.json", "format_version"),
                                           ("train_program.json", "format_version")])
def test_a_bundle_of_another_schema_version_is_refused(command: Path, lora: LoraBundle, tmp_path: Path,
                                                       file: str, key: str) -> None:
    import shutil

    b = tmp_path / "other-version"
    shutil.copytree(lora.path, b)
    data = json.loads((b / file).read_text())
    data[key] = 99
    (b / file).write_text(json.dumps(data))
    if file != "client.json":  # a consistent bundle whose manifest is of another version
        cfg = json.loads((b / "client.json").read_text())
        from orchard.edge_runtime.bundle import file_sha256
        cfg["training_program"]["sha256"] = file_sha256(b / file)
        (b / "client.json").write_text(json.dumps(cfg))
    res = subprocess.run([str(command), str(b)], capture_output=True, text=True, timeout=60)
    assert res.returncode in (4, ERR_PROGRAM), res.stderr
    assert f"{file} has format_version 99; this client reads 1" in res.stderr, res.stderr


def test_a_program_of_another_kind_is_refused_naming_the_kind(command: Path, lora: LoraBundle, tmp_path: Path) -> None:
    """A classification program (a task over rows of features) is not misread as a text
    one: the native trainer feeds token windows only, so the bundle is refused at open."""
    import shutil

    from orchard.edge_runtime.bundle import file_sha256

    b = tmp_path / "other-kind"
    shutil.copytree(lora.path, b)
    data = json.loads((b / "train_program.json").read_text())
    data["kind"] = "classification"
    (b / "train_program.json").write_text(json.dumps(data))
    cfg = json.loads((b / "client.json").read_text())
    cfg["training_program"]["sha256"] = file_sha256(b / "train_program.json")
    (b / "client.json").write_text(json.dumps(cfg))
    res = subprocess.run([str(command), str(b)], capture_output=True, text=True, timeout=60)
    assert res.returncode == ERR_REFUSED, res.stderr
    assert 'holds a training program of kind "classification"; this client trains "next_token" programs only' \
        in res.stderr, res.stderr
