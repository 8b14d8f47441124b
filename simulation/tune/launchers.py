"""Where trials run: worker processes on this machine, or tasks on a Ray cluster.

A launcher takes dispatches (a ticket and a sampler seed), each running one trial of the
study in its own worker (``run_dispatch``: Optuna's ``study.optimize`` for one trial,
with its heartbeat), and reports each as ``done`` or ``died``. It never decides what
runs: the driver does, from the study's storage. Both launchers run the same
``run_dispatch`` against the same storage, so a study is the same study either way.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import sys
from collections.abc import Callable
from multiprocessing.connection import Connection, wait
from typing import Any, Protocol

from orchard.simulation.tune.objective import TrialSetup, run_trial

Event = tuple[str, str, str]  # ("done" | "died", ticket, detail)


class Launcher(Protocol):
    def free(self) -> int: ...

    def submit(self, ticket: str, seed: int) -> None: ...

    def poll(self, timeout_s: float) -> list[Event]: ...

    def close(self) -> None: ...


def run_dispatch(setup: TrialSetup, ticket: str, seed: int, alive: Callable[[], bool] = lambda: True) -> str:
    """One trial of the study: the next waiting retry, or a new one drawn by the sampler
    seeded with ``seed``. Returns the trial's state's name."""
    import optuna

    from orchard.simulation.tune.study import load_study, make_storage

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    study = load_study(make_storage(setup.storage_url, setup.spec), setup.study_name, setup.spec, setup.rounds, seed)
    # catch: a trial its config fails is recorded FAIL (with its error) and the worker goes on.
    study.optimize(lambda trial: run_trial(trial, setup, ticket, alive), n_trials=1, catch=(Exception,))
    return str(study.trials[-1].state.name) if study.trials else "NONE"


def _die_with_parent() -> None:
    """On Linux, the kernel kills this process when its parent dies (even by SIGKILL)."""
    if sys.platform.startswith("linux"):
        import ctypes
        import signal

        with contextlib.suppress(OSError):
            ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def _worker_main(conn: Connection, setup: TrialSetup, parent: int) -> None:
    _die_with_parent()
    import torch

    torch.set_num_threads(1)  # one trial, one core: parallel trials are the parallelism

    def alive() -> bool:
        return os.getppid() == parent

    while True:
        try:
            msg = conn.recv()
        except (EOFError, OSError):
            return
        if msg is None:
            return
        ticket, seed = msg
        state = run_dispatch(setup, ticket, seed, alive)
        conn.send(("done", ticket, state))


class ProcessLauncher:
    """``slots`` long-lived worker processes (spawned, so each imports torch once); a
    worker that dies is replaced at the next dispatch."""

    def __init__(self, setup: TrialSetup, slots: int) -> None:
        self._setup, self._slots = setup, slots
        self._ctx = multiprocessing.get_context("spawn")
        self._idle: list[tuple[Any, Connection]] = []
        self._busy: dict[str, tuple[Any, Connection]] = {}  # ticket -> (process, pipe)

    def free(self) -> int:
        return self._slots - len(self._busy)

    def _spawn(self) -> tuple[Any, Connection]:
        here, there = self._ctx.Pipe()
        proc = self._ctx.Process(target=_worker_main, args=(there, self._setup, os.getpid()), daemon=True,
                                 name="orchard-tune-worker")
        proc.start()
        there.close()
        return proc, here

    def submit(self, ticket: str, seed: int) -> None:
        worker = self._idle.pop() if self._idle else self._spawn()
        worker[1].send((ticket, seed))
        self._busy[ticket] = worker

    def poll(self, timeout_s: float) -> list[Event]:
        if not self._busy:
            return []
        by_handle: dict[Any, str] = {}
        for ticket, (proc, conn) in self._busy.items():
            by_handle[conn] = by_handle[proc.sentinel] = ticket
        events: list[Event] = []
        for handle in wait(list(by_handle), timeout_s):
            ticket = by_handle[handle]
            if ticket not in self._busy:
                continue
            proc, conn = self._busy[ticket]
            try:
                if conn.poll():
                    _, t, state = conn.recv()
                    del self._busy[ticket]
                    self._idle.append((proc, conn))
                    events.append(("done", t, state))
                    continue
            except (EOFError, OSError):
                proc.join(timeout=10)  # the pipe closed: the worker is exiting
            if not proc.is_alive():
                del self._busy[ticket]
                conn.close()
                events.append(("died", ticket, f"worker exited with code {proc.exitcode}"))
        return events

    def close(self) -> None:
        for _, conn in [*self._idle, *self._busy.values()]:
            with contextlib.suppress(OSError):
                conn.send(None)
        for proc, _ in [*self._idle, *self._busy.values()]:
            proc.join(timeout=2)
            if proc.is_alive():
                proc.kill()
                proc.join()
        self._idle, self._busy = [], {}


class RayLauncher:
    """Each dispatch a Ray task (one CPU, no retry of its own: a trial's retry is the
    study's) on the cluster at ``address``. Every node must reach the study's storage:
    a SQLite file on a filesystem they share, or a database URL."""

    def __init__(self, setup: TrialSetup, slots: int, address: str) -> None:
        import ray

        from orchard.tasks.registry import extend_search_path, search_path

        self._ray = ray
        if not ray.is_initialized():
            ray.init(address=address, include_dashboard=False, log_to_driver=False)
        paths = search_path()

        @ray.remote(num_cpus=1, max_retries=0)
        def _dispatch(setup: TrialSetup, ticket: str, seed: int) -> tuple[str, str]:
            import torch

            extend_search_path(paths)  # a user's task module, as it imported here
            torch.set_num_threads(1)
            return run_dispatch(setup, ticket, seed), ray.get_runtime_context().get_node_id()

        self._remote, self._setup, self._slots = _dispatch, ray.put(setup), slots
        self._busy: dict[Any, str] = {}  # ObjectRef -> ticket
        self.nodes: set[str] = set()  # the nodes trials ran on

    def free(self) -> int:
        return self._slots - len(self._busy)

    def submit(self, ticket: str, seed: int) -> None:
        self._busy[self._remote.remote(self._setup, ticket, seed)] = ticket

    def poll(self, timeout_s: float) -> list[Event]:
        if not self._busy:
            return []
        ready, _ = self._ray.wait(list(self._busy), num_returns=len(self._busy), timeout=timeout_s)
        events: list[Event] = []
        for ref in ready:
            ticket = self._busy.pop(ref)
            try:
                state, node = self._ray.get(ref)
                self.nodes.add(node)
                events.append(("done", ticket, state))
            except Exception as err:  # the worker died (or Ray lost it): the trial is the study's to retry
                events.append(("died", ticket, f"{type(err).__name__}: {str(err)[:200]}"))
        return events

    def close(self) -> None:
        for ref in self._busy:
            self._ray.cancel(ref, force=True)
        self._busy = {}


def make_launcher(setup: TrialSetup, ray_address: str | None) -> ProcessLauncher | RayLauncher:
    """Worker processes here, or Ray tasks on the cluster at ``ray_address``; as many
    trials at once as the study's ``parallel``."""
    if ray_address:
        return RayLauncher(setup, setup.spec.parallel, ray_address)
    return ProcessLauncher(setup, setup.spec.parallel)
