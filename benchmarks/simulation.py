"""Simulator throughput: the digits MLP (64-64-10) with 20 samples per client (drawn with
replacement under each client's Dirichlet label mix), batch 10, one local epoch, plain
SGD, through the whole simulated round: device model, tiers, real client trainer (many
clients at once through torch.func.vmap), real codec, real fold, root finalize.

Each case runs in its own process (so peak RSS is that case's), runs one warm-up round
and then ``--rounds`` measured rounds, and reports:

- clients_per_second: clients trained, encoded and folded per wall second of the
  measured rounds (evaluation excluded); cpu_clients_per_second uses the engine
  process's CPU time instead (with the process backend, the workers' CPU is not in it:
  it measures the engine's critical path), which is what to compare on a loaded host;
- seconds_per_round: mean wall seconds of a measured round;
- peak_rss_mib: the engine process's peak resident set (``resource.getrusage``); with
  the process backend each worker's peak is reported too (``worker_peak_rss_mib``).

The per-client path (one TorchTrainer per client, the way a device trains) runs in the
same invocation as the baseline, on fewer clients per round, and the table prints the
throughput ratio. Flower's simulation engine is the reference peer; it needs Ray, and
the row says so when Ray is missing instead of making a number up.

    python benchmarks/simulation.py [--quick] [--json PATH] [--rounds 2] [--population 100000]
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from typing import Any


def _case(clients_per_round: int, population: int, aggregators: int, rounds: int, vectorize: bool,
          governor: bool, workers: int, backend: str) -> dict[str, Any]:
    import torch

    torch.set_num_threads(1)
    from orchard.config import RunConfig
    from orchard.simulation import SimulationConfig, run_simulation

    run = RunConfig(task="digits", task_params={"with_replacement": True, "samples_per_client": 20},
                    train={"epochs": 1, "batch_size": 10, "learning_rate": 0.1, "optimizer": "sgd"})
    cfg = SimulationConfig(clients=population, clients_per_round=clients_per_round, rounds=rounds + 1,
                           aggregators=aggregators, vectorize=vectorize, governor=governor, workers=workers,
                           backend=backend, chunk_size=1024, evaluate_every=0, progress=False, run=run)
    t0 = time.perf_counter()
    report = run_simulation(cfg)
    measured = report.rounds[1:]
    secs = sum(r["seconds"] for r in measured)
    cpu = sum(r["cpu_seconds"] for r in measured)
    trained = sum(r["trained"] for r in measured)
    return {
        "path": "vectorized" if vectorize else "per-client",
        "clients_per_round": clients_per_round,
        "population": population,
        "aggregators": aggregators,
        "governor": governor,
        "workers": workers,
        "backend": backend,
        "rounds": len(measured),
        "trained_per_round": trained / len(measured),
        "participants_per_round": sum(r["participants"] for r in measured) / len(measured),
        "clients_per_second": round(trained / secs, 1),
        "cpu_clients_per_second": round(trained / cpu, 1) if cpu > 0 else None,
        "seconds_per_round": round(secs / len(measured), 3),
        "cpu_seconds_per_round": round(cpu / len(measured), 3),
        "simulated_seconds_per_round": round(sum(r["simulated_seconds"] for r in measured) / len(measured), 2),
        "peak_rss_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
        # The largest worker's peak (workers have exited: run_simulation closed the backend).
        "worker_peak_rss_mib": (round(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024, 1)
                                if backend == "process" else None),
        "total_seconds": round(time.perf_counter() - t0, 2),
        "final_accuracy": report.final_accuracy,
    }


def _flower() -> dict[str, Any]:
    try:
        import flwr
        import flwr.simulation as fs
    except ImportError as err:
        return {"path": "flower", "status": f"not run: flwr is not importable ({err})"}
    missing = getattr(fs, "RAY_IMPORT_ERROR", None)
    try:
        import ray  # noqa: F401
    except ImportError:
        return {"path": "flower", "status": f"not run: flwr {flwr.__version__}'s simulation engine needs Ray, "
                                            "which is not installed here (pip install 'flwr[simulation]')"}
    return {"path": "flower", "status": f"not run: Ray is present but this benchmark has no Flower case yet "
                                        f"({missing or 'see the module docstring'})"}


def _spawn(args: dict[str, Any]) -> dict[str, Any]:
    cmd = [sys.executable, __file__, "--case", json.dumps(args)]
    out = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if out.returncode != 0:
        return {"path": "vectorized" if args["vectorize"] else "per-client", "status": "failed",
                "clients_per_round": args["clients_per_round"], "error": out.stderr[-2000:]}
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", dest="json_path", default=None)
    ap.add_argument("--rounds", type=int, default=2, help="measured rounds per case (after one warm-up)")
    ap.add_argument("--population", type=int, default=100_000)
    ap.add_argument("--per-round", type=int, nargs="*", default=[1000, 10_000])
    ap.add_argument("--baseline-per-round", type=int, default=500)
    ap.add_argument("--no-governor", action="store_true", help="device time from work alone, no pacing")
    # Two worker processes on a 2-core host: clients train and encode there while the
    # engine process checks in, paces and folds (the round's critical path).
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--backend", choices=["local", "process"], default="process",
                    help="where clients train: worker processes, or this process (threads if workers > 1)")
    ap.add_argument("--quick", action="store_true", help="1,000 clients per round only, one measured round")
    ap.add_argument("--case", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.case:
        print(json.dumps(_case(**json.loads(a.case))))
        return
    per_round = [1000] if a.quick else a.per_round
    rounds = 1 if a.quick else a.rounds
    governor = not a.no_governor
    rows = []
    for n in per_round:
        # About 250 clients per lowest-tier aggregator, as a deployment would shard them
        # (the coordinator scans its cohort's assignments on every upload, so a tier's
        # cost grows with the square of its cohort).
        aggs = max(1, n // 250)
        rows.append(_spawn(dict(clients_per_round=n, population=a.population, aggregators=aggs, rounds=rounds,
                                vectorize=True, governor=governor, workers=a.workers, backend=a.backend)))
    base = _spawn(dict(clients_per_round=a.baseline_per_round, population=a.population,
                       aggregators=max(1, a.baseline_per_round // 250),
                       rounds=rounds, vectorize=False, governor=governor, workers=a.workers,
                       backend=a.backend))
    rows.append(base)
    rows.append(_flower())
    base_cps = base.get("clients_per_second")
    base_cpu = base.get("cpu_clients_per_second")
    print(f"{'path':<11} {'per round':>9} {'clients/s':>9} {'cpu cl/s':>9} {'s/round':>8} {'cpu s/rd':>8} "
          f"{'sim s/rd':>8} {'RSS MiB':>8} {'wrk RSS':>8} {'x base':>7}")
    for r in rows:
        if "clients_per_second" not in r:
            print(f"{r['path']:<11} {r.get('status', '')}")
            if r.get("error"):
                print(r["error"])
            continue
        ratio = f"{r['clients_per_second'] / base_cps:.1f}" if base_cps else "-"
        print(f"{r['path']:<11} {r['clients_per_round']:>9} {r['clients_per_second']:>9.0f} "
              f"{r['cpu_clients_per_second'] or 0:>9.0f} {r['seconds_per_round']:>8.2f} "
              f"{r['cpu_seconds_per_round']:>8.2f} {r['simulated_seconds_per_round']:>8.1f} "
              f"{r['peak_rss_mib']:>8.0f} {r.get('worker_peak_rss_mib') or 0:>8.0f} {ratio:>7}")
    if base_cpu:
        for r in rows:
            if r.get("path") == "vectorized" and r.get("cpu_clients_per_second"):
                print(f"vectorized/per-client at {r['clients_per_round']} per round: "
                      f"{r['clients_per_second'] / base_cps:.1f}x wall, "
                      f"{r['cpu_clients_per_second'] / base_cpu:.1f}x CPU")
    print(f"population {a.population}, governor {'on' if governor else 'off'}, workers {a.workers} "
          f"({a.backend} backend)")
    if a.json_path:
        with open(a.json_path, "w") as f:
            json.dump({"cases": rows, "population": a.population, "governor": governor, "workers": a.workers,
                       "backend": a.backend}, f, indent=2)


if __name__ == "__main__":
    main()
