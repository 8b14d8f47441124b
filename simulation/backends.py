"""Where client jobs run: this process (threads), worker processes, or Ray actors.

A backend runs :func:`orchard.simulation.clients.run_jobs` on lists of jobs and hands
back their uploads; the round engine (tiers, clocks, folding) stays in the driving
process, except that the process backend can also make each worker a shard of it
(:meth:`ProcessBackend.start_shards`: an engine of its own over part of the tree). The
engine keeps at most two jobs per worker in flight (one running, the next queued behind
it), so what is materialised at once is about ``2 * workers * chunk_size`` clients
whatever the population.

Threads work because the heavy parts (torch kernels, numpy, hashing) release the GIL;
results do not depend on scheduling, since every client's work is a pure function of
its job and the engine folds uploads in simulated-time order, not completion order.
"""

from __future__ import annotations

import contextlib
import gc
import os
from collections import OrderedDict
from collections.abc import Callable, Mapping
from concurrent.futures import Future, InvalidStateError, ThreadPoolExecutor
from typing import Any, Protocol

from orchard.compression import build_codec
from orchard.config import RunConfig
from orchard.errors import ConfigError, OrchardError
from orchard.heap import keep_freed_memory
from orchard.simulation.clients import ClientJob, ClientOutput, PackedOutputs, run_jobs
from orchard.simulation.workers import WorkerPool
from orchard.tasks import Task, get_task
from orchard.tasks.registry import extend_search_path, search_path
from orchard.typing import NDArrays, TensorSpec


class BackendError(OrchardError):
    """A backend could not start or lost its workers."""


class Backend(Protocol):
    def submit(self, jobs: list[ClientJob], global_arrays: NDArrays,
               starts: Mapping[str, NDArrays] | None = None) -> Future[list[ClientOutput]]: ...

    def close(self) -> None: ...


class LocalBackend:
    """Jobs on the caller's thread (``workers=1``) or on ``workers`` threads of this process."""

    def __init__(self, task: Task, population: int, cfg: RunConfig, workers: int, vectorize: bool,
                 device: str = "cpu") -> None:
        self._run: Callable[[list[ClientJob], NDArrays, Mapping[str, NDArrays] | None], list[ClientOutput]] = (
            lambda jobs, arrays, starts: run_jobs(task, population, cfg, self._codec, arrays, jobs, vectorize,
                                                  starts, device))
        self._codec = build_codec(cfg.codec)
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="orchard-sim") if workers > 1 else None

    def submit(self, jobs: list[ClientJob], global_arrays: NDArrays,
               starts: Mapping[str, NDArrays] | None = None) -> Future[list[ClientOutput]]:
        if self._pool is not None:
            return self._pool.submit(self._run, jobs, global_arrays, starts)
        fut: Future[list[ClientOutput]] = Future()
        try:
            fut.set_result(self._run(jobs, global_arrays, starts))
        except BaseException as err:  # surfaced by fut.result(), as from a pool
            fut.set_exception(err)
        return fut

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)


_WORKER: dict[str, Any] = {}  # per worker process: the task, config and codec it serves


def _process_init(task_name: str, task_params: dict[str, Any], cfg_json: str, population: int,
                  vectorize: bool, device: str = "cpu", search_path: list[str] | None = None) -> None:
    import torch

    # A user's task module imports here as it did in the engine's process (from the
    # folder the command ran in, say), whatever this process was started with.
    extend_search_path(search_path or [])
    keep_freed_memory()  # as the engine: pickled batches of outputs reuse the heap
    torch.set_num_threads(1)
    cfg = RunConfig.model_validate_json(cfg_json)
    _WORKER.update(task=get_task(task_name, **task_params), cfg=cfg, codec=build_codec(cfg.codec),
                   population=population, vectorize=vectorize, device=device)
    # A worker only runs jobs: the cyclic collector stays off (it would run hundreds of
    # passes over each job's allocations, and over the pickling of its outputs, which
    # happens after _process_run returns); each job starts by collecting the young
    # generations, which hold what the previous one left.
    gc.disable()


