"""A tier below the root, one round at a time: open the parent's task, report the roster,
and once the round closed, the partial to push upward.

The gRPC aggregator (``orchard.server.aggregator``: the parent is reached over its
upstream link) and the simulator (its tiers: the parent is a coordinator in the same
process) both drive their tiers through :class:`ChildRound`, so the rules of a tier's
round from above are written once:

- the tier's task is the parent's assignment (``task_from_assignment``: this tier's
  share of the target, the parent's deadline less the time to push);
- under secure aggregation over the whole tree the tier relays its clients' exchanges
  to the root's session (``upstream``), reports its roster once complete, and pushes no
  partial: its clients' inputs are in the root's sum;
- otherwise, when the round closed, the tier's outcome goes up as one PARTIAL_SUM.
"""

from __future__ import annotations

from collections.abc import Callable

from orchard.config import RunConfig
from orchard.errors import OrchardError
from orchard.messages import TaskAssignment, UploadHeader
from orchard.server.cohort import CohortRound
from orchard.server.coordinator import Coordinator
from orchard.server.round import RoundOutcome, partial_upload, task_from_assignment
from orchard.server.secagg import SecureUpstream


class ChildRound:
    """Tier ``name``'s round for its parent's assignment ``a`` (model ``blob``).

    ``upstream``: builds the way to the root's secure session for ``a``, used only when
    the run's secure aggregation spans the tree. ``config``: the round's config when the
    parent's differs from the one in ``a`` (the simulator's DP rounds)."""

    def __init__(self, coord: Coordinator, name: str, a: TaskAssignment, blob: bytes,
                 upstream: Callable[[TaskAssignment], SecureUpstream], config: RunConfig | None = None) -> None:
        self.coord, self.name, self.assignment = coord, name, a
        task = task_from_assignment(a, blob, config)
        # Secure aggregation over the whole tree: the tier relays to the root's session.
        self.relays = task.config.secure_aggregation.over_tree
        self.cr: CohortRound = coord.open_round(task, upstream=upstream(a) if self.relays else None)

    async def report_roster(self) -> None:
        """Report this round's roster upward once complete (a relay only; else nothing).
        A roster the parent refuses closes the round: its clients cannot join the session."""
        try:
            await self.coord.send_roster(self.cr)
        except OrchardError as err:
            self.coord.close_round(self.cr, f"the roster could not be reported upstream: {err}")

    def partial(self, out: RoundOutcome) -> tuple[UploadHeader, bytes] | None:
        """The closed round's partial for the parent (header and payload); None for a relay."""
        if self.relays:
            return None
        return partial_upload(self.assignment, self.name, out)
