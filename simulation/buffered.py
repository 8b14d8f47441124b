"""The clock and devices of an asynchronous run (``[run.mode] kind = "async"``, FedBuff).

Nothing of asynchronous mode's rules lives here: the root coordinator does that work
(``open_round`` carries the devices still training into the new buffer and tops them up
to the concurrency; ``upload_now`` weights each update by its staleness or refuses it
past S). Here is only the clock and the devices: fresh devices check in (those still
training do not poll), the newly selected pull this version and are trained on it at
once (their output waits for their finish time), and arrivals of every version are
handed to the root in time order until the buffer closes at K (or its deadline).
Devices still training stay for the next buffer; the others go back to the population.
Flat trees only (validation says so).
"""

from __future__ import annotations

import heapq
import itertools
import math

from orchard import wire
from orchard.config import RunConfig
from orchard.errors import OrchardError, StaleUpdateError
from orchard.server.admission import check_version
from orchard.server.round import SimulatedCounts
from orchard.server.runloop import Played, enough
from orchard.simulation.checkin import CheckIn
from orchard.simulation.context import Context
from orchard.simulation.dispatch import Dispatch
from orchard.simulation.jobs import FAILED, FOLDED, Arrival, Jobs, played
from orchard.simulation.population import LiveDevice
from orchard.simulation.tree import Tree
from orchard.typing import NDArrays


