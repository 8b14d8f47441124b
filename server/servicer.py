"""gRPC servicers: translate protos to domain objects, call the coordinator, map errors.

No round logic lives here. Every ``OrchardError`` becomes a specific status code with
the error's own message, so a node always learns what was expected and what to do;
anything else is a server bug and becomes INTERNAL without taking the server down.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc

from orchard import wire
from orchard.errors import (
    AuthError,
    CodecError,
    ConfigError,
    DuplicateUploadError,
    FutureModelVersionError,
    IntegrityError,
    InvalidRequestError,
    NotSelectedError,
    OrchardError,
    PayloadTooLargeError,
    RateLimitedError,
    RoundClosedError,
    SecAggError,
    StaleUpdateError,
    StoreError,
    UnknownModelVersionError,
    UnknownNodeError,
    UnknownRunError,
    UpdateSchemaError,
)
from orchard.messages import DroppedUpload, Idle
from orchard.secure_agg import Stage
from orchard.secure_agg.stages import stage_of
from orchard.server import bounds
from orchard.server.auth import Ask, Authenticator, Enrollment, UpstreamUnavailable, bearer_token
from orchard.server.coordinator import Coordinator
from orchard.server.downlink import ModelReply
from orchard.server.ratelimit import JoinLimiter, peer_host
from orchard.server.store import hash_token
from orchard.typing import Role
from orchard.v1 import orchard_pb2 as pb
from orchard.v1 import orchard_pb2_grpc as pbg

log = logging.getLogger("orchard.server")
SERVICE = "orchard.v1.Fleet"

# Most specific first: the first match wins.
STATUS_OF: list[tuple[type[OrchardError], grpc.StatusCode]] = [
    (UpstreamUnavailable, grpc.StatusCode.UNAVAILABLE),  # an aggregator could not ask the root: retry
    (AuthError, grpc.StatusCode.UNAUTHENTICATED),
    (UnknownNodeError, grpc.StatusCode.NOT_FOUND),
    (UnknownRunError, grpc.StatusCode.NOT_FOUND),
    (DuplicateUploadError, grpc.StatusCode.ALREADY_EXISTS),
    (NotSelectedError, grpc.StatusCode.PERMISSION_DENIED),
    # Asynchronous mode's refusals, each its own code (subclasses of RoundClosedError: before it).
    (UnknownModelVersionError, grpc.StatusCode.NOT_FOUND),
    (FutureModelVersionError, grpc.StatusCode.OUT_OF_RANGE),
    (StaleUpdateError, grpc.StatusCode.ABORTED),
    (RoundClosedError, grpc.StatusCode.FAILED_PRECONDITION),
    (PayloadTooLargeError, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (RateLimitedError, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (InvalidRequestError, grpc.StatusCode.INVALID_ARGUMENT),
    (IntegrityError, grpc.StatusCode.DATA_LOSS),
    (UpdateSchemaError, grpc.StatusCode.INVALID_ARGUMENT),
    (CodecError, grpc.StatusCode.INVALID_ARGUMENT),
    (SecAggError, grpc.StatusCode.INVALID_ARGUMENT),
    (ConfigError, grpc.StatusCode.INVALID_ARGUMENT),
    (StoreError, grpc.StatusCode.INTERNAL),
]


def status_for(err: OrchardError) -> grpc.StatusCode:
    for cls, code in STATUS_OF:
        if isinstance(err, cls):
            return code
    return grpc.StatusCode.FAILED_PRECONDITION


def code_for_error_name(name: str) -> grpc.StatusCode | None:
    for cls, code in STATUS_OF:
        if cls.__name__ == name:
            return code
    return None


def trailers(err: OrchardError) -> tuple[tuple[str, str], ...]:
    """A refusal's trailing metadata: when to ask again (``retry-after-s``), if it says."""
    if isinstance(err, RateLimitedError):
        return (("retry-after-s", f"{err.retry_after_s:.3f}"),)
    return ()


