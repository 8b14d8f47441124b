"""Arrivals in simulated-time order: clients trained, uploads folded, tiers closed.

Uploads are handed to the tier in simulated-time order with ``Coordinator.upload_now``
(the gRPC path's admission, checks, decode and fold), or under secure aggregation posted
as masked inputs (``simulation.secure``). A tier closes when the coordinator says so
(target reached, or its secure session finished), at its deadline (``sweep``; late
devices are refused), or once every selected child delivered or was dropped (vanished
devices are dropped ``node_timeout_s`` after they fell silent). A secure tier's
masked-input stage ends when every selected client answered or at the stage's deadline,
as on a server. A closed tier pushes its partial upward (``ChildRound.partial``, then
``upload_now`` on its parent) after its transfer time.

Client training runs in a backend (threads, processes or Ray) in chunks of
``chunk_size`` clients taken in finish-time order, and only for clients expected to
count: a client that would arrive after its tier closed (past the deadline or the
masked-input stage, or after the tier's first ``target`` arrivals) is not trained,
since its upload would be refused anyway. When the guess is wrong (an earlier upload
failed or was refused, so the tier is still open when the client's turn comes) the
client is trained then.
"""

from __future__ import annotations

import heapq
import itertools
import math
import time
from collections import deque
from concurrent.futures import Future
from typing import Any

from orchard.errors import OrchardError
from orchard.messages import UploadHeader
from orchard.server.round import SimulatedCounts
from orchard.simulation.ahead import TrainingAhead
from orchard.simulation.clients import ClientOutput
from orchard.simulation.context import Context
from orchard.simulation.jobs import FAILED, FOLDED, LATE, Arrival, Jobs, done
from orchard.simulation.secure import SecureClients
from orchard.simulation.tree import Tier, Tree
from orchard.typing import NDArrays, Role

_FIRST_CHUNK = 64  # clients in the first training job of a round (see Arrivals.process)
_HELP_BATCH = 160  # clients the engine trains at a time while it waits on a worker (one vmap slice)
_HELD_HERE_MAX = 1024  # at most this many clients trained by the engine and not yet folded
_JOBS_PER_WORKER = 2  # jobs queued per worker: the next one waits while one runs, so a worker never idles between them


