"""The round policy: what decides how a tier's round opens, selects, admits, folds and
closes. One interface, one implementation per protocol, each in its own file:

- :class:`~orchard.server.tier.sync.SyncPolicy` (``sync.py``): synchronous rounds, the
  default. A round is one model version; it selects its cohort once (over-selected),
  takes updates of its own round and attempt up to its target, and closes at the
  target, when every selected node settled, or at its deadline.
- :class:`~orchard.server.tier.buffered.BufferedPolicy` (``buffered.py``): FedBuff's
  buffers (``[run.mode] kind = "async"``). A buffer carries what is still training from
  earlier versions, tops its clients up to the concurrency, takes updates up to S
  versions stale (the aggregation stack weights them, ``aggregation.layer.stale``),
  never closes short, leaves a continuation when it fills, and is journaled at the root.

The coordinator (``coordinator.py``) calls these hooks at fixed points of its one round
loop and holds no rule of either protocol itself; :func:`policy_for` picks the policy
for a round's config.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

import numpy as np

from orchard.messages import UploadHeader
from orchard.server.buffer import BufferState
from orchard.server.cohort import Assignment, CheckedUpload, CohortRound
from orchard.server.round import RoundTask
from orchard.server.secagg import SecureUpstream
from orchard.typing import NDArrays

if TYPE_CHECKING:
    from orchard.server.tier.coordinator import Coordinator
    from orchard.server.tier.registry import Child
    from orchard.server.tier.uploads import UploadSlot


class RoundPolicy(Protocol):
    """The hooks of one round protocol (see the module doc)."""

    def open(self, prev: CohortRound | None, task: RoundTask, restore: BufferState | None,
             upstream: SecureUpstream | None) -> CohortRound:
        """Build ``task``'s round and make it the tier's current one, settling ``prev``
        (close it, or carry it over) and taking back a journaled buffer (``restore``)."""

    def choose(self, cr: CohortRound, clients: list[str], share: int) -> list[str]:
        """Which of the eligible direct ``clients`` to select, for ``share`` updates."""

    def reshare(self, cr: CohortRound, a: Assignment | None, child: Child) -> Assignment | None:
        """A new assignment for an aggregator child that settled its last one, or None."""

    def admit(self, cr: CohortRound | None, run_id: str, rnd: int, attempt: int) -> int:
        """Refuse a caller's (run, round, attempt) that the open round does not take; the
        round its task is in."""

    def task_of(self, cr: CohortRound, h: UploadHeader) -> RoundTask:
        """The task an update was trained in (its shared seed decodes it)."""

    def fold_into(self, slot: UploadSlot) -> CohortRound:
        """The round an admitted upload folds into, once its payload is checked."""

    def staleness(self, cr: CohortRound, h: UploadHeader) -> int:
        """The update's staleness in ``cr``; refuses one too stale to fold."""

    def reserve(self, cr: CohortRound, h: UploadHeader) -> None:
        """The last check before a fold, on the loop thread; reserves its count."""

    def fold(self, cr: CohortRound, h: UploadHeader, arrays: NDArrays | CheckedUpload,
             staleness: int) -> BufferState | None:
        """Fold one upload (fold thread); a buffer state to journal, or None."""

    def folded(self, cr: CohortRound, snap: BufferState) -> None:
        """After a delivered fold, before its acknowledgement: journal ``snap``."""

    def waits(self, cr: CohortRound) -> bool:
        """The round takes uploads but neither closes nor hands out tasks by itself."""

    def short(self, cr: CohortRound) -> bool:
        """Below its minimum at a closing point: select more instead of closing."""

    def closed(self, cr: CohortRound) -> None:
        """``cr`` closed by its own rules (target, everyone settled, deadline)."""

    def model_blob(self, cr: CohortRound | None, model_hash: str) -> bytes | None:
        """A model other than the current round's this policy still serves, or None."""


def policy_for(tier: Coordinator, kind: str, have: dict[str, RoundPolicy]) -> RoundPolicy:
    """The policy of a round of mode ``kind`` (``RunConfig.mode.kind``); one instance per
    kind and tier (``have``), since a buffered policy keeps what outlives a buffer."""
    from orchard.server.tier.buffered import BufferedPolicy
    from orchard.server.tier.sync import SyncPolicy

    p = have.get(kind)
    if p is None:
        p = have[kind] = {"sync": SyncPolicy, "async": BufferedPolicy}[kind](tier)
    return p


def new_round(tier: Coordinator, task: RoundTask, compressed: bool, upstream: SecureUpstream | None,
              continuation: bool = False, rng: np.random.Generator | None = None) -> CohortRound:
    """A round of ``task`` at ``tier``'s clock, with the tier's noise generator."""
    return CohortRound(task, tier.now(), tier.noise_rng if rng is None else rng, compressed=compressed,
                       upstream=upstream, continuation=continuation)


def supersede(tier: Coordinator, prev: CohortRound | None, task: RoundTask) -> None:
    """Close ``prev``, which ``task``'s round replaces without taking its sums (whatever the
    new round's mode: this rule is the tier's, not one policy's). A buffer's continuation is
    pushed by no one but the round it moves into: what it acknowledged reaches no partial,
    and the tier's journal records it as dropped, with the reason."""
    if prev is None or prev.closed:
        return
    tier.close_round(prev, "superseded by a new round")
    if prev.continuation and tier.acks is not None:
        tier.acks.dropped(prev, "round over before applied: its continuation was superseded by "
                                f"a round of run {task.run_id!r}")
