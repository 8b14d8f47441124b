"""A tier's way to its parent's tree-scope session in the same process."""

from __future__ import annotations

from typing import TYPE_CHECKING

from orchard.messages import TaskAssignment, UploadHeader
from orchard.server.secagg import SecAggReply

if TYPE_CHECKING:
    from orchard.server.tier.coordinator import Coordinator


class ParentUpstream:
    """A ``SecureUpstream`` for the simulator and tests: the parent coordinator's
    ``secagg_roster`` and ``secagg_relayed``, called as ``Fleet.SecAgg`` would call them,
    without the wait. Bound to the tier's task ``t``."""

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
