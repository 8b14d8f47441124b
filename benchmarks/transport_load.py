"""The child-process side of ``benchmarks/transport.py``: the model and the updates every
process agrees on, the load generator that plays N devices (``--loadgen``), and the bare
gRPC sink the baseline runs against (``--sink``). Both run as ``benchmarks/transport.py``
with those flags; this module only holds their code, apart from the orchestrator that
starts and measures them.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from orchard import wire
from orchard.config import CodecSpec, CohortConfig, RunConfig
from orchard.v1 import orchard_pb2 as pb

NUMEL = 262_144  # float32 elements: 1 MiB
TENSOR = "w"
SEED = 7


# ---------------------------------------------------------------------------- the model and the updates


def base_delta() -> np.ndarray:
    return (np.random.default_rng(SEED).standard_normal(NUMEL) * 1e-3).astype(np.float32)


def initial_model() -> np.ndarray:
    return np.random.default_rng(SEED + 1).standard_normal(NUMEL).astype(np.float32)


def model_blob() -> bytes:
    return wire.arrays_to_blob({TENSOR: initial_model()})


def scale_of(i: int) -> float:
    """Client i sends ``base * scale_of(i)``: distinct updates with a known mean."""
    return 1.0 + (i % 16) / 16.0


def run_config(n: int) -> RunConfig:
    return RunConfig(task="digits", rounds=1, evaluate_every=0, codec=CodecSpec(name="float32"),
                     cohort=CohortConfig(target=n, over_selection=1.0, min_fraction=1.0, deadline_s=120.0,
                                         max_retries=0, weighting="uniform"))


# ---------------------------------------------------------------------------- load generator (child process)
#
# The generator plays N devices as cheaply as it can, so that the servers, not it, bound the
# round: every upload's bytes are encoded once and serialised once, and every client streams
# the same serialised messages (only its small header part is its own); every model pull after
# the first is compared byte for byte with the first, which was verified in full.

PULL = "/orchard.v1.Fleet/PullModel"
PUSH = "/orchard.v1.Fleet/PushUpdate"
VARIANTS = 16  # distinct updates: client i sends base * scale_of(i), and scale_of has period 16


class Uploads:
    """The round's uploads, built once: VARIANTS updates, each encoded by the client's own
    upload builder (:func:`orchard.client.update.build_upload`) and cut into serialised
    ``UploadPart`` data messages once. A client's upload is its own header part followed by
    its variant's data parts: the same ``bytes`` objects for every client, never copied here
    (gRPC copies each message into its send buffer once, as it would any message)."""

    def __init__(self, chunk_bytes: int = wire.DEFAULT_CHUNK_BYTES) -> None:
        self.chunk_bytes = chunk_bytes
        self._key: tuple[str, int, int] | None = None
        self._variants: list[tuple[Any, list[bytes], int]] = []  # (header, data parts, payload bytes)

    def _build(self, t: Any) -> None:
        from orchard.client.update import build_upload
        from orchard.compression import build_codec
        from orchard.trainer import TrainResult

        cfg = RunConfig.model_validate_json(t.config_json)
        codec = build_codec(cfg.codec)
        base = base_delta()
        result = TrainResult(arrays={}, weight=1.0, num_examples=1, num_steps=1)
        self._variants = []
        for k in range(VARIANTS):
            delta = {TENSOR: base * np.float32(scale_of(k))}
            header, payload, _ = build_upload(t, cfg, cfg.train, codec, "", delta, result, seed=k, states=None)
            parts = [pb.UploadPart(data=data).SerializeToString()
                     for _, data in wire.iter_chunks(payload, self.chunk_bytes)]
            self._variants.append((header, parts, len(payload)))
        self._key = (t.run_id, t.round, t.attempt)

    def parts(self, i: int, node_id: str, t: Any) -> tuple[list[bytes], int]:
        """Client ``i``'s upload for task ``t``: its serialised parts and its payload's size."""
        if self._key != (t.run_id, t.round, t.attempt):
            self._build(t)
        header, parts, size = self._variants[i % VARIANTS]
        own = dataclasses.replace(header, node_id=node_id, task_id=t.task_id)
        return [pb.UploadPart(header=wire.header_to_proto(own)).SerializeToString(), *parts], size


class ModelPulls:
    """Model pulls, checked: the first pull of a model is parsed and verified in full (offsets,
    size, sha256 against the model's hash, as :class:`orchard.link.FleetLink` does); every
    later pull must be the same serialised messages, byte for byte (a memcmp, where hashing
    would cost a thousand sha256 passes). Nothing is kept but the first pull."""

    def __init__(self) -> None:
        self._refs: dict[str, asyncio.Future[tuple[list[bytes], int]]] = {}

    async def pull(self, channel: Any, node_id: str, model_hash: str, metadata: Any = ()) -> int:
        """Pull ``model_hash`` over ``channel``; returns the model's size in bytes."""
        call = channel.unary_stream(PULL, request_serializer=pb.PullModelRequest.SerializeToString,
                                    response_deserializer=None)  # raw bytes: compared, not parsed
        req = pb.PullModelRequest(node_id=node_id, model_hash=model_hash)
        ref = self._refs.get(model_hash)
        if ref is None:
            fut = self._refs[model_hash] = asyncio.get_running_loop().create_future()
            try:
                msgs = [m async for m in call(req, metadata=metadata)]
                fut.set_result((msgs, _verify_model(msgs, model_hash)))
            except BaseException as err:
                fut.set_exception(RuntimeError(f"the reference pull failed: {err}"))
                raise
            return fut.result()[1]
        msgs, size = await asyncio.shield(ref)
        k = 0
        async for m in call(req, metadata=metadata):
            if k >= len(msgs) or m != msgs[k]:
                raise RuntimeError(f"model pull differs from the verified pull at message {k}")
            k += 1
        if k != len(msgs):
            raise RuntimeError(f"model pull ended after {k} of {len(msgs)} messages")
        return size


def _verify_model(msgs: list[bytes], model_hash: str) -> int:
    data, off, total = bytearray(), 0, -1
    for m in msgs:
        ch = pb.Chunk.FromString(m)
        if ch.offset != off:
            raise RuntimeError(f"model chunk at offset {ch.offset}, expected {off}")
        data += ch.data
        off += len(ch.data)
        total = ch.total_bytes
    if off != total or wire.sha256_hex(data) != model_hash:
        raise RuntimeError(f"model pull of {off} bytes (of {total}) does not match its sha256")
    if off < NUMEL * 4:
        raise RuntimeError(f"model blob of {off} bytes is smaller than the tensor")
    return off


def _channel(target: str, connection: int, ca_cert: Path | None):
    """A channel with its own TCP connection: gRPC shares one connection among all channels
    of a process whose arguments are equal, so each connection index is a channel argument.
    (A FleetLink built with the same argument shares this channel's connection.) TLS with
    ``ca_cert``, plaintext without."""
    from orchard import link as link_mod

    return link_mod.make_channel(target, ca_cert, ca_cert is None, (("orchard.bench.connection", connection),))


async def _push(channel: Any, parts: list[bytes], metadata: Any = ()) -> None:
    call = channel.stream_unary(PUSH, request_serializer=None, response_deserializer=pb.UploadReply.FromString)
    reply = await call(iter(parts), metadata=metadata)
    if not reply.accepted:
        raise RuntimeError("upload not accepted")


async def _one_client(i: int, target: str, connection: int, uploads: Uploads, pulls: ModelPulls,
                      t: dict[str, Any], joined: asyncio.Queue, ca_cert: Path | None, token: str | None) -> None:
    """One device against an Orchard tier: join and long-poll with the real client link,
    then pull the model and push its update over the same connection."""
    from orchard import link as link_mod
    from orchard.messages import TaskAssignment
    from orchard.typing import Role

    link = link_mod.FleetLink(link_mod.LinkConfig(
        target=target, role=Role.CLIENT, insecure=ca_cert is None, ca_cert=ca_cert, token=token,
        node_id=f"bench-{i:05d}", max_backoff_s=2.0, channel_options=(("orchard.bench.connection", connection),)))
    channel = _channel(target, connection, ca_cert)
    try:
        await link.join()
        t["joined"] = time.time()
        joined.put_nowait(i)
        while True:
            got = await link.poll()
            if isinstance(got, TaskAssignment):
                break
        t["task"] = time.time()
        t["bytes_down"] = await pulls.pull(channel, link.node_id, got.model_hash, link.call_metadata)
        t["pulled"] = time.time()
        parts, t["bytes_up"] = uploads.parts(i, link.node_id, got)
        t["push_start"] = time.time()
        await _push(channel, parts, link.call_metadata)
        t["pushed"] = time.time()
    finally:
        await channel.close()
        await link.close()


def _baseline_task(n: int) -> Any:
    """The task a baseline client 'receives': the same run config, schema and model as the
    Orchard round, so its upload is the same bytes."""
    from orchard.messages import TaskAssignment
    from orchard.typing import TensorSpec

    blob = model_blob()
    return TaskAssignment(run_id="baseline", round=1, attempt=0, task_id="", model_hash=wire.sha256_hex(blob),
                          model_bytes=len(blob), config_json=run_config(n).model_dump_json(),
                          schema=(TensorSpec(TENSOR, (NUMEL,), "float32"),), deadline_unix=0.0, cohort_target=n,
                          shared_seed=0)


async def _one_baseline_client(i: int, target: str, connection: int, uploads: Uploads, pulls: ModelPulls,
                               task: Any, t: dict[str, Any], joined: asyncio.Queue, go: asyncio.Event,
                               ca_cert: Path | None) -> None:
    """One device against the bare gRPC sink: connect, wait for the start, then the same pull
    and push as :func:`_one_client`."""
    channel = _channel(target, connection, ca_cert)
    try:
        await channel.channel_ready()
        t["joined"] = time.time()
        joined.put_nowait(i)
        await go.wait()
        t["task"] = time.time()
        node_id = f"bench-{i:05d}"
        t["bytes_down"] = await pulls.pull(channel, node_id, task.model_hash)
        t["pulled"] = time.time()
        parts, t["bytes_up"] = uploads.parts(i, node_id, dataclasses.replace(task, task_id=f"task-{i}"))
        t["push_start"] = time.time()
        await _push(channel, parts)
        t["pushed"] = time.time()
    finally:
        await channel.close()


async def _loadgen(target: str, n: int, connections: int, timeout_s: float, baseline: bool,
                   ca_cert: Path | None = None, tokens: list[str] | None = None) -> dict[str, Any]:
    times: list[dict[str, Any]] = [{} for _ in range(n)]
    joined: asyncio.Queue[int] = asyncio.Queue()
    uploads, pulls, go = Uploads(), ModelPulls(), asyncio.Event()
    task = _baseline_task(n) if baseline else None

    async def guarded(i: int) -> None:
        try:
            if baseline:
                client = _one_baseline_client(i, target, i % connections, uploads, pulls, task, times[i], joined, go,
                                              ca_cert)
            else:
                client = _one_client(i, target, i % connections, uploads, pulls, times[i], joined, ca_cert,
                                     tokens[i] if tokens else None)
            await asyncio.wait_for(client, timeout_s)
        except Exception as err:  # reported per client; the benchmark counts failures
            times[i]["error"] = f"{type(err).__name__}: {err}"[:300]
            if "joined" not in times[i]:
                joined.put_nowait(i)  # a client that failed before joining must not stall the start

    tasks = [asyncio.create_task(guarded(i)) for i in range(n)]
    for _ in range(n):
        await joined.get()
    # The orchestrator waits for this line before it starts the run; CPU from here on is the round's.
    cpu_joined = time.process_time()
    print(f"JOINED {n}", flush=True)
    if baseline:  # the sink has no round to open: the orchestrator says when to start
        await asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline)
        go.set()
    await asyncio.gather(*tasks)
    return {"clients": times, "round_cpu_seconds": time.process_time() - cpu_joined}


