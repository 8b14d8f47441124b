"""The dial-out side of Fleet, shared by clients and aggregators.

A node behind NAT only ever opens connections: it joins, long-polls for tasks, pulls
the model (chunked, sha256-checked, cached by hash so an unchanged model is not sent
again, or sent as a delta from the one it holds; see ``orchard.server.downlink``) and
pushes updates (chunked). Transient failures (server restarting, network
gone) are retried with capped exponential backoff and jitter; a server that forgot the
node (it restarted) gets a fresh Join.

A link enrolls its node (docs/operating.md, "Device credentials"): its first Join sends
the node's Ed25519 public key (``orchard.identity.NodeIdentity``, generated on the node,
kept in ``identity_dir``) with the enrollment token, and from the reply on the link
authenticates with the node's own credential, which it keeps there too. A later start
with the same ``identity_dir`` resumes that node: same node id, same credential.
"""

from __future__ import annotations

import asyncio
import logging
import random
from collections import OrderedDict
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import grpc

from orchard import wire
from orchard.errors import JOIN_FIRST, AuthError, IntegrityError, OrchardError, UnknownNodeError
from orchard.identity import (
    Enrolled,
    Enrollment,
    NodeIdentity,
    UpstreamUnavailable,
    enrollment_message,
    hash_secret,
)
from orchard.messages import DroppedUpload, Idle, TaskAssignment, UploadHeader
from orchard.typing import DeviceState, Role
from orchard.v1 import orchard_pb2 as pb
from orchard.v1 import orchard_pb2_grpc as pbg

log = logging.getLogger("orchard.link")
T = TypeVar("T")
# (base blob, delta blob, base sha256, encoding) -> the reconstructed model blob.
DeltaApplier = Callable[[bytes, bytes, str, str], bytes]

RETRYABLE = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.RESOURCE_EXHAUSTED,
             grpc.StatusCode.CANCELLED, grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN}
# Rejoins in a row within one call before the link gives up: a server that forgets a node
# right after each join would otherwise be asked to Join in a tight loop.
MAX_REJOINS = 3


