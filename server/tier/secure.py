"""Secure aggregation at a tier: one interface, three siblings.

- :class:`NoSecure` (here): the round runs none; every exchange is refused.
- :class:`~orchard.server.tier.secure_cohort.CohortSecure` (``secure_cohort.py``): one
  SecAgg+ session per round over the direct clients this tier selected (scope "cohort").
- :class:`~orchard.server.tier.secure_tree.TreeSecure` (``secure_tree.py``): one session
  per round over the whole tree, held at the root; the tiers below relay (scope "tree").

What each does at the round's open, on a stage message, on the sweep and at close is
behind :class:`SecureProtocol`; :class:`SessionRole` is what the two with a session
(the per-cohort tier, the tree's root) share: posting messages, long-polling for the
next broadcast, moving stages on (the unmasking off the loop where the executor defers
it) and folding the unmasked sum. :func:`secure_for` picks the sibling for a round.
"""

from __future__ import annotations

import asyncio
import contextlib
from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Protocol

from orchard.aggregation import Partial
from orchard.errors import OrchardError, SecAggAbort, SecAggError, UpdateSchemaError
from orchard.messages import UploadHeader
from orchard.secure_agg import Stage
from orchard.secure_agg.stages import stage_index as stage_index_of
from orchard.secure_agg.stages import stage_of
from orchard.server.cohort import Assignment, CohortRound
from orchard.server.round import RoundTask
from orchard.server.secagg import SecAggReply, new_cohort
from orchard.typing import Role

if TYPE_CHECKING:
    from orchard.server.tier.coordinator import Coordinator


class SecureProtocol(Protocol):
    takes_fill_ins: bool  # a client may fill an unused quota slot after selection
    trims_child_deadline: bool  # an aggregator child gets time to push its partial before the deadline

    def open(self, cr: CohortRound) -> None:
        """The round opened and selected: start what the protocol runs over it."""

    async def exchange(self, cr: CohortRound, node_id: str, stage_index: int, message: bytes,
                       header: UploadHeader | None, wait_s: float, caller: str) -> SecAggReply:
        """One client's stage message (if any), then its next broadcast."""

    def ended(self, cr: CohortRound) -> SecAggReply | None:
        """How the closed round's session ended, for a node that asks after; or None."""

    def relays_for(self, cr: CohortRound, via: str, node_id: str) -> bool:
        """Client ``node_id`` is in the round's session through aggregator ``via``."""

    async def roster(self, cr: CohortRound, a: Assignment, via: str, nodes: list[str], tiers: list[str]) -> None:
        """An aggregator child's roster of clients for the round's session."""

    async def send_roster(self, cr: CohortRound) -> None:
        """Report this tier's roster upward, once complete (a relay)."""

    def sweep(self, cr: CohortRound) -> bool:
        """The protocol's part of the sweep; True: the sweep stops here."""

    def holds_close(self, cr: CohortRound) -> bool:
        """The round may not close now (its session is unmasking)."""


def secure_for(tier: Coordinator, task: RoundTask, have: dict[str, SecureProtocol]) -> SecureProtocol:
    """The secure-aggregation sibling of ``task``'s round (one instance per kind and tier)."""
    from orchard.server.tier.secure_cohort import CohortSecure
    from orchard.server.tier.secure_tree import TreeSecure

    sa = task.config.secure_aggregation
    kind = "off" if not sa.enabled else "tree" if sa.over_tree else "cohort"
    p = have.get(kind)
    if p is None:
        p = have[kind] = {"off": NoSecure, "cohort": CohortSecure, "tree": TreeSecure}[kind](tier)
    return p


def check_exchange(cr: CohortRound, node_id: str, message: bytes, header: UploadHeader | None) -> None:
    if message and header is not None:
        names = [s.name for s in cr.task.schema]
        if header.node_id != node_id or [s.name for s in header.schema] != names:
            raise UpdateSchemaError("masked-input header does not match the caller or the round's schema")


class NoTree:
    """The tree-scope hooks of a protocol whose round has no session over the whole tree:
    no client is relayed, and a roster is refused. (``TreeSecure`` overrides them.)"""

    def relays_for(self, cr: CohortRound, via: str, node_id: str) -> bool:
        return False

    async def roster(self, cr: CohortRound, a: Assignment, via: str, nodes: list[str], tiers: list[str]) -> None:
        raise SecAggError(f"round {cr.task.round} runs no secure aggregation over the whole tree")

    async def send_roster(self, cr: CohortRound) -> None:
        return None


class NoSecure(NoTree):
    takes_fill_ins = True
    trims_child_deadline = True

    def __init__(self, tier: Coordinator) -> None:
        self.tier = tier

    def open(self, cr: CohortRound) -> None:
        return None

    async def exchange(self, cr: CohortRound, node_id: str, stage_index: int, message: bytes,
                       header: UploadHeader | None, wait_s: float, caller: str) -> SecAggReply:
        check_exchange(cr, node_id, message, header)
        raise SecAggError(f"round {cr.task.round} runs no secure aggregation for {node_id!r}")

    def ended(self, cr: CohortRound) -> SecAggReply | None:
        return None


    def sweep(self, cr: CohortRound) -> bool:
        return False

    def holds_close(self, cr: CohortRound) -> bool:
        return False


