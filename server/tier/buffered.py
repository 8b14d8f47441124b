"""FedBuff's buffers (``[run.mode] kind = "async"``; Nguyen et al., 2022): a round is a
buffer of K updates over whatever model versions the clients trained on.

The rules, all here::

    open          carry: assignments still training from versions r-S..r-1 move into the
                  new buffer (secure clients do not: a masked input belongs to its
                  session); the previous buffer, if still open (a continuation, or one the
                  upstream moved past), moves its sums in, in the fold pool after the
                  folds queued into it; a restarted root takes its journaled buffer back
    select        top the clients training up to ceil(K x over_selection) (the concurrency)
    assign        an aggregator that emitted its buffer takes a fresh share of this one
    admit         check_version: unknown run/version, future, too stale -> named refusals
    decode        an update of an earlier version with that version's shared seed
    fold          through the round's stack, whose stale stage weights it by f(s)
                  (aggregation.layer.stale); histogram += {s: 1} (a partial: its own
                  histogram shifted by s); the root journals the buffer after each fold
    short         below ceil(K x min_fraction) at the deadline, or with every chosen
                  client settled: select again and extend the deadline (never close short)
    close at K    a continuation (same task, ahead = 1) takes what arrives until the next
                  open; none after a secure buffer closed short (the root retries it);
                  a root's continuation of the run's last buffer refuses what comes
    compressed    sums in the compressed domain only when every update is of the buffer's
                  own version (max_staleness = 0) and nothing is journaled
"""

from __future__ import annotations

import dataclasses
import math
from typing import TYPE_CHECKING

from orchard.compression import sums_compressed
from orchard.errors import RoundClosedError
from orchard.messages import UploadHeader
from orchard.server.admission import check_version
from orchard.server.buffer import BufferState, Held
from orchard.server.cohort import Assignment, CheckedUpload, CohortRound
from orchard.server.round import RoundTask, round_seed
from orchard.server.secagg import SecureUpstream
from orchard.server.selection import pick
from orchard.server.tier.policy import new_round, supersede
from orchard.typing import NDArrays, Role

if TYPE_CHECKING:
    from orchard.server.tier.coordinator import Coordinator
    from orchard.server.tier.registry import Child
    from orchard.server.tier.uploads import UploadSlot


