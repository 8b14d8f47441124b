"""Targets for the gRPC services: every Fleet and Control request type through the
servicers' own handlers, in-process, with a context that records how a call ends.

Input layout (both targets): ``selector`` byte (which RPC; for Fleet, bit 3 picks the tier
whose round is secure), ``credential`` byte (which bearer token the caller presents), then
the request: one serialised proto for a unary call, or, for a client stream (PushUpdate,
StartRun), its messages as ``u16 length + bytes`` records (the last one takes what is left).
A stream's messages go through the deserializer the server registers for them.

A call must return a reply or abort with a status the servicer maps from a named error.
It fails the target when it aborts with INTERNAL (what an unexpected exception becomes,
logged with its traceback), raises anything else, or runs past ``HANG_S``.

The harness is a root tier: an in-memory store with tokens of each kind, two joined
clients and a joined aggregator, and an open round (float32 updates of a two-tensor model;
the other tier's round is secure). Its state is rebuilt every ``RESET_EVERY`` inputs (and
when joins have grown it), so a run's memory stays bounded. Three fix-ups let mutated
inputs reach past checks no fuzzer guesses: a Join whose ``key_proof`` is ``b"SIGN"`` is
signed with the harness's device key, a VerifyToken whose ``token`` names a kind
(``"client"``, ``"aggregator"``, ``"device"``) asks about the harness's token of that kind,
and a StartRun whose ``model_sha256`` is ``"SHA"`` gets its model's real digest.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shutil
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import numpy as np

from orchard import wire
from orchard.config import CohortConfig, RunConfig, SecureAggregationConfig, ServerConfig
from orchard.identity import SigningKey, enrollment_message
from orchard.server.auth import StoreAuthenticator
from orchard.server.control import ControlServicer
from orchard.server.coordinator import Coordinator
from orchard.server.decoding import ClientUpdateDecoder
from orchard.server.root import RootRunner
from orchard.server.round import RoundTask
from orchard.server.servicer import FleetServicer
from orchard.server.store import MemoryStore
from orchard.server.tokens import hash_token
from orchard.typing import DeviceState, Role, TensorSpec
from orchard.v1 import orchard_pb2 as pb

HANG_S = 1.0
RESET_EVERY = 500
CLIENTS = ("fuzz-client", "fuzz-client-2")
AGGREGATOR = "fuzz-agg"
SCHEMA = (TensorSpec("w", (4, 3), "float32"), TensorSpec("b", (5,), "float32"))
MODEL = {"w": np.arange(12, dtype=np.float32).reshape(4, 3), "b": np.zeros(5, np.float32)}
BLOB = wire.arrays_to_blob(MODEL)
RUN_ID = "fuzz-run"
DEVICE_KEY = SigningKey.from_bytes(bytes(range(32)))
CREDENTIALS = ("none", "client", "aggregator", "device", "admin", "garbage")


class FuzzBug(AssertionError):
    """A handler ended in a way no caller should see."""


class Aborted(grpc.aio.AbortError):
    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(f"{code.name}: {details}")
        self.code, self.details = code, details


class Context:
    """What a handler reads of its ``grpc.aio.ServicerContext``: the caller's metadata, and
    ``abort``, which raises as gRPC's does."""

    def __init__(self, token: str | None) -> None:
        self._metadata = (("authorization", f"Bearer {token}"),) if token else ()

    def invocation_metadata(self) -> tuple[tuple[str, str], ...]:
        return self._metadata

    def peer(self) -> str:
        return "ipv4:127.0.0.1:50000"  # one caller: the rate limits apply to it as to any

    async def abort(self, code: grpc.StatusCode, details: str = "", trailing_metadata: object = ()) -> None:
        raise Aborted(code, details)


class _Unexpected(logging.Handler):
    """Keeps the traceback the servicer logs when a handler raised something unexpected."""

    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.last = ""

    def emit(self, record: logging.LogRecord) -> None:
        if record.exc_info:
            self.last = "".join(traceback.format_exception(*record.exc_info))


UNEXPECTED = _Unexpected()
_log = logging.getLogger("orchard.server")
_log.addHandler(UNEXPECTED)
_log.propagate = False
_log.setLevel(logging.ERROR)
logging.getLogger("orchard").setLevel(logging.ERROR)


