"""The coordinator: the one piece of round logic that every tier runs.

A root is a coordinator whose rounds come from a run (``orchard.server.root``); an
aggregator is a coordinator whose rounds come from its upstream and whose results go
back up (``orchard.server.aggregator``). A tree of any depth is configuration.

Per round a coordinator:
  1. splits its target among live, eligible children (aggregators get a share of the
     target in proportion to their eligible pool; direct clients are over-selected,
     ``ceil(share * over_selection)``, so stragglers do not hold the round);
  2. hands out task assignments when selected children long-poll;
  3. checks each upload's header against the round before reading a byte of payload
     (``orchard.server.admission``: round, attempt, selection, duplicates, schema,
     sizes, weight), then checks the payload (sha256, decode -- or, summing in the
     compressed domain, parse -- and finite values) before anything is folded;
  4. folds accepted uploads into its round's sums (``orchard.server.cohort``: one
     float64 accumulator, O(model) memory, or the compressed-domain sum, or the secure
     cohort's unmasked sum), one fold at a time;
  5. closes when the target is reached, when every selected child has delivered or
     dropped, or at the deadline, and returns a ``RoundOutcome``.

Concurrency: everything here runs on the server's asyncio loop. State is mutated only
between awaits, so no lock guards it; CPU-heavy decode and fold run in executors and
their results are applied back on the loop. Nothing here awaits a network send while
round state is half-updated.

In-process use (the simulator, tests). A coordinator built with ``inline=True`` runs
decode and fold on the caller's thread: the same coroutines then finish without ever
suspending, and :meth:`Coordinator.upload_now` and :meth:`Coordinator.secagg_now` drive
them to the end synchronously. The simulator is one more transport over this class,
not a second implementation of it.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import math
import time
import uuid
from collections.abc import Awaitable, Callable, Coroutine, Generator, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, TypeVar

import numpy as np

from orchard.aggregation import MetricSums, Partial
from orchard.compression import sums_compressed
from orchard.config import RunConfig, ServerConfig
from orchard.errors import (
    IntegrityError,
    OrchardError,
    RoundClosedError,
    SecAggAbort,
    SecAggError,
    UnknownNodeError,
    UpdateSchemaError,
)
from orchard.messages import Idle, TaskAssignment, UploadHeader, UploadKind
from orchard.secure_agg import Stage
from orchard.secure_agg.stages import stage_index as stage_index_of
from orchard.secure_agg.stages import stage_of
from orchard.server.admission import admit_header, check_assignment, check_round
from orchard.server.cohort import Assignment, CheckedUpload, CohortRound, CompressedCohort
from orchard.server.downlink import DownlinkCache, ModelReply, full_reply
from orchard.server.round import RoundOutcome, RoundTask
from orchard.server.secagg import new_cohort
from orchard.server.selection import allocate, device_eligible, over_select
from orchard.typing import DeviceState, NDArrays, Role
from orchard.updates import decode_partial
from orchard.wire import sha256_hex

T = TypeVar("T")

# Decodes a client's payload into a float32 delta (codec-specific; see orchard.server.decoding).
ClientDecoder = Callable[[UploadHeader, bytes, RoundTask], NDArrays]


@dataclass
class Child:
    node_id: str
    role: Role
    token_hash: str
    device: DeviceState = field(default_factory=DeviceState)
    last_seen: float = 0.0  # monotonic seconds
    pool_size: int = 1
    pool_eligible: int = 1


@dataclass
class UploadSlot:
    header: UploadHeader
    cohort: CohortRound
    assignment: Assignment


@dataclass(frozen=True)
class SecAggReply:
    """What a node learns from one secure-aggregation exchange."""

    stage: int  # the session's current stage index
    broadcast: bytes  # the broadcast this node must answer, or b""
    done: bool
    aborted: str  # why the session aborted, or ""


class _Ready:
    """An awaitable that is already done: an inline coordinator's offloaded work."""

    __slots__ = ("value",)

    def __init__(self, value: Any) -> None:
        self.value = value

    def __await__(self) -> Generator[Any, None, Any]:
        return self.value
        yield  # a generator that returns at once: awaiting it never suspends