def loadgen_main(target: str, n: int, connections: int, report: Path, timeout_s: float, baseline: bool,
                 ca_cert: Path | None = None, tokens: list[str] | None = None) -> None:
    report.write_text(json.dumps(asyncio.run(_loadgen(target, n, connections, timeout_s, baseline, ca_cert,
                                                      tokens))))


# ---------------------------------------------------------------------------- baseline: a bare gRPC sink (child process)


async def _sink(port_file: Path, tls_dir: Path | None = None) -> None:
    """The floor any gRPC Python server pays for the round's bytes: it serves the model as
    pre-serialised chunks and takes uploads as raw messages, counting their bytes, with the
    tiers' own server options and, with ``tls_dir``, the tiers' own TLS credentials. No
    parsing, no checks, no sums."""
    import signal

    import grpc

    blob = model_blob()
    sha = wire.sha256_hex(blob)
    chunks = [pb.Chunk(data=d, offset=off, total_bytes=len(blob), blob_sha256=sha).SerializeToString()
              for off, d in wire.iter_chunks(blob, wire.DEFAULT_CHUNK_BYTES)]
    reply = pb.UploadReply(accepted=True).SerializeToString()
    received = [0]

    async def pull(request: bytes, context: Any):
        for c in chunks:
            yield c

    async def push(request_iterator: Any, context: Any) -> bytes:
        async for part in request_iterator:
            received[0] += len(part)
        return reply

    server = grpc.aio.server(options=wire.SERVER_GRPC_OPTIONS)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("orchard.v1.Fleet", {
        "PullModel": grpc.unary_stream_rpc_method_handler(pull),
        "PushUpdate": grpc.stream_unary_rpc_method_handler(push)}),))
    if tls_dir is not None:
        from orchard.server.tls import TlsPaths, server_credentials

        port = server.add_secure_port("127.0.0.1:0", server_credentials(TlsPaths.in_dir(tls_dir)))
    else:
        port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    port_file.write_text(str(port))
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    await server.stop(1.0)