class UploadRefused(OrchardError):
    """The server refused an upload; ``code`` and the message say why."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        self.code = code
        super().__init__(f"{code.name}: {message}")


@dataclass(frozen=True)
class LinkConfig:
    target: str  # HOST:PORT
    role: Role
    token: str | None = None
    ca_cert: Path | None = None  # None with insecure=True: plaintext (loopback development only)
    insecure: bool = False
    node_id: str = ""
    capabilities: tuple[tuple[str, str], ...] = ()
    chunk_bytes: int = wire.DEFAULT_CHUNK_BYTES
    max_backoff_s: float = 30.0
    model_cache_entries: int = 2
    # Extra gRPC channel arguments. gRPC shares one TCP connection among channels with
    # identical arguments in a process; a distinct argument gives a link its own.
    channel_options: tuple[tuple[str, str | int], ...] = ()
    # Where the node keeps its key and credential (mode 0700; files 0600). None: in
    # memory, for this process only.
    identity_dir: Path | None = None
    # The root's Ed25519 certificate key, when known beforehand (a bundle names it): a
    # Join answered with another root key is refused.
    root_public_key: bytes | None = None


def make_channel(target: str, ca_cert: Path | None, insecure: bool,
                 extra: tuple[tuple[str, str | int], ...] = ()) -> grpc.aio.Channel:
    options = [*wire.GRPC_OPTIONS, *extra]
    if insecure:
        return grpc.aio.insecure_channel(target, options=options)
    if ca_cert is None:
        raise AuthError("TLS needs the CA certificate: pass --ca-cert (from `orchard certs init`), "
                        "or --insecure for loopback development")
    creds = grpc.ssl_channel_credentials(root_certificates=Path(ca_cert).read_bytes())
    return grpc.aio.secure_channel(target, creds, options=options)


class FleetLink:
    def __init__(self, cfg: LinkConfig, rng: random.Random | None = None) -> None:
        self.cfg = cfg
        self.identity = NodeIdentity(cfg.identity_dir)
        held = self.identity.enrolled
        if held is not None and cfg.node_id and cfg.node_id != held.node_id:
            raise AuthError(f"{cfg.identity_dir} holds node {held.node_id!r}'s identity, not {cfg.node_id!r}'s: "
                            "drop --node-id or use another data dir")
        self.node_id = held.node_id if held is not None else cfg.node_id
        self._rng = rng or random.Random()
        self._channel = make_channel(cfg.target, cfg.ca_cert, cfg.insecure, cfg.channel_options)
        self._stub = pbg.FleetStub(self._channel)
        self._meta: tuple[tuple[str, str], ...] = ()
        self._use(held.credential if held is not None else cfg.token)
        # model hash -> (the blob held for it, that blob's sha256): they differ when the
        # blob is a reconstruction from a downlink delta.
        self._models: OrderedDict[str, tuple[bytes, str]] = OrderedDict()
        self.joined = False
        self.heartbeat_s = 10.0
        self.long_poll_s = 20.0
        self.bytes_down = 0
        self.bytes_up = 0

    async def close(self) -> None:
        await self._channel.close()

    def _use(self, secret: str | None) -> None:
        self._secret = secret
        self._meta = (("authorization", f"Bearer {secret}"),) if secret else ()

    @property
    def call_metadata(self) -> tuple[tuple[str, str], ...]:
        """The metadata this link's calls carry (its credential), for a caller that makes
        its own calls on the same tier (a load generator)."""
        return self._meta

    @property
    def certificate(self) -> bytes:
        """The root's certificate of this node's key (empty until enrolled)."""
        return self.identity.enrolled.certificate if self.identity.enrolled else b""

    # ------------------------------------------------------------------ retry

    async def _retry(self, what: str, fn: Callable[[], Awaitable[T]], device: DeviceState | None = None,
                     attempts: int | None = None) -> T:
        """Call ``fn`` until it succeeds; rejoin when the server forgot us; back off otherwise."""
        delay = 0.2
        n = rejoins = 0
        while True:
            n += 1
            try:
                return await fn()
            except grpc.aio.AioRpcError as err:
                code = err.code()
                if code == grpc.StatusCode.UNAUTHENTICATED:
                    raise AuthError(f"{what}: {err.details()}") from None
                if code == grpc.StatusCode.NOT_FOUND and (err.details() or "").endswith(JOIN_FIRST):
                    rejoins += 1
                    if rejoins > MAX_REJOINS:
                        raise UnknownNodeError(
                            f"{what}: the server forgot node {self.node_id!r} again right after each of "
                            f"{MAX_REJOINS} rejoins ({err.details()}); its registrations expire at once "
                            "(check the server's node_timeout_s) or another node shares this id"
                        ) from None
                    self.joined = False
                    await self.join(device)
                    continue
                if code not in RETRYABLE or (attempts is not None and n >= attempts):
                    raise
                log.info("%s failed (%s: %s); retrying in %.1fs", what, code.name, err.details(), delay)
                await asyncio.sleep(delay * (0.5 + self._rng.random()))
                delay = min(delay * 2, self.cfg.max_backoff_s)

    # ------------------------------------------------------------------ calls

    async def join(self, device: DeviceState | None = None) -> str:
        try:
            reply = await self._join(device)
        except AuthError:
            held = self.identity.enrolled
            if held is None or not self.cfg.token or self.cfg.token == held.credential:
                raise
            # The credential kept is refused (revoked): a token given now enrolls the node
            # again. The credential is kept until a new one replaces it.
            log.warning("node %s: its credential was refused; enrolling again with the token given", self.node_id)
            self._use(self.cfg.token)
            try:
                reply = await self._join(device, enrolling=True)
            except AuthError:
                self._use(held.credential)
                raise
        self.node_id = reply.node_id
        self.heartbeat_s = reply.heartbeat_s or self.heartbeat_s
        self.long_poll_s = reply.long_poll_s or self.long_poll_s
        self.joined = True
        return self.node_id

    async def _join(self, device: DeviceState | None, enrolling: bool = False) -> pb.JoinReply:
        """One Join (retried on transient failures); enrolls the node's key when it holds
        no credential (or ``enrolling``: with the token given, in place of a refused one)."""
        req = pb.JoinRequest(node_id=self.node_id, role=self.cfg.role.value, device=wire.device_to_proto(device),
                             capabilities=dict(self.cfg.capabilities), device_public_key=self.identity.public_key)
        if (enrolling or self.identity.enrolled is None) and self._secret:
            req.key_proof = self.identity.sign(enrollment_message(self.cfg.role.value, self.node_id, self._secret))

        async def call() -> pb.JoinReply:
            return await self._stub.Join(req, metadata=self._meta)

        reply = await self._retry("join", call)
        pinned = self.cfg.root_public_key
        if pinned and reply.root_public_key and reply.root_public_key != pinned:
            raise AuthError(f"the server answered with root key {reply.root_public_key.hex()[:16]}…, not the "
                            f"{pinned.hex()[:16]}… this node was given: another federation, or an impostor")
        if reply.credential:
            # Kept (on disk, with identity_dir) before it is used: a node never holds a
            # credential it could lose by crashing.
            self.identity.save(Enrolled(reply.node_id, reply.credential, reply.certificate, reply.root_public_key))
            self._use(reply.credential)
        elif reply.certificate:
            self.identity.refresh(reply.certificate, reply.root_public_key)
        return reply

    async def poll(self, device: DeviceState | None = None, pool_size: int = 0,
                   pool_eligible: int = 0, wait_s: float | None = None,
                   dropped: Sequence[DroppedUpload] = ()) -> TaskAssignment | Idle:
        """A task or Idle. ``dropped`` (an aggregator): uploads below that reach no aggregate,
        reported with this poll; they reached the server once this returns."""
        if not self.joined:
            await self.join(device)

        async def call() -> pb.PollReply:
            req = pb.PollRequest(node_id=self.node_id, device=wire.device_to_proto(device), pool_size=pool_size,
                                 pool_eligible=pool_eligible, wait_s=wait,
                                 dropped=[wire.dropped_to_proto(d) for d in dropped])
            return await self._stub.Poll(req, metadata=self._meta, timeout=wait + 15)

        wait = self.long_poll_s if wait_s is None else min(wait_s, self.long_poll_s)

        reply = await self._retry("poll", call, device)
        if reply.WhichOneof("kind") == "task":
            return wire.task_from_proto(reply.task)
        return Idle(reply.idle.retry_after_s, reply.idle.reason)

    async def heartbeat(self, task_id: str, device: DeviceState | None = None, progress: float = 0.0) -> bool:
        try:
            reply = await self._stub.Heartbeat(
                pb.HeartbeatRequest(node_id=self.node_id, device=wire.device_to_proto(device), task_id=task_id,
                                    progress=progress), metadata=self._meta, timeout=10)
        except grpc.aio.AioRpcError as err:
            log.info("heartbeat failed: %s", err.code().name)
            return True  # keep working; the upload will tell
        return bool(reply.task_still_wanted)

    async def pull_model(self, model_hash: str, apply_delta: DeltaApplier | None = None) -> bytes:
        """The model blob for this hash: from the cache, or streamed (resuming after breaks).

        Given ``apply_delta``, the link tells the server which model it holds (the one it
        used last), and the server may answer with a delta from it; the blob returned is
        then the reconstruction, whose sha256 the server states and the link checks. A
        delta that fails any check is dropped and the full model pulled instead. Without
        ``apply_delta`` (aggregators, which serve the exact model on) only full models come.
        """
        hit = self._models.get(model_hash)
        if hit is not None:
            self._models.move_to_end(model_hash)
            return hit[0]
        got: tuple[bytes, str] | None = None  # the blob and its sha256, checked
        if apply_delta is not None and self._models:
            base_blob, base_hash = next(reversed(self._models.values()))
            try:
                got = await self._pull_via_delta(model_hash, base_blob, base_hash, apply_delta)
            except IntegrityError as err:
                log.warning("model delta refused (%s); pulling the full model", err)
        if got is None:
            full, head = await self._stream(model_hash, "")
            if head.delta_from:
                raise IntegrityError("the server sent a delta to a pull that offered no base")
            if wire.sha256_hex(full) != model_hash:
                raise IntegrityError("model blob does not match its sha256; refusing it")
            got = (full, model_hash)
        blob = got[0]
        # Hashed once: a model is as large as anything a device handles.
        self._models[model_hash] = got
        while len(self._models) > self.cfg.model_cache_entries:
            self._models.popitem(last=False)
        return blob

    async def _pull_via_delta(self, model_hash: str, base_blob: bytes, base_hash: str,
                              apply_delta: DeltaApplier) -> tuple[bytes, str]:
        """The model rebuilt from a delta against ``base_blob`` (or the full model, when the
        server chose to send it), with its checked sha256."""
        got, head = await self._stream(model_hash, base_hash)
        if not head.delta_from:  # the server chose the full model
            if wire.sha256_hex(got) != model_hash:
                raise IntegrityError("model blob does not match its sha256")
            return got, model_hash
        if head.delta_from != base_hash or head.target_hash != model_hash:
            raise IntegrityError(f"delta from {head.delta_from[:12]} to {head.target_hash[:12]}, asked from "
                                 f"{base_hash[:12]} to {model_hash[:12]}")
        if wire.sha256_hex(got) != head.blob_sha256:
            raise IntegrityError("model delta does not match its sha256")
        try:
            result = await asyncio.get_running_loop().run_in_executor(
                None, apply_delta, base_blob, got, base_hash, head.encoding)
        except Exception as err:  # whatever a bad delta makes the decoder do, the answer is the same
            raise IntegrityError(f"model delta does not decode: {type(err).__name__}: {err}") from None
        if wire.sha256_hex(result) != head.result_sha256:
            raise IntegrityError("model rebuilt from the delta does not match the hash the server stated")
        return result, head.result_sha256

    async def _stream(self, model_hash: str, have_hash: str) -> tuple[bytes, pb.Chunk]:
        """One PullModel reply, resumed after breaks: its bytes and its first chunk's header."""
        parts: list[bytes] = []
        got = 0
        total = -1
        head: pb.Chunk | None = None

        async def call() -> None:
            nonlocal got, total, head
            stream = self._stub.PullModel(pb.PullModelRequest(node_id=self.node_id, model_hash=model_hash,
                                                              offset=got, have_hash=have_hash), metadata=self._meta)
            async for ch in stream:
                if ch.offset != got:
                    raise IntegrityError(f"model chunk at offset {ch.offset}, expected {got}")
                if head is None:
                    head = pb.Chunk(total_bytes=ch.total_bytes, blob_sha256=ch.blob_sha256, delta_from=ch.delta_from,
                                    target_hash=ch.target_hash, result_sha256=ch.result_sha256,
                                    encoding=ch.encoding)
                elif ch.blob_sha256 != head.blob_sha256:
                    # A resumed stream must continue the same blob (the server changed its answer).
                    raise IntegrityError("model stream changed blobs while resuming")
                parts.append(ch.data)
                got += len(ch.data)
                total = ch.total_bytes
                self.bytes_down += len(ch.data)

        await self._retry("pull model", call)
        blob = b"".join(parts)
        if total >= 0 and len(blob) != total:
            raise IntegrityError(f"model stream ended after {len(blob)} of {total} bytes")
        return blob, head if head is not None else pb.Chunk()

    async def push_update(self, header: UploadHeader, payload: bytes) -> None:
        """Stream header + payload chunks. Raises UploadRefused when the server says no."""

        async def parts() -> AsyncIterator[pb.UploadPart]:
            yield pb.UploadPart(header=wire.header_to_proto(header))
            for _, data in wire.iter_chunks(payload, self.cfg.chunk_bytes):
                yield pb.UploadPart(data=data)

        async def call() -> pb.UploadReply:
            return await self._stub.PushUpdate(parts(), metadata=self._meta)

        try:
            await self._retry("push update", call, attempts=4)
        except grpc.aio.AioRpcError as err:
            raise UploadRefused(err.code(), err.details() or "") from None
        self.bytes_up += len(payload)

    async def secagg(self, t: TaskAssignment, stage: int = 0, message: bytes = b"",
                     header: UploadHeader | None = None, wait_s: float | None = None,
                     client_id: str = "", bytes_down: int = 0) -> pb.SecAggReply:
        """Post one secure-aggregation stage message (or none) and long-poll for the next broadcast.

        An aggregator relaying for a client below it (``secure_aggregation.scope = "tree"``)
        names the client in ``client_id``, ``t`` being its own task, and reports the model
        bytes its tier sent down since its last report in ``bytes_down``."""
        wait = self.long_poll_s if wait_s is None else wait_s
        req = pb.SecAggRequest(node_id=self.node_id, run_id=t.run_id, round=t.round, attempt=t.attempt,
                               task_id=t.task_id, stage=stage, message=message, wait_s=wait,
                               client_id=client_id, bytes_down=bytes_down)
        if header is not None:
            req.header.CopyFrom(wire.header_to_proto(header))

        async def call() -> pb.SecAggReply:
            return await self._stub.SecAgg(req, metadata=self._meta, timeout=wait + 15)

        # A message must not be resent blindly (the server refuses duplicates); polls may be.
        reply: pb.SecAggReply = await self._retry("secure aggregation", call, attempts=None if not message else 3)
        self.bytes_up += len(message)
        self.bytes_down += len(reply.broadcast)
        return reply

    async def secagg_roster(self, t: TaskAssignment, nodes: list[str], tiers: list[str]) -> None:
        """An aggregator reports the clients selected below it for task ``t``'s secure
        session over the whole tree (``tiers``: the lowest tier of each, in order)."""
        req = pb.SecAggRequest(node_id=self.node_id, run_id=t.run_id, round=t.round, attempt=t.attempt,
                               task_id=t.task_id, roster=pb.SecAggRoster(nodes=nodes, tiers=tiers))

        async def call() -> pb.SecAggReply:
            return await self._stub.SecAgg(req, metadata=self._meta, timeout=15)

        # Sent once: the server refuses a second roster for the same task, as a repeated message.
        await self._retry("secure aggregation roster", call, attempts=3)

    async def verify_token(self, token: str, role: Role, *, node_id: str = "", enroll: bool = False,
                           public_key: bytes = b"", key_proof: bytes = b"") -> Enrollment:
        """Ask the upstream about a node's token or credential (``enroll``: forward the
        node's Join, to be enrolled by the root). The root's answer; AuthError with its
        reason when it refuses; UpstreamUnavailable when it cannot be asked."""
        req = pb.VerifyTokenRequest(token=token, role=role.value, node_id=node_id, enroll=enroll,
                                    device_public_key=public_key, key_proof=key_proof)

        async def call() -> pb.VerifyTokenReply:
            return await self._stub.VerifyToken(req, metadata=self._meta, timeout=15)

        try:
            r = await self._retry("verify token", call, attempts=3)
        except grpc.aio.AioRpcError as err:
            raise UpstreamUnavailable(f"cannot ask the upstream about a token: {err.code().name}: "
                                      f"{err.details()}") from None
        if not r.valid:
            raise AuthError(r.reason or "unknown or revoked enrollment token")
        return Enrollment(r.node_id or node_id, hash_secret(r.credential or token), r.credential, r.certificate,
                          r.root_public_key, r.roster_credential)
