"""What one case of ``benchmarks/simulation.py`` runs in its own process (``--case``):
the simulation, timed round by round, and the row of figures the benchmark reports.
The orchestrator in ``simulation.py`` spawns it, so each case's peak RSS is its own.
"""

from __future__ import annotations

import contextlib
import resource
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from _procs import throughput
from simulation_profile import _is_worker, _start_sampling, _stop_sampling


def _case(clients_per_round: int, population: int, aggregators: int, rounds: int, vectorize: bool,
          governor: bool, workers: int, backend: str, task: str = "digits", device: str = "cpu",
          save: str | None = None, verbose: bool = False, profile: str | None = None,
          codec: dict[str, Any] | None = None, secure: bool = False, size_spread: float = 0.0) -> dict[str, Any]:
    import psutil
    import torch

    torch.set_num_threads(1)
    from orchard.config import RunConfig
    from orchard.secure_agg.prg import available_cores
    from orchard.simulation import SimulationConfig, run_simulation

    params: dict[str, Any] = {"with_replacement": True, "samples_per_client": 20}
    if size_spread:  # uneven clients (mean about 20); absent otherwise, as an older revision expects
        params["size_spread"] = size_spread
    run = RunConfig(task=task, task_params=params,
                    train={"epochs": 1, "batch_size": 10, "learning_rate": 0.1, "optimizer": "sgd"},
                    codec=codec or {"name": "float32"}, secure_aggregation={"enabled": secure})
    cfg = SimulationConfig(clients=population, clients_per_round=clients_per_round, rounds=rounds + 1,
                           aggregators=aggregators, vectorize=vectorize, governor=governor, workers=workers,
                           backend=backend, chunk_size=512, evaluate_every=0, progress=False, run=run,
                           device=device)  # type: ignore[arg-type]
    t0 = time.perf_counter()
    me = psutil.Process()

    def children_cpu() -> float:
        """CPU seconds (user + system) of this case's child processes so far: the workers."""
        total = 0.0
        for child in me.children(recursive=True):
            with contextlib.suppress(psutil.Error):  # one that exited meanwhile counts nothing
                t = child.cpu_times()
                total += t.user + t.system
        return total

    # The workers' CPU at the end of each round (progress runs right after a round, before
    # the next one starts): the difference over the measured rounds is theirs.
    marks: list[float] = []
    samplers: dict[str, subprocess.Popen[bytes]] = {}

    def progress(r: dict[str, Any]) -> None:
        marks.append(children_cpu())
        if profile and r["round"] == 1:  # the measured rounds only: from the end of the warm-up on
            workers_now = [c for c in me.children() if _is_worker(c)]
            pids = {"engine": me.pid, **{f"worker{i}": c.pid for i, c in enumerate(workers_now)}}
            samplers.update(_start_sampling(pids, Path(profile)))
        if verbose:  # on stderr: a case that runs out of time still says how far it got
            print(f"    round {r['round']} ({'warm-up' if r['round'] == 1 else 'measured'}): {r['seconds']:.1f} s, "
                  f"{r['trained']} trained; {_phases(r.get('phase_seconds', {}))}", file=sys.stderr, flush=True)

    report = run_simulation(cfg, progress=progress)
    profile_rows = _stop_sampling(samplers, Path(profile), rounds) if samplers and profile else None
    if save:
        import numpy as np

        np.savez(save, **report.final_arrays)
    measured = report.rounds[1:]
    if len(measured) < rounds or any(r.get("status") == "failed" for r in measured):
        # The run stopped at a round that did not fill: its status says why and what to change.
        raise SystemExit(f"{len(report.rounds)} of {rounds + 1} rounds ran: {report.status}")
    secs = sum(r["seconds"] for r in measured)
    cpu = sum(r["cpu_seconds"] for r in measured)
    trained = sum(r["trained"] for r in measured)
    # Every process of the case (the engine and its workers) over the measured rounds: the
    # CPU a client costs, and the most clients per second that CPU allows on this many
    # cores if every core were busy all the time (a perfectly balanced engine and workers).
    # (In one process there are no children: the difference is 0.)
    tree_cpu = cpu + (marks[-1] - marks[0] if len(marks) > 1 else 0.0)
    cores = available_cores()
    # The engine's own account of where a measured round's wall time went (mean per round).
    phases: dict[str, float] = {}
    for r in measured:
        for k, v in r.get("phase_seconds", {}).items():
            phases[k] = phases.get(k, 0.0) + v / len(measured)
    import orchard.simulation.engine as engine_module

    return {
        "code": str(Path(engine_module.__file__).resolve().parents[1]),  # which checkout ran
        "task": task,
        "size_spread": size_spread,
        "device": device,
        "path": "vectorized" if vectorize else "per-client",
        "clients_per_round": clients_per_round,
        "population": population,
        "aggregators": aggregators,
        "governor": governor,
        "workers": workers,
        "backend": backend,
        **throughput(measured, trained, secs),
        "participants_per_round": sum(r["participants"] for r in measured) / len(measured),
        "cpu_clients_per_second": round(trained / cpu, 1) if cpu > 0 else None,
        "tree_cpu_seconds_per_round": round(tree_cpu / len(measured), 3),
        "tree_cpu_us_per_client": round(1e6 * tree_cpu / trained, 1) if trained else None,
        "cores": cores,
        "core_bound_clients_per_second": round(trained * cores / tree_cpu, 1) if tree_cpu > 0 else None,
        "cpu_seconds_per_round": round(cpu / len(measured), 3),
        "simulated_seconds_per_round": round(sum(r["simulated_seconds"] for r in measured) / len(measured), 2),
        "phase_seconds_per_round": {k: round(v, 3) for k, v in phases.items()},
        "peak_rss_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
        # The largest worker's peak (workers have exited: run_simulation closed the backend).
        "worker_peak_rss_mib": (round(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024, 1)
                                if backend == "process" else None),
        "total_seconds": round(time.perf_counter() - t0, 2),
        "final_accuracy": report.final_accuracy,
        "profile": profile_rows,
    }


def _phases(p: dict[str, float]) -> str:
    """The engine's round, step by step (wall seconds per round, this process only)."""
    return (f"engine s/round: check-in {p.get('check_in', 0):.2f}, open and select {p.get('open', 0):.2f}, "
            f"dispatch {p.get('dispatch', 0):.2f} (device models {p.get('device_models', 0):.2f}), "
            f"arrivals {p.get('arrivals', 0):.2f}, leave {p.get('leave', 0):.2f}")
