"""A client's job and what became of its upload.

An :class:`Arrival` is a selected device that will upload: when, from which partition,
its task and the model it trains from. :class:`Jobs` makes its training job (its codec
state, the attack's multiplier) and counts its fate, keeping the codec state of a
client whose upload was folded; in a shard it logs fates with their time instead, to be
counted once the root's close is known (:func:`count_log`).
"""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, cast

import numpy as np

from orchard.messages import TaskAssignment
from orchard.server.round import RoundOutcome, SimulatedCounts
from orchard.server.runloop import Played
from orchard.simulation.clients import ClientJob, ClientOutput
from orchard.simulation.config import AttackConfig
from orchard.simulation.context import Context
from orchard.simulation.tree import Tier

FOLDED, FAILED, LATE = "", "failed", "late"  # what became of an upload (Jobs.tally), else an error's name


@dataclass
class Arrival:
    finish: float
    partition: int
    node_id: str
    leaf: Tier
    assignment: TaskAssignment
    steps: int | None
    start: str = ""  # the model it trains from: "" the global one, else its downlink reconstruction
    deferred: bool = False  # expected to arrive after its tier closed: trained only if it did not
    output: ClientOutput | None = None  # asynchronous mode: trained when it pulled its model
    now_s: float = 0.0  # virtual time when it starts training: how much of a data stream has arrived


class Pace:
    """How long one client's training takes, as the engine timed the last batch it trained
    itself (wall seconds a client), and job sizes that follow from it.

    A job handed to a worker holds at most about ``JOB_SECONDS`` of training once the pace
    is known: where clients take milliseconds each (a Flower app, a large model), fixed
    sizes of hundreds of clients queued seconds of work on a worker while the engine,
    its own share done, waited for it at the round's end. Where clients take
    microseconds (a vectorised small model) the sizes stay as they were."""

    JOB_SECONDS = 0.1

    def __init__(self) -> None:
        self.client_s: float | None = None

    def timed(self, clients: int, seconds: float) -> None:
        """The engine trained ``clients`` in ``seconds`` (wall)."""
        if clients > 0:
            self.client_s = seconds / clients

    def clients(self, most: int) -> int:
        """``most``, or fewer: about ``JOB_SECONDS`` of training at the measured pace."""
        if self.client_s is None or self.client_s <= 0:
            return most
        return max(1, min(most, int(self.JOB_SECONDS / self.client_s)))


class Jobs:
    """Clients' jobs, the codec states their folded uploads leave (by partition), and the
    pace that sizes them."""

    def __init__(self, ctx: Context) -> None:
        self._seed = ctx.seed
        self._attack = ctx.attack
        # A device that personalizes keeps its adapter in its own directory across rounds.
        self._personal_root = ctx.device_root if ctx.run.personalization.enabled else None
        self.pace = Pace()
        self.codec_states: dict[int, dict[str, Any]] = {}
        # Canaries (attack kind "canary"): how often each canary device's update was folded.
        self.canaries: dict[int, int] | None = {} if ctx.attack is not None and ctx.attack.kind == "canary" else None
        # A shard's fates this round, as (time, client?, what, partition, codec state):
        # None outside a shard's round (see tally).
        self.log: list[tuple[float, bool, str, int, dict[str, Any] | None]] | None = None

    def job(self, a: Arrival) -> ClientJob:
        job = ClientJob(a.partition, a.node_id, a.assignment, a.steps, self.codec_states.get(a.partition), a.start,
                        now_s=a.now_s)
        if self._personal_root is not None:
            job.state_dir = f"{self._personal_root}/device-{a.partition}"
        if self.canaries is not None:  # a canary sends factor x its direction instead of its update
            job.canary = (self._seed, cast(AttackConfig, self._attack).factor) if self._drawn(a.partition) else None
        else:
            job.attack = self.attack(a.partition)
        return job

    def _drawn(self, partition: int) -> bool:
        """Whether the attack (or the canaries) drew this device, from the seed."""
        att = self._attack
        return (att is not None and att.fraction > 0
                and np.random.default_rng([self._seed, partition, 0xBAD]).random() < att.fraction)

    def attack(self, partition: int) -> float:
        """The multiplier a device applies to its update: the attack's for attackers (drawn
        per device from the seed), 1 for everyone else."""
        att = self._attack
        return cast(AttackConfig, att).factor if self._drawn(partition) else 1.0

    def tally(self, stats: SimulatedCounts, when: float, client: bool, what: str, partition: int = -1,
              codec_state: dict[str, Any] | None = None) -> None:
        """Count what became of a client's upload (``client``) or of a partial: folded
        (``FOLDED``, and the client's codec state is kept), ``FAILED``, ``LATE``, or
        refused with the error named ``what``. In a shard (``self.log`` is a list) it is
        logged with its time ``when`` instead, and counted once the root's close is
        known (:func:`count_log`)."""
        if self.log is not None:
            self.log.append((when, client, what, partition, codec_state))
            return
        count(stats, client, what)
        if client and what == FOLDED and self.canaries is not None and self._drawn(partition):
            self.canaries[partition] = self.canaries.get(partition, 0) + 1
        if codec_state:
            self.codec_states[partition] = codec_state

    def keep_before(self, kept: list[tuple[float, int, dict[str, Any]]], closed_at: float) -> None:
        """Keep the codec states a shard logged (``kept``: time, partition, state) of the
        clients folded before the root closed at ``closed_at``."""
        for when, part, state in kept:
            if when < closed_at:
                self.codec_states[part] = state


def count(stats: SimulatedCounts, client: bool, what: str) -> None:
    """Count one upload's fate (see :meth:`Jobs.tally`)."""
    if client:
        stats.trained += 1
        if what == FAILED:
            stats.failed_clients += 1
            return
        if what == LATE:
            stats.late += 1
            return
    if what != FOLDED:
        stats.rejected[what] = stats.rejected.get(what, 0) + 1


def count_log(stats: SimulatedCounts, log: list[tuple[float, bool, str]], closed_at: float) -> None:
    """Count a shard's logged fates for a round whose root closed at ``closed_at``: what
    happened before counts as it happened; a client that arrived from then on is late,
    as it is when the root is in the same loop (it stops there), and a partial that
    would have gone up since is not counted at all."""
    for when, client, what in log:
        if when < closed_at:
            count(stats, client, what)
        elif client:
            stats.late += 1


def add_counts(into: SimulatedCounts, other: SimulatedCounts) -> None:
    """Add a shard's counts of devices (``other``) to the round's."""
    for f in ("checked_in", "selected", "trained", "late", "vanished", "stopped_by_governor", "stopped_early",
              "failed_clients"):
        setattr(into, f, getattr(into, f) + getattr(other, f))
    for name, n in other.rejected.items():
        into.rejected[name] = into.rejected.get(name, 0) + n


def played(out: RoundOutcome, stats: SimulatedCounts, simulated_s: float, extra: dict[str, Any] | None = None
           ) -> Played:
    """A round's outcome with its counts of devices (``simulated_s``: the simulated
    seconds it took), as the run loop takes it."""
    stats.simulated_seconds = round(simulated_s, 3)
    return Played(out, simulated=stats, extra=extra or {})


def done(outputs: list[ClientOutput]) -> Future[list[ClientOutput]]:
    fut: Future[list[ClientOutput]] = Future()
    fut.set_result(outputs)
    return fut
