"""One upload, from its header to its fold: the pipeline every tier runs for every
update and partial, over gRPC and in the simulator alike.

::

    begin     the caller is a child; the header names it; the round policy admits its
              (run, round, attempt) and the assignment is its own; admit_header (pure,
              orchard.server.admission: kind, schema, sizes, weight) -> the slot
    decode    (executor: decode pool) size and sha256, then decode -- or, summing in the
              compressed domain, parse -- and finite values; nothing is folded yet
    reserve   (loop) the policy's last check; the fold's count is reserved before it runs
    fold      (executor: one fold at a time) the policy folds into the round's sums
    delivered (loop) the assignment settles, counts move, the round may close; a
              buffered root journals before the upload is acknowledged

A failure anywhere releases what was taken (the reserved count, the in-flight mark), so
the node may try again; the refusal is counted by its error's name.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from orchard.errors import OrchardError, UpdateSchemaError
from orchard.messages import DroppedUpload, UploadHeader, UploadKind
from orchard.server.admission import admit_header, check_assignment
from orchard.server.cohort import Assignment, CheckedUpload, CohortRound
from orchard.server.round import RoundTask
from orchard.typing import NDArrays
from orchard.updates import decode_partial
from orchard.wire import check_payload

if TYPE_CHECKING:
    from orchard.server.tier.coordinator import Coordinator


class AckLog(Protocol):
    """Where a tier records the client uploads it acknowledges, round by round, until a
    partial carries them (an aggregator's journal, ``orchard.server.ackjournal``). Every
    call is on the loop, before the acknowledgement or the change it reports."""

    def acked(self, cr: CohortRound, up: DroppedUpload) -> None:
        """``up`` is folded into ``cr``."""

    def moved(self, prev: CohortRound, cr: CohortRound) -> None:
        """``prev``'s sums move into ``cr`` (asynchronous mode: a buffer's continuation)."""

    def dropped(self, cr: CohortRound, reason: str) -> None:
        """``cr``'s uploads will be in no partial, for ``reason``."""


@dataclass
class UploadSlot:
    header: UploadHeader
    cohort: CohortRound
    assignment: Assignment


class Upload:
    """:meth:`Coordinator.upload`'s context manager (a class: a tier takes one per upload,
    and a generator-based one costs several times as much to enter and leave)."""

    __slots__ = ("coord", "node_id", "header", "slot")

    def __init__(self, coord: Coordinator, node_id: str, header: UploadHeader) -> None:
        self.coord, self.node_id, self.header = coord, node_id, header
        self.slot: UploadSlot | None = None

    def __enter__(self) -> UploadSlot:
        try:
            self.slot = self.coord.begin_upload(self.node_id, self.header)
        except OrchardError as err:
            self.coord.reject(err)
            raise
        return self.slot

    def __exit__(self, kind: type[BaseException] | None, err: BaseException | None, tb: Any) -> None:
        if kind is None:
            return
        assert self.slot is not None  # entered: __exit__ runs only after __enter__ returned
        self.coord.abort_upload(self.slot, type(err).__name__ if isinstance(err, OrchardError) else "stream broken")


def assignment(tier: Coordinator, node_id: str, run_id: str, rnd: int, attempt: int,
               task_id: str) -> tuple[CohortRound, Assignment]:
    """The open round and this node's assignment in it, or the reason there is none."""
    cr = tier.current
    in_round = tier.policy.admit(cr, run_id, rnd, attempt)  # refuses when no round is open
    assert cr is not None
    a = cr.assignments.get(node_id)
    check_assignment(a, node_id, task_id, in_round)
    assert a is not None
    return cr, a


def begin(tier: Coordinator, node_id: str, h: UploadHeader) -> UploadSlot:
    """Admit an upload's header and reserve the caller's slot; nothing is reserved unless
    it passes."""
    c = tier.registry.child(node_id)
    if h.node_id != node_id:
        raise UpdateSchemaError(f"header names node {h.node_id!r} but the caller is {node_id!r}")
    cr, a = assignment(tier, node_id, h.run_id, h.round, h.attempt, h.task_id)
    admit_header(h, node_id, c.role, cr.task, a, tier.cfg.max_upload_bytes)
    cr.set_in_flight(a, True)
    return UploadSlot(h, cr, a)


def _decode(tier: Coordinator, slot: UploadSlot, payload: bytes | bytearray | memoryview,
            task: RoundTask) -> NDArrays | CheckedUpload:
    """Everything that is checked before a fold. ``task``: the round the update was
    trained in (its shared seed decodes it)."""
    h, cr = slot.header, slot.cohort
    # The payload's integrity first, here in the decode pool rather than on the loop as
    # its chunks arrive: hashing a megabyte costs the loop as much as receiving it.
    check_payload(payload, h.total_bytes, h.payload_sha256)
    if h.kind is UploadKind.PARTIAL_SUM:
        return decode_partial(payload, cr.task.schema, h.payload_sizes)
    if cr.compressed is not None:
        return cr.compressed.check(h, payload)
    return tier.decode_client(h, payload, task)


async def complete(tier: Coordinator, slot: UploadSlot, payload: bytes | bytearray | memoryview) -> None:
    """Check, decode and fold a fully received payload (see the module doc)."""
    h, a, policy = slot.header, slot.assignment, tier.policy
    try:
        task = policy.task_of(slot.cohort, h)
        arrays = await tier.executor.decode(_decode, tier, slot, payload, task)
        cr = policy.fold_into(slot)
        s = policy.staleness(cr, h)
        policy.reserve(cr, h)
        try:
            snap = None
            if h.count > 0:
                snap = await tier.executor.fold(policy.fold, cr, h, arrays, s)
        except BaseException:
            cr.reserve(-h.count)
            raise
    except BaseException:
        slot.cohort.set_in_flight(a, False)
        raise
    if tier.acks is not None and h.kind is UploadKind.CLIENT_UPDATE:  # journaled before it is acknowledged
        tier.acks.acked(cr, DroppedUpload(h.run_id, h.round, h.attempt, h.node_id, h.task_id))
    delivered(tier, slot)
    if snap is not None:
        policy.folded(cr, snap)


def delivered(tier: Coordinator, slot: UploadSlot) -> None:
    h, cr, a = slot.header, slot.cohort, slot.assignment
    cr.set_in_flight(a, False)
    cr.settle(a, delivered=True)
    n = h.total_bytes
    counters = tier.counters
    counters["uploads_accepted"] += 1
    counters["bytes_up"] += n
    tier.registry.delivered(h.node_id)
    if h.kind is UploadKind.PARTIAL_SUM:
        cr.count_bytes(up=n + h.bytes_up, down=h.bytes_down)
        cr.count_dropped_below(h.dropped)
        for k, v in h.tier_participants.items():
            cr.count_participants(k, v)
    else:
        cr.count_bytes(up=n)
        cr.count_participants(tier.name)
    tier.check_close(cr)
    tier.notify()


def abort(tier: Coordinator, slot: UploadSlot, reason: str) -> None:
    slot.cohort.set_in_flight(slot.assignment, False)
    refuse(tier, slot.cohort, reason)


def refuse(tier: Coordinator, cr: CohortRound | None, reason: str) -> None:
    tier.counters["uploads_rejected"] += 1
    if cr is not None:
        cr.count_rejected(reason)