class BufferedPolicy:
    def __init__(self, tier: Coordinator) -> None:
        self.tier = tier
        # The model of the previous version, for clients that were assigned it just before
        # the version moved on and pull it after (two models at most: O(model)).
        self._prev_model: tuple[str, bytes] | None = None
        # Round task views with an older version's shared seed, to decode an update trained
        # on that version (random-k's indices); a few at a time.
        self._version_tasks: dict[tuple[int, int, int], RoundTask] = {}
        self._folds = 0  # folds made: orders journal states

    # ------------------------------------------------------------------ open

    def open(self, prev: CohortRound | None, task: RoundTask, restore: BufferState | None,
             upstream: SecureUpstream | None) -> CohortRound:
        tier = self.tier
        carry = prev is not None and prev.task.config.mode.is_async and prev.task.run_id == task.run_id
        if not carry:
            supersede(tier, prev, task)
        if carry and prev is not None and prev.task.model_hash != task.model_hash:
            self._prev_model = (prev.task.model_hash, prev.task.model_blob)
        cr = new_round(tier, task, self._compressed(task), upstream)
        tier.current = cr
        if carry and prev is not None:
            self._carry(prev, cr)
        if restore is not None:
            self._restore(cr, restore)
        return cr

    def _compressed(self, task: RoundTask) -> bool:
        """Payloads of other versions were encoded with other shared seeds and are decoded;
        a root that journals its buffer decodes too (the journal stores the decoded sum)."""
        return sums_compressed(task.config) and task.config.mode.max_stale == 0 and self.tier.journal is None

    def _carry(self, prev: CohortRound, cr: CohortRound) -> None:
        """The assignments still training (within ``max_staleness`` of the new version)
        and, if ``prev`` is still open, its folded updates."""
        S = cr.task.config.mode.max_stale
        secure = cr.task.config.secure_aggregation.enabled
        children = self.tier.children
        for a in prev.assignments.values():
            c = children.get(a.node_id)
            if a.delivered or a.dropped or c is None or cr.task.round - a.round > S:
                continue
            if secure and c.role is Role.CLIENT:
                continue  # a client's masked input belongs to its buffer's SecAgg+ session
            cr.add(a, c.role is Role.CLIENT)
        if prev.close(f"moved into the buffer of round {cr.task.round}"):
            if self.tier.acks is not None:
                self.tier.acks.moved(prev, cr)
            cr.absorb_counts(prev)
            # After the folds already queued into ``prev``, before any into ``cr``.
            self.tier.executor.after_folds(cr.absorb_sums, prev, then=lambda: self._moved(cr))

    def _moved(self, cr: CohortRound) -> None:
        self.tier.check_close(cr)
        self.tier.notify()

    def _restore(self, cr: CohortRound, state: BufferState) -> None:
        """A restarted root takes its journaled buffer back: the sum of every update it had
        acknowledged, those updates' (node, task) pairs (a retried upload of one is a
        duplicate), and the assignments still training, whose nodes are registered again
        (from the journal: role and token hash) with a fresh timeout to come back in."""
        tier = self.tier
        cr.restore(state)
        for k, v in state.counters.items():
            tier.counters[k] = v
        self._folds = max(self._folds, state.seq)
        done = set(state.accepted)
        for h in state.held:
            if (h.node_id, h.task_id) in done or h.node_id in cr.assignments:
                continue
            c = tier.registry.register(h.node_id, Role(h.role), h.token_hash)
            cr.add(Assignment(h.node_id, h.task_id, h.target, handed_out=True, round=h.round),
                   c.role is Role.CLIENT)
        for node, task_id in state.accepted:
            if node not in cr.assignments:
                cr.record_delivered(Assignment(node, task_id, 1, handed_out=True, delivered=True,
                                               round=cr.task.round))

    # ------------------------------------------------------------------ select, assign

    def choose(self, cr: CohortRound, clients: list[str], share: int) -> list[str]:
        """The quota is the concurrency: top the clients still training (carried over from
        earlier buffers) up to it with clients that are free."""
        children = self.tier.children
        free = [k for k in clients if k not in cr.assignments]
        busy = sum(1 for a in cr.assignments.values() if not (a.delivered or a.dropped)
                   and a.node_id in children and children[a.node_id].role is Role.CLIENT)
        return pick(free, max(0, cr.client_quota - busy), self.tier.rng)

    def reshare(self, cr: CohortRound, a: Assignment | None, child: Child) -> Assignment | None:
        """An aggregator that emitted its buffer takes another share of this version's
        buffer (the clients below it keep training meanwhile)."""
        if a is None or not a.settled or child.role is not Role.AGGREGATOR or cr.received >= cr.task.target:
            return None
        return self.tier.new_assignment(cr, child.node_id, max(1, min(child.pool_eligible,
                                                                      cr.task.target - cr.received)))

    # ------------------------------------------------------------------ uploads

    def admit(self, cr: CohortRound | None, run_id: str, rnd: int, attempt: int) -> int:
        if cr is None:
            raise RoundClosedError("no buffer is open at this tier; poll for a task")
        t, _ = check_version(cr.task, cr.closed, cr.close_reason, run_id, rnd, cr.task.config.mode.max_stale,
                             int(cr.continuation))
        return t.round

    def task_of(self, cr: CohortRound, h: UploadHeader) -> RoundTask:
        """The buffer's task, or an earlier version's view of it, whose shared seed differs
        (a random-k update is decoded with the indices it was encoded with)."""
        t = cr.task
        if h.round == t.round and h.attempt == t.attempt:
            return t
        key = (h.round, h.attempt, id(t))
        view = self._version_tasks.get(key)
        if view is None:
            if len(self._version_tasks) >= 8:
                self._version_tasks.clear()
            view = self._version_tasks[key] = dataclasses.replace(
                t, round=h.round, attempt=h.attempt, shared_seed=round_seed(t.config.seed, h.round, h.attempt))
        return view

    def fold_into(self, slot: UploadSlot) -> CohortRound:
        """The upload's own buffer, or, when that one closed while the payload arrived, the
        buffer its assignment moved into."""
        cr, cur = slot.cohort, self.tier.current
        if (cr.closed and cur is not None and cur is not cr and not cur.closed
                and cur.assignments.get(slot.assignment.node_id) is slot.assignment):
            slot.cohort = cur
            return cur
        return cr

    def staleness(self, cr: CohortRound, h: UploadHeader) -> int:
        """Refuses an update that became too stale while it arrived."""
        m = cr.task.config.mode
        return check_version(cr.task, False, "", h.run_id, h.round, m.max_stale, int(cr.continuation))[1]

    def reserve(self, cr: CohortRound, h: UploadHeader) -> None:
        """As sync, but a buffer may take a few more than K (those in flight at K). A root's
        continuation of the run's last buffer takes nothing: no version follows to apply it."""
        if cr.closed:
            raise RoundClosedError(f"round {cr.task.round} closed ({cr.close_reason}) while the upload arrived; "
                                   "late uploads are refused")
        if cr.continuation and self.tier.journal is not None and cr.task.round >= cr.task.config.rounds:
            raise RoundClosedError(f"round {cr.task.round}, the run's last, is full: nothing would apply this "
                                   "update; it is refused")
        cr.reserve(h.count)

    def fold(self, cr: CohortRound, h: UploadHeader, arrays: NDArrays | CheckedUpload,
             staleness: int) -> BufferState | None:
        """Fold (the stack's stale stage weights it) and count its staleness, in the
        buffer's histogram and the tier's, with the sum; with a journal, the buffer's
        state right after this fold."""
        cr.fold(h, arrays, staleness)
        inside = {k + staleness: n for k, n in h.staleness.items()} if h.staleness else {staleness: h.count}
        cr.record_fold(h.node_id, h.task_id, inside, self.tier.staleness)
        if self.tier.journal is None:
            return None
        self._folds += 1
        return cr.snapshot(self._folds)

    def folded(self, cr: CohortRound, snap: BufferState) -> None:
        """Complete a state taken right after a fold (sums, accepted) with what the loop
        keeps (assignments still training, counters) and journal it. After the update
        counts as delivered, before it is acknowledged: if the store fails, the node hears
        an error and its retry is a duplicate, never a second update."""
        tier = self.tier
        assert tier.journal is not None
        children = tier.children
        snap.held = [Held(a.node_id, a.task_id, a.round, a.target, children[a.node_id].role.value,
                          children[a.node_id].token_hash)
                     for a in cr.assignments.values() if not a.settled and a.node_id in children]
        snap.counters = dict(tier.counters)
        tier.journal(snap)

    # ------------------------------------------------------------------ closing

    def waits(self, cr: CohortRound) -> bool:
        return cr.continuation  # waits for the next version, whatever the time

    def short(self, cr: CohortRound) -> bool:
        """Below ``ceil(target x min_fraction)``: top up rather than close. (Not a buffer
        with a SecAgg+ session over its clients: the session is fixed when the buffer
        opens, and ends by its own rules.)"""
        cfg = cr.task.config
        return (not (cfg.secure_aggregation.enabled and cr.clients_selected > 0)
                and cr.received < math.ceil(cr.task.target * cfg.cohort.min_fraction))

    def closed(self, cr: CohortRound) -> None:
        """A buffer that filled leaves a continuation for the same version, so updates
        arriving before the next version opens are folded, not refused. Not one closed
        short of its minimum (only a secure buffer can): the root retries that round, and
        what a continuation took would belong to no round."""
        full = cr.received >= math.ceil(cr.task.target * cr.task.config.cohort.min_fraction)
        if not full or self.tier.current is not cr:
            return
        nxt = new_round(self.tier, cr.task, cr.compressed is not None, None, continuation=True)
        children = self.tier.children
        for a in cr.assignments.values():
            c = children.get(a.node_id)
            if not a.settled and c is not None:
                nxt.add(a, c.role is Role.CLIENT)
        self.tier.current = nxt

    def model_blob(self, cr: CohortRound | None, model_hash: str) -> bytes | None:
        """Assigned just before the version moved on: the previous model."""
        if cr is not None and cr.task.model_hash != model_hash and self._prev_model is not None \
                and self._prev_model[0] == model_hash:
            return self._prev_model[1]
        return None