def records(data: bytes) -> list[bytes]:
    """A client stream's messages: ``u16 length + bytes`` records, the last one the rest."""
    out, pos = [], 0
    while pos + 2 <= len(data):
        n = int.from_bytes(data[pos:pos + 2], "big")
        out.append(data[pos + 2:pos + 2 + n])
        pos += 2 + n
    if pos < len(data):
        out.append(data[pos:])
    return out


def stream(messages: list[bytes]) -> bytes:
    """The inverse of :func:`records` (what the seeds use)."""
    return b"".join(len(m).to_bytes(2, "big") + m for m in messages)


async def _aiter(items: list[Any]) -> Any:
    for item in items:
        yield item


class Tier:
    """One root tier with an open round; rebuilt from scratch by :meth:`reset`."""

    def __init__(self, secure: bool) -> None:
        self.secure = secure
        self.loop = asyncio.new_event_loop()
        self.data_dir: Path | None = None
        self.coord: Coordinator | None = None
        self.uses = 0
        self.reset()

    def reset(self) -> None:
        if self.coord is not None:
            self.close()
        self.data_dir = Path(tempfile.mkdtemp(prefix="orchard-fuzz-",
                                              dir="/dev/shm" if os.path.isdir("/dev/shm") else None))
        self.store = MemoryStore()
        self.tokens = {"none": None, "garbage": "orc_not_a_token", "admin": "orc_admin_fuzz",
                       "client": self.store.issue_token("client"),
                       "aggregator": self.store.issue_token("aggregator"),
                       "device": self.store.issue_token("client", device=True)}
        self.auth = StoreAuthenticator(self.store, hash_token(self.tokens["admin"]))
        cfg = ServerConfig(long_poll_s=0.01, node_timeout_s=600, chunk_bytes=1024, max_upload_bytes=1 << 20)
        self.coord = Coordinator("root", cfg, np.random.default_rng(0), ClientUpdateDecoder(), inline=True)
        self.fleet = FleetServicer(self.coord, self.auth,
                                   on_join=lambda n, r, h, caps: self.store.upsert_node(n, r.value, h, caps))
        self.runner = RootRunner(self.coord, self.store, self.data_dir, cfg, start_grace_s=0.0)
        self.control = ControlServicer(self.runner, self.auth)
        for node in CLIENTS:
            self.coord.join(node, Role.CLIENT, hash_token(self.tokens["client"]), DeviceState())
        self.coord.join(AGGREGATOR, Role.AGGREGATOR, hash_token(self.tokens["aggregator"]), DeviceState())
        run = RunConfig(cohort=CohortConfig(target=2, over_selection=1.0),
                        secure_aggregation=SecureAggregationConfig(enabled=self.secure))
        self.task = RoundTask(run_id=RUN_ID, round=1, attempt=0, config=run, config_json=run.model_dump_json(),
                              model_blob=BLOB, model_hash=wire.sha256_hex(BLOB), schema=SCHEMA,
                              deadline_unix=time.time() + 3600, target=2, shared_seed=1)
        self.coord.open_round(self.task)
        self.uses = 0

    def close(self) -> None:
        self.loop.run_until_complete(self._stop_run())
        self.coord.shutdown()
        if self.data_dir is not None:
            shutil.rmtree(self.data_dir, ignore_errors=True)

    async def _stop_run(self) -> None:
        task = self.runner._task  # noqa: SLF001 - a run StartRun began: stopped before the next input
        if task is not None and not task.done():
            task.cancel()
            with contextlib.suppress(BaseException):
                await task

    def call(self, service: str, method: str, request: Any, token: str | None, streaming: bool) -> None:
        """Run ``service.method`` (the servicer of this tier as it is now: a reset replaces it)."""
        self.uses += 1
        if self.uses > RESET_EVERY or len(self.coord.children) > 64:
            self.reset()
        handler = getattr(self.fleet if service == "fleet" else self.control, method)
        UNEXPECTED.last = ""

        async def go() -> None:
            ctx = Context(token)
            if streaming:
                n = 0
                async for _ in handler(request, ctx):
                    n += 1
                    if n > 1024:
                        raise FuzzBug("a server stream sent more than 1024 messages for one small model")
            else:
                await handler(request, ctx)

        try:
            self.loop.run_until_complete(asyncio.wait_for(go(), HANG_S))
        except Aborted as err:
            if err.code is grpc.StatusCode.INTERNAL:
                raise FuzzBug(f"{handler.__name__} aborted with INTERNAL ({err.details}):\n{UNEXPECTED.last}") from None
        except TimeoutError:
            raise FuzzBug(f"{handler.__name__} ran past {HANG_S}s") from None
        finally:
            self.loop.run_until_complete(self._stop_run())


