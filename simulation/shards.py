"""Sharded rounds: the root's subtrees run in separate processes, each its own group.

With worker processes, a synchronous round over a tree without secure aggregation is
sharded: each worker runs a group of the root's subtrees with an engine of its own over
the same tree (``Engine(tops=...)``), and the engine's process runs a group and the root.

A round over a sharded tree: every shard checks in (:meth:`Shard.check_in`); the root
takes the tops' reports, opens and assigns them; every shard opens its subtrees, hands
out tasks, runs its devices and trains and folds its clients in time order
(:meth:`Shard.run`), all at once in their processes; then the root takes the tops'
partials in time order (:meth:`ShardedRounds._root_phase`) until it closes, and every
shard ends the round at that time (:meth:`Shard.finish`). The tiers, the order of every
fold and the model are those of one process running the round; only what happened after
the root closed (in one process: never) is undone from the counts and the devices' codec
states.
"""

from __future__ import annotations

import gc
import heapq
import itertools
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

from orchard import wire
from orchard.config import RunConfig
from orchard.messages import TaskAssignment, UploadHeader
from orchard.server.round import SimulatedCounts
from orchard.server.runloop import Played
from orchard.simulation.arrivals import Arrivals
from orchard.simulation.checkin import CheckIn
from orchard.simulation.clients import ClientJob, ClientOutput
from orchard.simulation.context import Context
from orchard.simulation.dispatch import Dispatch
from orchard.simulation.jobs import Jobs, add_counts, count_log, done, played
from orchard.simulation.population import LiveDevice
from orchard.simulation.tree import Tree
from orchard.typing import NDArrays

_ENGINE_SHARE = 1.0  # the engine's share of the root's subtrees against a worker's 1 (the root itself costs ms)


class Shard:
    """One process's group of the root's subtrees (``Tree.tops``), through a round: the
    steps the engine runs for its own group and a worker's engine runs, by name, for its
    (``Engine.shard_check_in``, ``shard_run``, ``shard_finish``)."""

    def __init__(self, ctx: Context, tree: Tree, devices: CheckIn, dispatch: Dispatch, arrivals: Arrivals,
                 jobs: Jobs) -> None:
        self._ctx = ctx
        self._tree = tree
        self._devices = devices
        self._dispatch = dispatch
        self._arrivals = arrivals
        self._jobs = jobs
        self._live: dict[str, LiveDevice] = {}  # this round's devices
        self._kept: list[tuple[float, int, dict[str, Any]]] = []  # codec states logged this round
        self._steps = (0.0, 0.0)  # the last check_in's and finish's wall seconds

    @property
    def device_seconds(self) -> float:
        """The last dispatch's wall seconds waiting for its device models."""
        return self._dispatch.device_seconds

    def check_in(self, rnd: int, attempt: int, t: float) -> tuple[dict[str, tuple[int, int]], int]:
        """A shard's check-in at virtual time ``t``: devices check in at its lowest tiers
        (each its share, so the shards together check in what one process would), and
        its tops' pool reports for the root come back, with how many checked in."""
        started = time.perf_counter()
        self._ctx.time.t = t
        self._live = self._devices.check_in(rnd, attempt, SimulatedCounts())
        out = self._tree.report_pools(self._ctx.run, self._tree.tops), len(self._live)
        self._steps = (time.perf_counter() - started, self._steps[1])
        return out

    def run(self, assignments: dict[str, TaskAssignment], blob: bytes, schema: tuple, shared_seed: int,
            config: RunConfig | None, arrays: NDArrays | None = None
            ) -> tuple[list[tuple[float, str, UploadHeader, bytes]], list[tuple[float, bool, str]], SimulatedCounts]:
        """A shard's round once the root assigned its tops (``assignments``, by name): the
        tops' partials for the root as (time, top, header, payload), the fates of its
        uploads as (time, client?, what), and its counts of devices (their ``phase_seconds``:
        where this shard's time went). ``config``: the round's config when it is not the
        run's (with DP: the ledger's)."""
        tops = self._tree.tops
        assert tops is not None  # a shard
        self._ctx.round_cfg = self._ctx.run if config is None else config
        if arrays is None:
            arrays = wire.blob_to_arrays(blob)
        clock = time.perf_counter
        t0 = clock()
        for t in self._tree.tiers(tops):
            t.reset()
        for t in tops:
            a = assignments.get(t.name)
            if a is not None:
                self._tree.open_tier(t, a, blob)
        stats = SimulatedCounts()
        starts: dict[str, tuple[bytes, NDArrays]] = {}
        arrivals = self._dispatch.dispatch(self._live, blob, schema, shared_seed, stats, starts)
        t1 = clock()
        jobs, fold = self._jobs, self._arrivals
        jobs.log, fold.partials = [], []
        try:
            fold.process(arrivals, arrays, stats, {k: v[1] for k, v in starts.items()}, tops=tops)
            log, partials = jobs.log, fold.partials
        finally:
            jobs.log = fold.partials = None
        stats.phase_seconds = {"check_in": self._steps[0], "dispatch": t1 - t0, "arrivals": clock() - t1,
                               "finish": self._steps[1]}
        self._kept = [(when, part, state) for when, _, _, part, state in log if state]
        return partials, [(when, client, what) for when, client, what, _, _ in log], stats

    def finish(self, closed_at: float, collect: bool = False) -> None:
        """The round ended when the root closed at ``closed_at``: keep the codec states of
        the clients folded before it, and let the round's devices go at that time. With
        ``collect`` (a shard in a worker, where the cyclic collector is off), collect the
        young generations then: what the round allocated and did not free. The engine
        reads this step's answer only when the next round starts, so nothing waits on it
        (collecting before each step instead cost about 20 CPU-µs a client)."""
        started = time.perf_counter()
        self._jobs.keep_before(self._kept, closed_at)
        self._kept = []
        self._ctx.time.t = closed_at
        self._tree.close_open(self._tree.tops)
        self._devices.leave(self._live)
        self._live = {}
        if collect:
            gc.collect(1)
        self._steps = (self._steps[0], time.perf_counter() - started)