def run_inline(coro: Coroutine[Any, Any, T]) -> T:
    """Drive a coroutine of an inline coordinator to its end on this thread. It must not
    suspend (an inline coordinator's offloaded work is already done when awaited)."""
    try:
        coro.send(None)
    except StopIteration as stop:
        return stop.value  # type: ignore[no-any-return]
    coro.close()
    raise RuntimeError("an in-process coordinator call had to wait; only inline coordinators run in-process")


class Coordinator:
    def __init__(self, name: str, cfg: ServerConfig, rng: np.random.Generator,
                 client_decoder: ClientDecoder, monotonic: Callable[[], float] = time.monotonic,
                 wall: Callable[[], float] = time.time, inline: bool = False,
                 noise_rng: np.random.Generator | None = None) -> None:
        self.name = name
        # inline: decode and fold on the caller's thread (in-process use, see the module doc).
        self.inline = inline
        # Central DP noise at the root: OS entropy unless the caller (a seeded simulation)
        # passes a generator; never the seeded selection generator.
        self.noise_rng = noise_rng if noise_rng is not None else np.random.default_rng()
        self.cfg = cfg
        self.rng = rng
        self._decode_client = client_decoder
        self._mono = monotonic
        self._wall = wall
        self.children: dict[str, Child] = {}
        self.current: CohortRound | None = None
        # Long-pollers wait on the current event; a change sets it and installs a fresh one,
        # so waiting needs no lock and a timeout cannot leave one half-held.
        self._changed = asyncio.Event()
        self._changed_watched = False  # whether a waiter holds _changed (else there is no one to wake)
        self._ids = itertools.count()
        # One fold at a time (the accumulator is not thread-safe); decoding runs beside it.
        self._fold_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="orchard-fold")
        self._decode_pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="orchard-decode")
        self.upload_slots = asyncio.Semaphore(cfg.max_inflight_uploads)
        # Models nodes below may hold, for downlink deltas (orchard.server.downlink).
        self.downlink = DownlinkCache()
        self.counters: dict[str, int] = {"uploads_accepted": 0, "uploads_rejected": 0, "bytes_up": 0,
                                         "bytes_down": 0, "rounds_closed": 0}

    # ------------------------------------------------------------------ registry

    def join(self, node_id: str, role: Role, token_hash: str, device: DeviceState) -> str:
        node_id = node_id or f"{role.value}-{uuid.uuid4().hex[:12]}"
        prev = self.children.get(node_id)
        if prev is not None and prev.token_hash != token_hash:
            # A node id is bound to the credential that first claimed it.
            raise UnknownNodeError(f"node id {node_id!r} is registered with another token; pick another id")
        self.children[node_id] = Child(node_id, role, token_hash, device, self._mono(),
                                       pool_size=0 if role is Role.AGGREGATOR else 1,
                                       pool_eligible=0 if role is Role.AGGREGATOR else 1)
        self._notify()
        return node_id

    def child(self, node_id: str, token_hash: str | None = None) -> Child:
        c = self.children.get(node_id)
        if c is None:
            raise UnknownNodeError(f"node {node_id!r} has not joined this server (or expired); call Join first")
        if token_hash is not None and c.token_hash != token_hash:
            raise UnknownNodeError(f"node {node_id!r} is registered with another token")
        return c

    def touch(self, node_id: str, device: DeviceState | None = None, pool_size: int | None = None,
              pool_eligible: int | None = None) -> Child:
        c = self.child(node_id)
        c.last_seen = self._mono()
        if device is not None:
            c.device = device
        if c.role is Role.AGGREGATOR:
            if pool_size is not None:
                c.pool_size = max(0, int(pool_size))
            if pool_eligible is not None:
                c.pool_eligible = max(0, min(int(pool_eligible), c.pool_size))
        return c

    def live(self, c: Child) -> bool:
        return self._mono() - c.last_seen <= self.cfg.node_timeout_s

    def capacity(self, cfg: RunConfig | None = None) -> tuple[int, int]:
        """(live clients below this tier, eligible clients below this tier)."""
        size = elig = 0
        for c in self.children.values():
            if not self.live(c):
                continue
            if c.role is Role.AGGREGATOR:
                size += c.pool_size
                elig += c.pool_eligible
            else:
                size += 1
                elig += int(cfg is None or device_eligible(c.device, cfg.eligibility)[0])
        return size, elig

    def expire_children(self) -> None:
        """Forget nodes unseen for a long time (10 x timeout): bounds the registry."""
        now = self._mono()
        for nid in [n for n, c in self.children.items() if now - c.last_seen > 10 * self.cfg.node_timeout_s]:
            if self.current is None or nid not in self.current.assignments:
                del self.children[nid]

    def leave(self, node_id: str) -> None:
        """A node goes away now (a simulated device at the end of its round; a client that
        says goodbye). An assignment it holds in the open round stays, and is dropped by
        the sweep like any silent node's."""
        self.children.pop(node_id, None)

    # ------------------------------------------------------------------ rounds

    def open_round(self, task: RoundTask) -> CohortRound:
        if self.current is not None and not self.current.closed:
            self.close_round(self.current, "superseded by a new round")
        prev = self.current
        if task.config.downlink_delta and prev is not None and prev.task.model_hash != task.model_hash:
            # Nodes that trained last round hold that model: keep it as a delta base
            # (only when deltas are on: each base is one more model in memory).
            self.downlink.remember(prev.task.model_hash, prev.task.model_blob)
        cr = CohortRound(task, self._mono(), self.noise_rng)
        if sums_compressed(task.config):
            cr.compressed = CompressedCohort(task)
        self.current = cr
        self._select(cr)
        if task.config.secure_aggregation.enabled:
            self._start_secure(cr)
        self._notify()
        return cr

    def _start_secure(self, cr: CohortRound) -> None:
        """One SecAgg+ session over the direct clients selected now; no fill-ins join it."""
        clients = [a.node_id for a in cr.assignments.values() if self.children[a.node_id].role is Role.CLIENT]
        cr.client_quota = len(clients)
        if not clients:
            return
        try:
            cr.secure = new_cohort(cr.task.config, cr.task.schema, clients, cr.task.round,
                                   cr.task.deadline_unix, self._wall)
        except OrchardError as err:
            # Too few clients for the protocol's threshold: this cohort contributes nothing.
            for n in clients:
                cr.settle(cr.assignments[n], delivered=False)
            cr.rejected[f"secure aggregation could not start: {err}"] = len(clients)

    def _select(self, cr: CohortRound) -> None:
        cfg = cr.task.config
        caps: dict[str, int] = {}
        for c in self.children.values():
            if not self.live(c):
                continue
            if c.role is Role.AGGREGATOR:
                if c.pool_eligible > 0:
                    caps[c.node_id] = c.pool_eligible
            elif device_eligible(c.device, cfg.eligibility)[0]:
                caps[c.node_id] = 1
        alloc = allocate(cr.task.target, caps)
        client_ids = [k for k in caps if self.children[k].role is Role.CLIENT]
        client_share = sum(alloc[k] for k in client_ids)
        for k, n in alloc.items():
            if n > 0 and self.children[k].role is Role.AGGREGATOR:
                self._assign(cr, k, n)
        # Direct clients are over-selected; the first `client_share` updates count.
        cr.client_quota = math.ceil(max(client_share, 0) * cfg.cohort.over_selection)
        for k in over_select(client_ids, client_share, cfg.cohort.over_selection, self.rng):
            self._assign(cr, k, 1)
        # Clients that join while the round is open may fill an unused quota; if no direct
        # client was known at open time, any remaining target may go to late joiners.
        if not caps:
            cr.client_quota = math.ceil(cr.task.target * cfg.cohort.over_selection)

    def _assign(self, cr: CohortRound, node_id: str, target: int) -> Assignment:
        a = Assignment(node_id, f"{cr.task.run_id}.{cr.task.round}.{cr.task.attempt}.{next(self._ids)}", target)
        cr.add(a, self.children[node_id].role is Role.CLIENT)
        return a

    def _task_for(self, cr: CohortRound, a: Assignment) -> TaskAssignment:
        c = self.children[a.node_id]
        deadline = cr.task.deadline_unix
        if c.role is Role.AGGREGATOR:
            # Leave the aggregator time to push its partial before our own deadline.
            deadline -= min(5.0, 0.1 * max(0.0, deadline - self._wall()))
        return TaskAssignment(
            run_id=cr.task.run_id, round=cr.task.round, attempt=cr.task.attempt, task_id=a.task_id,
            model_hash=cr.task.model_hash, model_bytes=len(cr.task.model_blob),
            config_json=cr.task.config_json, schema=cr.task.schema, deadline_unix=deadline,
            cohort_target=a.target, shared_seed=cr.task.shared_seed)

    async def poll(self, node_id: str, device: DeviceState | None, pool_size: int | None,
                   pool_eligible: int | None, wait_s: float) -> TaskAssignment | Idle:
        """Long-poll: return this node's assignment as soon as there is one, else Idle after ``wait_s``."""
        self.touch(node_id, device, pool_size, pool_eligible)
        deadline = self._mono() + max(0.0, min(wait_s, self.cfg.long_poll_s))
        while True:
            got = self.assign(node_id)
            if got is not None:
                return got
            remaining = deadline - self._mono()
            if remaining <= 0:
                return Idle(retry_after_s=0.0, reason=self._idle_reason(node_id))
            ev = self._watch()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(ev.wait(), timeout=remaining)
            self.touch(node_id)

    def _idle_reason(self, node_id: str) -> str:
        cr = self.current
        if cr is None or cr.closed:
            return "no round open"
        c = self.children[node_id]
        if c.role is Role.CLIENT:
            ok, why = device_eligible(c.device, cr.task.config.eligibility)
            if not ok:
                return "not eligible: " + "; ".join(why)
        return "not selected for this round"

    def assign(self, node_id: str) -> TaskAssignment | None:
        """This node's task in the open round, if it is selected (or may fill in an unused
        slot); None otherwise. What ``poll`` answers without waiting."""
        cr = self.current
        if cr is None or cr.closed:
            return None
        a = cr.assignments.get(node_id)
        if a is None:
            c = self.children[node_id]
            # Fill-in: a client that arrived after selection may take an unused quota slot.
            if (c.role is Role.CLIENT and not cr.task.config.secure_aggregation.enabled
                    and cr.clients_selected < cr.client_quota
                    and cr.received < cr.task.target
                    and device_eligible(c.device, cr.task.config.eligibility)[0]):
                a = self._assign(cr, node_id, 1)
            else:
                return None
        if a.delivered or a.dropped:
            return None
        a.handed_out = True
        return self._task_for(cr, a)

    def heartbeat(self, node_id: str, device: DeviceState | None, task_id: str) -> bool:
        self.touch(node_id, device)
        cr = self.current
        if cr is None or cr.closed:
            return False
        a = cr.assignments.get(node_id)
        return a is not None and a.task_id == task_id and not a.delivered and not a.dropped

    def model_blob(self, model_hash: str) -> bytes:
        cr = self.current
        if cr is None or cr.task.model_hash != model_hash:
            raise RoundClosedError(f"model {model_hash[:16]}... is not the current round's model; poll for a task")
        return cr.task.model_blob

    async def model_reply(self, model_hash: str, have_hash: str = "") -> ModelReply:
        """The current model for a node that holds ``have_hash`` (empty: nothing): a delta
        from it when the run allows downlink deltas, the tier knows it and the delta is
        smaller; the full model otherwise."""
        blob = self.model_blob(model_hash)
        cr = self.current
        if cr is None or not cr.task.config.downlink_delta or not have_hash:
            return full_reply(blob, model_hash)
        return await self.downlink.reply(blob, model_hash, have_hash, self._decode_pool)

    def count_bytes_down(self, n: int) -> None:
        self.counters["bytes_down"] += n
        if self.current is not None:
            self.current.bytes_down += n

    # ------------------------------------------------------------------ uploads

    def _assignment(self, node_id: str, run_id: str, rnd: int, attempt: int,
                    task_id: str) -> tuple[CohortRound, Assignment]:
        """The open round and this node's assignment in it, or the reason there is none."""
        cr = self.current
        t = check_round(cr.task if cr is not None else None, cr is not None and cr.closed,
                        cr.close_reason if cr is not None else "", run_id, rnd, attempt)
        assert cr is not None  # check_round refuses when no round is open
        a = cr.assignments.get(node_id)
        check_assignment(a, node_id, task_id, t.round)
        assert a is not None
        return cr, a

    def begin_upload(self, node_id: str, h: UploadHeader) -> UploadSlot:
        """Check an upload's header against the open round (``admit_header``) and reserve
        the caller's slot. Nothing is reserved unless it passes."""
        c = self.child(node_id)
        if h.node_id != node_id:
            raise UpdateSchemaError(f"header names node {h.node_id!r} but the caller is {node_id!r}")
        cr, a = self._assignment(node_id, h.run_id, h.round, h.attempt, h.task_id)
        admit_header(h, node_id, c.role, cr.task, a, self.cfg.max_upload_bytes)
        a.in_flight = True
        return UploadSlot(h, cr, a)

    @contextlib.contextmanager
    def upload(self, node_id: str, h: UploadHeader) -> Iterator[UploadSlot]:
        """One upload, from its header to its fold: admits the header and reserves the
        caller's slot on entry; if the body raises (a bad payload, a broken stream), the
        slot is released and the refusal counted, so the node may try again."""
        try:
            slot = self.begin_upload(node_id, h)
        except OrchardError as err:
            self.reject(err)
            raise
        try:
            yield slot
        except OrchardError as err:
            self.abort_upload(slot, type(err).__name__)
            raise
        except BaseException:
            self.abort_upload(slot, "stream broken")
            raise

    def upload_now(self, node_id: str, h: UploadHeader, payload: bytes) -> None:
        """An in-process upload on an inline coordinator: the gRPC path's admission,
        integrity check, decode and fold, run to the end on the caller's thread."""
        if not self.inline:
            raise RuntimeError("upload_now needs an inline coordinator (Coordinator(..., inline=True))")
        with self.upload(node_id, h) as slot:
            if sha256_hex(payload) != h.payload_sha256 or len(payload) != h.total_bytes:
                raise IntegrityError("payload does not match its declared size and sha256")
            run_inline(self.complete_upload(slot, payload))

    def abort_upload(self, slot: UploadSlot, reason: str) -> None:
        slot.assignment.in_flight = False
        self._reject(slot.cohort, reason)

    def _reject(self, cr: CohortRound | None, reason: str) -> None:
        self.counters["uploads_rejected"] += 1
        if cr is not None:
            cr.rejected[reason] = cr.rejected.get(reason, 0) + 1

    def reject(self, err: OrchardError) -> None:
        self._reject(self.current, type(err).__name__)

    def _decode(self, slot: UploadSlot, payload: bytes) -> NDArrays | CheckedUpload:
        """Everything that is checked before a fold: a decoded update or partial, or a
        client's payload checked for the compressed sum."""
        h, cr = slot.header, slot.cohort
        if h.kind is UploadKind.PARTIAL_SUM:
            return decode_partial(payload, cr.task.schema, h.payload_sizes)
        if cr.compressed is not None:
            return cr.compressed.check(h, payload)
        return self._decode_client(h, payload, cr.task)

    async def complete_upload(self, slot: UploadSlot, payload: bytes) -> None:
        """Decode, check, and fold a fully received, hash-checked payload."""
        h, cr, a = slot.header, slot.cohort, slot.assignment
        try:
            arrays = await self._offload(self._decode_pool, self._decode, slot, payload)
            self._reserve_fold(cr, h)
            try:
                if h.count > 0:
                    await self._offload(self._fold_pool, self._fold, cr, h, arrays)
            except BaseException:
                cr.reserved -= h.count
                raise
        except BaseException:
            a.in_flight = False
            raise
        self._delivered(slot)

    def _offload(self, pool: ThreadPoolExecutor, fn: Callable[..., T], *args: Any) -> Awaitable[T]:
        """CPU work in ``pool`` off the event loop; on the caller's thread when inline."""
        if self.inline:
            return _Ready(fn(*args))
        return asyncio.get_running_loop().run_in_executor(pool, fn, *args)

    def _reserve_fold(self, cr: CohortRound, h: UploadHeader) -> None:
        """The last check before a fold, on the loop thread. A fold reserves its count here,
        before it runs, so two uploads racing for the last slot cannot both get in. (A
        partial from below is never refused for overshooting: it is a whole cohort.)"""
        if cr.closed:
            raise RoundClosedError(f"round {cr.task.round} closed ({cr.close_reason}) while the upload arrived; "
                                   "late uploads are refused")
        if h.kind is UploadKind.CLIENT_UPDATE and cr.reserved >= cr.task.target:
            raise RoundClosedError(f"round {cr.task.round} already has its {cr.task.target} updates; "
                                   "late uploads are refused")
        cr.reserved += h.count

    def _delivered(self, slot: UploadSlot) -> None:
        h, cr, a = slot.header, slot.cohort, slot.assignment
        a.in_flight = False
        cr.settle(a, delivered=True)
        n = h.total_bytes
        self.counters["uploads_accepted"] += 1
        self.counters["bytes_up"] += n
        cr.bytes_up += n + (h.bytes_up if h.kind is UploadKind.PARTIAL_SUM else 0)
        if h.kind is UploadKind.PARTIAL_SUM:
            cr.bytes_down += h.bytes_down
            for k, v in h.tier_participants.items():
                cr.tier_participants[k] = cr.tier_participants.get(k, 0) + v
        else:
            cr.tier_participants[self.name] = cr.tier_participants.get(self.name, 0) + 1
        self._check_close(cr)
        self._notify()

    @staticmethod
    def _fold(cr: CohortRound, h: UploadHeader, arrays: NDArrays | CheckedUpload) -> None:
        if isinstance(arrays, CheckedUpload):
            assert cr.compressed is not None  # only _decode makes one, for such a round
            cr.compressed.fold(h, arrays)
            return
        ms = MetricSums(dict(h.metric_sums), dict(h.metric_weights))
        if h.kind is UploadKind.PARTIAL_SUM:
            cr.fold_partial(Partial(sums=arrays, weight=h.weight, count=h.count, metrics=ms))
        else:
            cr.fold_update(arrays, h.weight, ms)  # the decoder checked it

    # ------------------------------------------------------------------ secure aggregation

    async def secagg_exchange(self, node_id: str, run_id: str, rnd: int, attempt: int, task_id: str,
                              stage_index: int, message: bytes, header: UploadHeader | None,
                              wait_s: float) -> SecAggReply:
        """Take one stage message (if any), then long-poll up to ``wait_s`` for this node's
        next broadcast."""
        cr = self._secagg_post(node_id, run_id, rnd, attempt, task_id, stage_index, message, header)
        end = self._mono() + max(0.0, min(wait_s, self.cfg.long_poll_s))
        while True:
            reply = self._secagg_reply(cr, node_id)
            if reply.broadcast or reply.done or reply.aborted:
                return reply
            remaining = end - self._mono()
            if remaining <= 0 or cr.closed:
                return reply
            ev = self._watch()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(ev.wait(), timeout=remaining)
            self.touch(node_id)

    def secagg_now(self, node_id: str, run_id: str, rnd: int, attempt: int, task_id: str, stage_index: int,
                   message: bytes, header: UploadHeader | None) -> SecAggReply:
        """``secagg_exchange`` without the wait, for in-process callers: post the message
        (if any) and return what this node must answer now."""
        cr = self._secagg_post(node_id, run_id, rnd, attempt, task_id, stage_index, message, header)
        return self._secagg_reply(cr, node_id)

    def _secagg_post(self, node_id: str, run_id: str, rnd: int, attempt: int, task_id: str, stage_index: int,
                     message: bytes, header: UploadHeader | None) -> CohortRound:
        self.touch(node_id)
        cr, _ = self._assignment(node_id, run_id, rnd, attempt, task_id)
        sc = cr.secure
        if sc is None:
            raise SecAggError(f"round {rnd} runs no secure aggregation for {node_id!r}")
        if message:
            if header is not None:
                names = [s.name for s in cr.task.schema]
                if header.node_id != node_id or [s.name for s in header.schema] != names:
                    raise UpdateSchemaError("masked-input header does not match the caller or the round's schema")
            sc.receive(node_id, stage_of(stage_index), message, header)
            self._secure_progress(cr)
            self._notify()
        return cr

    @staticmethod
    def _secagg_reply(cr: CohortRound, node_id: str) -> SecAggReply:
        sc = cr.secure
        assert sc is not None  # _secagg_post refuses a round without a session
        if sc.finished:
            return SecAggReply(stage_index_of(sc.stage), b"", sc.stage is Stage.DONE, sc.abort_reason)
        return SecAggReply(stage_index_of(sc.stage), sc.broadcast(node_id), False, "")

    def _secure_progress(self, cr: CohortRound) -> None:
        """Move the session's stages on; fold the cohort's sum once it is unmasked."""
        sc = cr.secure
        if sc is None or cr.closed:
            return
        moved = False
        while sc.advance(self._wall()):
            moved = True
        if not moved or not sc.finished:
            if moved:
                self._notify()
            return
        clients = [a for a in cr.assignments.values() if self.children.get(a.node_id) is not None
                   and self.children[a.node_id].role is Role.CLIENT]
        p = None
        if sc.stage is Stage.DONE:
            try:
                p = sc.partial()
            except SecAggAbort as err:
                for a in clients:
                    cr.settle(a, delivered=False)
                cr.rejected[f"secure aggregation: {err}"] = len(clients)
        if p is not None:
            contributed = set(sc.contributors())
            if p.count > 0:
                cr.secure_sum = p  # folded with the outcome (fold_aside), after the fold pool drained
                cr.reserved += p.count
            for a in clients:
                cr.settle(a, a.node_id in contributed)
            cr.tier_participants[self.name] = cr.tier_participants.get(self.name, 0) + p.count
            self.counters["uploads_accepted"] += p.count
        elif sc.stage is not Stage.DONE:
            for a in clients:
                cr.settle(a, delivered=False)
            cr.rejected[f"secure aggregation aborted: {sc.abort_reason}"] = len(clients)
        cr.bytes_up += sc.bytes_up
        cr.bytes_down += sc.bytes_down
        self.counters["bytes_up"] += sc.bytes_up
        self._check_close(cr)
        self._notify()

    # ------------------------------------------------------------------ closing

    def sweep(self) -> None:
        """Drop silent selected nodes, enforce the deadline; called periodically."""
        cr = self.current
        if cr is None or cr.closed:
            return
        now = self._mono()
        for a in cr.pending():
            c = self.children.get(a.node_id)
            if c is None or (now - c.last_seen > self.cfg.node_timeout_s and not a.in_flight):
                cr.settle(a, delivered=False)
        if cr.secure is not None:
            self._secure_progress(cr)
            if cr.closed:
                return
        if self._wall() >= cr.task.deadline_unix:
            self.close_round(cr, "deadline")
            return
        self._check_close(cr)

    def _check_close(self, cr: CohortRound) -> None:
        if cr.closed:
            return
        if cr.received >= cr.task.target:
            self.close_round(cr, "target reached")
        elif cr.assignments and cr.open == 0 and cr.clients_selected >= cr.client_quota:
            self.close_round(cr, "every selected node delivered or dropped")

    def close_round(self, cr: CohortRound, reason: str) -> None:
        if cr.closed:
            return
        cr.closed = True
        cr.close_reason = reason
        self.counters["rounds_closed"] += 1
        cr.closed_event.set()
        self._notify()

    async def wait_round(self, cr: CohortRound) -> RoundOutcome:
        await cr.closed_event.wait()
        # Let folds already queued finish before the partial is read.
        await asyncio.get_running_loop().run_in_executor(self._fold_pool, lambda: None)
        return self.outcome(cr)

    def outcome(self, cr: CohortRound) -> RoundOutcome:
        """The result of a closed round (the simulator calls this directly), once its folds
        are done."""
        partial, measurements = cr.result()
        dropped = sum(1 for a in cr.assignments.values() if a.dropped)
        return RoundOutcome(task=cr.task, partial=partial, selected=len(cr.assignments), dropped=dropped,
                            bytes_up=cr.bytes_up, bytes_down=cr.bytes_down,
                            tier_participants=dict(cr.tier_participants), reason=cr.close_reason,
                            seconds=self._mono() - cr.started, rejected=dict(cr.rejected),
                            measurements=measurements)

    def _watch(self) -> asyncio.Event:
        """The event a long-poller waits on; set (and replaced) at the next change."""
        self._changed_watched = True
        return self._changed

    def _notify(self) -> None:
        # A tier notifies on every fold; with no long-poller holding the event (the
        # simulator, a busy round) there is nothing to wake and nothing to replace.
        if not self._changed_watched:
            return
        ev, self._changed, self._changed_watched = self._changed, asyncio.Event(), False
        ev.set()

    def shutdown(self) -> None:
        self._fold_pool.shutdown(wait=False, cancel_futures=True)
        self._decode_pool.shutdown(wait=False, cancel_futures=True)
