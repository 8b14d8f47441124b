"""Who takes part in a tier's round: the split of its target among the children waiting
for work and eligible (``Registry.selectable``: aggregators get a share in proportion to
their eligible pool; the round policy chooses the direct clients), what a selected child
is handed, and when a selected child is dropped (``drop_silent``)."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from orchard.messages import TaskAssignment
from orchard.server.cohort import Assignment, CohortRound
from orchard.server.selection import allocate, device_eligible
from orchard.typing import Role

if TYPE_CHECKING:
    from orchard.server.tier.coordinator import Coordinator


def select(tier: Coordinator, cr: CohortRound) -> None:
    cfg, children = cr.task.config, tier.children
    tier.registry.participation.begin(cr.task.run_id, cr.task.round, cfg.privacy)
    caps: dict[str, int] = {}
    for c in children.values():
        if (n := tier.registry.selectable(c, cfg)) > 0:
            caps[c.node_id] = n
    alloc = allocate(cr.task.target, caps)
    client_ids = [k for k in caps if children[k].role is Role.CLIENT]
    client_share = sum(alloc[k] for k in client_ids)
    for k, n in alloc.items():
        if n > 0 and children[k].role is Role.AGGREGATOR and k not in cr.assignments:
            tier.new_assignment(cr, k, n)
    # Direct clients are over-selected; the first `client_share` updates count.
    cr.set_quota(math.ceil(max(client_share, 0) * cfg.cohort.over_selection))
    for k in tier.policy.choose(cr, client_ids, client_share):
        tier.new_assignment(cr, k, 1)
    # Clients that join while the round is open may fill an unused quota; if no direct
    # client was known at open time, any remaining target may go to late joiners.
    if not caps:
        cr.set_quota(math.ceil(cr.task.target * cfg.cohort.over_selection))


def drop_silent(tier: Coordinator, cr: CohortRound) -> None:
    """Settle as dropped every pending assignment whose node left, stopped waiting for work
    before it took its task (gone, or no poll since), or fell silent while working on it
    (no call within the node timeout). An upload in progress keeps its node."""
    reg = tier.registry
    for a in cr.pending():
        c = tier.children.get(a.node_id)
        if c is None or (not a.in_flight and not (reg.waiting(c) if not a.handed_out else reg.live(c))):
            cr.settle(a, delivered=False)


def task_for(tier: Coordinator, cr: CohortRound, a: Assignment) -> TaskAssignment:
    t, deadline = cr.task, cr.task.deadline_unix
    if tier.children[a.node_id].role is Role.AGGREGATOR and tier.secure.trims_child_deadline:
        # Leave the aggregator time to push its partial before our own deadline. (A relay
        # of the tree's session pushes none: it relays until the session's last stage ends.)
        deadline -= min(5.0, 0.1 * max(0.0, deadline - tier.wall()))
    return TaskAssignment(
        run_id=t.run_id, round=t.round, attempt=t.attempt, task_id=a.task_id, model_hash=t.model_hash,
        model_bytes=len(t.model_blob), config_json=t.config_json, schema=t.schema, deadline_unix=deadline,
        cohort_target=a.target, shared_seed=t.shared_seed)


def idle_reason(tier: Coordinator, node_id: str) -> str:
    cr = tier.current
    if cr is None or cr.closed:
        return "no round open"
    c = tier.children[node_id]
    if c.role is Role.CLIENT:
        ok, why = device_eligible(c.device, cr.task.config.eligibility)
        if not ok:
            return "not eligible: " + "; ".join(why)
        if not tier.registry.participation.allows(node_id):
            return "not eligible: past the run's participation bound (privacy.max_participations, min_separation)"
    return "not selected for this round"
