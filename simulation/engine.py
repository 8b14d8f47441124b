"""The round engine of a simulation: real tiers, virtual time, simulated devices.

The simulator is an execution backend of the one round engine, not a second
implementation of it. Every tier is a real :class:`orchard.server.coordinator.Coordinator`
built ``inline`` (decode and fold on this thread, no event loop); every client builds
its upload with the client's own ``build_upload`` and answers secure aggregation with the
client's own :class:`~orchard.client.secure.SecureParticipant`; the run loop the gRPC root
runs (``orchard.server.runloop``) judges each round's outcome and steps the model with
:func:`orchard.aggregation.server_step`. What differs from a gRPC federation is the
clock (virtual), the transport (method calls on the coordinators' public API: ``join``,
``assign``, ``upload_now``, ``secagg_now``, ``leave``) and how clients train (in a
backend, many at a time).

Per round (attempt), in simulated time:

1. **Check-in.** Devices are drawn in a seeded random order; the ones online at this
   hour (their kind's availability) are brought up to the present a batch at a time
   (``Population.catch_up``: the edge runtime's device model over columns), each is
   made the edge runtime's :class:`SimulatedDevice`, and it checks in (``join``) at the
   lowest-tier coordinator it dials if the device-side policy
   (``edge_runtime.policy.check_eligibility``) lets it. Each lowest-tier coordinator
   takes its share of ``clients_per_round * over_selection * checkin_factor`` devices
   (they fill independently, as aggregators' pools do); check-in stops once all have.
2. **Selection.** Aggregators report their pools upward (``touch``), the root opens the
   round, and each tier takes its assignment from its parent (``assign``) and opens its
   own round (``server.upstream.ChildRound``), exactly as ``server.aggregator`` does
   over gRPC; lowest tiers over-select their clients.
3. **Devices.** A selected device downloads the model (its link speed), trains under
   the edge runtime's governor (``run_governed`` on its simulated battery and thermal
   model: it may pace itself or stop early, and then trains only the steps it did),
   and uploads. Its finish time is download + training + upload; some devices vanish
   mid-task (their kind's dropout rate) and are never heard from again. Under secure
   aggregation every selected device answers the key stages when the round opens (a
   real client runs them while it trains).
4. **Arrivals.** Uploads are handed to the tier in simulated-time order with
   ``Coordinator.upload_now`` (the gRPC path's admission, checks, decode and fold), or
   under secure aggregation posted as masked inputs with ``secagg_now``. A tier closes
   when the coordinator says so (target reached, or its secure session finished), at
   its deadline (``sweep``; late devices are refused), or once every selected child
   delivered or was dropped (vanished devices are dropped ``node_timeout_s`` after they
   fell silent). A secure tier's masked-input stage ends when every selected client
   answered or at the stage's deadline, as on a server. A closed tier pushes its
   partial upward (``ChildRound.partial``, then ``upload_now`` on its parent) after its
   transfer time.
5. **Root.** When the root closes, its outcome goes back to the run loop
   (``orchard.server.runloop``, the gRPC root's too): ``server_step``, or too few
   updates fail the round and it is retried.

With worker processes, a synchronous round over a tree without secure aggregation is
sharded: each worker runs a group of the root's subtrees with an engine of its own over
the same tree, and this one runs a group and the root (see :meth:`Engine.shard_check_in`).

Client training runs in a backend (threads, processes or Ray) in chunks of
``chunk_size`` clients taken in finish-time order, and only for clients expected to
count: a client that would arrive after its tier closed (past the deadline or the
masked-input stage, or after the tier's first ``target`` arrivals) is not trained,
since its upload would be refused anyway. That keeps large over-selected rounds cheap
without changing any number: when the guess is wrong (an earlier upload failed or was
refused, so the tier is still open when the client's turn comes) the client is trained
then.
"""

from __future__ import annotations

import contextlib
import gc
import hashlib
import heapq
import itertools
import math
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from orchard import wire
from orchard.client.secure import SecureParticipant, masked_input
from orchard.client.update import train_seed
from orchard.compression import build_codec, encode_update
from orchard.config import RunConfig, ServerConfig
from orchard.edge_runtime.clock import VirtualClock
from orchard.edge_runtime.device import SimulatedDevice, SimulatedDeviceParams
from orchard.edge_runtime.governor import Governor, run_governed
from orchard.edge_runtime.policy import DevicePolicy, RoundBudget
from orchard.errors import OrchardError, SecAggError, StaleUpdateError
from orchard.messages import TaskAssignment, UploadHeader
from orchard.secure_agg import Stage
from orchard.server.admission import check_version
from orchard.server.cohort import CohortRound
from orchard.server.coordinator import Coordinator, ParentUpstream, run_inline
from orchard.server.decoding import ClientUpdateDecoder
from orchard.server.round import (
    RoundOutcome,
    RoundTask,
    SimulatedCounts,
    root_task,
)
from orchard.server.runloop import Played, enough
from orchard.server.secagg import STAGE_END, SecureCohort
from orchard.server.upstream import ChildRound
from orchard.simulation.backends import Backend
from orchard.simulation.clients import ClientJob, ClientOutput
from orchard.simulation.config import AttackConfig
from orchard.simulation.population import LiveDevice, Population
from orchard.tasks import Task
from orchard.typing import DeviceState, NDArrays, Role
from orchard.updates import pack
from orchard.wire import sha256_hex

_FIRST_CHUNK = 64  # clients in the first training job of a round (see Engine._process)
_HELP_BATCH = 160  # clients the engine trains at a time while it waits on a worker (one vmap slice)
_HELD_HERE_MAX = 1024  # at most this many clients trained by the engine and not yet folded
_TOKEN = "simulated"  # every simulated node presents the same (unchecked) credential
_AHEAD_BATCH = 320  # clients per job trained ahead, on an idle worker, while devices are dispatched
_AHEAD_MAX = 4096  # at most this many clients trained ahead per round (their uploads wait in memory)
_JOBS_PER_WORKER = 2  # jobs queued per worker: the next one waits while one runs, so a worker never idles between them
_DEVICE_BATCH = 256  # device models per batch sent to a worker (see _DeviceRuns)
_ENGINE_SHARE = 1.0  # the engine's share of the root's subtrees against a worker's 1 (the root itself costs ms)
_FOLDED, _FAILED, _LATE = "", "failed", "late"  # what became of an upload (Engine._tally), else an error's name


class VirtualTime:
    """The simulated clock every coordinator reads (monotonic and wall, in seconds)."""

    def __init__(self, wall_origin: float) -> None:
        self.t = 0.0
        self.origin = wall_origin

    def monotonic(self) -> float:
        return self.t

    def wall(self) -> float:
        return self.origin + self.t

    def advance_to(self, t: float) -> None:
        # Events are handled in time order; an event stamped earlier than now (a
        # partial whose transfer was shorter than the wait) is handled now.
        self.t = max(self.t, t)


@dataclass
class Tier:
    name: str
    coord: Coordinator
    parent: Tier | None
    children: list[Tier] = field(default_factory=list)
    # per round
    cr: CohortRound | None = None
    pushed: bool = False
    waiting: int = 0  # selected clients still expected to upload (not vanished, not late)
    last_silence: float = -math.inf  # latest time a vanished client fell silent
    working: set[str] = field(default_factory=set)  # selected clients still training
    assignment: TaskAssignment | None = None  # this tier's task from its parent
    child: ChildRound | None = None  # this tier's round for that task
    # Secure aggregation: each selected client's side of the tier's SecAgg+ session and its task.
    secure: dict[str, tuple[SecureParticipant, TaskAssignment]] = field(default_factory=dict)

    def reset(self) -> None:
        self.cr, self.pushed, self.waiting, self.last_silence = None, False, 0, -math.inf
        self.working, self.assignment, self.child, self.secure = set(), None, None, {}


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