class SessionRole(NoTree, ABC):
    """What a tier that holds a round's session does with it (see the module doc). The
    siblings say who the session's members are and whom its sum credits."""

    takes_fill_ins = False  # the session is fixed when it opens: no fill-ins join it

    def __init__(self, tier: Coordinator) -> None:
        self.tier = tier

    def start(self, cr: CohortRound, participants: list[str]) -> bool:
        """Open the round's session over ``participants``; False when it could not start
        (too few for the protocol's threshold: the round gets nothing from them)."""
        t = self.tier
        # The certificates of the participants this tier knows, for those that advertise no
        # roster credential (secure_agg.roster.with_certificates: the native device client).
        active = cr.task.config.secure_aggregation.adversary == "active"
        certs = {p: c for p in participants if (c := t.certificates(p))} if active else {}
        try:
            cr.attach_secure(new_cohort(cr.task.config, cr.task.schema, participants, cr.task.round,
                                        cr.task.deadline_unix, t.wall,
                                        t.executor.mask_workers(cr.task.config, cr.task.schema, len(participants)),
                                        certs))
        except OrchardError as err:
            cr.set_rejected(f"secure aggregation could not start: {err}", len(participants))
            return False
        return True

    def no_session(self, cr: CohortRound, node_id: str, message: bytes) -> None:
        raise SecAggError(f"round {cr.task.round} runs no secure aggregation for {node_id!r}")

    async def exchange(self, cr: CohortRound, node_id: str, stage_index: int, message: bytes,
                       header: UploadHeader | None, wait_s: float, caller: str) -> SecAggReply:
        """``node_id``: the client whose exchange this is; ``caller``: the child that sent it
        (the client itself, or the aggregator relaying for it), the one a long poll keeps alive."""
        check_exchange(cr, node_id, message, header)
        t = self.tier
        sc = cr.secure
        if sc is None:
            self.no_session(cr, node_id, message)
        elif message:
            sc.receive(node_id, stage_of(stage_index), message, header)
            self.progress(cr)
            t.notify()
        end = t.now() + max(0.0, min(wait_s, t.cfg.long_poll_s))
        while True:
            reply = self.reply(cr, node_id)
            if reply.broadcast or reply.done or reply.aborted:
                return reply
            remaining = end - t.now()
            if remaining <= 0 or cr.closed:
                return reply
            ev = t.watch()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(ev.wait(), timeout=remaining)
            t.touch(caller)  # never a relayed client: it is no child of this tier

    @staticmethod
    def reply(cr: CohortRound, node_id: str) -> SecAggReply:
        sc = cr.secure
        if sc is None:  # tree scope, before the rosters are in
            return SecAggReply(stage_index_of(Stage.ADVERTISE_KEYS), b"", False, "")
        if sc.finished:
            return SecAggReply(stage_index_of(sc.stage), b"", sc.stage is Stage.DONE, sc.abort_reason)
        return SecAggReply(stage_index_of(sc.stage), sc.broadcast(node_id), False, "")

    def ended(self, cr: CohortRound) -> SecAggReply | None:
        sc = cr.secure
        if sc is None or not sc.finished:
            return None
        return SecAggReply(stage_index_of(sc.stage), b"", sc.stage is Stage.DONE, sc.abort_reason)

    def progress(self, cr: CohortRound) -> None:
        """Move the session's stages on; fold the round's sum once it is unmasked. The
        unmasking (seconds of mask expansion in a large session) closes off the loop where
        the executor defers it; the loop goes on answering heartbeats and polls meanwhile."""
        sc, t = cr.secure, self.tier
        if sc is None or cr.closed:
            return
        moved, was_closing = False, sc.closing
        while sc.advance(t.wall(), defer_unmasking=t.executor.defers_unmasking):
            moved = True
        if sc.closing and not was_closing:  # this call found the unmasking due
            t.executor.unmask(sc, lambda: None if cr.closed else self.finished(cr))
        if not moved or not sc.finished:
            if moved:
                t.notify()
            return
        self.finished(cr)

    def direct_clients(self, cr: CohortRound) -> list[Assignment]:
        ch = self.tier.children
        return [a for a in cr.assignments.values() if a.node_id in ch and ch[a.node_id].role is Role.CLIENT]

    @abstractmethod
    def members(self, cr: CohortRound) -> list[Assignment]:
        """The assignments the session's end settles."""

    @abstractmethod
    def credit(self, cr: CohortRound, members: list[Assignment], contributed: set[str], p: Partial) -> None:
        """Settle ``members`` by who contributed, and count the participants by tier."""

    def finished(self, cr: CohortRound) -> None:
        """The session ended: keep the round's unmasked sum aside, or record why there is none."""
        sc, t = cr.secure, self.tier
        assert sc is not None and sc.finished
        p = None
        if sc.stage is Stage.DONE:
            try:
                p = sc.partial()
            except SecAggAbort as err:
                for a in self.direct_clients(cr):
                    cr.settle(a, delivered=False)
                cr.set_rejected(f"secure aggregation: {err}", len(sc.participants))
        members = self.members(cr)
        if p is not None:
            if p.count > 0:
                cr.set_secure_sum(p)  # folded with the outcome (fold_aside), after the fold pool drained
            self.credit(cr, members, set(sc.contributors()), p)
            t.counters["uploads_accepted"] += p.count
        elif sc.stage is not Stage.DONE:
            for a in members:
                cr.settle(a, delivered=False)
            cr.set_rejected(f"secure aggregation aborted: {sc.abort_reason}", len(sc.participants))
        cr.count_bytes(up=sc.bytes_up, down=sc.bytes_down)
        t.counters["bytes_up"] += sc.bytes_up
        t.check_close(cr)
        t.notify()

    def sweep(self, cr: CohortRound) -> bool:
        sc = cr.secure
        if sc is None:
            return False
        self.progress(cr)
        return cr.closed or sc.closing  # unmasking: the round closes when it ends

    def holds_close(self, cr: CohortRound) -> bool:
        return cr.secure is not None and cr.secure.closing