class Buffered:
    """An asynchronous run's devices across buffers: those still training (``busy``, by
    node), their arrivals in time order (``in_flight``), and those that vanished, with
    when their tier forgets them (``silent``)."""

    def __init__(self, ctx: Context, tree: Tree, devices: CheckIn, dispatch: Dispatch, jobs: Jobs) -> None:
        self._ctx = ctx
        self.time = ctx.time
        self.root = tree.root
        self._tree = tree
        self._devices = devices
        self._dispatch = dispatch
        self._jobs = jobs
        self.busy: dict[str, LiveDevice] = {}
        self.in_flight: list[tuple[float, int, Arrival]] = []
        self.silent: dict[str, float] = {}
        self._arrivals = itertools.count()

    def buffer(self, rnd: int, attempt: int, arrays: NDArrays, config: RunConfig | None = None,
               noise_stddev: float = 0.0) -> Played:
        """One buffer (see ``Engine.buffer``)."""
        ctx = self._ctx
        cfg = config if config is not None else ctx.run
        ctx.round_cfg = cfg
        stats = SimulatedCounts()
        t_open = self.time.t
        blob = wire.arrays_to_blob(arrays)
        root = self.root
        self._forget_silent()
        live = self._devices.check_in(rnd, attempt, stats, self.busy)
        task = self._tree.root_task(rnd, attempt, arrays, blob, cfg, config, noise_stddev)
        root.reset()
        root.cr = cr = root.coord.open_round(task)
        fresh = self._dispatch.dispatch(live, blob, task.schema, task.shared_seed, stats, {})
        self._train_now(fresh, arrays, live, stats)
        extensions = 0
        while not cr.closed:
            deadline = cr.task.deadline_unix - self.time.origin
            nxt = self.in_flight[0][0] if self.in_flight else math.inf
            if deadline <= nxt:
                self.time.advance_to(deadline)
                self._heartbeats()
                # At its deadline the buffer closes, or, short of its minimum, the root tops
                # its clients up from those checked in (more devices check in first) and
                # waits another deadline: devices poll all the time, not only at a version.
                extensions += 1
                more = self._devices.check_in(rnd, attempt + 1000 * extensions, stats, {**self.busy, **live})
                live.update(more)
                root.coord.sweep()
                if cr.closed or extensions > 100:
                    break
                idle = {n: d for n, d in live.items() if n not in self.busy and n in root.coord.children}
                fresh = self._dispatch.dispatch(idle, blob, task.schema, task.shared_seed, stats, {})
                self._train_now(fresh, arrays, idle, stats)
                continue
            _, _, a = heapq.heappop(self.in_flight)
            self.time.advance_to(a.finish)
            self._arrive(a, stats)
        if not cr.closed:
            root.coord.close_round(cr, "no device could fill the buffer")
        out = root.coord.outcome(cr)
        if enough(out, cfg):  # the next version opens: devices too stale for it stop now
            self._past_staleness(rnd + 1, stats)
        for node, dev in live.items():  # checked in, never chosen: back to the population
            if node not in self.busy and node in root.coord.children:
                self._devices.release(node, dev)
        return played(out, stats, self.time.t - t_open, {"in_flight": len(self.in_flight), "model_version": rnd - 1})

    def _train_now(self, fresh: list[Arrival], arrays: NDArrays, live: dict[str, LiveDevice],
                   stats: SimulatedCounts) -> None:
        """Train the newly assigned devices on the version they pulled; queue their arrivals.
        A selected device that does not arrive (vanished, or its governor stopped it before
        a step) falls silent, and its tier drops it ``node_timeout_s`` later."""
        arriving = {a.node_id for a in fresh}
        cr = self.root.cr
        assert cr is not None
        for node, dev in live.items():
            a = cr.assignments.get(node)
            if a is not None and a.round == cr.task.round and node not in arriving:
                self.silent[node] = self.time.t + self._ctx.server_cfg.node_timeout_s
                self.busy[node] = dev
        if not fresh:
            return
        job = self._jobs.job
        outputs = {o.partition: o for o in self._ctx.backend.submit([job(a) for a in fresh], arrays).result()}
        for a in fresh:
            a.output = outputs[a.partition]
            self.busy[a.node_id] = live[a.node_id]
            heapq.heappush(self.in_flight, (a.finish, next(self._arrivals), a))

    def _arrive(self, a: Arrival, stats: SimulatedCounts) -> None:
        o = a.output
        assert o is not None
        what = FAILED
        if o.header is not None:
            try:
                self.root.coord.upload_now(a.node_id, o.header, o.payload)
                what = FOLDED
            except OrchardError as err:
                what = type(err).__name__
        self._jobs.tally(stats, a.finish, True, what, a.partition, o.codec_state if what == FOLDED else None)
        self._devices.release(a.node_id, self.busy.pop(a.node_id))

    def _past_staleness(self, rnd: int, stats: SimulatedCounts) -> None:
        """Before version ``rnd`` opens: a device still training on a version the root's
        admission would refuse from then on (``check_version``: more than S versions
        stale) stops now, as a late device of a synchronous round does; its training is
        counted, its upload refused by name."""
        assert self.root.cr is not None
        ctx = self._ctx
        task, S = self.root.cr.task, ctx.run.mode.max_stale
        keep = []
        for item in self.in_flight:
            a = item[2]
            try:
                check_version(task, False, "", ctx.run_id, a.assignment.round, S, ahead=rnd - task.round)
                keep.append(item)
            except StaleUpdateError as err:
                stats.trained += 1
                name = type(err).__name__
                stats.rejected[name] = stats.rejected.get(name, 0) + 1
                self._devices.release(a.node_id, self.busy.pop(a.node_id))
        if len(keep) != len(self.in_flight):
            self.in_flight = keep
            heapq.heapify(self.in_flight)
        for node in list(self.silent):
            held = self.root.cr.assignments.get(node) if self.root.cr is not None else None
            if held is None or rnd - held.round > S:
                del self.silent[node]
                self._devices.release(node, self.busy.pop(node))

    def _heartbeats(self) -> None:
        """Devices still training heartbeat; a sweep drops only the silent."""
        for node in self.busy:
            if node not in self.silent and node in self.root.coord.children:
                self.root.coord.touch(node)

    def _forget_silent(self) -> None:
        """Devices that fell silent are forgotten once their tier's timeout has passed."""
        for node, when in list(self.silent.items()):
            if when <= self.time.t:
                del self.silent[node]
                self._devices.release(node, self.busy.pop(node))
        self._heartbeats()
        self.root.coord.sweep()
