"""SecAgg+ per cohort (``secure_aggregation.scope = "cohort"``, the default): the lowest
aggregating tier runs one session per round over the direct clients it selected at the
round's open (no fill-ins join it), and folds the cohort's unmasked sum as a partial
like any other when the session ends.

At open: the session starts over the selected clients (too few for the protocol's
threshold: they are dropped and the refusal recorded). On a message: the session takes
it and moves on (``SessionRole``). On the sweep: stages close at their deadlines; while
the unmasking closes off the loop the round neither takes messages nor closes. At the
end: the clients that contributed are delivered, the others dropped."""

from __future__ import annotations

from orchard.aggregation import Partial
from orchard.messages import DroppedUpload
from orchard.server.cohort import Assignment, CohortRound
from orchard.server.tier.secure import SessionRole


class CohortSecure(SessionRole):
    trims_child_deadline = True

    def open(self, cr: CohortRound) -> None:
        clients = [a.node_id for a in self.direct_clients(cr)]
        cr.set_quota(len(clients))
        if clients and not self.start(cr, clients):
            for n in clients:
                cr.settle(cr.assignments[n], delivered=False)

    def members(self, cr: CohortRound) -> list[Assignment]:
        return self.direct_clients(cr)

    def credit(self, cr: CohortRound, members: list[Assignment], contributed: set[str], p: Partial) -> None:
        acks = self.tier.acks
        for a in members:
            cr.settle(a, a.node_id in contributed)
            if acks is not None and a.node_id in contributed:  # an aggregator journals what it takes
                acks.acked(cr, DroppedUpload(cr.task.run_id, cr.task.round, cr.task.attempt, a.node_id, a.task_id))
        cr.count_participants(self.tier.name, p.count)