class Arrivals:
    """The round's events in time order: arrivals, deadlines, quiet closes, the end of a
    secure session's masked-input stage and partials pushed up. In a shard's round
    (``partials`` is a list) its tops' partials for the root are collected there."""

    def __init__(self, ctx: Context, tree: Tree, jobs: Jobs, ahead: TrainingAhead, secure: SecureClients) -> None:
        self._ctx = ctx
        self.time = ctx.time
        self._tree = tree
        self.root = tree.root
        self._jobs = jobs
        self._tally = jobs.tally
        self._ahead = ahead
        self._secure = secure
        self._node_timeout_s = ctx.server_cfg.node_timeout_s
        self._aggregator_mbps = ctx.aggregator_mbps
        self.partials: list[tuple[float, str, UploadHeader, bytes]] | None = None

    def process(self, arrivals: list[Arrival], arrays: NDArrays, stats: SimulatedCounts,
                starts: dict[str, NDArrays], tops: list[Tier] | None = None) -> None:
        """Training, uploads and folds in simulated-time order, until the root closes; or,
        with ``tops`` (a shard's subtrees, the root elsewhere), until nothing of theirs is
        left to happen: their partials for the root are collected (``self.partials``)
        and what counts in ``stats`` is logged with its time (``Jobs.log``), since only
        the root says when the round ended (see ``shards.Shard.run``)."""
        ctx = self._ctx
        events: list[tuple[float, int, str, Any]] = []  # (time, seq, kind, payload)
        seq = itertools.count()
        for t in self._tree.tiers(tops):
            if t.cr is not None:
                heapq.heappush(events, (t.cr.task.deadline_unix - self.time.origin, next(seq), "deadline", t))
                if t.cr.secure is not None and t.cr.upstream is None:  # the masked-input stage ends for whoever is missing
                    heapq.heappush(events, (self._secure.input_deadline(t) - self.time.origin, next(seq), "inputs", t))
        for leaf in self._tree.leaves:
            if leaf.cr is not None and leaf.waiting == 0:
                self._schedule_quiet_close(leaf, events, seq)
        self._defer_expected_late(arrivals)
        # Training in finish-time order: arrivals, their outputs (from a worker, or
        # trained here: how many).
        pending: deque[tuple[list[Arrival], Future[list[ClientOutput]], bool, int]] = deque()
        outputs: dict[int, ClientOutput] = {}
        cursor = 0
        backend, job, workers, chunk_size = ctx.backend, self._jobs.job, ctx.workers, ctx.chunk_size
        pace = self._jobs.pace  # jobs of about Pace.JOB_SECONDS of training, once it is measured
        # The first jobs are small and grow to chunk_size: folding starts as soon as the
        # first few clients are trained instead of after a whole chunk (a worker's
        # chunk of 512 digits clients is ~0.1 s the engine would otherwise sit idle).
        # Which clients train, and their results, do not depend on the job sizes.
        limit = min(chunk_size, _FIRST_CHUNK)
        # With worker processes, the engine trains small batches itself while the next
        # worker job it needs is not done (it would only wait), and holds their outputs
        # until their turn; `in_flight` counts the workers' jobs, `unfolded` the
        # clients trained here and not folded yet.
        run_here = getattr(backend, "run_here", None)
        in_flight = unfolded = 0
        ahead = self._ahead.parts  # trained while the round was dispatched
        trained_ahead = self._ahead.take

        def take(size: int) -> list[Arrival]:
            nonlocal cursor
            batch: list[Arrival] = []
            while cursor < len(arrivals) and len(batch) < size:
                a = arrivals[cursor]
                cursor += 1
                if a.leaf.cr is not None and not a.leaf.cr.closed:
                    batch.append(a)
                else:
                    self._never_trained(a, stats)
            return batch

        def refill() -> None:
            nonlocal limit, in_flight
            while in_flight < _JOBS_PER_WORKER * workers and cursor < len(arrivals):
                size, limit = limit, min(chunk_size, 2 * limit)
                batch = take(pace.clients(size))
                if batch:
                    jobs = [job(a) for a in batch if not a.deferred and a.partition not in ahead]
                    if jobs:
                        pending.append((batch, backend.submit(jobs, arrays, starts or None), True, 0))
                        in_flight += 1
                    else:
                        pending.append((batch, done([]), False, 0))

        def help_while_waiting() -> None:
            nonlocal unfolded
            fut = pending[0][1]
            while (run_here is not None and not fut.done() and cursor < len(arrivals)
                   and unfolded < _HELD_HERE_MAX):
                batch = take(pace.clients(_HELP_BATCH))
                if not batch:
                    continue
                jobs = [job(a) for a in batch if not a.deferred and a.partition not in ahead]
                t0 = time.perf_counter()
                got = run_here(jobs, arrays, starts or None) if jobs else []
                pace.timed(len(jobs), time.perf_counter() - t0)
                pending.append((batch, done(got), False, len(jobs)))
                unfolded += len(jobs)

        def root_done() -> bool:
            return tops is None and self.root.cr is not None and self.root.cr.closed

        refill()
        while not root_done():
            next_arrival = pending[0][0][0].finish if pending else math.inf
            next_event = events[0][0] if events else math.inf
            if next_event == math.inf and next_arrival == math.inf:
                break
            if next_event <= next_arrival:
                when, _, kind, obj = heapq.heappop(events)
                self.time.advance_to(when)
                self.event(kind, obj, events, seq, stats)
                continue
            help_while_waiting()
            batch, fut, by_worker, here = pending.popleft()
            for o in fut.result():
                outputs[o.partition] = o
            in_flight -= by_worker
            unfolded -= here
            refill()
            for a in batch:
                # Deadlines and partials due before this arrival come first.
                while events and events[0][0] <= a.finish and not root_done():
                    when, _, kind, obj = heapq.heappop(events)
                    self.time.advance_to(when)
                    self.event(kind, obj, events, seq, stats)
                if root_done():
                    stats.late += 1
                    continue
                self.time.advance_to(a.finish)
                o = outputs.pop(a.partition, None) or trained_ahead(a.partition)
                if a.deferred:
                    if a.leaf.cr is None or a.leaf.cr.closed:  # as expected
                        self._never_trained(a, stats)
                        continue
                    # Its tier is still open (an upload before it failed or was refused):
                    # train it now, as it would have been (here when the backend can).
                    if o is None:
                        one = [job(a)]
                        (o,) = (run_here(one, arrays, starts or None) if run_here is not None
                                else backend.submit(one, arrays, starts or None).result())
                assert o is not None  # every client not deferred was in a job
                self._arrive(a, o, events, seq, stats)
            outputs.clear()
        # Whoever had not arrived when the root closed is late, whether or not its job was
        # already out (how far ahead jobs ran depends on the backend, not on the round).
        for batch, fut, _, _ in pending:
            fut.cancel()
            stats.late += len(batch)
        stats.late += len(arrivals) - cursor
        self._ahead.forget()

    @staticmethod
    def _never_trained(a: Arrival, stats: SimulatedCounts) -> None:
        """A client whose tier closed before its upload: late, and never trained."""
        stats.late += 1
        a.leaf.waiting -= 1
        a.leaf.working.discard(a.node_id)

    def _defer_expected_late(self, arrivals: list[Arrival]) -> None:
        """Mark the arrivals expected to find their tier closed: past the tier's deadline,
        or after the tier's first ``target`` arrivals (which close it). Only a guess --
        an upload that fails or is refused leaves the tier open for one more, and then a
        deferred client is trained when its turn comes -- but it is right in the common
        case, and an over-selected round then trains only the clients that count."""
        seen: dict[int, int] = {}
        session, input_deadline = self._secure.session, self._secure.input_deadline
        origin = self.time.origin
        for a in arrivals:  # in finish-time order
            cr = a.leaf.cr
            assert cr is not None  # a client arrives only at a tier that opened
            if session(a.leaf) is not None:  # a secure session takes every masked input until its stage ends
                a.deferred = a.finish >= input_deadline(a.leaf) - origin
                continue
            k = seen.get(id(a.leaf), 0)
            seen[id(a.leaf)] = k + 1
            a.deferred = k >= cr.task.target or a.finish >= cr.task.deadline_unix - origin

    def _arrive(self, a: Arrival, o: ClientOutput, events: list, seq: Any, stats: SimulatedCounts) -> None:
        leaf = a.leaf
        leaf.waiting -= 1
        leaf.working.discard(a.node_id)
        if o.header is None:
            what = FAILED
        elif leaf.cr is None or leaf.cr.closed:
            what = LATE
        else:
            what = FOLDED
            try:
                if a.node_id in leaf.secure:
                    self._secure.post_input(leaf, a, o)
                else:
                    leaf.coord.upload_now(a.node_id, o.header, o.payload)
            except OrchardError as err:
                what = type(err).__name__
        self._tally(stats, a.finish, True, what, a.partition, o.codec_state if what == FOLDED else None)
        if leaf.cr is not None and not leaf.cr.closed and leaf.waiting == 0:
            self._schedule_quiet_close(leaf, events, seq)
        self._after(leaf, events, seq)

    def _schedule_quiet_close(self, leaf: Tier, events: list, seq: Any) -> None:
        """Nobody else will upload: the tier closes once it has dropped the silent ones."""
        assert leaf.cr is not None
        at = max(self.time.t, leaf.last_silence + self._node_timeout_s)
        heapq.heappush(events, (at, next(seq), "quiet", leaf))

    def event(self, kind: str, obj: Any, events: list, seq: Any, stats: SimulatedCounts) -> None:
        """Handle one event that fell due (the clock is at its time): a partial reaching
        its parent, or a tier's deadline, quiet close or masked-input deadline."""
        if kind == "partial":
            below, header, payload = obj
            parent = below.parent
            try:
                parent.coord.upload_now(below.name, header, payload)
            except OrchardError as err:
                self._tally(stats, self.time.t, False, type(err).__name__)
            self._after(parent, events, seq)
            return
        tier: Tier = obj
        if tier.cr is None or tier.cr.closed:
            self._after(tier, events, seq)
            return
        if kind == "deadline":
            self._heartbeats(tier)
            tier.coord.sweep()
            if not tier.cr.closed and not SecureClients.relays(tier):  # the virtual wall sits exactly on the deadline
                tier.coord.close_round(tier.cr, "deadline")
        elif kind == "quiet":
            self._heartbeats(tier)
            tier.coord.sweep()
        elif kind == "inputs":
            # The tier moves its session on at the stage's deadline (sweep); the clients
            # whose masked inputs are in answer the unmasking stage.
            self._heartbeats(tier)
            tier.coord.sweep()
            if not tier.cr.closed:
                self._secure.answer(tier)
        self._after(tier, events, seq)

    @staticmethod
    def _heartbeats(tier: Tier) -> None:
        """Clients still training keep heartbeating, and so do secure clients whose masked
        input is in (they long-poll for the unmasking stage); a sweep drops only the silent."""
        assert tier.cr is not None
        for a in tier.cr.pending():
            c = tier.coord.children.get(a.node_id)
            polling = a.node_id in tier.secure and tier.secure[a.node_id][0].sent_input
            if c is not None and (c.role is Role.AGGREGATOR or a.node_id in tier.working or polling):
                tier.coord.touch(a.node_id)

    def _after(self, tier: Tier, events: list, seq: Any) -> None:
        """If ``tier`` just closed, push its partial up (after the transfer time)."""
        if tier.cr is None or not tier.cr.closed or tier.pushed:
            return
        tier.pushed = True
        child = tier.child
        if child is None or child.relays:  # the root, or a relay: its clients are in the root's sum
            return
        up = child.partial(tier.coord.outcome(tier.cr))
        assert up is not None
        header, payload = up
        at = self.time.t + len(payload) * 8 / (self._aggregator_mbps * 1e6)
        if self.partials is not None and tier.parent is self.root:  # a shard's top: the root is elsewhere
            self.partials.append((at, tier.name, header, payload))
            return
        heapq.heappush(events, (at, next(seq), "partial", (tier, header, payload)))