def _process_run(jobs: list[ClientJob], arrays: NDArrays, starts: Mapping[str, NDArrays] | None,
                 segment: str | None = None) -> PackedOutputs:
    w = _WORKER
    gc.collect(1)
    outputs = run_jobs(w["task"], w["population"], w["cfg"], w["codec"], arrays, jobs, w["vectorize"], starts,
                       w["device"])
    return PackedOutputs(outputs, _attached(segment) if segment is not None else None)


_ATTACHED_MAX = 8  # segments a worker keeps mapped (the engine has about as many as jobs in flight)


def _attached(name: str) -> memoryview:
    """The buffer of the engine's shared segment ``name``, mapped once per worker."""
    from multiprocessing.shared_memory import SharedMemory

    held: OrderedDict[str, SharedMemory] = _WORKER.setdefault("segments", OrderedDict())
    seg = held.get(name)
    if seg is None:
        seg = held[name] = SharedMemory(name)
        while len(held) > _ATTACHED_MAX:  # one the engine replaced by a larger one
            held.popitem(last=False)[1].close()
    held.move_to_end(name)
    assert seg.buf is not None  # open until closed here
    return seg.buf


def _process_devices(params: dict[str, Any], batch: list[tuple[Any, ...]]) -> list[tuple[float, int, tuple[Any, ...]]]:
    from orchard.simulation.engine import run_devices  # (the engine imports this module)

    return run_devices(params, batch)


def _shard_start(population: Any, fanout: list[int], tops: list[str], opts: dict[str, Any]) -> None:
    """Make this worker a shard of the round engine: an engine over the same tree that
    runs the subtrees under ``tops`` (``Engine(tops=...)``), training here."""
    from orchard.simulation.engine import Engine  # (the engine imports this module)

    w = _WORKER
    here = LocalBackend(w["task"], w["population"], w["cfg"], 1, w["vectorize"], w["device"])
    w["shard"] = Engine(w["task"], population, w["cfg"], fanout, here, tops=tops, **opts)


def _shard_call(method: str, args: tuple[Any, ...]) -> Any:
    """One of the shard's steps of a round (``Engine.shard_check_in``, ``shard_run``,
    ``shard_finish``, which also collects the young generations once a round)."""
    return getattr(_WORKER["shard"], method)(*args)


class _Shard:
    """The engine's handle on a shard in worker ``index``: the root's children it runs
    (``tops``), and its steps (``call``), which the worker runs in order."""

    def __init__(self, pool: WorkerPool, index: int, tops: list[str]) -> None:
        self._pool, self.index, self.tops = pool, index, tops

    def call(self, method: str, *args: Any) -> Future[Any]:
        return self._pool.submit_to(self.index, _shard_call, method, args)