def can_shard(ctx: Context, tree: Tree, backend: Any) -> bool:
    """Whether the root's subtrees can run in separate processes: a synchronous run
    over a tree of two or more subtrees (their devices, clients and folds never meet
    below the root) without secure aggregation (whose sessions can span the tree),
    on a backend with workers."""
    return (getattr(backend, "start_shards", None) is not None and len(tree.root.children) >= 2
            and not ctx.run.mode.is_async and not ctx.run.secure_aggregation.enabled)


class ShardedRounds:
    """The engine's side of sharded rounds: the root, its own shard (``local``) and the
    workers' (``remotes``, each a handle whose ``call`` runs a shard step by name)."""

    def __init__(self, ctx: Context, tree: Tree, local: Shard, arrivals: Arrivals, remotes: list[Any]) -> None:
        self._ctx = ctx
        self._tree = tree
        self._local = local
        self._arrivals = arrivals
        self._remotes = remotes
        self._finishing: list[Future[Any]] = []  # the workers' ends of the last round

    @classmethod
    def start(cls, ctx: Context, tree: Tree, local: Shard, arrivals: Arrivals, fanout: list[int],
              opts: dict[str, Any]) -> ShardedRounds:
        """Split the root's children into contiguous groups, one for this process and one
        for each worker (sized by ``_ENGINE_SHARE``: the root's own work is a few
        milliseconds a round, so equal), and start the workers' (each an engine built
        with ``opts``). This process's clients then train here; each worker is a shard."""
        backend = ctx.backend
        tops = tree.root.children
        n = min(len(tops), 1 + ctx.workers)
        weights = [_ENGINE_SHARE] + [1.0] * (n - 1)
        bounds = [round(len(tops) * sum(weights[:k]) / sum(weights)) for k in range(n + 1)]
        if any(lo >= hi for lo, hi in itertools.pairwise(bounds)):
            bounds = [len(tops) * k // n for k in range(n + 1)]
        groups = [[t.name for t in tops[lo:hi]] for lo, hi in itertools.pairwise(bounds)]
        remotes = backend.start_shards(ctx.pop, fanout, groups[1:], opts)
        tree.serve(groups[0])
        ctx.backend = Here(backend.run_here)
        return cls(ctx, tree, local, arrivals, remotes)

    def round(self, rnd: int, attempt: int, arrays: NDArrays, cfg: RunConfig, config: RunConfig | None,
              noise_stddev: float) -> Played:
        """``Engine.round`` over a sharded tree (see the module's docstring)."""
        ctx, tree, local = self._ctx, self._tree, self._local
        stats = SimulatedCounts()
        t_open = ctx.time.t
        clock = time.perf_counter
        t0 = clock()
        blob = wire.arrays_to_blob(arrays)
        for fut in self._finishing:  # the last round's ends (errors surface here)
            fut.result()
        self._finishing = []
        calls = [r.call("shard_check_in", rnd, attempt, t_open) for r in self._remotes]
        pools, stats.checked_in = local.check_in(rnd, attempt, t_open)
        for call in calls:
            more, n = call.result()
            pools.update(more)
            stats.checked_in += n
        root = tree.root
        for t in reversed(root.children):  # as Tree.report_pools, bottom-up
            if t.name in pools:
                size, elig = pools[t.name]
                root.coord.touch(t.name, pool_size=size, pool_eligible=elig)
        t1 = clock()
        task = tree.root_task(rnd, attempt, arrays, blob, cfg, config, noise_stddev)
        tree.open_root(task)
        assignments: dict[str, TaskAssignment] = {}
        for t in root.children:
            a = root.coord.assign(t.name)
            if a is not None:
                root.coord.count_bytes_down(len(blob))
                assignments[t.name] = a
        calls = [r.call("shard_run", {n: assignments[n] for n in r.tops if n in assignments}, blob, task.schema,
                        task.shared_seed, config) for r in self._remotes]
        t2 = clock()
        partials, log, counts = local.run(assignments, blob, task.schema, task.shared_seed, config, arrays)
        add_counts(stats, counts)
        own = counts.phase_seconds
        t3 = clock()
        workers: dict[str, float] = {}  # the slowest worker shard's steps
        for call in calls:
            more, more_log, counts = call.result()
            partials += more
            log += more_log
            add_counts(stats, counts)
            for k, v in counts.phase_seconds.items():
                workers[k] = max(workers.get(k, 0.0), v)
        t4 = clock()
        closed_at = self._root_phase(partials, stats, t_open)
        count_log(stats, log, closed_at)
        self._finishing = [r.call("shard_finish", closed_at, True) for r in self._remotes]
        assert root.cr is not None
        if not root.cr.closed:
            root.coord.close_round(root.cr, "simulation round over")
        out = root.coord.outcome(root.cr)
        t5 = clock()
        local.finish(closed_at)
        stats.phase_seconds = {
            "check_in": round(t1 - t0, 4),  # every shard's devices polled, caught up, checked and joined
            "open": round(t2 - t1, 4),  # the root's task, its children assigned
            "dispatch": round(own["dispatch"], 4),  # this process's subtrees opened, their devices' models run
            "device_models": round(local.device_seconds, 4),  # of dispatch: the governors' runs
            "arrivals": round(own["arrivals"], 4),  # this process's clients trained and folded, in time order
            "waiting_for_shards": round(t4 - t3, 4),  # the workers' subtrees, after this process's were done
            "root": round(t5 - t4, 4),  # the partials folded at the root, in time order
            "leave": round(clock() - t5, 4),  # devices back into the population
            # The slowest worker shard: its check-in, dispatch and arrivals this round, and
            # its last round's end (devices let go, garbage collected) before this one.
            **{f"worker_{k}": round(v, 4) for k, v in workers.items()},
        }
        return played(out, stats, ctx.time.t - t_open)

    def _root_phase(self, partials: list[tuple[float, str, UploadHeader, bytes]], stats: SimulatedCounts,
                    t_open: float) -> float:
        """The root takes the shards' partials in time order (ties in tree order, as one
        process pushes them) from the round's open, with its deadline, until it closes;
        returns the virtual time it closed at."""
        ctx, tree = self._ctx, self._tree
        root = tree.root
        assert root.cr is not None
        ctx.time.t = t_open
        events: list[tuple[float, int, str, Any]] = [
            (root.cr.task.deadline_unix - ctx.time.origin, -1, "deadline", root)]
        events += [(at, tree.order[name], "partial", (tree.by_name[name], header, payload))
                   for at, name, header, payload in partials]
        heapq.heapify(events)
        seq = itertools.count(len(tree.order))
        while events and not root.cr.closed:
            when, _, kind, obj = heapq.heappop(events)
            ctx.time.advance_to(when)
            self._arrivals.event(kind, obj, events, seq, stats)
        return ctx.time.t


class Here:
    """A backend that trains on the caller's thread with ``run_here``: the engine's own
    clients when the workers are shards."""

    def __init__(self, run_here: Callable[..., list[ClientOutput]]) -> None:
        self._run_here = run_here

    def submit(self, jobs: list[ClientJob], global_arrays: NDArrays,
               starts: dict[str, NDArrays] | None = None) -> Future[list[ClientOutput]]:
        return done(self._run_here(jobs, global_arrays, starts))

    def close(self) -> None:
        pass