class Engine:
    def __init__(self, task: Task, population: Population, run: RunConfig, fanout: list[int], backend: Backend,
                 *, chunk_size: int, workers: int, governor: bool, checkin_factor: float, node_timeout_s: float,
                 aggregator_mbps: float, wall_origin: float, num_partitions: int, seed: int,
                 attack: AttackConfig | None = None, sharded: bool = False, tops: list[str] | None = None) -> None:
        """``sharded``: with a backend of worker processes (``start_shards``), a synchronous
        run over a tree without secure aggregation runs the root's subtrees in the workers
        and here, each process its own (see :meth:`shard_check_in`). ``tops``: this engine
        is such a shard, in a worker: it runs the subtrees of these children of the root."""
        self.task = task
        self.pop = population
        self.run = run
        self.backend = backend
        self.chunk_size = chunk_size
        self.workers = workers
        self.governor = governor
        self.checkin_factor = checkin_factor
        self.aggregator_mbps = aggregator_mbps
        self.num_partitions = num_partitions
        self.seed = seed
        self.time = VirtualTime(wall_origin)
        self.codec = build_codec(run.codec)
        self.attack = attack
        # Liveness is modelled here (a vanished device is silent), so tiers use the
        # configured timeout on the virtual clock; limits are the real defaults.
        self.server_cfg = ServerConfig(node_timeout_s=node_timeout_s)
        self.root = self._tier("root", None, 0)
        level = [self.root]
        for depth, fan in enumerate(fanout, start=1):
            nxt = []
            for p in level:
                for i in range(fan):
                    t = self._tier(f"{p.name}/agg{depth}.{i}" if p.parent else f"agg{depth}.{i}", p, depth)
                    p.children.append(t)
                    p.coord.join(t.name, Role.AGGREGATOR, _TOKEN, _box_state())
                    nxt.append(t)
            level = nxt
        self.leaves = level
        # Each partition's example count, read per device as a Python int.
        self._size_of: list[int] = [int(n) for n in task.partition(num_partitions, seed).sizes]
        self.codec_states: dict[int, dict[str, Any]] = {}
        # Downlink deltas (run.downlink_delta): the model each device holds (sha256) and
        # those models' blobs, pruned every round to what its tier can still delta from.
        self.held: dict[int, str] = {}
        self.held_blobs: dict[str, bytes] = {}
        self.run_id = f"sim-{seed}"
        self.config_json = run.model_dump_json()
        self.round_cfg = run
        # Asynchronous mode: devices still training across buffers, by node; their arrivals
        # in time order; devices that vanished, with when their tier forgets them.
        self.busy: dict[str, LiveDevice] = {}
        self.in_flight: list[tuple[float, int, Arrival]] = []
        self.silent: dict[str, float] = {}
        self._arrivals = itertools.count()
        # Clients trained ahead of their turn (see _train_ahead): their jobs in flight, in
        # order, the outputs that came back, by partition, and every partition sent ahead.
        self._ahead_jobs: deque[Future[list[ClientOutput]]] = deque()
        self._ahead: dict[int, ClientOutput] = {}
        self._ahead_parts: set[int] = set()
        self._policies: dict[tuple[int, float], DevicePolicy] = {}  # device policies by (steps, seconds)
        self._device_seconds = 0.0  # the last dispatch's wall seconds waiting for its device models (_DeviceRuns.results)
        # Sharding: each tier's place in the tree's order; the lowest tiers whose devices
        # check in here; the root's subtrees run here (None: the whole tree, with the root);
        # the shards in workers (engine only), and this round's devices, log and partials.
        self._order = {t.name: i for i, t in enumerate(self.tiers())}
        self._by_name = {t.name: t for t in self.tiers()}
        self._mine = [True] * len(self.leaves)
        self._tops: list[Tier] | None = None
        self._remotes: list[Any] = []
        self._finishing: list[Future[Any]] = []
        self._live: dict[str, LiveDevice] = {}
        self._log: list[tuple[float, bool, str, int, dict[str, Any] | None]] | None = None
        self._partials: list[tuple[float, str, UploadHeader, bytes]] | None = None
        self._kept: list[tuple[float, int, dict[str, Any]]] = []
        self._shard_steps = (0.0, 0.0)  # the last shard_check_in's and shard_finish's wall seconds
        if tops is not None:
            self._serve(tops)
        elif sharded and self._can_shard(backend):
            self._start_shards(backend, fanout, dict(
                chunk_size=chunk_size, workers=1, governor=governor, checkin_factor=checkin_factor,
                node_timeout_s=node_timeout_s, aggregator_mbps=aggregator_mbps, wall_origin=wall_origin,
                num_partitions=num_partitions, seed=seed, attack=attack))

    def _tier(self, name: str, parent: Tier | None, depth: int) -> Tier:
        h = int(hashlib.sha256(name.encode()).hexdigest()[:8], 16)
        rng = np.random.default_rng([self.seed, depth, h])
        # DP noise (central, at the root) is seeded like everything else in a simulation,
        # so a seed replays a run; a real root draws it from OS entropy.
        coord = Coordinator(name, self.server_cfg, rng, ClientUpdateDecoder(),
                            monotonic=self.time.monotonic, wall=self.time.wall, inline=True,
                            noise_rng=np.random.default_rng([self.seed, depth, h, 0xD9]))
        return Tier(name, coord, parent)

    def tiers(self, tops: list[Tier] | None = None) -> list[Tier]:
        """The tree's tiers in breadth-first order (from ``tops`` down, if given)."""
        out, queue = [], deque([self.root] if tops is None else tops)
        while queue:
            t = queue.popleft()
            out.append(t)
            queue.extend(t.children)
        return out

    # ------------------------------------------------------------------ one round

    def round(self, rnd: int, attempt: int, arrays: NDArrays, config: RunConfig | None = None,
              noise_stddev: float = 0.0) -> Played:
        """Run one attempt of round ``rnd``: the root's outcome and the round's counts (the
        run loop, ``orchard.server.runloop``, judges and steps it).

        ``config``: this round's config when it differs from the run's (with DP: the
        ledger's, carrying the clip norm and noise multiplier); ``noise_stddev``: the
        root's central DP noise."""
        cfg = config if config is not None else self.run
        self.round_cfg = cfg
        if self._remotes:
            return self._round_sharded(rnd, attempt, arrays, cfg, config, noise_stddev)
        stats = SimulatedCounts()
        t_open = self.time.t
        clock = time.perf_counter
        t0 = clock()
        blob = wire.arrays_to_blob(arrays)
        live = self._check_in(rnd, attempt, stats)
        self._report_pools()
        t1 = clock()
        task = self._open_root(rnd, attempt, arrays, blob, cfg, config, noise_stddev)
        schema, shared_seed = task.schema, task.shared_seed
        self._open_below(self.root, blob)
        t2 = clock()
        starts: dict[str, tuple[bytes, NDArrays]] = {}  # downlink reconstructions, by sha256
        arrivals = self._dispatch(live, blob, schema, shared_seed, stats, starts, ahead_of=arrays)
        t3 = clock()
        self._secure_answer_all()  # the key stages, while the clients train
        self._process(arrivals, arrays, stats, {k: v[1] for k, v in starts.items()})
        for t in self.tiers():
            if t.cr is not None and not t.cr.closed:
                t.coord.close_round(t.cr, "simulation round over")
        out = self.root.coord.outcome(self.root.cr)
        t4 = clock()
        self._leave(live)
        stats.phase_seconds = {
            "check_in": round(t1 - t0, 4),  # devices polled, caught up, checked and joined
            "open": round(t2 - t1, 4),  # the root's task, every tier opened and its cohort selected
            "dispatch": round(t3 - t2, 4),  # assignments, downloads and the device models
            "device_models": round(self._device_seconds, 4),  # of dispatch: the governors' runs
            "arrivals": round(t4 - t3, 4),  # training, uploads and folds, in time order
            "leave": round(clock() - t4, 4),  # devices back into the population
        }
        return self._played(out, stats, t_open)

    def _open_root(self, rnd: int, attempt: int, arrays: NDArrays, blob: bytes, cfg: RunConfig,
                   config: RunConfig | None, noise_stddev: float) -> RoundTask:
        """Every tier's round state cleared, and the root's round opened: its task."""
        task = root_task(self.run_id, rnd, attempt, cfg, self.config_json if config is None else cfg.model_dump_json(),
                         arrays, blob, sha256_hex(blob), self.time.wall(), noise_stddev)
        for t in self.tiers():
            t.reset()
        self.root.cr = self.root.coord.open_round(task)
        return task

    def _played(self, out: RoundOutcome, stats: SimulatedCounts, t_open: float,
                extra: dict[str, Any] | None = None) -> Played:
        """A round's outcome with its counts of devices, as the run loop takes it."""
        stats.simulated_seconds = round(self.time.t - t_open, 3)
        return Played(out, simulated=stats, extra=extra or {})

    # ------------------------------------------------------------------ shards

    def _can_shard(self, backend: Backend) -> bool:
        """Whether the root's subtrees can run in separate processes: a synchronous run
        over a tree of two or more subtrees (their devices, clients and folds never meet
        below the root) without secure aggregation (whose sessions can span the tree),
        on a backend with workers."""
        return (getattr(backend, "start_shards", None) is not None and len(self.root.children) >= 2
                and not self.run.mode.is_async and not self.run.secure_aggregation.enabled)

    def _serve(self, tops: list[str]) -> None:
        """Run only the subtrees under the root's children ``tops``: check devices in at
        their lowest tiers only, and train and fold only their clients."""
        self._tops = [self._by_name[n] for n in tops]
        below = {id(t) for t in self.tiers(self._tops)}
        self._mine = [id(leaf) in below for leaf in self.leaves]

    def _start_shards(self, backend: Any, fanout: list[int], opts: dict[str, Any]) -> None:
        """Split the root's children into contiguous groups, one for this process and one
        for each worker (sized by ``_ENGINE_SHARE``: the root's own work is a few
        milliseconds a round, so equal), and start the workers'."""
        tops = self.root.children
        n = min(len(tops), 1 + self.workers)
        weights = [_ENGINE_SHARE] + [1.0] * (n - 1)
        bounds = [round(len(tops) * sum(weights[:k]) / sum(weights)) for k in range(n + 1)]
        if any(lo >= hi for lo, hi in itertools.pairwise(bounds)):
            bounds = [len(tops) * k // n for k in range(n + 1)]
        groups = [[t.name for t in tops[lo:hi]] for lo, hi in itertools.pairwise(bounds)]
        self._remotes = backend.start_shards(self.pop, fanout, groups[1:], opts)
        self._serve(groups[0])
        self.backend = _Here(backend.run_here)  # this process trains its own clients; each worker is a shard

    def shard_check_in(self, rnd: int, attempt: int, t: float) -> tuple[dict[str, tuple[int, int]], int]:
        """A shard's check-in at virtual time ``t``: devices check in at its lowest tiers
        (each its share, so the shards together check in what one process would), and
        its tops' pool reports for the root come back, with how many checked in.

        A round over a sharded tree: every shard checks in (:meth:`shard_check_in`); the
        root takes the tops' reports, opens and assigns them; every shard opens its
        subtrees, hands out tasks, runs its devices and trains and folds its clients in
        time order (:meth:`shard_run`), all at once in their processes; then the root
        takes the tops' partials in time order (:meth:`_root_phase`) until it closes,
        and every shard ends the round at that time (:meth:`shard_finish`). The tiers,
        the order of every fold and the model are those of one process running the
        round; only what happened after the root closed (in one process: never) is
        undone from the counts and the devices' codec states."""
        started = time.perf_counter()
        self.time.t = t
        self._live = self._check_in(rnd, attempt, SimulatedCounts())
        out = self._report_pools(self._tops), len(self._live)
        self._shard_steps = (time.perf_counter() - started, self._shard_steps[1])
        return out

    def shard_run(self, assignments: dict[str, TaskAssignment], blob: bytes, schema: tuple, shared_seed: int,
                  config: RunConfig | None, arrays: NDArrays | None = None
                  ) -> tuple[list[tuple[float, str, UploadHeader, bytes]], list[tuple[float, bool, str]],
                             SimulatedCounts]:
        """A shard's round once the root assigned its tops (``assignments``, by name): the
        tops' partials for the root as (time, top, header, payload), the fates of its
        uploads as (time, client?, what), and its counts of devices (their ``phase_seconds``:
        where this shard's time went). ``config``: the round's config when it is not the
        run's (with DP: the ledger's)."""
        assert self._tops is not None  # a shard
        self.round_cfg = self.run if config is None else config
        if arrays is None:
            arrays = wire.blob_to_arrays(blob)
        clock = time.perf_counter
        t0 = clock()
        for t in self.tiers(self._tops):
            t.reset()
        for t in self._tops:
            a = assignments.get(t.name)
            if a is not None:
                self._open_tier(t, a, blob)
        stats = SimulatedCounts()
        starts: dict[str, tuple[bytes, NDArrays]] = {}
        arrivals = self._dispatch(self._live, blob, schema, shared_seed, stats, starts)
        t1 = clock()
        self._log, self._partials = [], []
        try:
            self._process(arrivals, arrays, stats, {k: v[1] for k, v in starts.items()}, tops=self._tops)
            log, partials = self._log, self._partials
        finally:
            self._log = self._partials = None
        stats.phase_seconds = {"check_in": self._shard_steps[0], "dispatch": t1 - t0, "arrivals": clock() - t1,
                               "finish": self._shard_steps[1]}
        self._kept = [(when, part, state) for when, _, _, part, state in log if state]
        return partials, [(when, client, what) for when, client, what, _, _ in log], stats

    def shard_finish(self, closed_at: float, collect: bool = False) -> None:
        """The round ended when the root closed at ``closed_at``: keep the codec states of
        the clients folded before it, and let the round's devices go at that time. With
        ``collect`` (a shard in a worker, where the cyclic collector is off), collect the
        young generations then: what the round allocated and did not free. The engine
        reads this step's answer only when the next round starts, so nothing waits on it
        (collecting before each step instead cost about 20 CPU-µs a client)."""
        started = time.perf_counter()
        for when, part, state in self._kept:
            if when < closed_at:
                self.codec_states[part] = state
        self._kept = []
        self.time.t = closed_at
        for t in self.tiers(self._tops):
            if t.cr is not None and not t.cr.closed:
                t.coord.close_round(t.cr, "simulation round over")
        self._leave(self._live)
        self._live = {}
        if collect:
            gc.collect(1)
        self._shard_steps = (self._shard_steps[0], time.perf_counter() - started)

    def _round_sharded(self, rnd: int, attempt: int, arrays: NDArrays, cfg: RunConfig,
                       config: RunConfig | None, noise_stddev: float) -> Played:
        """:meth:`round` over a sharded tree (see :meth:`shard_check_in`)."""
        stats = SimulatedCounts()
        t_open = self.time.t
        clock = time.perf_counter
        t0 = clock()
        blob = wire.arrays_to_blob(arrays)
        for fut in self._finishing:  # the last round's ends (errors surface here)
            fut.result()
        self._finishing = []
        calls = [r.call("shard_check_in", rnd, attempt, t_open) for r in self._remotes]
        pools, stats.checked_in = self.shard_check_in(rnd, attempt, t_open)
        for call in calls:
            more, n = call.result()
            pools.update(more)
            stats.checked_in += n
        root = self.root
        for t in reversed(root.children):  # as _report_pools, bottom-up
            if t.name in pools:
                size, elig = pools[t.name]
                root.coord.touch(t.name, pool_size=size, pool_eligible=elig)
        t1 = clock()
        task = self._open_root(rnd, attempt, arrays, blob, cfg, config, noise_stddev)
        assignments: dict[str, TaskAssignment] = {}
        for t in root.children:
            a = root.coord.assign(t.name)
            if a is not None:
                root.coord.count_bytes_down(len(blob))
                assignments[t.name] = a
        calls = [r.call("shard_run", {n: assignments[n] for n in r.tops if n in assignments}, blob, task.schema,
                        task.shared_seed, config) for r in self._remotes]
        t2 = clock()
        partials, log, counts = self.shard_run(assignments, blob, task.schema, task.shared_seed, config, arrays)
        _add_counts(stats, counts)
        own = counts.phase_seconds
        t3 = clock()
        workers: dict[str, float] = {}  # the slowest worker shard's steps
        for call in calls:
            more, more_log, counts = call.result()
            partials += more
            log += more_log
            _add_counts(stats, counts)
            for k, v in counts.phase_seconds.items():
                workers[k] = max(workers.get(k, 0.0), v)
        t4 = clock()
        closed_at = self._root_phase(partials, stats, t_open)
        _count_log(stats, log, closed_at)
        self._finishing = [r.call("shard_finish", closed_at, True) for r in self._remotes]
        assert root.cr is not None
        if not root.cr.closed:
            root.coord.close_round(root.cr, "simulation round over")
        out = root.coord.outcome(root.cr)
        t5 = clock()
        self.shard_finish(closed_at)
        stats.phase_seconds = {
            "check_in": round(t1 - t0, 4),  # every shard's devices polled, caught up, checked and joined
            "open": round(t2 - t1, 4),  # the root's task, its children assigned
            "dispatch": round(own["dispatch"], 4),  # this process's subtrees opened, their devices' models run
            "device_models": round(self._device_seconds, 4),  # of dispatch: the governors' runs
            "arrivals": round(own["arrivals"], 4),  # this process's clients trained and folded, in time order
            "waiting_for_shards": round(t4 - t3, 4),  # the workers' subtrees, after this process's were done
            "root": round(t5 - t4, 4),  # the partials folded at the root, in time order
            "leave": round(clock() - t5, 4),  # devices back into the population
            # The slowest worker shard: its check-in, dispatch and arrivals this round, and
            # its last round's end (devices let go, garbage collected) before this one.
            **{f"worker_{k}": round(v, 4) for k, v in workers.items()},
        }
        return self._played(out, stats, t_open)

    def _root_phase(self, partials: list[tuple[float, str, UploadHeader, bytes]], stats: SimulatedCounts,
                    t_open: float) -> float:
        """The root takes the shards' partials in time order (ties in tree order, as one
        process pushes them) from the round's open, with its deadline, until it closes;
        returns the virtual time it closed at."""
        root = self.root
        assert root.cr is not None
        self.time.t = t_open
        events: list[tuple[float, int, str, Any]] = [
            (root.cr.task.deadline_unix - self.time.origin, -1, "deadline", root)]
        events += [(at, self._order[name], "partial", (self._by_name[name], header, payload))
                   for at, name, header, payload in partials]
        heapq.heapify(events)
        seq = itertools.count(len(self._order))
        while events and not root.cr.closed:
            when, _, kind, obj = heapq.heappop(events)
            self.time.advance_to(when)
            self._event(kind, obj, events, seq, stats)
        return self.time.t

    # ------------------------------------------------------------------ asynchronous mode

    def buffer(self, rnd: int, attempt: int, arrays: NDArrays, config: RunConfig | None = None,
               noise_stddev: float = 0.0) -> Played:
        """One buffer of an asynchronous run (``[run.mode] kind = "async"``): what
        :meth:`round` is to a synchronous one, with the same outcome and counts.

        The root coordinator does the asynchronous work (``open_round`` carries the
        devices still training into the new buffer and tops them up to the concurrency;
        ``upload_now`` weights each update by its staleness or refuses it past S). Here
        is only the clock and the devices: fresh devices check in (those still training
        do not poll), the newly selected pull this version and are trained on it at once
        (their output waits for their finish time), and arrivals of every version are
        handed to the root in time order until the buffer closes at K (or its deadline).
        Devices still training stay for the next buffer; the others go back to the
        population. Flat trees only (validation says so)."""
        cfg = config if config is not None else self.run
        self.round_cfg = cfg
        stats = SimulatedCounts()
        t_open = self.time.t
        blob = wire.arrays_to_blob(arrays)
        root = self.root
        self._forget_silent()
        live = self._check_in(rnd, attempt, stats, self.busy)
        task = root_task(self.run_id, rnd, attempt, cfg, self.config_json if config is None else cfg.model_dump_json(),
                         arrays, blob, sha256_hex(blob), self.time.wall(), noise_stddev)
        root.reset()
        root.cr = cr = root.coord.open_round(task)
        fresh = self._dispatch(live, blob, task.schema, task.shared_seed, stats, {})
        self._train_now(fresh, arrays, live, stats)
        extensions = 0
        while not cr.closed:
            deadline = cr.task.deadline_unix - self.time.origin
            nxt = self.in_flight[0][0] if self.in_flight else math.inf
            if deadline <= nxt:
                self.time.advance_to(deadline)
                self._heartbeats_async()
                # At its deadline the buffer closes, or, short of its minimum, the root tops
                # its clients up from those checked in (more devices check in first) and
                # waits another deadline: devices poll all the time, not only at a version.
                extensions += 1
                more = self._check_in(rnd, attempt + 1000 * extensions, stats, {**self.busy, **live})
                live.update(more)
                root.coord.sweep()
                if cr.closed or extensions > 100:
                    break
                idle = {n: d for n, d in live.items() if n not in self.busy and n in root.coord.children}
                fresh = self._dispatch(idle, blob, task.schema, task.shared_seed, stats, {})
                self._train_now(fresh, arrays, idle, stats)
                continue
            _, _, a = heapq.heappop(self.in_flight)
            self.time.advance_to(a.finish)
            self._arrive_async(a, stats)
        if not cr.closed:
            root.coord.close_round(cr, "no device could fill the buffer")
        out = root.coord.outcome(cr)
        if enough(out, cfg):  # the next version opens: devices too stale for it stop now
            self._past_staleness(rnd + 1, stats)
        for node, dev in live.items():  # checked in, never chosen: back to the population
            if node not in self.busy and node in root.coord.children:
                self._release(node, dev)
        return self._played(out, stats, t_open, {"in_flight": len(self.in_flight), "model_version": rnd - 1})

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
                self.silent[node] = self.time.t + self.server_cfg.node_timeout_s
                self.busy[node] = dev
        if not fresh:
            return
        outputs = {o.partition: o for o in self.backend.submit([self._job(a) for a in fresh], arrays).result()}
        for a in fresh:
            a.output = outputs[a.partition]
            self.busy[a.node_id] = live[a.node_id]
            heapq.heappush(self.in_flight, (a.finish, next(self._arrivals), a))

    def _arrive_async(self, a: Arrival, stats: SimulatedCounts) -> None:
        o = a.output
        assert o is not None
        what = _FAILED
        if o.header is not None:
            try:
                self.root.coord.upload_now(a.node_id, o.header, o.payload)
                what = _FOLDED
            except OrchardError as err:
                what = type(err).__name__
        self._tally(stats, a.finish, True, what, a.partition, o.codec_state if what == _FOLDED else None)
        self._release(a.node_id, self.busy.pop(a.node_id))

    def _past_staleness(self, rnd: int, stats: SimulatedCounts) -> None:
        """Before version ``rnd`` opens: a device still training on a version the root's
        admission would refuse from then on (``check_version``: more than S versions
        stale) stops now, as a late device of a synchronous round does; its training is
        counted, its upload refused by name."""
        assert self.root.cr is not None
        task, S = self.root.cr.task, self.run.mode.max_stale
        keep = []
        for item in self.in_flight:
            a = item[2]
            try:
                check_version(task, False, "", self.run_id, a.assignment.round, S, ahead=rnd - task.round)
                keep.append(item)
            except StaleUpdateError as err:
                stats.trained += 1
                name = type(err).__name__
                stats.rejected[name] = stats.rejected.get(name, 0) + 1
                self._release(a.node_id, self.busy.pop(a.node_id))
        if len(keep) != len(self.in_flight):
            self.in_flight = keep
            heapq.heapify(self.in_flight)
        for node in list(self.silent):
            held = self.root.cr.assignments.get(node) if self.root.cr is not None else None
            if held is None or rnd - held.round > S:
                del self.silent[node]
                self._release(node, self.busy.pop(node))

    def _heartbeats_async(self) -> None:
        """Devices still training heartbeat; a sweep drops only the silent."""
        for node in self.busy:
            if node not in self.silent and node in self.root.coord.children:
                self.root.coord.touch(node)

    def _forget_silent(self) -> None:
        """Devices that fell silent are forgotten once their tier's timeout has passed."""
        for node, when in list(self.silent.items()):
            if when <= self.time.t:
                del self.silent[node]
                self._release(node, self.busy.pop(node))
        self._heartbeats_async()
        self.root.coord.sweep()

    def _release(self, node: str, dev: LiveDevice) -> None:
        """A device leaves its tier and goes back to the population (it may check in again)."""
        self.root.coord.leave(node)
        dev.clock.advance(max(0.0, self.time.t - dev.clock.monotonic()))
        self.pop.store(dev)

    # ------------------------------------------------------------------ check-in and selection

    def _check_in(self, rnd: int, attempt: int, stats: SimulatedCounts,
                  busy: dict[str, LiveDevice] | None = None) -> dict[str, LiveDevice]:
        """Devices check in at their lowest-tier nodes until each node has its share of
        ``clients_per_round * over_selection * checkin_factor`` (or everyone was asked):
        the lowest tiers fill independently, as aggregators' pools do, so a process that
        runs only some of them (a shard) checks in exactly the devices they would get."""
        cfg = self.run
        want = math.ceil(cfg.cohort.target * cfg.cohort.over_selection * self.checkin_factor)
        n_leaves = len(self.leaves)
        # Each lowest tier's share, in tree order; a tier this process does not run wants none.
        left = [want // n_leaves + (li < want % n_leaves) if self._mine[li] else 0 for li in range(n_leaves)]
        need = sum(left)
        live: dict[str, LiveDevice] = {}
        now = self.time.t
        wall = self.time.wall()
        # Offer devices in a seeded order until enough are in (or everyone was asked). The
        # online ones whose tier still wants devices are brought up to now a slice at a
        # time (Population.catch_up, which writes nothing), each slice no longer than the
        # devices still wanted; each then reads its state and decides, in order, and only
        # a device that was asked (its tier still wanted one) is written back.
        leaves = self.leaves
        for k, order in enumerate(self.pop.candidates(rnd, attempt, max(64, 2 * want))):
            online = order[self.pop.online(order, now, rnd, attempt * 1_000_003 + k)]
            if n_leaves > 1:
                online = online[np.asarray(left)[online % n_leaves] > 0]
            ids_online = online.tolist()
            if busy:  # still training (asynchronous mode): not polling
                ids_online = [i for i in ids_online if f"device-{i}" not in busy]
            pos = 0
            while pos < len(ids_online) and need > 0:
                ids = ids_online[pos:pos + max(64, need)]
                pos += len(ids)
                cols = self.pop.catch_up(np.asarray(ids, dtype=np.int64), now)
                for j, i in enumerate(ids):
                    li = i % n_leaves
                    if not left[li]:
                        continue
                    dev = self.pop.device(i, cols, j)
                    state = Population.state_of(dev)
                    if not Population.eligible(state, cfg.eligibility, wall):
                        self.pop.store(dev)
                        continue
                    node = f"device-{i}"
                    leaves[li].coord.join(node, Role.CLIENT, _TOKEN, state)
                    live[node] = dev
                    left[li] -= 1
                    need -= 1
                    if not need:
                        break
            if not need:
                break
        stats.checked_in = len(live)
        return live

    def _report_pools(self, tops: list[Tier] | None = None) -> dict[str, tuple[int, int]]:
        """Bottom-up: each aggregator tells its parent how many clients it can reach. With
        ``tops`` (a shard's subtrees), the tops' own reports are returned, by name, for
        the root (in another process) instead."""
        out: dict[str, tuple[int, int]] = {}
        for t in reversed(self.tiers(tops)):
            if t.parent is not None:
                size, elig = t.coord.capacity(self.run)
                if tops is not None and t.parent is self.root:
                    out[t.name] = (size, elig)
                else:
                    t.parent.coord.touch(t.name, pool_size=size, pool_eligible=elig)
        return out

    def _open_below(self, parent: Tier, blob: bytes) -> None:
        for t in parent.children:
            a = parent.coord.assign(t.name)
            if a is None:
                continue
            parent.coord.count_bytes_down(len(blob))
            self._open_tier(t, a, blob)

    def _open_tier(self, t: Tier, a: TaskAssignment, blob: bytes) -> None:
        """Tier ``t`` opens its parent's assignment ``a``, and the tiers below it theirs."""
        parent = t.parent
        assert parent is not None
        # The gRPC aggregator's ChildRound: the parent's task, this tier's cohort; under
        # secure aggregation over the whole tree the tier relays to its parent's session
        # and reports its roster once its own children have.
        t.child = ChildRound(t.coord, t.name, a, blob, lambda a: ParentUpstream(parent.coord, t.name, a),
                             self.round_cfg)
        t.assignment, t.cr = a, t.child.cr
        self._open_below(t, blob)
        run_inline(t.child.report_roster())

    # ------------------------------------------------------------------ devices

    def _planned_steps(self, partition: int) -> int:
        tc = self.run.train
        if tc.steps is not None:
            return tc.steps
        n = self._size_of[partition]
        return tc.epochs * max(1, -(-n // tc.batch_size))

    def _payload_estimate(self, schema: tuple, shared_seed: int) -> int:
        # The codec's size for a zero update: exact for fixed-size codecs, close for the rest.
        zeros = {s.name: np.zeros(s.shape, np.float32) for s in schema}
        payloads, _ = encode_update(self.codec, zeros, np.random.default_rng(0), None, shared_seed)
        return len(pack(list(payloads.values()))[0])

    def _dispatch(self, live: dict[str, LiveDevice], blob: bytes, schema: tuple, shared_seed: int,
                  stats: SimulatedCounts, starts: dict[str, tuple[bytes, NDArrays]],
                  ahead_of: NDArrays | None = None) -> list[Arrival]:
        """Hand out assignments; simulate each selected device's download, training time and upload.

        ``ahead_of``: the round's global model, to train clients ahead on an idle worker
        while the rest are dispatched (:meth:`_train_ahead`); None to train none ahead."""
        up_bytes = self._payload_estimate(schema, shared_seed)
        self._policies.clear()
        self._forget_ahead()
        ahead = ahead_of is not None and getattr(self.backend, "run_here", None) is not None
        queued: list[Arrival] = []
        if self.run.downlink_delta:
            self._prune_held()
        t_open = self.time.t
        # First every selected device is handed its task and downloads; then their device
        # models run (on an idle worker from the first full batch on, the rest here and
        # there: see _DeviceRuns); then, in the same order, each one's fate and arrival.
        # No step reads what a later one of another device writes, so this is the order
        # of doing each device whole.
        picked: list[tuple[Tier, str, TaskAssignment, LiveDevice, str, float, int, tuple[float, float]]] = []
        runs = _DeviceRuns(getattr(self.backend, "run_devices", None) if self.governor else None,
                           self.pop.kind_params())
        for li, leaf in enumerate(self.leaves):
            if leaf.cr is None:
                continue
            # One stream per tier and round, drawn in assignment order: same seed, same fates.
            # Two doubles per dispatched device, all drawn at once: Generator.random fills
            # an array from the stream in order, so row j is the j-th device's pair.
            nodes = list(leaf.cr.assignments)
            fates = np.random.default_rng([self.seed, leaf.cr.task.round, leaf.cr.task.attempt, li, 0xD0]
                                          ).random((len(nodes), 2)).tolist()
            drawn = 0
            # Only selected devices get a task; the others' polls would come back Idle
            # (every eligible device was already a candidate, so none can fill in).
            for node in nodes:
                if node not in live:
                    continue
                a = leaf.coord.assign(node)
                if a is None:
                    continue
                dev = live[node]
                part = dev.index
                down_bytes, start = self._pull(leaf, part, blob, starts)
                leaf.coord.count_bytes_down(down_bytes)
                if leaf.cr.secure is not None or leaf.cr.tree is not None:
                    # Its side of the tier's (or the tree's) session: the key stages run while it trains.
                    entropy = hashlib.sha256(f"{self.seed}/{a.task_id}".encode()).digest()
                    leaf.secure[node] = (SecureParticipant(node, entropy), a)
                stats.selected += 1
                down_s = dev.profile.latency_s + down_bytes * 8 / (dev.profile.down_mbps * 1e6)
                dev.clock.advance(max(0.0, t_open + down_s - dev.clock.monotonic()))
                planned = self._planned_steps(part)
                picked.append((leaf, node, a, dev, start, down_s, planned, fates[drawn]))
                drawn += 1
                runs.add(self._device_plan(dev, planned, a.deadline_unix - self.time.wall() - down_s))
        started = time.perf_counter()
        trained = runs.results()
        self._device_seconds = time.perf_counter() - started  # (a round's phase_seconds)
        arrivals: list[Arrival] = []
        for (leaf, node, a, dev, start, down_s, planned, (fate, when)), (train_s, steps) in zip(
                picked, trained, strict=True):
            up_s = dev.profile.latency_s + up_bytes * 8 / (dev.profile.up_mbps * 1e6)
            finish = t_open + down_s + train_s + up_s
            if steps == 0:
                stats.stopped_by_governor += 1
                continue
            if fate < dev.profile.dropout:
                stats.vanished += 1
                leaf.last_silence = max(leaf.last_silence, t_open + when * (finish - t_open))
                continue
            if steps < planned:
                stats.stopped_early += 1
            leaf.waiting += 1
            leaf.working.add(node)
            arrivals.append(Arrival(finish, dev.index, node, leaf, a, steps if steps < planned else None, start))
            if ahead:
                queued.append(arrivals[-1])
                if len(queued) >= _AHEAD_BATCH:
                    assert ahead_of is not None
                    queued = self._train_ahead(queued, ahead_of, starts)
        arrivals.sort(key=lambda x: (x.finish, x.partition))
        return arrivals

    # ------------------------------------------------------------------ training ahead

    def _train_ahead(self, queued: list[Arrival], arrays: NDArrays,
                     starts: dict[str, tuple[bytes, NDArrays]]) -> list[Arrival]:
        """Hand the worker a job of dispatched clients while it would sit idle (devices are
        still being dispatched, so no client's turn is known yet); returns what is left
        queued. A client's output is a pure function of its job, which is fixed once the
        device is dispatched (its steps, codec state and start model), so training it
        early changes nothing; one that turns out never to be needed (its tier closes
        first) was trained for nothing, which costs an idle core only. At most one such
        job waits behind the one running, and at most ``_AHEAD_MAX`` clients a round."""
        while self._ahead_jobs and self._ahead_jobs[0].done():
            self._collect_ahead(self._ahead_jobs.popleft())
        if len(self._ahead_jobs) >= 2:  # the worker is busy: keep the newest clients for later
            return queued[-_AHEAD_BATCH:]
        if len(self._ahead_parts) + len(queued) > _AHEAD_MAX:
            return []
        jobs = [self._job(a) for a in queued]
        need = {a.start for a in queued if a.start}
        self._ahead_jobs.append(
            self.backend.submit(jobs, arrays, {k: v[1] for k, v in starts.items() if k in need} or None))
        self._ahead_parts.update(a.partition for a in queued)
        return []

    def _collect_ahead(self, fut: Future[list[ClientOutput]]) -> None:
        for o in fut.result():
            self._ahead[o.partition] = o

    def _trained_ahead(self, partition: int) -> ClientOutput | None:
        """The output of a client trained ahead (waiting for its job if need be), or None."""
        if partition not in self._ahead_parts:
            return None
        while partition not in self._ahead:
            self._collect_ahead(self._ahead_jobs.popleft())
        return self._ahead.pop(partition)

    def _forget_ahead(self) -> None:
        """Drop what was trained ahead for an earlier round (an attempt that ended early)."""
        for fut in self._ahead_jobs:
            fut.cancel()
        self._ahead_jobs.clear()
        self._ahead.clear()
        self._ahead_parts.clear()

    def _pull(self, leaf: Tier, device: int, blob: bytes,
              starts: dict[str, tuple[bytes, NDArrays]]) -> tuple[int, str]:
        """What a device downloads for the round's model, as ``FleetLink.pull_model`` with
        the hash it holds and the tier's ``model_reply``: (bytes sent, the start key).
        Each distinct reconstruction is rebuilt once per round, with the client's
        ``apply_downlink_delta``, and checked against the hash the reply states."""
        assert leaf.cr is not None
        target = leaf.cr.task.model_hash
        if not self.run.downlink_delta:
            return len(blob), ""
        have = self.held.get(device, "")
        reply = leaf.coord.downlink.reply_now(blob, target, have) if have else None
        if reply is None or not reply.is_delta:
            self._hold(device, target, blob)
            return len(blob), ""
        key = reply.result_sha256
        if key not in starts:
            from orchard.client.runtime import apply_downlink_delta  # the client's own code

            rebuilt = apply_downlink_delta(self.held_blobs[have], reply.blob, have, reply.encoding)
            if sha256_hex(rebuilt) != key:
                # As the link does: a delta that does not rebuild the stated model is
                # dropped and the full model pulled.
                self._hold(device, target, blob)
                return len(reply.blob) + len(blob), ""
            starts[key] = (rebuilt, wire.blob_to_arrays(rebuilt))
        self._hold(device, key, starts[key][0])
        return len(reply.blob), key

    def _hold(self, device: int, model_hash: str, blob: bytes) -> None:
        self.held[device] = model_hash
        self.held_blobs.setdefault(model_hash, blob)

    def _prune_held(self) -> None:
        """Forget what no tier can delta from any more: memory follows the devices of the
        last rounds, not the population."""
        n = len(self.leaves)
        self.held = {d: h for d, h in self.held.items() if self.leaves[d % n].coord.downlink.knows(h)}
        used = set(self.held.values())
        self.held_blobs = {h: b for h, b in self.held_blobs.items() if h in used}

    def _policy(self, planned: int, time_left_s: float) -> DevicePolicy:
        """A device's governor policy for this round: its eligibility rules, its planned
        steps and the time it has. Devices of one kind share a link and so a time budget:
        their (frozen) policies are one object, built once a round."""
        key = (planned, max(time_left_s, 1e-3))
        policy = self._policies.get(key)
        if policy is None:
            if len(self._policies) >= 256:
                self._policies.clear()
            policy = self._policies[key] = DevicePolicy(
                eligibility=self.run.eligibility, budget=RoundBudget(max_steps=key[0], time_s=key[1]))
        return policy

    def _device_plan(self, dev: LiveDevice, planned: int, time_left_s: float
                     ) -> tuple[LiveDevice, DevicePolicy | None, int, int]:
        """(device, policy, planned steps, examples a step) for a device that trains
        ``planned`` steps with ``time_left_s`` seconds before its deadline."""
        n = self._size_of[dev.index]
        per_step = min(self.run.train.batch_size, max(n, 1))
        return dev, self._policy(planned, time_left_s) if self.governor else None, planned, per_step

    # ------------------------------------------------------------------ arrivals, in time order

    def _process(self, arrivals: list[Arrival], arrays: NDArrays, stats: SimulatedCounts,
                 starts: dict[str, NDArrays], tops: list[Tier] | None = None) -> None:
        """Training, uploads and folds in simulated-time order, until the root closes; or,
        with ``tops`` (a shard's subtrees, the root elsewhere), until nothing of theirs is
        left to happen: their partials for the root are collected (``self._partials``)
        and what counts in ``stats`` is logged with its time (``self._log``), since only
        the root says when the round ended (see :meth:`shard_run`)."""
        events: list[tuple[float, int, str, Any]] = []  # (time, seq, kind, payload)
        seq = itertools.count()
        for t in self.tiers(tops):
            if t.cr is not None:
                heapq.heappush(events, (t.cr.task.deadline_unix - self.time.origin, next(seq), "deadline", t))
                if t.cr.secure is not None and t.cr.upstream is None:  # the masked-input stage ends for whoever is missing
                    heapq.heappush(events, (self._input_deadline(t) - self.time.origin, next(seq), "inputs", t))
        for leaf in self.leaves:
            if leaf.cr is not None and leaf.waiting == 0:
                self._schedule_quiet_close(leaf, events, seq)
        self._defer_expected_late(arrivals)
        # Training in finish-time order: arrivals, their outputs (from a worker, or
        # trained here: how many).
        pending: deque[tuple[list[Arrival], Future[list[ClientOutput]], bool, int]] = deque()
        outputs: dict[int, ClientOutput] = {}
        cursor = 0
        # The first jobs are small and grow to chunk_size: folding starts as soon as the
        # first few clients are trained instead of after a whole chunk (a worker's
        # chunk of 512 digits clients is ~0.1 s the engine would otherwise sit idle).
        # Which clients train, and their results, do not depend on the job sizes.
        limit = min(self.chunk_size, _FIRST_CHUNK)
        # With worker processes, the engine trains small batches itself while the next
        # worker job it needs is not done (it would only wait), and holds their outputs
        # until their turn; `in_flight` counts the workers' jobs, `unfolded` the
        # clients trained here and not folded yet.
        run_here = getattr(self.backend, "run_here", None)
        in_flight = unfolded = 0
        ahead = self._ahead_parts  # trained while the round was dispatched

        def take(size: int) -> list[Arrival]:
            nonlocal cursor
            batch: list[Arrival] = []
            while cursor < len(arrivals) and len(batch) < size:
                a = arrivals[cursor]
                cursor += 1
                if a.leaf.cr is not None and not a.leaf.cr.closed:
                    batch.append(a)
                else:
                    self._never_trained(a, stats)
            return batch

        def refill() -> None:
            nonlocal limit, in_flight
            while in_flight < _JOBS_PER_WORKER * self.workers and cursor < len(arrivals):
                size, limit = limit, min(self.chunk_size, 2 * limit)
                batch = take(size)
                if batch:
                    jobs = [self._job(a) for a in batch if not a.deferred and a.partition not in ahead]
                    if jobs:
                        pending.append((batch, self.backend.submit(jobs, arrays, starts or None), True, 0))
                        in_flight += 1
                    else:
                        pending.append((batch, _done([]), False, 0))

        def help_while_waiting() -> None:
            nonlocal unfolded
            fut = pending[0][1]
            while (run_here is not None and not fut.done() and cursor < len(arrivals)
                   and unfolded < _HELD_HERE_MAX):
                batch = take(_HELP_BATCH)
                if not batch:
                    continue
                jobs = [self._job(a) for a in batch if not a.deferred and a.partition not in ahead]
                pending.append((batch, _done(run_here(jobs, arrays, starts or None) if jobs else []), False,
                                len(jobs)))
                unfolded += len(jobs)

        def root_done() -> bool:
            return tops is None and self.root.cr is not None and self.root.cr.closed

        refill()
        while not root_done():
            next_arrival = pending[0][0][0].finish if pending else math.inf
            next_event = events[0][0] if events else math.inf
            if next_event == math.inf and next_arrival == math.inf:
                break
            if next_event <= next_arrival:
                when, _, kind, obj = heapq.heappop(events)
                self.time.advance_to(when)
                self._event(kind, obj, events, seq, stats)
                continue
            help_while_waiting()
            batch, fut, by_worker, here = pending.popleft()
            for o in fut.result():
                outputs[o.partition] = o
            in_flight -= by_worker
            unfolded -= here
            refill()
            for a in batch:
                # Deadlines and partials due before this arrival come first.
                while events and events[0][0] <= a.finish and not root_done():
                    when, _, kind, obj = heapq.heappop(events)
                    self.time.advance_to(when)
                    self._event(kind, obj, events, seq, stats)
                if root_done():
                    stats.late += 1
                    continue
                self.time.advance_to(a.finish)
                o = outputs.pop(a.partition, None) or self._trained_ahead(a.partition)
                if a.deferred:
                    if a.leaf.cr is None or a.leaf.cr.closed:  # as expected
                        self._never_trained(a, stats)
                        continue
                    # Its tier is still open (an upload before it failed or was refused):
                    # train it now, as it would have been (here when the backend can).
                    if o is None:
                        job = [self._job(a)]
                        (o,) = (run_here(job, arrays, starts or None) if run_here is not None
                                else self.backend.submit(job, arrays, starts or None).result())
                assert o is not None  # every client not deferred was in a job
                self._arrive(a, o, events, seq, stats)
            outputs.clear()
        # Whoever had not arrived when the root closed is late, whether or not its job was
        # already out (how far ahead jobs ran depends on the backend, not on the round).
        for batch, fut, _, _ in pending:
            fut.cancel()
            stats.late += len(batch)
        stats.late += len(arrivals) - cursor
        self._forget_ahead()

    @staticmethod
    def _never_trained(a: Arrival, stats: SimulatedCounts) -> None:
        """A client whose tier closed before its upload: late, and never trained."""
        stats.late += 1
        a.leaf.waiting -= 1
        a.leaf.working.discard(a.node_id)

    def _job(self, a: Arrival) -> ClientJob:
        return ClientJob(a.partition, a.node_id, a.assignment, a.steps, self.codec_states.get(a.partition), a.start,
                         self._attack(a.partition))

    def _attack(self, partition: int) -> float:
        """The multiplier a device applies to its update: the attack's for attackers (drawn
        per device from the seed), 1 for everyone else."""
        att = self.attack
        if att is None or att.fraction <= 0:
            return 1.0
        return att.factor if np.random.default_rng([self.seed, partition, 0xBAD]).random() < att.fraction else 1.0

    def _defer_expected_late(self, arrivals: list[Arrival]) -> None:
        """Mark the arrivals expected to find their tier closed: past the tier's deadline,
        or after the tier's first ``target`` arrivals (which close it). Only a guess --
        an upload that fails or is refused leaves the tier open for one more, and then a
        deferred client is trained when its turn comes -- but it is right in the common
        case, and an over-selected round then trains only the clients that count."""
        seen: dict[int, int] = {}
        for a in arrivals:  # in finish-time order
            cr = a.leaf.cr
            assert cr is not None  # a client arrives only at a tier that opened
            if self._session(a.leaf) is not None:  # a secure session takes every masked input until its stage ends
                a.deferred = a.finish >= self._input_deadline(a.leaf) - self.time.origin
                continue
            k = seen.get(id(a.leaf), 0)
            seen[id(a.leaf)] = k + 1
            a.deferred = k >= cr.task.target or a.finish >= cr.task.deadline_unix - self.time.origin

    def _arrive(self, a: Arrival, o: ClientOutput, events: list, seq: Any, stats: SimulatedCounts) -> None:
        leaf = a.leaf
        leaf.waiting -= 1
        leaf.working.discard(a.node_id)
        if o.header is None:
            what = _FAILED
        elif leaf.cr is None or leaf.cr.closed:
            what = _LATE
        else:
            what = _FOLDED
            try:
                if a.node_id in leaf.secure:
                    self._secure_input(leaf, a, o)
                else:
                    leaf.coord.upload_now(a.node_id, o.header, o.payload)
            except OrchardError as err:
                what = type(err).__name__
        self._tally(stats, a.finish, True, what, a.partition, o.codec_state if what == _FOLDED else None)
        if leaf.cr is not None and not leaf.cr.closed and leaf.waiting == 0:
            self._schedule_quiet_close(leaf, events, seq)
        self._after(leaf, events, seq)

    def _tally(self, stats: SimulatedCounts, when: float, client: bool, what: str, partition: int = -1,
               codec_state: dict[str, Any] | None = None) -> None:
        """Count what became of a client's upload (``client``) or of a partial: folded
        (``_FOLDED``, and the client's codec state is kept), ``_FAILED``, ``_LATE``, or
        refused with the error named ``what``. In a shard (``self._log`` is a list) it is
        logged with its time ``when`` instead, and counted once the root's close is
        known (:func:`_count_log`)."""
        if self._log is not None:
            self._log.append((when, client, what, partition, codec_state))
            return
        _count(stats, client, what)
        if codec_state:
            self.codec_states[partition] = codec_state

    def _schedule_quiet_close(self, leaf: Tier, events: list, seq: Any) -> None:
        """Nobody else will upload: the tier closes once it has dropped the silent ones."""
        assert leaf.cr is not None
        at = max(self.time.t, leaf.last_silence + self.server_cfg.node_timeout_s)
        heapq.heappush(events, (at, next(seq), "quiet", leaf))

    def _event(self, kind: str, obj: Any, events: list, seq: Any, stats: SimulatedCounts) -> None:
        if kind == "partial":
            below, header, payload = obj
            parent = below.parent
            try:
                parent.coord.upload_now(below.name, header, payload)
            except OrchardError as err:
                self._tally(stats, self.time.t, False, type(err).__name__)
            self._after(parent, events, seq)
            return
        tier: Tier = obj
        if tier.cr is None or tier.cr.closed:
            self._after(tier, events, seq)
            return
        if kind == "deadline":
            self._heartbeats(tier)
            tier.coord.sweep()
            if not tier.cr.closed and not self._relays(tier):  # the virtual wall sits exactly on the deadline
                tier.coord.close_round(tier.cr, "deadline")
        elif kind == "quiet":
            self._heartbeats(tier)
            tier.coord.sweep()
        elif kind == "inputs":
            # The tier moves its session on at the stage's deadline (sweep); the clients
            # whose masked inputs are in answer the unmasking stage.
            self._heartbeats(tier)
            tier.coord.sweep()
            if not tier.cr.closed:
                self._answer(tier)
        self._after(tier, events, seq)

    @staticmethod
    def _heartbeats(tier: Tier) -> None:
        """Clients still training keep heartbeating, and so do secure clients whose masked
        input is in (they long-poll for the unmasking stage); a sweep drops only the silent."""
        assert tier.cr is not None
        for a in tier.cr.pending():
            c = tier.coord.children.get(a.node_id)
            polling = a.node_id in tier.secure and tier.secure[a.node_id][0].sent_input
            if c is not None and (c.role is Role.AGGREGATOR or a.node_id in tier.working or polling):
                tier.coord.touch(a.node_id)

    # ------------------------------------------------------------------ secure aggregation

    def _session(self, tier: Tier) -> SecureCohort | None:
        """The secure session a tier's clients answer: the tier's own, or with scope "tree"
        the root's (None before it opens, or without secure aggregation)."""
        assert tier.cr is not None
        if tier.cr.tree is not None and self.root.cr is not None:
            return self.root.cr.secure
        return tier.cr.secure

    @staticmethod
    def _relays(tier: Tier) -> bool:
        """A tier below the root that relays to the tree's session (no sum of its own)."""
        return tier.cr is not None and tier.cr.tree is not None and tier.parent is not None

    def _input_deadline(self, tier: Tier) -> float:
        """The virtual wall time at which the session's masked-input stage ends (server.secagg)."""
        sc = self._session(tier)
        assert sc is not None
        return sc.started_wall + STAGE_END[Stage.MASKED_INPUT] * (sc.deadline_wall - sc.started_wall)

    def _secure_turn(self, tier: Tier, node: str, masked: tuple[UploadHeader, np.ndarray] | None = None) -> bool:
        """Let one client answer what the tier's session asks of it now, as its runtime
        would over ``Fleet.SecAgg`` (``secagg_now`` is the exchange without the wait).
        True if it answered anything."""
        me, t = tier.secure[node]
        stage, message, header = -1, b"", None
        answered = False
        while True:
            r = tier.coord.secagg_now(node, t.run_id, t.round, t.attempt, t.task_id, stage, message, header)
            got = None if (r.done or r.aborted) else me.answer(r.stage, r.broadcast, masked)
            if got is None:
                return answered
            (message, header), stage, answered = got, r.stage, True

    def _answer(self, tier: Tier) -> None:
        """The clients that answer a session which moved on: the tier's own, or with scope
        "tree" every tier's."""
        assert tier.cr is not None
        if tier.cr.tree is not None:
            self._secure_answer_all()
        elif tier.secure:
            self._secure_answer(tier)

    def _secure_answer_all(self) -> None:
        """Every secure client answers what it can; with scope "tree" the stages of the one
        session move on with the answers of every tier's clients, so go round until none can."""
        tiers = [t for t in self.tiers() if t.secure and t.cr is not None]
        progress = True
        while progress:
            progress = False
            for t in tiers:
                progress |= self._secure_answer(t)

    def _secure_answer(self, tier: Tier) -> bool:
        """Every client of the tier that can answer the session's current stage does, until
        none can (a stage moves on when its last expected answer is in)."""
        assert tier.cr is not None
        progress, any_answer = True, False
        while progress and not tier.cr.closed:
            progress = False
            for node in tier.secure:
                with contextlib.suppress(OrchardError):  # dropped from the session: silent from here on
                    progress |= self._secure_turn(tier, node)
            any_answer |= progress
        return any_answer

    def _secure_input(self, tier: Tier, a: Arrival, o: ClientOutput) -> None:
        """An arriving client posts its masked input (refused once the stage is over)."""
        assert o.header is not None and tier.cr is not None
        me, t = tier.secure[a.node_id]
        seed = train_seed(self.run.seed, t.round, a.partition)
        noise_rng = np.random.default_rng([self.seed, t.round, t.attempt, a.partition, 0xD9])
        masked = masked_input(self.round_cfg, self.codec, t, o.header, o.payload, seed, me.participants, noise_rng)
        if not self._secure_turn(tier, a.node_id, masked):
            raise SecAggError(f"round {t.round}: the secure cohort no longer takes masked inputs")
        sc = self._session(tier)
        if sc is not None and sc.stage is Stage.UNMASKING:
            self._answer(tier)

    def _after(self, tier: Tier, events: list, seq: Any) -> None:
        """If ``tier`` just closed, push its partial up (after the transfer time)."""
        if tier.cr is None or not tier.cr.closed or tier.pushed:
            return
        tier.pushed = True
        child = tier.child
        if child is None or child.relays:  # the root, or a relay: its clients are in the root's sum
            return
        up = child.partial(tier.coord.outcome(tier.cr))
        assert up is not None
        header, payload = up
        at = self.time.t + len(payload) * 8 / (self.aggregator_mbps * 1e6)
        if self._partials is not None and tier.parent is self.root:  # a shard's top: the root is elsewhere
            self._partials.append((at, tier.name, header, payload))
            return
        heapq.heappush(events, (at, next(seq), "partial", (tier, header, payload)))

    # ------------------------------------------------------------------ after the round

    def _leave(self, live: dict[str, LiveDevice]) -> None:
        """Devices disconnect when the round is over; their state goes back to the population."""
        for leaf in self.leaves:
            # A simulated device that goes away goes at once (a real one would expire).
            for node in [n for n, c in leaf.coord.children.items() if c.role is Role.CLIENT]:
                leaf.coord.leave(node)
        self.pop.store_many(list(live.values()), self.time.t)

    def shutdown(self) -> None:
        for t in self.tiers():
            t.coord.shutdown()


class _DeviceRuns:
    """The device models of one dispatch: (seconds, steps done) of local training on each
    device added, each device's state moved on by its training.

    Under the governor a device's model is thousands of small steps of Python a round.
    With a backend that runs devices elsewhere (``run_devices``: a worker process, idle
    while devices are handed their tasks) full batches go to the worker as soon as they
    are added, while the rest of the cohort is handed out, as long as the worker has at
    most one batch waiting behind the one it runs. :meth:`results` then runs the rest
    here from the front while the worker takes batches from the back, until they meet. A
    device's result is a pure function of its state, policy and plan, so where and when
    it ran changes nothing; a device run elsewhere comes back as a snapshot of its new
    state. Without such a backend (or without the governor) every device runs here."""

    def __init__(self, run_devices: Callable[..., Future[list[tuple[float, int, tuple[Any, ...]]]]] | None,
                 kind_params: dict[str, SimulatedDeviceParams]) -> None:
        self._run_devices = run_devices
        self._kind_params = kind_params  # what rebuilds a device from its snapshot on the worker
        self.plans: list[tuple[LiveDevice, DevicePolicy | None, int, int]] = []
        self._away: list[tuple[int, int, Future[list[tuple[float, int, tuple[Any, ...]]]]]] = []
        self._sent = 0  # plans[:_sent] were sent while devices were added (front to back)

    def add(self, plan: tuple[LiveDevice, DevicePolicy | None, int, int]) -> None:
        """A device's plan (``Engine._device_plan``), its state as it starts."""
        self.plans.append(plan)
        if (self._run_devices is not None and len(self.plans) - self._sent >= _DEVICE_BATCH
                and self._worker_has_room()):
            self._send(self._sent, self._sent + _DEVICE_BATCH)
            self._sent += _DEVICE_BATCH

    def _worker_has_room(self) -> bool:
        # A worker runs its batches in order: if the last-but-one is done, so is every
        # earlier one.
        return sum(not f.done() for _, _, f in self._away[-2:]) < 2

    def _send(self, lo: int, hi: int) -> None:
        assert self._run_devices is not None  # only sent to a backend that runs devices
        batch = [(dev.kind, dev.device.snapshot(), policy, planned, per_step, dev.seconds_per_example)
                 for dev, policy, planned, per_step in self.plans[lo:hi]]
        self._away.append((lo, hi, self._run_devices(self._kind_params, batch)))

    def _here(self, lo: int, hi: int, out: list[tuple[float, int] | None]) -> None:
        for i in range(lo, hi):
            dev, policy, planned, per_step = self.plans[i]
            out[i] = device_training(dev.device, dev.clock, policy, planned, per_step, dev.seconds_per_example)

    def results(self) -> list[tuple[float, int]]:
        """(seconds, steps done) of every device added, in the order they were added."""
        plans = self.plans
        out: list[tuple[float, int] | None] = [None] * len(plans)
        front, back = self._sent, len(plans)
        if self._run_devices is None or back - front < 2 * _DEVICE_BATCH:
            self._here(front, back, out)
            front = back
        while front < back:
            if self._worker_has_room() and back - front > _DEVICE_BATCH:
                lo = max(front, back - _DEVICE_BATCH)
                self._send(lo, back)  # the worker keeps one batch running and one waiting
                back = lo
                continue
            hi = min(front + _DEVICE_BATCH // 4, back)
            self._here(front, hi, out)
            front = hi
        for lo, hi, fut in self._away:
            for i, (secs, steps, snap) in zip(range(lo, hi), fut.result(), strict=True):
                plans[i][0].device.restore(snap)
                out[i] = (secs, steps)
        done = [r for r in out if r is not None]
        assert len(done) == len(plans)  # every device ran, here or on the worker
        return done


def device_training(device: SimulatedDevice, clock: VirtualClock, policy: DevicePolicy | None, planned: int,
                    per_step: int, seconds_per_example: float) -> tuple[float, int]:
    """(seconds, steps done) of ``planned`` local steps of ``per_step`` examples on a
    simulated device: under the edge runtime's governor with ``policy`` (it may pace the
    device or stop early), or without one (None) every step at once."""
    if policy is None:
        return device.work(planned * per_step * seconds_per_example), planned
    gov = Governor(device, policy, clock)

    def step() -> float:
        device.work(per_step * seconds_per_example)
        return float(per_step)

    report = run_governed(gov, step)
    return report.elapsed_s, report.steps_done


def run_devices(params: dict[str, SimulatedDeviceParams],
                batch: list[tuple[str, tuple[Any, ...], DevicePolicy | None, int, int, float]]
                ) -> list[tuple[float, int, tuple[Any, ...]]]:
    """:func:`device_training` for devices sent as (kind, snapshot, policy, planned steps,
    examples per step, seconds per example), each rebuilt from its kind's parameters
    (``params``): (seconds, steps, the device's new snapshot) for each."""
    out = []
    for kind, snap, policy, planned, per_step, spe in batch:
        device = SimulatedDevice.from_snapshot(params[kind], snap)
        secs, steps = device_training(device, device.clock, policy, planned, per_step, spe)
        out.append((secs, steps, device.snapshot()))
    return out


def _count(stats: SimulatedCounts, client: bool, what: str) -> None:
    """Count one upload's fate (see :meth:`Engine._tally`)."""
    if client:
        stats.trained += 1
        if what == _FAILED:
            stats.failed_clients += 1
            return
        if what == _LATE:
            stats.late += 1
            return
    if what != _FOLDED:
        stats.rejected[what] = stats.rejected.get(what, 0) + 1


def _count_log(stats: SimulatedCounts, log: list[tuple[float, bool, str]], closed_at: float) -> None:
    """Count a shard's logged fates for a round whose root closed at ``closed_at``: what
    happened before counts as it happened; a client that arrived from then on is late,
    as it is when the root is in the same loop (it stops there), and a partial that
    would have gone up since is not counted at all."""
    for when, client, what in log:
        if when < closed_at:
            _count(stats, client, what)
        elif client:
            stats.late += 1


def _add_counts(into: SimulatedCounts, other: SimulatedCounts) -> None:
    """Add a shard's counts of devices (``other``) to the round's."""
    for f in ("checked_in", "selected", "trained", "late", "vanished", "stopped_by_governor", "stopped_early",
              "failed_clients"):
        setattr(into, f, getattr(into, f) + getattr(other, f))
    for name, n in other.rejected.items():
        into.rejected[name] = into.rejected.get(name, 0) + n


class _Here:
    """A backend that trains on the caller's thread with ``run_here``: the engine's own
    clients when the workers are shards."""

    def __init__(self, run_here: Callable[..., list[ClientOutput]]) -> None:
        self._run_here = run_here

    def submit(self, jobs: list[ClientJob], global_arrays: NDArrays,
               starts: dict[str, NDArrays] | None = None) -> Future[list[ClientOutput]]:
        return _done(self._run_here(jobs, global_arrays, starts))

    def close(self) -> None:
        pass


def _done(outputs: list[ClientOutput]) -> Future[list[ClientOutput]]:
    fut: Future[list[ClientOutput]] = Future()
    fut.set_result(outputs)
    return fut


def _box_state() -> DeviceState:
    # Aggregators run on mains power in a data centre: always eligible.
    return DeviceState(charging=True)
