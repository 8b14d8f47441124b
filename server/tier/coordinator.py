"""The coordinator: the one piece of round logic that every tier runs.

A root is a coordinator whose rounds come from a run (``orchard.server.root``); an
aggregator is a coordinator whose rounds come from its upstream and whose results go
back up (``orchard.server.aggregator``). A tree of any depth is configuration.

This class is the round loop and the tier's public API; every rule of a protocol lives
in a sibling behind an interface, picked per round from its config:

- ``registry.py``: the children (join, touch, liveness, capacity, expiry);
- ``policy.py`` -> ``sync.py`` | ``buffered.py``: how a round opens, selects, admits,
  folds and closes (synchronous rounds, FedBuff buffers);
- ``uploads.py``: one upload from header to fold (admission, decode, reserve, fold,
  delivered);
- ``secure.py`` -> ``secure_cohort.py`` | ``secure_tree.py``: secure aggregation per
  cohort or over the whole tree (open, messages, sweep, close guards);
- ``executor.py``: where CPU work and sends run (pooled off the loop, or inline);
- ``orchard.server.cohort``: the round's state, changed only through its methods.

Per round: split the target among live, eligible children (aggregators in proportion
to their eligible pool; direct clients chosen by the policy); hand out assignments when
selected children long-poll; fold accepted uploads; close at the target, when every
selected child settled, or at the deadline, and return a ``RoundOutcome``.

Concurrency: everything here runs on the server's asyncio loop. State is mutated only
between awaits, so no lock guards it; decode and fold run on the executor. Nothing here
awaits a network send while round state is half-updated. An in-process coordinator
(``inline=True``: the simulator, tests) finishes its coroutines without suspending, and
:meth:`upload_now` and :meth:`secagg_now` drive them to the end synchronously.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import time
from collections.abc import Callable

import numpy as np

from orchard.config import RunConfig, ServerConfig
from orchard.errors import OrchardError, RoundClosedError, SecAggError, UpdateSchemaError
from orchard.messages import Idle, TaskAssignment, UploadHeader
from orchard.server.buffer import BufferState
from orchard.server.cohort import Assignment, CohortRound
from orchard.server.downlink import DownlinkCache, ModelReply, full_reply
from orchard.server.round import RoundOutcome, RoundTask
from orchard.server.secagg import SecAggReply, SecureUpstream
from orchard.server.tier import selection, uploads
from orchard.server.tier.executor import Executor, executor_for, run_inline
from orchard.server.tier.policy import RoundPolicy, policy_for
from orchard.server.tier.registry import Child, Registry
from orchard.server.tier.secure import NoSecure, SecureProtocol, secure_for
from orchard.server.tier.uploads import AckLog, Upload, UploadSlot
from orchard.typing import DeviceState, NDArrays, Role

# Decodes a client's payload into a float32 delta (codec-specific; see orchard.server.decoding).
ClientDecoder = Callable[[UploadHeader, bytes | bytearray | memoryview, RoundTask], NDArrays]


class Coordinator:
    def __init__(self, name: str, cfg: ServerConfig, rng: np.random.Generator,
                 client_decoder: ClientDecoder, monotonic: Callable[[], float] = time.monotonic,
                 wall: Callable[[], float] = time.time, inline: bool = False,
                 noise_rng: np.random.Generator | None = None) -> None:
        self.name = name
        self.cfg = cfg
        self.rng = rng
        # Central DP noise at the root: OS entropy unless the caller (a seeded simulation)
        # passes a generator; never the seeded selection generator.
        self.noise_rng = noise_rng if noise_rng is not None else np.random.default_rng()
        self.decode_client = client_decoder
        self.now, self.wall = monotonic, wall
        self.executor: Executor = executor_for(name, cfg, inline)
        self.registry = Registry(cfg.node_timeout_s, monotonic, ready_s=max(5.0, cfg.heartbeat_s))
        self.children: dict[str, Child] = self.registry.children
        self.current: CohortRound | None = None
        self._policies: dict[str, RoundPolicy] = {}
        self._secures: dict[str, SecureProtocol] = {}
        self.policy: RoundPolicy = policy_for(self, "sync", self._policies)  # the current round's
        self.secure: SecureProtocol = NoSecure(self)
        # Long-pollers wait on the current event; a change sets it and installs a fresh one,
        # so waiting needs no lock and a timeout cannot leave one half-held.
        self._changed = asyncio.Event()
        self._changed_watched = False  # whether a waiter holds _changed (else there is no one to wake)
        self._ids = itertools.count()
        self.upload_slots = asyncio.Semaphore(cfg.max_inflight_uploads)
        # Models nodes below may hold, for downlink deltas (orchard.server.downlink).
        self.downlink = DownlinkCache()
        self.counters: dict[str, int] = {"uploads_accepted": 0, "uploads_rejected": 0, "bytes_up": 0,
                                         "bytes_down": 0, "rounds_closed": 0}
        self.staleness: dict[int, int] = {}  # asynchronous mode: updates folded over the run, by staleness
        # Called on the loop after an accepted fold, before the upload is acknowledged: by a root
        # (async: the buffer's state), by an aggregator (the client upload's ids, ackjournal.py).
        self.journal: Callable[[BufferState], None] | None = None
        self.acks: AckLog | None = None
        self.certificates: Callable[[str], bytes | None] = lambda node: None  # the tier's authenticator's

    # ------------------------------------------------------------------ registry

    def join(self, node_id: str, role: Role, token_hash: str, device: DeviceState, waiting: bool = True) -> str:
        """``waiting``: the node waits for work from now (in-process); else once it polls.
        No long-poller is woken: what one waits for (its own assignment) does not change
        when another node joins, and waking them all makes a thousand joins cost a million."""
        return self.registry.join(node_id, role, token_hash, device, waiting)

    def child(self, node_id: str, token_hash: str | None = None) -> Child:
        return self.registry.child(node_id, token_hash)

    def touch(self, node_id: str, device: DeviceState | None = None, pool_size: int | None = None,
              pool_eligible: int | None = None) -> Child:
        return self.registry.touch(node_id, device, pool_size, pool_eligible)

    def live(self, c: Child) -> bool:
        return self.registry.live(c)

    def capacity(self, cfg: RunConfig | None = None) -> tuple[int, int]:
        """(live clients below this tier, eligible clients below this tier)."""
        return self.registry.capacity(cfg)

    def expire_children(self) -> list[str]:
        """Forget nodes long unseen (``Registry.expire``), but those the open round holds."""
        cr = self.current
        return self.registry.expire(lambda n: cr is not None and n in cr.assignments)

    def leave(self, node_id: str) -> None:
        """A node goes away now (a simulated device at the end of its round; a client that
        says goodbye). An assignment it holds stays, and is dropped by the sweep."""
        self.registry.leave(node_id)

    # ------------------------------------------------------------------ rounds

    def open_round(self, task: RoundTask, restore: BufferState | None = None,
                   upstream: SecureUpstream | None = None) -> CohortRound:
        """Open ``task``'s round (asynchronous mode: its buffer). ``restore``: a journaled
        buffer of this round to take back first (a restarted root). ``upstream``: a tier
        below the root, its way to the round's secure session when that spans the whole
        tree; the tier then reports its roster with :meth:`send_roster`."""
        prev = self.current
        if task.config.downlink_delta and prev is not None and prev.task.model_hash != task.model_hash:
            # Nodes that trained last round hold that model: keep it as a delta base
            # (only when deltas are on: each base is one more model in memory).
            self.downlink.remember(prev.task.model_hash, prev.task.model_blob)
        self.policy = policy_for(self, task.config.mode.kind, self._policies)
        self.secure = secure_for(self, task, self._secures)
        cr = self.policy.open(prev, task, restore, upstream)
        selection.select(self, cr)
        self.secure.open(cr)
        self.notify()
        return cr

    def new_assignment(self, cr: CohortRound, node_id: str, target: int) -> Assignment:
        t = cr.task
        a = Assignment(node_id, f"{t.run_id}.{t.round}.{t.attempt}.{next(self._ids)}", target, round=t.round)
        cr.add(a, self.registry.assigned(node_id))
        return a

    async def poll(self, node_id: str, device: DeviceState | None, pool_size: int | None,
                   pool_eligible: int | None, wait_s: float) -> TaskAssignment | Idle:
        """Long-poll: this node's assignment as soon as there is one, else Idle after ``wait_s``."""
        c = self.touch(node_id, device, pool_size, pool_eligible)
        deadline = self.now() + max(0.0, min(wait_s, self.cfg.long_poll_s))
        self.registry.poll_started(c)
        gone = False
        try:
            while (got := self.assign(node_id)) is None:
                if (remaining := deadline - self.now()) <= 0:
                    return Idle(retry_after_s=0.0, reason=selection.idle_reason(self, node_id))
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self.watch().wait(), timeout=remaining)
                self.touch(node_id)
            return got
        except asyncio.CancelledError:  # gRPC cancels the call when its peer disconnects
            gone = True
            raise
        finally:
            self.registry.poll_ended(c, gone)

    def assign(self, node_id: str) -> TaskAssignment | None:
        """This node's task in the open round, if it is selected (or may fill in an unused
        slot); None otherwise. What ``poll`` answers without waiting."""
        cr = self.current
        if cr is None or cr.closed or self.policy.waits(cr):
            return None
        a = cr.assignments.get(node_id)
        c = self.children[node_id]
        a = self.policy.reshare(cr, a, c) or a
        if a is None:
            # Fill-in: a client that arrived after selection may take an unused quota slot.
            if (c.role is Role.CLIENT and self.secure.takes_fill_ins and cr.clients_selected < cr.client_quota
                    and cr.received < cr.task.target and self.registry.may_select(c, cr.task.config)):
                a = self.new_assignment(cr, node_id, 1)
                self.registry.participation.flush()  # durable before the device takes its task
            else:
                return None
        if a.delivered or a.dropped:
            return None
        cr.hand_out(a)
        return selection.task_for(self, cr, a)

    def heartbeat(self, node_id: str, device: DeviceState | None, task_id: str) -> bool:
        self.touch(node_id, device)
        cr = self.current
        if cr is None or cr.closed:
            return False
        a = cr.assignments.get(node_id)
        return a is not None and a.task_id == task_id and not a.delivered and not a.dropped

    def model_blob(self, model_hash: str) -> bytes:
        cr = self.current
        older = self.policy.model_blob(cr, model_hash)
        if older is not None:
            return older
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
        return await self.downlink.reply(blob, model_hash, have_hash, self.executor.pool(), cr.task.config.downlink_codec)

    def count_bytes_down(self, n: int) -> None:
        self.counters["bytes_down"] += n
        if self.current is not None:
            self.current.count_bytes(down=n)

    # ------------------------------------------------------------------ uploads (uploads.py)

    def begin_upload(self, node_id: str, h: UploadHeader) -> UploadSlot:
        """Check an upload's header against the open round and reserve the caller's slot."""
        return uploads.begin(self, node_id, h)

    def upload(self, node_id: str, h: UploadHeader) -> Upload:
        """One upload, from its header to its fold, as a context manager: admits the header
        and reserves the caller's slot on entry (the slot is what ``with`` gives); if the
        body raises (a bad payload, a broken stream), the slot is released and the refusal
        counted, so the node may try again."""
        return Upload(self, node_id, h)

    def upload_now(self, node_id: str, h: UploadHeader, payload: bytes) -> None:
        """An in-process upload on an inline coordinator: the gRPC path's admission,
        integrity check, decode and fold, run to the end on the caller's thread."""
        self.executor.in_process("upload_now")
        with Upload(self, node_id, h) as slot:
            run_inline(uploads.complete(self, slot, payload))

    def abort_upload(self, slot: UploadSlot, reason: str) -> None:
        uploads.abort(self, slot, reason)

    def reject(self, err: OrchardError) -> None:
        uploads.refuse(self, self.current, type(err).__name__)

    async def complete_upload(self, slot: UploadSlot, payload: bytes | bytearray | memoryview) -> None:
        """Check (size and sha256 against the header), decode and fold a fully received payload."""
        await uploads.complete(self, slot, payload)

    # ------------------------------------------------------------------ secure aggregation (secure*.py)

    async def secagg_exchange(self, node_id: str, run_id: str, rnd: int, attempt: int, task_id: str,
                              stage_index: int, message: bytes, header: UploadHeader | None,
                              wait_s: float) -> SecAggReply:
        """Take one stage message (if any), then long-poll ``wait_s`` for its next broadcast."""
        self.touch(node_id)
        ended = self._session_ended(node_id, run_id, rnd, attempt, task_id)
        if ended is not None:
            return ended
        cr, _ = uploads.assignment(self, node_id, run_id, rnd, attempt, task_id)
        return await self.secure.exchange(cr, node_id, stage_index, message, header, wait_s, node_id)

    async def secagg_relayed(self, via: str, run_id: str, rnd: int, attempt: int, task_id: str, node_id: str,
                             stage_index: int, message: bytes, header: UploadHeader | None,
                             wait_s: float, bytes_down: int = 0) -> SecAggReply:
        """``secagg_exchange`` for a client below the aggregator child ``via``, which relays
        it (scope "tree"): ``via``'s own task identifies the round, its roster the client.
        ``bytes_down``: what ``via``'s tier sent its nodes since its last report (model
        downloads), for the round's record (a relay pushes no partial that would carry it)."""
        self.touch(via)
        ended = self._session_ended(via, run_id, rnd, attempt, task_id)
        if ended is not None and self.current is not None and self.secure.relays_for(self.current, via, node_id):
            return ended
        cr, _ = uploads.assignment(self, via, run_id, rnd, attempt, task_id)
        if not self.secure.relays_for(cr, via, node_id):
            raise SecAggError(f"client {node_id!r} is not in {via!r}'s roster for round {rnd}")
        if not 0 <= bytes_down <= 1 << 50:
            raise UpdateSchemaError(f"a relay's byte count must be in [0, 2^50], got {bytes_down}")
        reply = await self.secure.exchange(cr, node_id, stage_index, message, header, wait_s, via)
        cr.count_bytes(down=bytes_down)  # once taken: a refused exchange's count comes again with the next
        return reply

    def secagg_now(self, node_id: str, run_id: str, rnd: int, attempt: int, task_id: str, stage_index: int,
                   message: bytes, header: UploadHeader | None) -> SecAggReply:
        """``secagg_exchange`` without the wait, for in-process callers."""
        return run_inline(self.secagg_exchange(node_id, run_id, rnd, attempt, task_id, stage_index, message,
                                               header, 0.0))

    def _session_ended(self, node_id: str, run_id: str, rnd: int, attempt: int,
                       task_id: str) -> SecAggReply | None:
        """How the round's session ended, for a node of the round that asks after the round
        closed: None while the round is open, or when it is not this node's."""
        cr = self.current
        if cr is None or not cr.closed or (cr.task.run_id, cr.task.round, cr.task.attempt) != (run_id, rnd, attempt):
            return None
        a = cr.assignments.get(node_id)
        if a is None or a.task_id != task_id:
            return None
        return self.secure.ended(cr)

    async def secagg_roster(self, via: str, run_id: str, rnd: int, attempt: int, task_id: str,
                            nodes: list[str], tiers: list[str]) -> None:
        """An aggregator child reports the clients selected below it for the round's
        tree-scope session (``tiers``: the lowest tier of each)."""
        self.touch(via)
        cr, a = uploads.assignment(self, via, run_id, rnd, attempt, task_id)
        await self.secure.roster(cr, a, via, nodes, tiers)

    async def send_roster(self, cr: CohortRound) -> None:
        """A tier below the root: report this round's roster upward once it is complete."""
        await self.secure.send_roster(cr)

    # ------------------------------------------------------------------ closing

    def sweep(self) -> None:
        """Drop silent selected nodes, enforce the deadline; called periodically."""
        cr = self.current
        if cr is None or cr.closed:
            return
        selection.drop_silent(self, cr)
        if self.policy.waits(cr) or self.secure.sweep(cr):
            return
        if self.wall() >= cr.task.deadline_unix:
            if self.policy.short(cr):
                # Never drop an accepted update: a buffer short of its minimum tops its
                # clients up and waits another deadline_s.
                cr.extend_deadline(self.wall() + cr.task.config.cohort.deadline_s)
                selection.select(self, cr)
                self.notify()
                return
            self._close(cr, "deadline")
            return
        self.check_close(cr)

    def check_close(self, cr: CohortRound) -> None:
        if cr.closed or self.policy.waits(cr) or self.secure.holds_close(cr):
            return
        if cr.received >= cr.task.target:
            self._close(cr, "target reached")
        elif cr.assignments and cr.open == 0 and cr.clients_selected >= cr.client_quota:
            if self.policy.short(cr):
                selection.select(self, cr)  # everyone it chose delivered or dropped: choose more
                return
            self._close(cr, "every selected node delivered or dropped")

    def _close(self, cr: CohortRound, reason: str) -> None:
        """Close a round by its own rules; the policy says what follows (a continuation)."""
        self.close_round(cr, reason)
        self.policy.closed(cr)

    def close_round(self, cr: CohortRound, reason: str) -> None:
        if cr.close(reason):
            self.counters["rounds_closed"] += 1
            self.notify()

    async def wait_round(self, cr: CohortRound) -> RoundOutcome:
        await cr.closed_event.wait()
        await self.executor.drain()  # folds already queued finish before the partial is read
        return self.outcome(cr)

    def outcome(self, cr: CohortRound) -> RoundOutcome:
        """The result of a closed round, once its folds are done (the simulator calls this)."""
        partial, measurements = cr.result()
        dropped = sum(1 for a in cr.assignments.values() if a.dropped) + cr.dropped_below
        return RoundOutcome(task=cr.task, partial=partial, selected=len(cr.assignments), dropped=dropped,
                            bytes_up=cr.bytes_up, bytes_down=cr.bytes_down,
                            tier_participants=dict(cr.tier_participants), reason=cr.close_reason,
                            seconds=self.now() - cr.started, rejected=dict(cr.rejected),
                            measurements=measurements, staleness=dict(cr.staleness))

    def watch(self) -> asyncio.Event:
        """The event a long-poller waits on; set (and replaced) at the next change."""
        self._changed_watched = True
        return self._changed

    def notify(self) -> None:
        # A tier notifies on every fold; with no long-poller holding the event (the
        # simulator, a busy round) there is nothing to wake and nothing to replace.
        if not self._changed_watched:
            return
        ev, self._changed, self._changed_watched = self._changed, asyncio.Event(), False
        ev.set()

    def shutdown(self) -> None:
        self.executor.shutdown()
