"""Synchronous rounds: a round is one model version, one attempt, one cohort.

Selection over-selects the direct clients (``ceil(share x over_selection)``) so that
stragglers do not hold the round; an upload is admitted only for the open round's run,
round and attempt; a client update beyond the round's target is refused (a partial from
below never is: it is a whole cohort); the round closes at its target, once every
selected node settled, or at its deadline, with whatever it has."""

from __future__ import annotations

from typing import TYPE_CHECKING

from orchard.compression import sums_compressed
from orchard.errors import RoundClosedError
from orchard.messages import UploadHeader, UploadKind
from orchard.server.admission import check_round
from orchard.server.buffer import BufferState
from orchard.server.cohort import Assignment, CheckedUpload, CohortRound
from orchard.server.round import RoundTask
from orchard.server.secagg import SecureUpstream
from orchard.server.selection import over_select
from orchard.server.tier.policy import new_round, supersede
from orchard.typing import NDArrays

if TYPE_CHECKING:
    from orchard.server.tier.coordinator import Coordinator
    from orchard.server.tier.registry import Child
    from orchard.server.tier.uploads import UploadSlot


class SyncPolicy:
    def __init__(self, tier: Coordinator) -> None:
        self.tier = tier

    def open(self, prev: CohortRound | None, task: RoundTask, restore: BufferState | None,
             upstream: SecureUpstream | None) -> CohortRound:
        supersede(self.tier, prev, task)
        cr = new_round(self.tier, task, sums_compressed(task.config), upstream)
        self.tier.current = cr
        return cr

    def choose(self, cr: CohortRound, clients: list[str], share: int) -> list[str]:
        return over_select(clients, share, cr.task.config.cohort.over_selection, self.tier.rng)

    def reshare(self, cr: CohortRound, a: Assignment | None, child: Child) -> Assignment | None:
        return None

    def admit(self, cr: CohortRound | None, run_id: str, rnd: int, attempt: int) -> int:
        return check_round(cr.task if cr is not None else None, cr is not None and cr.closed,
                           cr.close_reason if cr is not None else "", run_id, rnd, attempt).round

    def task_of(self, cr: CohortRound, h: UploadHeader) -> RoundTask:
        return cr.task

    def fold_into(self, slot: UploadSlot) -> CohortRound:
        return slot.cohort

    def staleness(self, cr: CohortRound, h: UploadHeader) -> int:
        return 0

    def reserve(self, cr: CohortRound, h: UploadHeader) -> None:
        """A fold reserves its count before it runs, so two uploads racing for the last
        slot cannot both get in."""
        if cr.closed:
            raise RoundClosedError(f"round {cr.task.round} closed ({cr.close_reason}) while the upload arrived; "
                                   "late uploads are refused")
        if h.kind is UploadKind.CLIENT_UPDATE and cr.reserved >= cr.task.target:
            raise RoundClosedError(f"round {cr.task.round} already has its {cr.task.target} updates; "
                                   "late uploads are refused")
        cr.reserve(h.count)

    @staticmethod
    def fold(cr: CohortRound, h: UploadHeader, arrays: NDArrays | CheckedUpload, staleness: int) -> None:
        cr.fold(h, arrays)

    def folded(self, cr: CohortRound, snap: BufferState) -> None:
        raise AssertionError("a synchronous round journals nothing")

    def waits(self, cr: CohortRound) -> bool:
        return False

    def short(self, cr: CohortRound) -> bool:
        return False

    def closed(self, cr: CohortRound) -> None:
        return None

    def model_blob(self, cr: CohortRound | None, model_hash: str) -> bytes | None:
        return None
