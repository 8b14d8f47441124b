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
the same tree, and this one runs a group and the root (``simulation.shards``).

Client training runs in a backend (threads, processes or Ray) in chunks of
``chunk_size`` clients taken in finish-time order, and only for clients expected to
count: a client that would arrive after its tier closed (past the deadline or the
masked-input stage, or after the tier's first ``target`` arrivals) is not trained,
since its upload would be refused anyway. That keeps large over-selected rounds cheap
without changing any number: when the guess is wrong (an earlier upload failed or was
refused, so the tier is still open when the client's turn comes) the client is trained
then.

The engine is a handful of parts, each owning one rule, wired here and sharing one
:class:`~orchard.simulation.context.Context` (the run, its seeds, the clock):

- ``tree.Tree``: the tiers, each opened from its parent (step 2);
- ``checkin.CheckIn``: devices checking in and leaving (step 1, and after the round);
- ``dispatch.Dispatch``: the hand-out and the device models (step 3), with
  ``downlink.Downlink`` (what a device pulls), ``device_model`` (the governor's runs)
  and ``ahead.TrainingAhead`` (clients trained while the rest are dispatched);
- ``arrivals.Arrivals``: events in simulated-time order (step 4);
- ``secure.SecureClients``: each selected client's side of SecAgg+;
- ``jobs.Jobs``: a client's job, and what became of its upload;
- ``shards``: sharded rounds; ``buffered.Buffered``: the asynchronous mode's devices.

Each part is handed the parts it calls when it is built, rather than inheriting them:
what a part reads is in its constructor, and a part is read without the others.
"""

from __future__ import annotations

import time

from orchard import wire
from orchard.compression import build_codec
from orchard.config import RunConfig, ServerConfig
from orchard.messages import TaskAssignment, UploadHeader
from orchard.server.round import SimulatedCounts
from orchard.server.runloop import Played
from orchard.simulation.ahead import TrainingAhead
from orchard.simulation.arrivals import Arrivals
from orchard.simulation.backends import Backend
from orchard.simulation.buffered import Buffered
from orchard.simulation.checkin import CheckIn
from orchard.simulation.clock import VirtualTime
from orchard.simulation.config import AttackConfig
from orchard.simulation.context import Context
from orchard.simulation.device_model import run_devices
from orchard.simulation.dispatch import Dispatch
from orchard.simulation.downlink import Downlink
from orchard.simulation.jobs import Jobs, played
from orchard.simulation.population import Population
from orchard.simulation.secure import SecureClients
from orchard.simulation.shards import Shard, ShardedRounds, can_shard
from orchard.simulation.tree import Tree
from orchard.tasks import Task
from orchard.typing import NDArrays

# run_devices: the device model as a worker process runs it, imported from here by the
# backends (backends._process_devices).
__all__ = ["Engine", "run_devices"]


class Engine:
    """A simulation's round engine: the synchronous round (:meth:`round`), an asynchronous
    run's buffer (:meth:`buffer`) and a shard's steps, over its parts (see the module)."""

    def __init__(self, task: Task, population: Population, run: RunConfig, fanout: list[int], backend: Backend,
                 *, chunk_size: int, workers: int, governor: bool, checkin_factor: float, node_timeout_s: float,
                 aggregator_mbps: float, wall_origin: float, num_partitions: int, seed: int,
                 attack: AttackConfig | None = None, sharded: bool = False, tops: list[str] | None = None,
                 device_root: str | None = None) -> None:
        """``sharded``: with a backend of worker processes (``start_shards``), a synchronous
        run over a tree without secure aggregation runs the root's subtrees in the workers
        and here, each process its own (``simulation.shards``). ``tops``: this engine is
        such a shard, in a worker: it runs the subtrees of these children of the root."""
        self._ctx = ctx = Context(
            task=task, pop=population, run=run, backend=backend, seed=seed, time=VirtualTime(wall_origin),
            server_cfg=ServerConfig(node_timeout_s=node_timeout_s), codec=build_codec(run.codec),
            chunk_size=chunk_size, workers=workers, governor=governor, checkin_factor=checkin_factor,
            aggregator_mbps=aggregator_mbps, attack=attack, run_id=f"sim-{seed}",
            config_json=run.model_dump_json(), round_cfg=run, device_root=device_root)
        self.time = ctx.time
        self.run_id = ctx.run_id
        self.tree = tree = Tree(ctx, fanout)
        self.jobs = jobs = Jobs(ctx)
        self.devices = devices = CheckIn(ctx, tree)
        self.secure = secure = SecureClients(ctx, tree)
        ahead = TrainingAhead(ctx, jobs)
        self.dispatch = dispatch = Dispatch(ctx, tree, num_partitions, Downlink(run, tree.leaves), secure, ahead)
        self.arrivals = arrivals = Arrivals(ctx, tree, jobs, ahead, secure)
        self.shard = Shard(ctx, tree, devices, dispatch, arrivals, jobs)
        self.buffered = Buffered(ctx, tree, devices, dispatch, jobs)
        self._sharded: ShardedRounds | None = None
        if tops is not None:
            tree.serve(tops)
        elif sharded and can_shard(ctx, tree, backend):
            self._sharded = ShardedRounds.start(ctx, tree, self.shard, arrivals, fanout, dict(
                chunk_size=chunk_size, workers=1, governor=governor, checkin_factor=checkin_factor,
                node_timeout_s=node_timeout_s, aggregator_mbps=aggregator_mbps, wall_origin=wall_origin,
                num_partitions=num_partitions, seed=seed, attack=attack, device_root=device_root))

    # ------------------------------------------------------------------ one round

    def round(self, rnd: int, attempt: int, arrays: NDArrays, config: RunConfig | None = None,
              noise_stddev: float = 0.0) -> Played:
        """Run one attempt of round ``rnd``: the root's outcome and the round's counts (the
        run loop, ``orchard.server.runloop``, judges and steps it).

        ``config``: this round's config when it differs from the run's (with DP: the
        ledger's, carrying the clip norm and noise multiplier); ``noise_stddev``: the
        root's central DP noise."""
        ctx, tree = self._ctx, self.tree
        cfg = config if config is not None else ctx.run
        ctx.round_cfg = cfg
        if self._sharded is not None:
            return self._sharded.round(rnd, attempt, arrays, cfg, config, noise_stddev)
        stats = SimulatedCounts()
        t_open = self.time.t
        clock = time.perf_counter
        t0 = clock()
        blob = wire.arrays_to_blob(arrays)
        live = self.devices.check_in(rnd, attempt, stats)
        tree.report_pools(ctx.run)
        t1 = clock()
        task = tree.root_task(rnd, attempt, arrays, blob, cfg, config, noise_stddev)
        tree.open_root(task)
        tree.open_below(tree.root, blob)
        t2 = clock()
        starts: dict[str, tuple[bytes, NDArrays]] = {}  # downlink reconstructions, by sha256
        arrivals = self.dispatch.dispatch(live, blob, task.schema, task.shared_seed, stats, starts, ahead_of=arrays)
        t3 = clock()
        self.secure.answer_all()  # the key stages, while the clients train
        self.arrivals.process(arrivals, arrays, stats, {k: v[1] for k, v in starts.items()})
        tree.close_open()
        out = tree.root.coord.outcome(tree.root.cr)
        t4 = clock()
        self.devices.leave(live)
        stats.phase_seconds = {
            "check_in": round(t1 - t0, 4),  # devices polled, caught up, checked and joined
            "open": round(t2 - t1, 4),  # the root's task, every tier opened and its cohort selected
            "dispatch": round(t3 - t2, 4),  # assignments, downloads and the device models
            "device_models": round(self.dispatch.device_seconds, 4),  # of dispatch: the governors' runs
            "arrivals": round(t4 - t3, 4),  # training, uploads and folds, in time order
            "leave": round(clock() - t4, 4),  # devices back into the population
        }
        return played(out, stats, self.time.t - t_open)

    # ------------------------------------------------------------------ asynchronous mode

    def buffer(self, rnd: int, attempt: int, arrays: NDArrays, config: RunConfig | None = None,
               noise_stddev: float = 0.0) -> Played:
        """One buffer of an asynchronous run (``[run.mode] kind = "async"``): what
        :meth:`round` is to a synchronous one, with the same outcome and counts.

        The root coordinator does the asynchronous work (``open_round`` carries the
        devices still training into the new buffer and tops them up to the concurrency;
        ``upload_now`` weights each update by its staleness or refuses it past S). Here
        is only the clock and the devices (``buffered.Buffered``): fresh devices check in
        (those still training do not poll), the newly selected pull this version and are
        trained on it at once (their output waits for their finish time), and arrivals of
        every version are handed to the root in time order until the buffer closes at K
        (or its deadline). Devices still training stay for the next buffer; the others go
        back to the population. Flat trees only (validation says so)."""
        return self.buffered.buffer(rnd, attempt, arrays, config, noise_stddev)

    # ------------------------------------------------------------------ a shard's steps
    # Worker processes call these by name (backends._shard_call); see simulation.shards.

    def shard_check_in(self, rnd: int, attempt: int, t: float) -> tuple[dict[str, tuple[int, int]], int]:
        """A shard's check-in at virtual time ``t`` (``shards.Shard.check_in``)."""
        return self.shard.check_in(rnd, attempt, t)

    def shard_run(self, assignments: dict[str, TaskAssignment], blob: bytes, schema: tuple, shared_seed: int,
                  config: RunConfig | None, arrays: NDArrays | None = None
                  ) -> tuple[list[tuple[float, str, UploadHeader, bytes]], list[tuple[float, bool, str]],
                             SimulatedCounts]:
        """A shard's round once the root assigned its tops (``shards.Shard.run``)."""
        return self.shard.run(assignments, blob, schema, shared_seed, config, arrays)

    def shard_finish(self, closed_at: float, collect: bool = False) -> None:
        """The round ended when the root closed at ``closed_at`` (``shards.Shard.finish``)."""
        self.shard.finish(closed_at, collect)

    def shutdown(self) -> None:
        self.tree.shutdown()