def _parse(cls: Any, raw: bytes) -> Any | None:
    from google.protobuf.message import DecodeError

    try:
        return cls.FromString(raw)
    except DecodeError:
        return None  # gRPC answers INTERNAL "failed to deserialize" before any handler runs


def fleet() -> Callable[[bytes], None]:
    tiers = (Tier(secure=False), Tier(secure=True))

    def one_input(data: bytes) -> None:
        if len(data) < 2:
            return
        tier = tiers[(data[0] >> 3) & 1]
        token = tier.tokens[CREDENTIALS[data[1] % len(CREDENTIALS)]]
        rpc, body = data[0] % 7, data[2:]
        if rpc == 4:  # PushUpdate: the server's own deserializer (the data-part fast path)
            parts = []
            for raw in records(body):
                part = _parse_part(raw)
                if part is None:
                    return
                parts.append(part)
            return tier.call("fleet", "PushUpdate", _aiter(parts), token, streaming=False)
        cls, handler, streaming = FLEET[rpc]
        req = _parse(cls, body)
        if req is None:
            return
        if rpc == 0 and req.key_proof == b"SIGN":
            req.key_proof = DEVICE_KEY.sign(enrollment_message(req.role, req.node_id, token or ""))
        if rpc == 6 and req.token in tier.tokens:
            req.token = tier.tokens[req.token] or ""
        tier.call("fleet", handler, req, token, streaming)

    return one_input


def _parse_part(raw: bytes) -> Any | None:
    from google.protobuf.message import DecodeError

    try:
        return wire.parse_upload_part(raw)
    except DecodeError:
        return None


FLEET = {0: (pb.JoinRequest, "Join", False), 1: (pb.PollRequest, "Poll", False),
         2: (pb.HeartbeatRequest, "Heartbeat", False), 3: (pb.PullModelRequest, "PullModel", True),
         5: (pb.SecAggRequest, "SecAgg", False), 6: (pb.VerifyTokenRequest, "VerifyToken", False)}
CONTROL = {1: (pb.StatusRequest, "Status", False), 2: (pb.ListNodesRequest, "ListNodes", False),
           3: (pb.StopRunRequest, "StopRun", False), 4: (pb.PullGlobalRequest, "PullGlobal", True),
           5: (pb.ListRunsRequest, "ListRuns", False), 6: (pb.RunLogRequest, "RunLog", False)}


def control() -> Callable[[bytes], None]:
    tier = Tier(secure=False)

    def one_input(data: bytes) -> None:
        if len(data) < 2:
            return
        token = tier.tokens[CREDENTIALS[data[1] % len(CREDENTIALS)]]
        rpc, body = data[0] % 7, data[2:]
        if rpc == 0:  # StartRun
            parts = []
            for raw in records(body):
                part = _parse(pb.StartRunPart, raw)
                if part is None:
                    return
                parts.append(part)
            if parts and parts[0].WhichOneof("part") == "header" and parts[0].header.model_sha256 == "SHA":
                model = b"".join(p.data for p in parts[1:])
                parts[0].header.model_sha256 = wire.sha256_hex(model)
            return tier.call("control", "StartRun", _aiter(parts), token, streaming=False)
        cls, handler, streaming = CONTROL[rpc]
        req = _parse(cls, body)
        if req is None:
            return
        tier.call("control", handler, req, token, streaming)

    return one_input


# ------------------------------------------------------------------------------ seeds