class _Segments:
    """Shared-memory segments that carry jobs' payloads from the workers to the engine
    (``PackedOutputs(into=...)``). A job takes one when it is submitted and gives it back
    once its outputs are copied out, so there are about as many as jobs in flight, all
    of one size: the largest job's payloads so far, rounded up to a MiB. Until a job has
    come back (the payload size is not known yet), for a job that would not fit, and
    where no segment can be made (no room in ``/dev/shm``), payloads go through the pipe.
    Used from the engine's thread only (the worker pool settles calls there)."""

    def __init__(self) -> None:
        self._free: list[Any] = []  # SharedMemory
        self._all: dict[str, Any] = {}
        self._per_client = 0  # the largest payload seen, bytes
        self._size = 0  # bytes of each segment
        self._broken = False  # a segment could not be made: pipe only from then on

    def take(self, clients: int) -> Any:
        """A free segment for ``clients`` payloads, or None (the pipe)."""
        need = clients * self._per_client
        if self._broken or need == 0:
            return None
        if need > self._size:  # every free one is too small: replace them
            self._size = -(-need // (1 << 20)) << 20
            for seg in self._free:
                self._drop(seg)
            self._free = []
        if self._free:
            return self._free.pop()
        try:
            seg = _new_segment(self._size)
        except OSError:
            self._broken = True
            return None
        self._all[seg.name] = seg
        return seg

    def give(self, seg: Any, largest_payload: int) -> None:
        """A segment whose payloads were copied out; the largest of them, in bytes."""
        self._per_client = max(self._per_client, largest_payload)
        if seg is None or seg.name not in self._all:  # (none lent, or the backend closed)
            return
        if seg.size < self._size:
            self._drop(seg)
        else:
            self._free.append(seg)

    def _drop(self, seg: Any) -> None:
        del self._all[seg.name]
        seg.close()
        seg.unlink()

    def close(self) -> None:
        for seg in list(self._all.values()):
            self._drop(seg)
        self._free = []


def _new_segment(size: int) -> Any:
    """A shared-memory segment of ``size`` bytes whose memory is there: in ``/dev/shm`` (a
    tmpfs) it is allocated now, so a full ``/dev/shm`` is an OSError here, not a SIGBUS
    in a worker writing to it."""
    from multiprocessing.shared_memory import SharedMemory

    seg = SharedMemory(create=True, size=size)
    path = f"/dev/shm/{seg.name.lstrip('/')}"
    if os.path.exists(path):
        try:
            fd = os.open(path, os.O_RDWR)
            try:
                os.posix_fallocate(fd, 0, size)
            finally:
                os.close(fd)
        except OSError:
            seg.close()
            seg.unlink()
            raise
    return seg


class _Unpacked(Future[list[ClientOutput]]):
    """The outputs of a worker's job: its :class:`PackedOutputs`, unpacked once they arrive
    (its payloads copied out of ``segment``, which then goes back to ``segments``)."""

    def __init__(self, inner: Future[PackedOutputs], schemas: tuple[tuple[TensorSpec, ...], ...] = (),
                 segments: _Segments | None = None, segment: Any = None) -> None:
        super().__init__()
        self._inner: Future[PackedOutputs] | None = inner
        self._schemas = schemas  # the jobs' schemas, for PackedOutputs.unpack
        self._segments, self._segment = segments, segment
        inner.add_done_callback(self._arrived)

    def _arrived(self, inner: Future[PackedOutputs]) -> None:
        # The inner future keeps this callback (so this future) for good: drop the link
        # back, or the pair is a reference cycle holding both copies of a job's outputs
        # (~40 MB a job for the digits MLP) until a full garbage collection.
        self._inner = None
        seg, self._segment = self._segment, None
        largest = 0
        try:
            if self.cancelled():
                return
            if inner.cancelled():
                self.cancel()
            elif (err := inner.exception()) is not None:
                self.set_exception(err)
            else:
                outputs = inner.result().unpack(self._schemas, seg.buf if seg is not None else None)
                largest = max((len(o.payload) for o in outputs), default=0)
                self.set_result(outputs)
        except InvalidStateError:  # cancelled meanwhile by the engine: nobody waits for it
            pass
        finally:
            if self._segments is not None:  # the worker is done with it, whatever happened
                self._segments.give(seg, largest)

    def done(self) -> bool:
        inner = self._inner
        if inner is not None:
            inner.done()  # a worker pool's call moves on when it is looked at
        return super().done()

    def result(self, timeout: float | None = None) -> list[ClientOutput]:
        inner = self._inner
        if inner is not None:
            with contextlib.suppress(BaseException):  # what it raised, this future raises
                inner.exception()  # waits for it (and settles this future)
        return super().result(timeout)

    def cancel(self) -> bool:
        inner = self._inner
        if inner is not None:
            inner.cancel()
        return super().cancel()


class ProcessBackend:
    """Jobs on ``workers`` processes of this machine: client work (training, encoding)
    in parallel with the engine's device model and folding, past the GIL. Each worker
    builds the task once (spawned, so no torch state is shared by fork)."""

    def __init__(self, task_name: str, task_params: dict[str, Any], population: int, cfg: RunConfig,
                 workers: int, vectorize: bool, task: Task | None = None, device: str = "cpu") -> None:
        self._here = (task, population, cfg, build_codec(cfg.codec), vectorize) if task is not None else None
        self._segments = _Segments()
        self._device = device
        self._workers = workers
        self._pool = WorkerPool(workers, _process_init,
                                (task_name, dict(task_params), cfg.model_dump_json(), population, vectorize, device,
                                 search_path()))

    def submit(self, jobs: list[ClientJob], global_arrays: NDArrays,
               starts: Mapping[str, NDArrays] | None = None) -> Future[list[ClientOutput]]:
        # Only the reconstructions these jobs start from travel with them.
        need = {j.start for j in jobs if j.start}
        sent = {k: v for k, v in starts.items() if k in need} if starts and need else None
        schemas = tuple({id(j.assignment.schema): j.assignment.schema for j in jobs}.values())
        seg = self._segments.take(len(jobs))
        try:
            inner = self._pool.submit(_process_run, jobs, global_arrays, sent, None if seg is None else seg.name)
        except BaseException:
            self._segments.give(seg, 0)
            raise
        return _Unpacked(inner, schemas, self._segments, seg)

    def run_devices(self, params: dict[str, Any], batch: list[tuple[Any, ...]]
                    ) -> Future[list[tuple[float, int, tuple[Any, ...]]]]:
        """Run simulated devices' training under their governors on a worker
        (``engine.run_devices``): the engine hands a worker part of a dispatch while the
        worker would otherwise wait for jobs."""
        return self._pool.submit(_process_devices, params, batch)

    def start_shards(self, population: Any, fanout: list[int], groups: list[list[str]],
                     opts: dict[str, Any]) -> list[_Shard]:
        """Make workers shards of the round engine, one for each group of the root's
        children (at most one per worker), each with its own copy of ``population`` (it
        only ever touches its own subtrees' devices). Waits until they are built."""
        if len(groups) > self._workers:
            raise BackendError(f"{len(groups)} shards for {self._workers} workers")
        calls = [self._pool.submit_to(i, _shard_start, population, fanout, tops, opts) for i, tops in enumerate(groups)]
        for call in calls:
            call.result()
        return [_Shard(self._pool, i, tops) for i, tops in enumerate(groups)]

    def run_here(self, jobs: list[ClientJob], global_arrays: NDArrays,
                 starts: Mapping[str, NDArrays] | None = None) -> list[ClientOutput]:
        """Run jobs in the calling process (the engine, while it would wait on a worker)."""
        if self._here is None:
            raise BackendError("this process backend was built without the task; it cannot run jobs here")
        import torch

        task, population, cfg, codec, vectorize = self._here
        threads = torch.get_num_threads()
        torch.set_num_threads(1)  # as in a worker: the workers have the other cores
        try:
            return run_jobs(task, population, cfg, codec, global_arrays, jobs, vectorize, starts, self._device)
        finally:
            torch.set_num_threads(threads)

    def close(self) -> None:
        self._pool.close()
        self._segments.close()


class RayBackend:
    """Jobs on ``workers`` Ray actors; each builds the task once and keeps it.

    ``ray.init()`` joins the cluster named by ``RAY_ADDRESS`` when set, else starts a
    local one. The actors are spread over the cluster's nodes (Ray's ``SPREAD``
    strategy: by default Ray packs them onto the node that asks while it has room, so
    a cluster's other nodes would sit idle), and jobs go to them in turn. The global
    model goes to the object store once per round. Where the jobs ran does not change
    the model: uploads are folded in simulated-time order, not in completion order.
    """

    def __init__(self, task_name: str, task_params: dict[str, Any], population: int, cfg: RunConfig,
                 workers: int, vectorize: bool) -> None:
        try:
            import ray
        except ImportError as err:
            raise ConfigError("backend 'ray' needs ray: pip install 'orchard-fl[ray]'") from err
        self._ray = ray
        if not ray.is_initialized():
            ray.init(num_cpus=None, include_dashboard=False, log_to_driver=False)

        paths = search_path()

        @ray.remote
        class _Worker:
            def __init__(self, cfg_json: str) -> None:
                import torch

                extend_search_path(paths)  # a user's task module, as it imported in the driver
                keep_freed_memory()
                torch.set_num_threads(1)
                self.cfg = RunConfig.model_validate_json(cfg_json)
                self.task = get_task(task_name, **task_params)
                self.codec = build_codec(self.cfg.codec)

                self.jobs = 0

            def run(self, jobs: list[ClientJob], arrays: NDArrays,
                    starts: Mapping[str, NDArrays] | None) -> list[ClientOutput]:
                outputs = run_jobs(self.task, population, self.cfg, self.codec, arrays, jobs, vectorize, starts)
                self.jobs += 1
                return outputs

            def placement(self) -> tuple[str, int]:
                """The node this actor runs on, and how many jobs it ran there."""
                return ray.get_runtime_context().get_node_id(), self.jobs

        cfg_json = cfg.model_dump_json()
        # An actor holds no CPU by default, and SPREAD alone is a preference: under load Ray
        # placed both actors of a two-node cluster on one node. When the cluster has a CPU
        # for each worker, each actor holds one, so the workers land where CPUs are free;
        # with more workers than CPUs they hold none (a held CPU would leave actors pending).
        cpus = 1 if workers <= int(ray.cluster_resources().get("CPU", 0)) else 0
        # ray.remote turned the class into an actor class, with .options (unknown to mypy).
        spread = _Worker.options(scheduling_strategy="SPREAD", num_cpus=cpus)  # type: ignore[attr-defined]
        self._actors = [spread.remote(cfg_json) for _ in range(workers)]
        self._next = 0
        self._arrays_ref: Any = None
        self._arrays_id: int | None = None

    def submit(self, jobs: list[ClientJob], global_arrays: NDArrays,
               starts: Mapping[str, NDArrays] | None = None) -> Future[list[ClientOutput]]:
        if self._arrays_id != id(global_arrays):
            self._arrays_ref = self._ray.put(global_arrays)
            self._arrays_id = id(global_arrays)
        need = {j.start for j in jobs if j.start}
        sent = {k: v for k, v in starts.items() if k in need} if starts and need else None
        actor = self._actors[self._next % len(self._actors)]
        self._next += 1
        ref = actor.run.remote(jobs, self._arrays_ref, sent)
        return ref.future()  # type: ignore[no-any-return]

    def placement(self) -> dict[str, int]:
        """Jobs run so far on each node (by Ray node id), as the actors report them."""
        counts: dict[str, int] = {}
        for node, jobs in self._ray.get([a.placement.remote() for a in self._actors]):
            counts[node] = counts.get(node, 0) + jobs
        return counts

    def close(self) -> None:
        for a in self._actors:
            self._ray.kill(a)
        self._actors = []


def make_backend(kind: str, task: Task, task_name: str, task_params: dict[str, Any], population: int,
                 cfg: RunConfig, workers: int, vectorize: bool, device: str = "cpu") -> Backend:
    if kind == "ray":
        return RayBackend(task_name, task_params, population, cfg, workers, vectorize)
    if kind == "local":
        return LocalBackend(task, population, cfg, workers, vectorize, device)
    if kind == "process":
        return ProcessBackend(task_name, task_params, population, cfg, workers, vectorize, task, device)
    raise ConfigError(f"unknown backend {kind!r}; expected 'local', 'process' or 'ray'")
