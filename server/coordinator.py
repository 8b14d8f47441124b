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
import dataclasses
import itertools
import logging
import math
import time
import uuid
from collections.abc import Awaitable, Callable, Coroutine, Generator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, TypeVar

import numpy as np

from orchard.aggregation import MetricSums, Partial
from orchard.aggregation.staleness import staleness_weight
from orchard.compression import sums_compressed
from orchard.config import EligibilityConfig, RunConfig, ServerConfig
from orchard.errors import (
    JOIN_FIRST,
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
from orchard.server.admission import admit_header, check_assignment, check_round, check_version
from orchard.server.buffer import BufferState, Held
from orchard.server.cohort import Assignment, CheckedUpload, CohortRound, CompressedCohort
from orchard.server.downlink import DownlinkCache, ModelReply, full_reply
from orchard.server.maskworkers import MaskWorkers
from orchard.server.round import RoundOutcome, RoundTask, round_seed
from orchard.server.secagg import (
    MASK_WORKERS_MIN_BYTES,
    ROSTER_END,
    SecAggReply,
    SecureUpstream,
    TreeRoster,
    check_masked_header,
    mask_bytes,
    new_cohort,
)
from orchard.server.selection import allocate, device_eligible, over_select, pick
from orchard.typing import DeviceState, NDArrays, Role, TensorSpec
from orchard.updates import decode_partial
from orchard.wire import check_payload

T = TypeVar("T")
log = logging.getLogger("orchard.server.coordinator")

# Decodes a client's payload into a float32 delta (codec-specific; see orchard.server.decoding).
ClientDecoder = Callable[[UploadHeader, bytes | bytearray | memoryview, RoundTask], NDArrays]


@dataclass
class Child:
    node_id: str
    role: Role
    token_hash: str
    device: DeviceState = field(default_factory=DeviceState)
    last_seen: float = 0.0  # monotonic seconds
    pool_size: int = 1
    pool_eligible: int = 1
    # device_eligible's verdict, for the state and rules it was given (a round asks twice:
    # the pool report, then selection; the state only changes when the node reports one).
    _verdict: tuple[DeviceState, EligibilityConfig, bool] | None = field(default=None, repr=False, compare=False)

    def eligible(self, rules: EligibilityConfig) -> bool:
        """Whether this node's last reported state passes ``rules`` (``device_eligible``)."""
        v = self._verdict
        if v is not None and v[0] is self.device and v[1] is rules:
            return v[2]
        ok = device_eligible(self.device, rules)[0]
        self._verdict = (self.device, rules, ok)
        return ok


@dataclass
class UploadSlot:
    header: UploadHeader
    cohort: CohortRound
    assignment: Assignment


class _Upload:
    """:meth:`Coordinator.upload`'s context manager (a class: a tier takes one per upload,
    and a generator-based one costs several times as much to enter and leave)."""

    __slots__ = ("coord", "node_id", "header", "slot")

    def __init__(self, coord: Coordinator, node_id: str, header: UploadHeader) -> None:
        self.coord, self.node_id, self.header = coord, node_id, header
        self.slot: UploadSlot | None = None

    def __enter__(self) -> UploadSlot:
        try:
            self.slot = self.coord.begin_upload(self.node_id, self.header)
        except OrchardError as err:
            self.coord.reject(err)
            raise
        return self.slot

    def __exit__(self, kind: type[BaseException] | None, err: BaseException | None, tb: Any) -> None:
        if kind is None:
            return
        assert self.slot is not None  # entered: __exit__ runs only after __enter__ returned
        self.coord.abort_upload(self.slot, type(err).__name__ if isinstance(err, OrchardError) else "stream broken")


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


class ParentUpstream:
    """A tier's way to its parent's tree-scope session in the same process (the simulator,
    tests): the parent coordinator's ``secagg_roster`` and ``secagg_relayed``, called as
    ``Fleet.SecAgg`` would call them, without the wait. Bound to the tier's task ``t``."""

    def __init__(self, parent: Coordinator, name: str, t: TaskAssignment) -> None:
        self.parent, self.name, self.t = parent, name, t

    async def roster(self, nodes: list[str], tiers: list[str]) -> None:
        t = self.t
        await self.parent.secagg_roster(self.name, t.run_id, t.round, t.attempt, t.task_id, nodes, tiers)

    async def exchange(self, node: str, stage_index: int, message: bytes, header: UploadHeader | None,
                       wait_s: float, bytes_down: int = 0) -> SecAggReply:
        t = self.t
        return await self.parent.secagg_relayed(self.name, t.run_id, t.round, t.attempt, t.task_id, node,
                                                stage_index, message, header, 0.0, bytes_down)


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
        self._mask_workers: MaskWorkers | None = None  # started by a large secure session
        self._mask_workers_failed = False  # they could not start: threads from then on
        self._unmask_pool: ThreadPoolExecutor | None = None  # a session's unmasking, off the loop
        self.upload_slots = asyncio.Semaphore(cfg.max_inflight_uploads)
        # Models nodes below may hold, for downlink deltas (orchard.server.downlink).
        self.downlink = DownlinkCache()
        self.counters: dict[str, int] = {"uploads_accepted": 0, "uploads_rejected": 0, "bytes_up": 0,
                                         "bytes_down": 0, "rounds_closed": 0}
        # Asynchronous mode (RunConfig.mode). Updates folded over the run, by staleness.
        self.staleness: dict[int, int] = {}
        # The model of the previous version, for clients that were assigned it just before
        # the version moved on and pull it after (two models at most: O(model)).
        self._prev_model: tuple[str, bytes] | None = None
        # Round task views with an older version's shared seed, to decode an update trained
        # on that version (random-k's indices); a few at a time.
        self._version_tasks: dict[tuple[int, int, int], RoundTask] = {}
        # Set by the root: called (on the loop) with the buffer's state after every
        # accepted fold in asynchronous mode, before the upload is acknowledged.
        self.journal: Callable[[BufferState], None] | None = None
        self._folds = 0  # folds made: orders journal states
        self._tasks: set[asyncio.Task[None]] = set()  # sends upstream started from sweep (held until done)

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
        # No long-poller is woken: what one is waiting for (its own assignment) does not
        # change when another node joins, and waking them all on every join makes a
        # thousand joins cost a million wake-ups.
        return node_id

    def child(self, node_id: str, token_hash: str | None = None) -> Child:
        c = self.children.get(node_id)
        if c is None:
            raise UnknownNodeError(f"node {node_id!r} has not joined this server (or expired); {JOIN_FIRST}")
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
                elig += int(cfg is None or c.eligible(cfg.eligibility))
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

    def open_round(self, task: RoundTask, restore: BufferState | None = None,
                   upstream: SecureUpstream | None = None) -> CohortRound:
        """Open ``task``'s round (asynchronous mode: its buffer). ``restore``: a journaled
        buffer of this round to take back first (a restarted root, see :meth:`_restore`).
        ``upstream``: a tier below the root, its way to the round's secure session when
        that spans the whole tree (``secure_aggregation.scope = "tree"``); the tier then
        reports its roster with :meth:`send_roster`."""
        prev = self.current
        carry = (prev is not None and task.config.mode.is_async and prev.task.config.mode.is_async
                 and prev.task.run_id == task.run_id)
        if prev is not None and not prev.closed and not carry:
            self.close_round(prev, "superseded by a new round")
        if task.config.downlink_delta and prev is not None and prev.task.model_hash != task.model_hash:
            # Nodes that trained last round hold that model: keep it as a delta base
            # (only when deltas are on: each base is one more model in memory).
            self.downlink.remember(prev.task.model_hash, prev.task.model_blob)
        if carry and prev is not None and prev.task.model_hash != task.model_hash:
            self._prev_model = (prev.task.model_hash, prev.task.model_blob)
        cr = CohortRound(task, self._mono(), self.noise_rng)
        cr.upstream = upstream
        if sums_compressed(task.config) and self._sums_compressed_async(task):
            cr.compressed = CompressedCohort(task)
        self.current = cr
        if carry and prev is not None:
            self._carry(prev, cr)
        if restore is not None:
            self._restore(cr, restore)
        self._select(cr)
        if task.config.secure_aggregation.enabled:
            if task.config.secure_aggregation.over_tree:
                self._start_tree(cr)
            else:
                self._start_secure(cr)
        self._notify()
        return cr

    def _sums_compressed_async(self, task: RoundTask) -> bool:
        """Asynchronous buffers sum in the compressed domain only when every update in
        them was trained on the buffer's own version (``max_staleness = 0``): payloads of
        other versions were encoded with other shared seeds, and are decoded. A root that
        journals its buffer decodes too (the journal stores the decoded sum)."""
        m = task.config.mode
        return not m.is_async or (m.max_stale == 0 and self.journal is None)

    def _carry(self, prev: CohortRound, cr: CohortRound) -> None:
        """Asynchronous mode: a new buffer takes over the previous one's assignments still
        training (within ``max_staleness`` of the new version), and, if the previous buffer
        is still open (the continuation a full buffer left, or a buffer the upstream moved
        past), its folded updates."""
        S = cr.task.config.mode.max_stale
        secure = cr.task.config.secure_aggregation.enabled
        for a in prev.assignments.values():
            c = self.children.get(a.node_id)
            if a.delivered or a.dropped or c is None or cr.task.round - a.round > S:
                continue
            if secure and c.role is Role.CLIENT:
                continue  # a client's masked input belongs to its buffer's SecAgg+ session
            cr.add(a, c.role is Role.CLIENT)
        if not prev.closed:
            prev.closed = True
            prev.close_reason = f"moved into the buffer of round {cr.task.round}"
            prev.closed_event.set()
            self._move_counts(prev, cr)
            if self.inline:
                self._move_sums(prev, cr)
            else:
                # After the folds already queued into ``prev``, before any into ``cr``: the
                # fold pool runs one job at a time, in order.
                fut = asyncio.get_running_loop().run_in_executor(self._fold_pool, self._move_sums, prev, cr)
                fut.add_done_callback(lambda f: self._moved(f, cr))

    def _moved(self, fut: asyncio.Future[None], cr: CohortRound) -> None:
        if fut.cancelled() or fut.exception() is not None:
            return
        self._check_close(cr)
        self._notify()

    def _restore(self, cr: CohortRound, state: BufferState) -> None:
        """A restarted root takes its journaled buffer back: the sum of every update it had
        acknowledged, those updates' (node, task) pairs (a retried upload of one is a
        duplicate), and the assignments still training, whose nodes are registered again
        (from the journal: role and token hash) with a fresh timeout to come back in."""
        p = state.partial
        if p.count:
            cr.acc.merge(p, owned=True)
            cr.reserved += p.count
        cr.accepted = list(state.accepted)
        cr.staleness = dict(state.staleness)
        for k, v in state.counters.items():
            self.counters[k] = v
        self._folds = max(self._folds, state.seq)
        done = set(state.accepted)
        for h in state.held:
            if (h.node_id, h.task_id) in done or h.node_id in cr.assignments:
                continue
            c = self.children.get(h.node_id)
            if c is None:
                c = self.children[h.node_id] = Child(h.node_id, Role(h.role), h.token_hash, DeviceState(),
                                                     self._mono(), pool_size=0 if h.role == "aggregator" else 1,
                                                     pool_eligible=0 if h.role == "aggregator" else 1)
            cr.add(Assignment(h.node_id, h.task_id, h.target, handed_out=True, round=h.round),
                   c.role is Role.CLIENT)
        for node, task_id in state.accepted:
            if node not in cr.assignments:
                cr.assignments[node] = Assignment(node, task_id, 1, handed_out=True, delivered=True,
                                                  round=cr.task.round)

    @staticmethod
    def _move_sums(prev: CohortRound, cr: CohortRound) -> None:
        """The fold pool's half of moving a buffer: its sums, the updates' ids and staleness."""
        prev.fold_aside()
        p = prev.acc.partial
        if p.count:
            cr.acc.merge(p, owned=True)
        for s_, n in prev.staleness.items():
            cr.staleness[s_] = cr.staleness.get(s_, 0) + n
        cr.accepted += prev.accepted

    @staticmethod
    def _move_counts(prev: CohortRound, cr: CohortRound) -> None:
        """The loop's half: the counts it keeps."""
        cr.reserved += prev.reserved
        cr.bytes_up += prev.bytes_up
        cr.bytes_down += prev.bytes_down
        for k, v in prev.tier_participants.items():
            cr.tier_participants[k] = cr.tier_participants.get(k, 0) + v
        for k, v in prev.rejected.items():
            cr.rejected[k] = cr.rejected.get(k, 0) + v

    def _continue(self, cr: CohortRound) -> None:
        """Asynchronous mode: a buffer that filled up leaves a continuation for the same
        version, so updates arriving before the next version opens are folded, not refused
        (the tier's next ``open_round`` moves them into the new buffer)."""
        nxt = CohortRound(cr.task, self._mono())
        nxt.continuation = True
        if cr.compressed is not None:
            nxt.compressed = CompressedCohort(cr.task)
        for a in cr.assignments.values():
            c = self.children.get(a.node_id)
            if not (a.delivered or a.dropped) and c is not None:
                nxt.add(a, c.role is Role.CLIENT)
        self.current = nxt

    def _start_secure(self, cr: CohortRound) -> None:
        """One SecAgg+ session over the direct clients selected now; no fill-ins join it."""
        clients = [a.node_id for a in cr.assignments.values() if self.children[a.node_id].role is Role.CLIENT]
        cr.client_quota = len(clients)
        if not clients:
            return
        try:
            cr.secure = new_cohort(cr.task.config, cr.task.schema, clients, cr.task.round,
                                   cr.task.deadline_unix, self._wall,
                                   self._mask_workers_for(cr.task.config, cr.task.schema, len(clients)))
        except OrchardError as err:
            # Too few clients for the protocol's threshold: this cohort contributes nothing.
            for n in clients:
                cr.settle(cr.assignments[n], delivered=False)
            cr.rejected[f"secure aggregation could not start: {err}"] = len(clients)

    def _mask_workers_for(self, run: RunConfig, schema: tuple[TensorSpec, ...], n: int) -> MaskWorkers | None:
        """This tier's mask worker processes for a session of ``n`` clients, started with
        the first session large enough to gain from them; None (the session's threads)
        for smaller ones, in-process coordinators and ``server.mask_workers = 0``."""
        if self.inline or self.cfg.mask_workers == 0 or self._mask_workers_failed \
                or mask_bytes(run, schema, n) < MASK_WORKERS_MIN_BYTES:
            return None
        if self._mask_workers is None or self._mask_workers.closed:
            try:
                self._mask_workers = MaskWorkers(self.cfg.mask_workers)
            except (OSError, RuntimeError) as err:  # no processes to be had here: threads, for good
                self._mask_workers_failed = True
                log.warning("%s: could not start mask worker processes (%s); secure sessions unmask on "
                            "threads", self.name, err)
                return None
        return self._mask_workers

    def _start_tree(self, cr: CohortRound) -> None:
        """Scope "tree": the round's session is the root's. This tier's direct clients are
        its roster; the aggregators it selected add theirs (``secagg_roster``). The root
        opens the session once every roster is in (``_open_tree``); a tier below reports
        its roster upward as soon as it is complete (``send_roster``)."""
        cr.tree = TreeRoster()
        for a in cr.assignments.values():
            if self.children[a.node_id].role is Role.CLIENT:
                cr.tree.route[a.node_id] = a.node_id
                cr.tree.tiers[a.node_id] = self.name
            else:
                cr.tree.waiting.add(a.node_id)
        cr.client_quota = sum(1 for n, via in cr.tree.route.items() if n == via)
        now = self._wall()
        # A tier below the root reports by half the root's roster deadline, so that its
        # roster (with or without a silent child's) is in when the root opens the session.
        frac = ROSTER_END if cr.upstream is None else ROSTER_END / 2
        cr.tree.roster_deadline = now + frac * max(0.0, cr.task.deadline_unix - now)
        if cr.upstream is None and not cr.tree.waiting:
            self._open_tree(cr)

    def _open_tree(self, cr: CohortRound) -> None:
        """The root opens the round's one session over every client in the rosters."""
        tree = cr.tree
        assert tree is not None and cr.upstream is None
        tree.waiting.clear()
        if not tree.route:
            return
        try:
            cr.secure = new_cohort(cr.task.config, cr.task.schema, sorted(tree.route), cr.task.round,
                                   cr.task.deadline_unix, self._wall,
                                   self._mask_workers_for(cr.task.config, cr.task.schema, len(tree.route)))
        except OrchardError as err:
            # Too few clients for the protocol's threshold: the round gets nothing.
            for a in list(cr.assignments.values()):
                cr.settle(a, delivered=False)
            cr.rejected[f"secure aggregation could not start: {err}"] = len(tree.route)
            self._check_close(cr)
        self._notify()

    async def secagg_roster(self, via: str, run_id: str, rnd: int, attempt: int, task_id: str,
                            nodes: list[str], tiers: list[str]) -> None:
        """An aggregator child reports the clients selected below it for the round's
        tree-scope session (``tiers``: the lowest tier of each). Once every selected
        aggregator has, the root opens the session and a tier below reports upward."""
        self.touch(via)
        cr, a = self._assignment(via, run_id, rnd, attempt, task_id)
        tree = cr.tree
        if tree is None:
            raise SecAggError(f"round {rnd} runs no secure aggregation over the whole tree")
        if via not in tree.waiting:
            if via in tree.reporters and tree.reported(via) == dict(zip(nodes, tiers, strict=False)):
                return  # the same roster again: a retry whose first reply was lost
            raise SecAggError(f"{via!r} already reported its roster for round {rnd}, or the session opened "
                              "without it (its roster came after the roster deadline)")
        # Lowest tiers select ceil(share x over_selection) clients each, their shares summing
        # to the target: a roster holds at most target x (over_selection + 1) of them.
        cap = math.ceil(a.target * (cr.task.config.cohort.over_selection + 1))
        if len(nodes) > cap:
            raise SecAggError(f"{via!r} reported {len(nodes)} clients for a share of {a.target} updates; at most "
                              f"{cap} can have been selected below it")
        if any(len(x) > 256 for x in (*nodes, *tiers)):
            raise SecAggError("a roster's client and tier names are at most 256 characters")
        tree.add(via, nodes, tiers)
        tree.waiting.discard(via)
        if tree.waiting:
            return
        if cr.upstream is None:
            self._open_tree(cr)
        else:
            await self.send_roster(cr)

    async def send_roster(self, cr: CohortRound) -> None:
        """A tier below the root: report this round's roster upward, once it is complete
        (every aggregator child selected has reported). Does nothing otherwise."""
        tree = cr.tree
        if tree is None or cr.upstream is None or tree.waiting or tree.sent or cr.closed:
            return
        tree.sent = True
        nodes = list(tree.route)
        await cr.upstream.roster(nodes, [tree.tiers[n] for n in nodes])

    def _spawn(self, cr: CohortRound, coro: Coroutine[Any, Any, None]) -> None:
        """Run ``coro`` (a send upstream) from a synchronous step: to its end when inline,
        else as a task of the loop; a failure is recorded with the round's refusals."""
        if self.inline:
            try:
                run_inline(coro)
            except OrchardError as err:
                cr.rejected[f"could not report upstream: {err}"] = 1
            return

        def done(t: asyncio.Task[None]) -> None:
            self._tasks.discard(t)
            if not t.cancelled() and t.exception() is not None:
                cr.rejected[f"could not report upstream: {t.exception()}"] = 1

        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(done)

    def _select(self, cr: CohortRound) -> None:
        cfg = cr.task.config
        caps: dict[str, int] = {}
        for c in self.children.values():
            if not self.live(c):
                continue
            if c.role is Role.AGGREGATOR:
                if c.pool_eligible > 0:
                    caps[c.node_id] = c.pool_eligible
            elif c.eligible(cfg.eligibility):
                caps[c.node_id] = 1
        alloc = allocate(cr.task.target, caps)
        client_ids = [k for k in caps if self.children[k].role is Role.CLIENT]
        client_share = sum(alloc[k] for k in client_ids)
        for k, n in alloc.items():
            if n > 0 and self.children[k].role is Role.AGGREGATOR and k not in cr.assignments:
                self._assign(cr, k, n)
        # Direct clients are over-selected; the first `client_share` updates count.
        cr.client_quota = math.ceil(max(client_share, 0) * cfg.cohort.over_selection)
        if cfg.mode.is_async:
            # The quota is the concurrency: top the clients still training (carried over
            # from earlier buffers) up to it with clients that are free.
            free = [k for k in client_ids if k not in cr.assignments]
            busy = sum(1 for a in cr.assignments.values() if not (a.delivered or a.dropped)
                       and a.node_id in self.children and self.children[a.node_id].role is Role.CLIENT)
            chosen = pick(free, max(0, cr.client_quota - busy), self.rng)
        else:
            chosen = over_select(client_ids, client_share, cfg.cohort.over_selection, self.rng)
        for k in chosen:
            self._assign(cr, k, 1)
        # Clients that join while the round is open may fill an unused quota; if no direct
        # client was known at open time, any remaining target may go to late joiners.
        if not caps:
            cr.client_quota = math.ceil(cr.task.target * cfg.cohort.over_selection)

    def _assign(self, cr: CohortRound, node_id: str, target: int) -> Assignment:
        a = Assignment(node_id, f"{cr.task.run_id}.{cr.task.round}.{cr.task.attempt}.{next(self._ids)}", target,
                       round=cr.task.round)
        cr.add(a, self.children[node_id].role is Role.CLIENT)
        return a

    def _task_for(self, cr: CohortRound, a: Assignment) -> TaskAssignment:
        c = self.children[a.node_id]
        deadline = cr.task.deadline_unix
        if c.role is Role.AGGREGATOR and cr.tree is None:
            # Leave the aggregator time to push its partial before our own deadline. (A
            # relay of the tree's session pushes none: it keeps the round's deadline, so
            # that it relays until the session's last stage ends.)
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
        if cr is None or cr.closed or cr.continuation:
            return None
        a = cr.assignments.get(node_id)
        c = self.children[node_id]
        if (a is not None and (a.delivered or a.dropped) and c.role is Role.AGGREGATOR
                and cr.task.config.mode.is_async and cr.received < cr.task.target):
            # Asynchronous mode: an aggregator that emitted its buffer takes another share
            # of this version's buffer (the clients below it keep training meanwhile).
            a = self._assign(cr, node_id, max(1, min(c.pool_eligible, cr.task.target - cr.received)))
        if a is None:
            # Fill-in: a client that arrived after selection may take an unused quota slot.
            if (c.role is Role.CLIENT and not cr.task.config.secure_aggregation.enabled
                    and cr.clients_selected < cr.client_quota
                    and cr.received < cr.task.target
                    and c.eligible(cr.task.config.eligibility)):
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
        if cr is not None and cr.task.model_hash != model_hash and self._prev_model is not None \
                and self._prev_model[0] == model_hash:
            return self._prev_model[1]  # asynchronous mode: assigned just before the version moved on
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
        if cr is not None and cr.task.config.mode.is_async:
            t, _ = check_version(cr.task, cr.closed, cr.close_reason, run_id, rnd, cr.task.config.mode.max_stale,
                                 int(cr.continuation))
        else:
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

    def upload(self, node_id: str, h: UploadHeader) -> _Upload:
        """One upload, from its header to its fold, as a context manager: admits the header
        and reserves the caller's slot on entry (the slot is what ``with`` gives); if the
        body raises (a bad payload, a broken stream), the slot is released and the refusal
        counted, so the node may try again."""
        return _Upload(self, node_id, h)

    def upload_now(self, node_id: str, h: UploadHeader, payload: bytes) -> None:
        """An in-process upload on an inline coordinator: the gRPC path's admission,
        integrity check, decode and fold, run to the end on the caller's thread."""
        if not self.inline:
            raise RuntimeError("upload_now needs an inline coordinator (Coordinator(..., inline=True))")
        with self.upload(node_id, h) as slot:
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

    def _decode(self, slot: UploadSlot, payload: bytes | bytearray | memoryview, task: RoundTask) -> NDArrays | CheckedUpload:
        """Everything that is checked before a fold: a decoded update or partial, or a
        client's payload checked for the compressed sum. ``task``: the round the update
        was trained in (its shared seed decodes it)."""
        h, cr = slot.header, slot.cohort
        # The payload's integrity first, here in the decode pool rather than on the loop as
        # its chunks arrive: hashing a megabyte costs the loop as much as receiving it.
        check_payload(payload, h.total_bytes, h.payload_sha256)
        if h.kind is UploadKind.PARTIAL_SUM:
            return decode_partial(payload, cr.task.schema, h.payload_sizes)
        if cr.compressed is not None:
            return cr.compressed.check(h, payload)
        return self._decode_client(h, payload, task)

    def _task_of(self, cr: CohortRound, h: UploadHeader) -> RoundTask:
        """The task an update was trained in: the buffer's, or in asynchronous mode an
        earlier version's, whose shared seed differs (a random-k update is decoded with the
        indices it was encoded with)."""
        t = cr.task
        if h.round == t.round and h.attempt == t.attempt or not t.config.mode.is_async:
            return t
        key = (h.round, h.attempt, id(t))
        view = self._version_tasks.get(key)
        if view is None:
            if len(self._version_tasks) >= 8:
                self._version_tasks.clear()
            view = self._version_tasks[key] = dataclasses.replace(
                t, round=h.round, attempt=h.attempt, shared_seed=round_seed(t.config.seed, h.round, h.attempt))
        return view

    def _fold_buffer(self, slot: UploadSlot) -> CohortRound:
        """The buffer an upload folds into: its own, or in asynchronous mode, when that one
        closed while the payload arrived, the buffer its assignment moved into."""
        cr, cur = slot.cohort, self.current
        if (cr.closed and cr.task.config.mode.is_async and cur is not None and cur is not cr and not cur.closed
                and cur.assignments.get(slot.assignment.node_id) is slot.assignment):
            slot.cohort = cur
            return cur
        return cr

    @staticmethod
    def _staleness(cr: CohortRound, h: UploadHeader) -> tuple[int, float]:
        """(staleness, its weight) of an update folded into ``cr``: (0, 1) in sync mode.
        Refuses an update that became too stale while it arrived."""
        m = cr.task.config.mode
        if not m.is_async:
            return 0, 1.0
        _, s = check_version(cr.task, False, "", h.run_id, h.round, m.max_stale, int(cr.continuation))
        return s, staleness_weight(s, m.weighting, m.exponent, m.hinge)

    async def complete_upload(self, slot: UploadSlot, payload: bytes | bytearray | memoryview) -> None:
        """Check (size and sha256 against the header), decode and fold a fully received payload."""
        h, a = slot.header, slot.assignment
        try:
            task = self._task_of(slot.cohort, h)
            arrays = await self._offload(self._decode_pool, self._decode, slot, payload, task)
            cr = self._fold_buffer(slot)
            s, factor = self._staleness(cr, h)
            self._reserve_fold(cr, h)
            try:
                snap = None
                if h.count > 0:
                    snap = await self._offload(self._fold_pool, self._fold, cr, h, arrays, factor, s,
                                               self.staleness,
                                               self.journal is not None and cr.task.config.mode.is_async,
                                               self._next_fold())
            except BaseException:
                cr.reserved -= h.count
                raise
        except BaseException:
            a.in_flight = False
            raise
        self._delivered(slot)
        if snap is not None:
            # After the update counts as delivered, before it is acknowledged: if the store
            # fails, the node hears an error and its retry is a duplicate (the update is
            # counted once, in memory), never a second update.
            self._write_journal(cr, snap)

    def _next_fold(self) -> int:
        self._folds += 1
        return self._folds

    def _write_journal(self, cr: CohortRound, snap: BufferState) -> None:
        """Complete a buffer state taken right after a fold (sums, accepted) with what the
        loop keeps (assignments still training, histograms, counters) and journal it."""
        assert self.journal is not None
        snap.held = [Held(a.node_id, a.task_id, a.round, a.target, self.children[a.node_id].role.value,
                          self.children[a.node_id].token_hash)
                     for a in cr.assignments.values()
                     if not (a.delivered or a.dropped) and a.node_id in self.children]
        snap.counters = dict(self.counters)
        self.journal(snap)

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
        if (h.kind is UploadKind.CLIENT_UPDATE and cr.reserved >= cr.task.target
                and not cr.task.config.mode.is_async):  # an async buffer may take a few more than K
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
    def _fold(cr: CohortRound, h: UploadHeader, arrays: NDArrays | CheckedUpload, factor: float = 1.0,
              s: int = 0, totals: dict[int, int] | None = None, snapshot: bool = False,
              seq: int = 0) -> BufferState | None:
        """Fold one upload; ``factor``: its staleness weight f(s). As FedBuff (Alg. 1), the
        update joins the sum scaled by ``f(s)`` and the buffer is divided by the plain
        weights: ``sum_i w_i f(s_i) x_i / sum_i w_i``. The staleness histograms (the
        buffer's, ``totals``) change here, with the sum, so an outcome read after the fold
        pool drained sees both. With ``snapshot``, return the buffer's state right after
        this fold (the root's journal; fold thread only)."""
        if isinstance(arrays, CheckedUpload):
            assert cr.compressed is not None and factor == 1.0  # only fresh updates take this path
            cr.compressed.fold(h, arrays)
        else:
            ms = MetricSums(dict(h.metric_sums), dict(h.metric_weights))
            if factor == 1.0:  # every sync fold, and fresh async ones: through the round's aggregator
                if h.kind is UploadKind.PARTIAL_SUM:
                    cr.fold_partial(Partial(sums=arrays, weight=h.weight, count=h.count, metrics=ms))
                else:
                    cr.fold_update(arrays, h.weight, ms)  # the decoder checked it
            elif h.kind is UploadKind.PARTIAL_SUM:
                # Asynchronous mode runs the plain weighted sum (validation refuses stages).
                sums = {k: np.multiply(v, factor) for k, v in arrays.items()}
                cr.acc.merge(Partial(sums=sums, weight=h.weight, count=h.count, metrics=ms))
            else:
                cr.acc.accumulate(arrays, h.weight * factor, checked=True)  # the decoder checked it
                cr.acc.partial.weight += h.weight - h.weight * factor
                cr.acc.partial.metrics.merge(ms)
        if cr.task.config.mode.is_async:
            # Which (node, task) pairs are in the buffer: the journal's, against retried uploads.
            cr.accepted.append((h.node_id, h.task_id))
            # A partial's updates: their staleness below plus the partial's own here.
            inside = {k + s: n for k, n in h.staleness.items()} if h.staleness else {s: h.count}
            for k, n in inside.items():
                cr.staleness[k] = cr.staleness.get(k, 0) + n
                if totals is not None:
                    totals[k] = totals.get(k, 0) + n
        if not snapshot:
            return None
        p = cr.acc.partial
        copy = Partial(sums={k: v.copy() for k, v in p.sums.items()}, weight=p.weight, count=p.count,
                       metrics=MetricSums(dict(p.metrics.sums), dict(p.metrics.weights)))
        return BufferState(round=cr.task.round + int(cr.continuation), seq=seq, partial=copy,
                           accepted=list(cr.accepted), staleness=dict(cr.staleness))

    # ------------------------------------------------------------------ secure aggregation

    async def secagg_exchange(self, node_id: str, run_id: str, rnd: int, attempt: int, task_id: str,
                              stage_index: int, message: bytes, header: UploadHeader | None,
                              wait_s: float) -> SecAggReply:
        """Take one stage message (if any), then long-poll up to ``wait_s`` for this node's
        next broadcast."""
        self.touch(node_id)
        ended = self._session_ended(node_id, run_id, rnd, attempt, task_id)
        if ended is not None:
            return ended
        cr, _ = self._assignment(node_id, run_id, rnd, attempt, task_id)
        return await self._secagg(cr, node_id, stage_index, message, header, wait_s, caller=node_id)

    async def secagg_relayed(self, via: str, run_id: str, rnd: int, attempt: int, task_id: str, node_id: str,
                             stage_index: int, message: bytes, header: UploadHeader | None,
                             wait_s: float, bytes_down: int = 0) -> SecAggReply:
        """``secagg_exchange`` for a client below the aggregator child ``via``, which relays
        it (scope "tree"): ``via``'s own task identifies the round, its roster the client.
        ``bytes_down``: what ``via``'s tier sent its nodes since its last report (model
        downloads), for the round's record (a relay pushes no partial that would carry it)."""
        self.touch(via)
        ended = self._session_ended(via, run_id, rnd, attempt, task_id)
        if ended is not None and self.current is not None and self.current.tree is not None \
                and self.current.tree.route.get(node_id) == via:
            return ended
        cr, _ = self._assignment(via, run_id, rnd, attempt, task_id)
        if cr.tree is None or cr.tree.route.get(node_id) != via:
            raise SecAggError(f"client {node_id!r} is not in {via!r}'s roster for round {rnd}")
        if not 0 <= bytes_down <= 1 << 50:
            raise UpdateSchemaError(f"a relay's byte count must be in [0, 2^50], got {bytes_down}")
        reply = await self._secagg(cr, node_id, stage_index, message, header, wait_s, caller=via)
        cr.bytes_down += bytes_down  # once taken: a refused exchange's count comes again with the next
        return reply

    def secagg_now(self, node_id: str, run_id: str, rnd: int, attempt: int, task_id: str, stage_index: int,
                   message: bytes, header: UploadHeader | None) -> SecAggReply:
        """``secagg_exchange`` without the wait, for in-process callers: post the message
        (if any) and return what this node must answer now."""
        return run_inline(self.secagg_exchange(node_id, run_id, rnd, attempt, task_id, stage_index, message,
                                               header, 0.0))

    def _session_ended(self, node_id: str, run_id: str, rnd: int, attempt: int,
                       task_id: str) -> SecAggReply | None:
        """How the round's session ended, for a node of the round that asks after the
        round closed (a client polling once more; a relay's, after the root closed on the
        session's end): None while the round is open, or when it is not this node's."""
        cr = self.current
        if cr is None or not cr.closed or (cr.task.run_id, cr.task.round, cr.task.attempt) != (run_id, rnd, attempt):
            return None
        a = cr.assignments.get(node_id)
        if a is None or a.task_id != task_id:
            return None
        if cr.tree is not None and cr.tree.final is not None:
            return cr.tree.final
        sc = cr.secure
        if sc is None or not sc.finished:
            return None
        return SecAggReply(stage_index_of(sc.stage), b"", sc.stage is Stage.DONE, sc.abort_reason)

    async def _secagg(self, cr: CohortRound, node_id: str, stage_index: int, message: bytes,
                      header: UploadHeader | None, wait_s: float, caller: str) -> SecAggReply:
        """``node_id``: the client whose exchange this is; ``caller``: the child that sent it
        (the client itself, or the aggregator relaying for it), the one a long poll keeps alive."""
        if message and header is not None:
            names = [s.name for s in cr.task.schema]
            if header.node_id != node_id or [s.name for s in header.schema] != names:
                raise UpdateSchemaError("masked-input header does not match the caller or the round's schema")
        if cr.upstream is not None and cr.tree is not None:
            return await self._relay(cr, node_id, stage_index, message, header, wait_s)
        self._secagg_post(cr, node_id, stage_index, message, header)
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
            self.touch(caller)  # never a relayed client: it is no child of this tier

    def _secagg_post(self, cr: CohortRound, node_id: str, stage_index: int, message: bytes,
                     header: UploadHeader | None) -> None:
        sc = cr.secure
        if sc is None:
            if cr.tree is not None and cr.tree.route and not cr.closed:
                if message:
                    raise SecAggError(f"round {cr.task.round}: the secure session has not opened yet "
                                      "(rosters still coming); poll without a message")
                return  # the session opens once the rosters are in: the client polls again
            raise SecAggError(f"round {cr.task.round} runs no secure aggregation for {node_id!r}")
        if message:
            sc.receive(node_id, stage_of(stage_index), message, header)
            self._secure_progress(cr)
            self._notify()

    @staticmethod
    def _secagg_reply(cr: CohortRound, node_id: str) -> SecAggReply:
        sc = cr.secure
        if sc is None:  # tree scope, before the rosters are in
            return SecAggReply(stage_index_of(Stage.ADVERTISE_KEYS), b"", False, "")
        if sc.finished:
            return SecAggReply(stage_index_of(sc.stage), b"", sc.stage is Stage.DONE, sc.abort_reason)
        return SecAggReply(stage_index_of(sc.stage), sc.broadcast(node_id), False, "")

    async def _relay(self, cr: CohortRound, node_id: str, stage_index: int, message: bytes,
                     header: UploadHeader | None, wait_s: float) -> SecAggReply:
        """A tier below the root passes a client's exchange on to the round's session. It
        keeps nothing of the messages, only which clients sent a masked input (the root's
        session counts the messages' bytes; this tier reports its own downloads with the
        exchange); when the session's end comes back, it settles its assignments and closes."""
        tree, up = cr.tree, cr.upstream
        assert tree is not None and up is not None
        if tree.final is not None:
            return tree.final
        if message and stage_of(stage_index) is Stage.MASKED_INPUT:
            check_masked_header(header)
        sent = cr.bytes_down - tree.reported_down
        tree.reported_down = cr.bytes_down
        try:
            reply = await up.exchange(node_id, stage_index, message, header, wait_s, sent)
        except BaseException:
            tree.reported_down -= sent  # not reported: the next exchange carries it
            raise
        if message and stage_of(stage_index) is Stage.MASKED_INPUT:
            tree.inputs.add(node_id)
        if (reply.done or reply.aborted) and tree.final is None:
            self._tree_final(cr, reply)
        return reply

    def _tree_final(self, cr: CohortRound, reply: SecAggReply) -> None:
        """A tier below the root hears that the round's session ended: its clients (and
        aggregator children) count as delivered if a masked input went up through them."""
        tree = cr.tree
        assert tree is not None
        tree.final = reply
        through = {tree.route[n] for n in tree.inputs} if reply.done else set()
        for a in list(cr.assignments.values()):
            cr.settle(a, a.node_id in through)
        if reply.done:
            cr.tier_participants[self.name] = sum(1 for n in tree.inputs if tree.tiers.get(n) == self.name)
        why = "the round's secure session finished at the root" if reply.done else \
            f"the round's secure session aborted at the root: {reply.aborted}"
        self.close_round(cr, why)

    def _secure_progress(self, cr: CohortRound) -> None:
        """Move the session's stages on; fold the cohort's sum once it is unmasked."""
        sc = cr.secure
        if sc is None or cr.closed:
            return
        moved, was_closing = False, sc.closing
        # The unmasking (seconds of mask expansion in a large session) closes on a thread of
        # its own, not on the loop, which goes on answering heartbeats and polls meanwhile.
        while sc.advance(self._wall(), defer_unmasking=not self.inline):
            moved = True
        if sc.closing and not was_closing:  # this call found the unmasking due
            task = asyncio.get_running_loop().create_task(self._unmask_off_loop(cr))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
        if not moved or not sc.finished:
            if moved:
                self._notify()
            return
        self._secure_finished(cr)

    def _secure_finished(self, cr: CohortRound) -> None:
        """The session ended: fold the cohort's sum, or record why there is none."""
        sc = cr.secure
        assert sc is not None and sc.finished
        clients = [a for a in cr.assignments.values() if self.children.get(a.node_id) is not None
                   and self.children[a.node_id].role is Role.CLIENT]
        p = None
        if sc.stage is Stage.DONE:
            try:
                p = sc.partial()
            except SecAggAbort as err:
                for a in clients:
                    cr.settle(a, delivered=False)
                cr.rejected[f"secure aggregation: {err}"] = len(sc.participants)
        tree = cr.tree
        if tree is not None:  # the tree's session: the aggregators below relayed for their clients
            clients = list(cr.assignments.values())
        if p is not None:
            contributed = set(sc.contributors())
            if p.count > 0:
                cr.secure_sum = p  # folded with the outcome (fold_aside), after the fold pool drained
                cr.reserved += p.count
            if tree is None:
                for a in clients:
                    cr.settle(a, a.node_id in contributed)
                cr.tier_participants[self.name] = cr.tier_participants.get(self.name, 0) + p.count
            else:
                through = {tree.route[n] for n in contributed}
                for a in clients:
                    cr.settle(a, a.node_id in through)
                for n in contributed:
                    cr.tier_participants[tree.tiers[n]] = cr.tier_participants.get(tree.tiers[n], 0) + 1
            self.counters["uploads_accepted"] += p.count
        elif sc.stage is not Stage.DONE:
            for a in clients:
                cr.settle(a, delivered=False)
            cr.rejected[f"secure aggregation aborted: {sc.abort_reason}"] = len(sc.participants)
        cr.bytes_up += sc.bytes_up
        cr.bytes_down += sc.bytes_down
        self.counters["bytes_up"] += sc.bytes_up
        self._check_close(cr)
        self._notify()

    async def _unmask_off_loop(self, cr: CohortRound) -> None:
        """Close the session's unmasking stage on the unmasking thread, then go on from its end."""
        sc = cr.secure
        assert sc is not None
        if self._unmask_pool is None:
            self._unmask_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="orchard-unmask")
        try:
            await asyncio.get_running_loop().run_in_executor(self._unmask_pool, sc.close_due_stage)
        except Exception as err:  # a fault, not the protocol's abort (that is recorded by the session)
            sc.failure = f"unmasking failed: {type(err).__name__}: {err}"
        finally:
            sc.closing = False
        if not cr.closed:
            self._secure_finished(cr)

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
        if cr.continuation:  # waits for the next version, whatever the time
            return
        tree = cr.tree
        if tree is not None and cr.secure is None and tree.waiting and not tree.sent:
            # The root opens the session without the rosters of aggregators that fell
            # silent, and at the roster deadline without those still to come; a tier below
            # reports its roster upward the same way.
            tree.waiting = {n for n in tree.waiting if not cr.assignments[n].dropped}
            if not tree.waiting or self._wall() >= tree.roster_deadline:
                if cr.upstream is None:
                    self._open_tree(cr)
                    if cr.closed:
                        return
                else:
                    tree.waiting.clear()
                    self._spawn(cr, self.send_roster(cr))
        if (tree is not None and cr.upstream is not None and tree.final is None and tree.inputs
                and self._wall() < cr.task.deadline_unix + max(5.0, 0.1 * cr.task.config.cohort.deadline_s)):
            # A relay whose clients' masked inputs went up stays open past its own
            # deadline while the root's session unmasks (the root's deadline is later).
            self._check_close(cr)
            return
        if cr.secure is not None:
            self._secure_progress(cr)
            if cr.closed or cr.secure.closing:  # unmasking: the round closes when it ends
                return
        if self._wall() >= cr.task.deadline_unix:
            if self._short(cr):
                # Asynchronous mode never drops an accepted update: a buffer short of its
                # minimum tops its clients up and waits another deadline_s.
                cr.task.deadline_unix = self._wall() + cr.task.config.cohort.deadline_s
                self._select(cr)
                self._notify()
                return
            self._close_buffer(cr, "deadline")
            return
        self._check_close(cr)

    @staticmethod
    def _short(cr: CohortRound) -> bool:
        """An asynchronous buffer below its minimum, ``ceil(target x min_fraction)``: it
        does not close short, it tops up. (Not one that runs a SecAgg+ session over its
        clients: the session is fixed when the buffer opens, and ends by its own rules.)"""
        cfg = cr.task.config
        return (cfg.mode.is_async and not (cfg.secure_aggregation.enabled and cr.clients_selected > 0)
                and cr.received < math.ceil(cr.task.target * cfg.cohort.min_fraction))

    def _check_close(self, cr: CohortRound) -> None:
        if cr.closed or cr.continuation or (cr.secure is not None and cr.secure.closing):
            return
        if cr.received >= cr.task.target:
            self._close_buffer(cr, "target reached")
        elif cr.assignments and cr.open == 0 and cr.clients_selected >= cr.client_quota:
            if self._short(cr):
                self._select(cr)  # everyone it chose delivered or dropped: choose more
                return
            self._close_buffer(cr, "every selected node delivered or dropped")

    def _close_buffer(self, cr: CohortRound, reason: str) -> None:
        """Close a round by its own rules; in asynchronous mode leave a continuation, unless
        the buffer closed short of its minimum (only a SecAgg+ session's buffer can): the
        root retries that round, and what a continuation took would belong to no round."""
        self.close_round(cr, reason)
        cfg = cr.task.config
        full = cr.received >= math.ceil(cr.task.target * cfg.cohort.min_fraction)
        if cfg.mode.is_async and full and self.current is cr:
            self._continue(cr)

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
                            measurements=measurements, staleness=dict(cr.staleness))

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
        if self._unmask_pool is not None:
            self._unmask_pool.shutdown(wait=False, cancel_futures=True)
        if self._mask_workers is not None:
            self._mask_workers.close()