def _upload_seed(tier: Tier, node: str) -> bytes:
    from orchard.client.update import build_upload
    from orchard.compression import build_codec
    from orchard.trainer import TrainResult

    a = tier.coord.assign(node)
    assert a is not None, f"{node} is not selected in the harness's round"
    res = TrainResult(arrays={}, weight=2.0, num_examples=2, num_steps=1)
    delta = {k: np.full(v.shape, 0.5, np.float32) for k, v in MODEL.items()}
    h, payload, _ = build_upload(a, tier.task.config, tier.task.config.train, build_codec(tier.task.config.codec),
                                 node, delta, res, seed=0, states=None)
    header = pb.UploadPart(header=wire.header_to_proto(h)).SerializeToString()
    half = len(payload) // 2
    return stream([header, pb.UploadPart(data=payload[:half]).SerializeToString(),
                   pb.UploadPart(data=payload[half:]).SerializeToString()])


def fleet_seeds() -> Iterator[bytes]:
    from orchard.secure_agg import AdvertiseKeys

    plain, secure = Tier(secure=False), Tier(secure=True)
    cred = {name: i for i, name in enumerate(CREDENTIALS)}
    device = wire.device_to_proto(DeviceState(battery_percent=80.0, charging=True, temperature_c=30.0))
    model_hash = plain.task.model_hash
    for tier_bit, c, req in (
        (0, "client", pb.JoinRequest(node_id="fuzz-new", role="client", device=device,
                                     capabilities={"runtime": "torch"})),
        (0, "device", pb.JoinRequest(node_id="fuzz-device", role="client", device_public_key=DEVICE_KEY.public_key,
                                     key_proof=b"SIGN")),
        (0, "aggregator", pb.JoinRequest(node_id="fuzz-agg-2", role="aggregator")),
        (1, "client", pb.PollRequest(node_id=CLIENTS[0], device=device, wait_s=0.0)),
        (2, "client", pb.HeartbeatRequest(node_id=CLIENTS[0], device=device, task_id=f"{RUN_ID}.1.0.0")),
        (3, "client", pb.PullModelRequest(node_id=CLIENTS[0], model_hash=model_hash)),
        (3, "client", pb.PullModelRequest(node_id=CLIENTS[0], model_hash=model_hash, offset=100)),
        (5, "aggregator", pb.SecAggRequest(node_id=AGGREGATOR, run_id=RUN_ID, round=1,
                                           roster=pb.SecAggRoster(nodes=["c"], tiers=[AGGREGATOR]))),
        (6, "aggregator", pb.VerifyTokenRequest(token="client", role="client", node_id=CLIENTS[0])),
        (6, "aggregator", pb.VerifyTokenRequest(token="device", role="client", node_id="fuzz-device", enroll=True)),
    ):
        yield bytes([tier_bit, cred[c]]) + req.SerializeToString()
    yield bytes([4, cred["client"]]) + _upload_seed(plain, CLIENTS[0])
    a = secure.coord.assign(CLIENTS[0])
    assert a is not None
    keys = AdvertiseKeys(b"\x00" * 16, 1, CLIENTS[0], bytes(32), bytes(range(32))).to_bytes()
    for msg, stage in ((b"", 0), (keys, 0)):
        req = pb.SecAggRequest(node_id=CLIENTS[0], run_id=RUN_ID, round=1, task_id=a.task_id, stage=stage,
                               message=msg)
        yield bytes([8 | 5, cred["client"]]) + req.SerializeToString()
    for tier in (plain, secure):
        tier.close()


def control_seeds() -> Iterator[bytes]:
    admin = CREDENTIALS.index("admin")
    cfg = RunConfig(rounds=1).model_dump_json()
    header = pb.StartRunPart(header=pb.StartRunHeader(config_json=cfg, model_bytes=len(BLOB), model_sha256="SHA"))
    yield bytes([0, admin]) + stream([header.SerializeToString(), pb.StartRunPart(data=BLOB).SerializeToString()])
    for rpc, req in ((1, pb.StatusRequest()), (2, pb.ListNodesRequest()), (3, pb.StopRunRequest(run_id="run-x")),
                     (4, pb.PullGlobalRequest(run_id="run-x", round=0)), (5, pb.ListRunsRequest(limit=3)),
                     (6, pb.RunLogRequest(run_id="", after=0, max_lines=10))):
        yield bytes([rpc, admin]) + req.SerializeToString()


SEEDS: dict[str, Callable[[], Iterator[bytes]]] = {"fleet": fleet_seeds, "control": control_seeds}