def mapped(fn: Callable[..., Awaitable[Any]]) -> Callable[..., Awaitable[Any]]:
    """Map OrchardErrors to status codes for unary handlers."""

    @functools.wraps(fn)
    async def wrapper(self: Any, request: Any, context: grpc.aio.ServicerContext) -> Any:
        try:
            return await fn(self, request, context)
        except OrchardError as err:
            await context.abort(status_for(err), str(err), trailers(err))
        except grpc.aio.AbortError:
            raise
        except Exception:  # a bug must not take the server down; the caller sees INTERNAL
            log.exception("unhandled error in %s", fn.__name__)
            await context.abort(grpc.StatusCode.INTERNAL, f"internal error in {fn.__name__}; see server log")

    return wrapper


def mapped_stream(fn: Callable[..., AsyncIterator[Any]]) -> Callable[..., AsyncIterator[Any]]:
    """The same for server-streaming handlers."""

    @functools.wraps(fn)
    async def wrapper(self: Any, request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
        try:
            async for item in fn(self, request, context):
                yield item
        except OrchardError as err:
            await context.abort(status_for(err), str(err), trailers(err))
        except grpc.aio.AbortError:
            raise
        except Exception:
            log.exception("unhandled error in %s", fn.__name__)
            await context.abort(grpc.StatusCode.INTERNAL, f"internal error in {fn.__name__}; see server log")

    return wrapper


def parse_role(s: str) -> Role:
    try:
        return Role(s)
    except ValueError:
        raise UpdateSchemaError(f"role must be 'client' or 'aggregator', got {s!r}") from None


class FleetServicer(pbg.FleetServicer):
    """Fleet for one tier (root or aggregator): the same servicer at every level."""

    def __init__(self, coordinator: Coordinator, auth: Authenticator,
                 on_join: Callable[[str, Role, str, dict[str, str]], None] | None = None,
                 verify_token_upstream: Ask | None = None, limits: JoinLimiter | None = None,
                 on_dropped: Callable[[str, list[DroppedUpload]], None] | None = None) -> None:
        self.coord = coordinator
        self.auth = auth
        cfg = coordinator.cfg
        self.limits = limits or JoinLimiter(time.monotonic, cfg.join_failures_burst, cfg.join_failures_per_s,
                                            cfg.unpolled_joins_burst, cfg.unpolled_joins_per_s)
        self._on_join = on_join
        self._on_dropped = on_dropped  # an aggregator's report of uploads below that reach no aggregate
        self._verify_upstream = verify_token_upstream
        self._chunks = ChunkCache()

    async def _caller(self, context: grpc.aio.ServicerContext, node_id: str) -> str:
        """The token hash of the caller, checked against the node's registration (and, for
        a credential, against the node id it was issued for)."""
        token = bearer_token(context.invocation_metadata())
        c = self.coord.children.get(node_id)
        if c is None:
            # Authenticate before saying anything about which nodes exist.
            try:
                await self.auth.verify(token, Role.CLIENT, node_id)
            except AuthError:
                await self.auth.verify(token, Role.AGGREGATOR, node_id)
            self.coord.child(node_id)  # raises UnknownNodeError
        token_hash = await self.auth.verify(token, c.role if c else Role.CLIENT, node_id)
        self.coord.child(node_id, token_hash)
        return token_hash

    @mapped
    async def Join(self, request: pb.JoinRequest, context: grpc.aio.ServicerContext) -> pb.JoinReply:
        role = parse_role(request.role)
        device = wire.device_from_proto(request.device)
        bounds.check_join(request.node_id, request.capabilities, device, request.device_public_key, request.key_proof)
        token = bearer_token(context.invocation_metadata())
        peer, cred = peer_host(context.peer()), hash_token(token or "")
        known = self.coord.children.get(request.node_id) if request.node_id else None
        known_now = known is not None and known.token_hash == cred  # a node this tier knows, as it registered
        if not known_now:
            self.limits.check(peer, cred)
        try:
            e = await self.auth.enroll(token, role, request.node_id, request.device_public_key, request.key_proof)
        except AuthError:
            self.limits.failed(peer, cred)
            raise
        prev = self.coord.children.get(e.node_id)
        if e.credential and prev is not None and prev.token_hash != e.token_hash:
            # The root just issued this node id's credential: the registration made with
            # what it held before (a token it exchanged now, a revoked credential) goes.
            self.coord.leave(e.node_id)
        node_id = self.coord.join(e.node_id, role, e.token_hash, device, waiting=False)  # waits once it polls
        if not known_now:
            self.limits.joined(node_id, peer, cred)  # owed until the node polls
        if self._on_join is not None:
            self._on_join(node_id, role, e.token_hash, dict(request.capabilities))
        cfg = self.coord.cfg
        return pb.JoinReply(node_id=node_id, heartbeat_s=cfg.heartbeat_s, long_poll_s=cfg.long_poll_s,
                            max_chunk_bytes=cfg.chunk_bytes, server_id=self.coord.name, credential=e.credential,
                            certificate=e.certificate, root_public_key=e.root_public_key)

    @mapped
    async def Poll(self, request: pb.PollRequest, context: grpc.aio.ServicerContext) -> pb.PollReply:
        device = wire.device_from_proto(request.device)
        bounds.check_poll(request.node_id, device, request.pool_size, request.pool_eligible, request.wait_s)
        dropped = [wire.dropped_from_proto(d) for d in request.dropped]
        bounds.check_dropped(dropped)
        await self._caller(context, request.node_id)
        self.limits.polled(request.node_id)
        if dropped:
            self._dropped(request.node_id, dropped)
        got = await self.coord.poll(request.node_id, device,
                                    request.pool_size, request.pool_eligible, request.wait_s)
        if isinstance(got, Idle):
            return pb.PollReply(idle=pb.Idle(retry_after_s=got.retry_after_s, reason=got.reason))
        return pb.PollReply(task=wire.task_to_proto(got))

    def _dropped(self, node_id: str, dropped: list[DroppedUpload]) -> None:
        c = self.coord.children.get(node_id)
        if c is None or c.role is not Role.AGGREGATOR:
            raise InvalidRequestError("only an aggregator reports dropped uploads in its poll; send none")
        if self._on_dropped is None:
            log.warning("%s reported %d dropped uploads; this tier keeps no record of them", node_id, len(dropped))
        else:
            self._on_dropped(node_id, dropped)

    @mapped
    async def Heartbeat(self, request: pb.HeartbeatRequest, context: grpc.aio.ServicerContext) -> pb.HeartbeatReply:
        device = wire.device_from_proto(request.device)
        bounds.check_heartbeat(request.node_id, device, request.task_id, request.progress)
        await self._caller(context, request.node_id)
        wanted = self.coord.heartbeat(request.node_id, device, request.task_id)
        return pb.HeartbeatReply(task_still_wanted=wanted)

    @mapped_stream
    async def PullModel(self, request: pb.PullModelRequest,
                        context: grpc.aio.ServicerContext) -> AsyncIterator[pb.Chunk | bytes]:
        await self._caller(context, request.node_id)
        reply = await self.coord.model_reply(request.model_hash, request.have_hash)
        blob = reply.blob
        if not 0 <= request.offset <= len(blob):
            raise IntegrityError(f"offset {request.offset} outside the {len(blob)}-byte model")
        chunk_bytes = self.coord.cfg.chunk_bytes
        if request.offset % chunk_bytes == 0:  # every pull but a resumption mid-chunk: chunks serialised once
            for n, msg in self._chunks.get(reply, chunk_bytes)[request.offset // chunk_bytes:]:
                self.coord.count_bytes_down(n)  # as sent: a delta counts its own size
                self.coord.touch(request.node_id)  # a node pulling a large model is alive
                yield msg
            return
        for off, data in wire.iter_chunks(blob, chunk_bytes, request.offset):
            self.coord.count_bytes_down(len(data))
            self.coord.touch(request.node_id)
            yield _chunk(reply, off, data)

    @mapped
    async def PushUpdate(self, request_iterator: AsyncIterator[pb.UploadPart | memoryview],
                         context: grpc.aio.ServicerContext) -> pb.UploadReply:
        first = await anext(aiter(request_iterator), None)
        if not isinstance(first, pb.UploadPart) or first.WhichOneof("part") != "header":
            raise UpdateSchemaError("an upload stream must start with its header")
        header = wire.header_from_proto(first.header)
        await self._caller(context, header.node_id)
        # The upload context admits the header, reserves the slot and releases it on any failure.
        # Staged uploads are bounded: a tier never holds more than max_inflight_uploads payloads.
        with self.coord.upload(header.node_id, header) as slot:
            async with self.coord.upload_slots:
                # Sizes are checked as chunks arrive; the sha256, where the payload is decoded.
                asm = wire.ChunkAssembler(header.total_bytes, None, self.coord.cfg.max_upload_bytes)
                async for part in request_iterator:
                    if isinstance(part, memoryview):  # a data part, as a view of the message (parse_upload_part)
                        asm.add(part)
                    elif part.WhichOneof("part") == "data":
                        asm.add(part.data)
                    else:
                        raise UpdateSchemaError("only data parts may follow the header")
                payload = asm.finish()
                await self.coord.complete_upload(slot, payload)
        return pb.UploadReply(accepted=True)

    @mapped
    async def SecAgg(self, request: pb.SecAggRequest, context: grpc.aio.ServicerContext) -> pb.SecAggReply:
        """A client's exchange; or, from an aggregator below (scope "tree"), a roster report
        or an exchange it relays for one of its clients."""
        await self._caller(context, request.node_id)
        via = request.node_id
        roster = request.roster if request.HasField("roster") else None
        if (roster is not None or request.client_id) and self.coord.child(via).role is not Role.AGGREGATOR:
            raise NotSelectedError(f"{via!r} is not an aggregator: only an aggregator reports a roster or relays "
                                   "secure-aggregation messages for its clients")
        if roster is not None:
            await self.coord.secagg_roster(via, request.run_id, request.round, request.attempt, request.task_id,
                                           list(roster.nodes), list(roster.tiers))
            return pb.SecAggReply()
        header = wire.header_from_proto(request.header) if request.HasField("header") else None
        if request.client_id:
            r = await self.coord.secagg_relayed(
                via, request.run_id, request.round, request.attempt, request.task_id, request.client_id,
                request.stage, request.message, header, request.wait_s, request.bytes_down)
        else:
            r = await self.coord.secagg_exchange(
                request.node_id, request.run_id, request.round, request.attempt, request.task_id, request.stage,
                request.message, header, request.wait_s)
            if r.broadcast and stage_of(r.stage) is Stage.ADVERTISE_KEYS:  # the client vouches for its keys now
                cred = await self.auth.roster_credential(bearer_token(context.invocation_metadata()), request.node_id)
                return pb.SecAggReply(stage=r.stage, broadcast=r.broadcast, roster_credential=cred)
        return pb.SecAggReply(stage=r.stage, broadcast=r.broadcast, done=r.done, aborted=r.aborted)

    @mapped
    async def VerifyToken(self, request: pb.VerifyTokenRequest, context: grpc.aio.ServicerContext) -> pb.VerifyTokenReply:
        """An aggregator below asks about a node's token or credential, or forwards its Join
        (``enroll``). A tier with an upstream asks its own upstream, uncached, so answers
        are the root's however deep the tree."""
        # Only an enrolled aggregator may ask, so the call cannot be used to probe tokens.
        await self.auth.verify(bearer_token(context.invocation_metadata()), Role.AGGREGATOR)
        role = parse_role(request.role)
        try:
            if self._verify_upstream is not None:
                e = await self._verify_upstream(request.token, role, node_id=request.node_id, enroll=request.enroll,
                                                public_key=request.device_public_key, key_proof=request.key_proof)
            elif request.enroll:
                e = await self.auth.enroll(request.token, role, request.node_id, request.device_public_key,
                                           request.key_proof)
            else:
                h = await self.auth.verify(request.token, role, request.node_id)
                cert = self.auth.certificate(request.node_id) if request.node_id else None
                e = Enrollment(request.node_id, h, certificate=cert or b"")
            if self._verify_upstream is None and role is Role.CLIENT and e.node_id:  # the root's own roster
                e = dataclasses.replace(e, roster_credential=await self.auth.roster_credential(None, e.node_id))
        except UpstreamUnavailable:
            raise
        except AuthError as err:
            return pb.VerifyTokenReply(valid=False, reason=str(err))
        return pb.VerifyTokenReply(valid=True, node_id=e.node_id, credential=e.credential, certificate=e.certificate,
                                   root_public_key=e.root_public_key, roster_credential=e.roster_credential)


def _chunk(reply: ModelReply, offset: int, data: bytes) -> pb.Chunk:
    return pb.Chunk(data=data, offset=offset, total_bytes=len(reply.blob), blob_sha256=reply.sha256,
                    delta_from=reply.delta_from, target_hash=reply.target_hash, result_sha256=reply.result_sha256,
                    encoding=reply.encoding)


class ChunkCache:
    """The serialised chunks of the last few model replies a tier streamed.

    Every node of a round pulls the same model (or one of a few deltas): serialising its
    chunks once, not once per node, spares a tier two copies of the model per pull.
    Memory: at most ``entries`` replies, each about the size of its blob (O(model))."""

    def __init__(self, entries: int = 4) -> None:
        self.entries = entries
        self._cache: OrderedDict[tuple[object, ...], list[tuple[int, bytes]]] = OrderedDict()

    def get(self, reply: ModelReply, chunk_bytes: int) -> list[tuple[int, bytes]]:
        """(data bytes, serialised Chunk) for every chunk of ``reply``, in order."""
        key = (reply.sha256, reply.target_hash, reply.delta_from, reply.result_sha256, reply.encoding, chunk_bytes)
        hit = self._cache.get(key)
        if hit is None:
            hit = self._cache[key] = [(len(data), _chunk(reply, off, data).SerializeToString())
                                      for off, data in wire.iter_chunks(reply.blob, chunk_bytes)]
            while len(self._cache) > self.entries:
                self._cache.popitem(last=False)
        else:
            self._cache.move_to_end(key)
        return hit


def add_fleet_servicer(servicer: FleetServicer, server: grpc.aio.Server) -> None:
    """Register Fleet on ``server``: the generated handlers, except for the two bulk
    streams, whose bytes skip a protobuf copy each way. PushUpdate's data parts arrive as
    views of the received messages (:func:`orchard.wire.parse_upload_part`); PullModel
    sends chunks serialised once per model (:class:`ChunkCache`,
    :func:`orchard.wire.serialize_chunk`). The wire format is unchanged."""
    handlers: dict[str, grpc.RpcMethodHandler] = {}

    class _Collect:  # takes the generated registration's handlers, registers nothing
        def add_generic_rpc_handlers(self, generic: Any) -> None:
            pass

        def add_registered_method_handlers(self, service: str, methods: dict[str, grpc.RpcMethodHandler]) -> None:
            handlers.update(methods)

    pbg.add_FleetServicer_to_server(servicer, _Collect())
    handlers["PushUpdate"] = grpc.stream_unary_rpc_method_handler(
        servicer.PushUpdate, request_deserializer=wire.parse_upload_part,
        response_serializer=pb.UploadReply.SerializeToString)
    handlers["PullModel"] = grpc.unary_stream_rpc_method_handler(
        servicer.PullModel, request_deserializer=pb.PullModelRequest.FromString,
        response_serializer=wire.serialize_chunk)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, handlers),))
    server.add_registered_method_handlers(SERVICE, handlers)
