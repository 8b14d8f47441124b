"""SecAgg+ over the whole tree (``secure_aggregation.scope = "tree"``), for distributed
DP, where a session per cohort would put one noise per cohort into the root's sum.

The root holds the round's one session; every tier below is the same coordinator in a
relay role. At open: a tier's roster is its direct clients, and the aggregators it
selected add theirs (``roster``); the root opens the session once every roster is in, or
at its roster deadline with those that are; a tier below reports upward as soon as its
roster is complete, by half the root's deadline. On a message: the root's session takes
it (``SessionRole``); a relay passes it on (``SecureUpstream``) keeping only which
clients sent a masked input, and when the session's end comes back settles its
assignments and closes. On the sweep: rosters of silent children are given up; a relay
whose clients' inputs went up stays open past its own deadline while the root unmasks.
A relay pushes no partial, so its aggregator children keep the round's whole deadline.
"""

from __future__ import annotations

import math

from orchard.aggregation import Partial
from orchard.errors import SecAggError
from orchard.messages import UploadHeader
from orchard.secure_agg import Stage
from orchard.secure_agg.stages import stage_of
from orchard.server.cohort import Assignment, CohortRound
from orchard.server.secagg import ROSTER_END, SecAggReply, TreeRoster, check_masked_header
from orchard.server.tier.secure import SessionRole, check_exchange
from orchard.typing import Role


class TreeSecure(SessionRole):
    trims_child_deadline = False

    # ------------------------------------------------------------------ open

    def open(self, cr: CohortRound) -> None:
        tree = TreeRoster()
        cr.attach_tree(tree)
        children = self.tier.children
        for a in cr.assignments.values():
            if children[a.node_id].role is Role.CLIENT:
                tree.route[a.node_id] = a.node_id
                tree.tiers[a.node_id] = self.tier.name
            else:
                tree.waiting.add(a.node_id)
        cr.set_quota(sum(1 for n, via in tree.route.items() if n == via))
        now = self.tier.wall()
        # A tier below the root reports by half the root's roster deadline, so that its
        # roster (with or without a silent child's) is in when the root opens the session.
        frac = ROSTER_END if cr.upstream is None else ROSTER_END / 2
        tree.roster_deadline = now + frac * max(0.0, cr.task.deadline_unix - now)
        if cr.upstream is None and not tree.waiting:
            self._open_session(cr)

    def _open_session(self, cr: CohortRound) -> None:
        """The root opens the round's one session over every client in the rosters."""
        tree = cr.tree
        assert tree is not None and cr.upstream is None
        tree.waiting.clear()
        if not tree.route:
            return
        if not self.start(cr, sorted(tree.route)):
            for a in list(cr.assignments.values()):
                cr.settle(a, delivered=False)
            self.tier.check_close(cr)
        self.tier.notify()

    async def roster(self, cr: CohortRound, a: Assignment, via: str, nodes: list[str], tiers: list[str]) -> None:
        tree, rnd = cr.tree, cr.task.round
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
            self._open_session(cr)
        else:
            await self.send_roster(cr)

    async def send_roster(self, cr: CohortRound) -> None:
        tree = cr.tree
        if tree is None or cr.upstream is None or tree.waiting or tree.sent or cr.closed:
            return
        tree.sent = True
        nodes = list(tree.route)
        await cr.upstream.roster(nodes, [tree.tiers[n] for n in nodes])

    # ------------------------------------------------------------------ messages

    def no_session(self, cr: CohortRound, node_id: str, message: bytes) -> None:
        if cr.tree is not None and cr.tree.route and not cr.closed:
            if message:
                raise SecAggError(f"round {cr.task.round}: the secure session has not opened yet "
                                  "(rosters still coming); poll without a message")
            return  # the session opens once the rosters are in: the client polls again
        super().no_session(cr, node_id, message)

    async def exchange(self, cr: CohortRound, node_id: str, stage_index: int, message: bytes,
                       header: UploadHeader | None, wait_s: float, caller: str) -> SecAggReply:
        if cr.upstream is None or cr.tree is None:
            return await super().exchange(cr, node_id, stage_index, message, header, wait_s, caller)
        check_exchange(cr, node_id, message, header)
        return await self._relay(cr, node_id, stage_index, message, header, wait_s)

    async def _relay(self, cr: CohortRound, node_id: str, stage_index: int, message: bytes,
                     header: UploadHeader | None, wait_s: float) -> SecAggReply:
        """Pass a client's exchange on to the round's session. The relay keeps nothing of
        the messages, only which clients sent a masked input (the root's session counts
        the messages' bytes; this tier reports its own downloads with the exchange)."""
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
            self._final(cr, reply)
        return reply

    def _final(self, cr: CohortRound, reply: SecAggReply) -> None:
        """The session ended at the root: this tier's clients (and aggregator children)
        count as delivered if a masked input went up through them."""
        tree = cr.tree
        assert tree is not None
        tree.final = reply
        through = {tree.route[n] for n in tree.inputs} if reply.done else set()
        for a in list(cr.assignments.values()):
            cr.settle(a, a.node_id in through)
        if reply.done:
            name = self.tier.name
            cr.set_participants(name, sum(1 for n in tree.inputs if tree.tiers.get(n) == name))
        why = "the round's secure session finished at the root" if reply.done else \
            f"the round's secure session aborted at the root: {reply.aborted}"
        self.tier.close_round(cr, why)

    def ended(self, cr: CohortRound) -> SecAggReply | None:
        if cr.tree is not None and cr.tree.final is not None:
            return cr.tree.final
        return super().ended(cr)

    def relays_for(self, cr: CohortRound, via: str, node_id: str) -> bool:
        return cr.tree is not None and cr.tree.route.get(node_id) == via

    # ------------------------------------------------------------------ the end

    def members(self, cr: CohortRound) -> list[Assignment]:
        return list(cr.assignments.values())  # the aggregators below relayed for their clients

    def credit(self, cr: CohortRound, members: list[Assignment], contributed: set[str], p: Partial) -> None:
        tree = cr.tree
        assert tree is not None
        through = {tree.route[n] for n in contributed}
        for a in members:
            cr.settle(a, a.node_id in through)
        for n in contributed:
            cr.count_participants(tree.tiers[n])

    def sweep(self, cr: CohortRound) -> bool:
        tree, t = cr.tree, self.tier
        if tree is not None and cr.secure is None and tree.waiting and not tree.sent:
            # The root opens the session without the rosters of aggregators that fell
            # silent, and at the roster deadline without those still to come; a tier below
            # reports its roster upward the same way.
            tree.waiting = {n for n in tree.waiting if not cr.assignments[n].dropped}
            if not tree.waiting or t.wall() >= tree.roster_deadline:
                if cr.upstream is None:
                    self._open_session(cr)
                    if cr.closed:
                        return True
                else:
                    tree.waiting.clear()
                    t.executor.spawn(self.send_roster(cr), lambda err: cr.set_rejected(
                        f"could not report upstream: {err}", 1))
        if (tree is not None and cr.upstream is not None and tree.final is None and tree.inputs
                and t.wall() < cr.task.deadline_unix + max(5.0, 0.1 * cr.task.config.cohort.deadline_s)):
            # A relay whose clients' masked inputs went up stays open past its own
            # deadline while the root's session unmasks (the root's deadline is later).
            t.check_close(cr)
            return True
        return super().sweep(cr)
