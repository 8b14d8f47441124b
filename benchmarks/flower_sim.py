"""One Flower ClientApp, simulated by Flower's own engine and by ``orchard simulate
--flower-app``, in one invocation.

The app is ``client_app`` of ``benchmarks/flower_peer.py``, unchanged on both paths: the
digits MLP (64-64-10), 20 training examples a client drawn with replacement under the
client's Dirichlet label mix, batch 10, one local epoch of SGD at 0.1, seeded by
``server-round`` and ``partition-id``. Both paths start from the same initial arrays
(``flower_peer.build_model()`` under ``torch.manual_seed(0)``, as its ServerApp builds
them), run FedAvg (weighted by ``num-examples``) over ``--clients`` clients, every one of
them in every round, for ``--rounds`` measured rounds after one warm-up round.

- Flower: ``flower_peer.run_flower`` (``flwr.simulation.run_simulation``, Ray backend,
  ``--ray-cpus`` CPUs), in a child process.
- Orchard: the task ``flower`` with the app and the initial arrays, as ``orchard simulate
  --flower-app flower_peer:client_app --initial-arrays FILE`` builds it, through
  ``run_simulation`` (the recipe that command runs) in a child process: population =
  clients per round, edge boxes that are always available and never drop out (as every
  SuperNode is), the float32 codec, central evaluation only at the end. The backend
  and its worker count are the command's own defaults (``auto``: on 2 cores and 1,000
  clients a round, one worker process beside the engine) unless ``--backend`` or
  ``--workers`` says otherwise.

Measured alike on both paths:

- clients_per_second: clients trained in the measured rounds over the wall seconds they
  took (Flower: between the end of round 1's aggregation and the end of the last;
  Orchard: the rounds' own wall seconds, which run back to back);
- peak_rss_mib: the peak of the summed RSS of the child and all its descendants, sampled
  every 0.25 s by ``flower_peer.TreeMemorySampler`` (the same sampler on both paths);
- final_accuracy: the final global model on the digits task's held-out test pool
  (``flower_peer._final_accuracy``), after the same number of rounds.

The ratios are Orchard's figure over Flower's, in one run on one machine.

    python benchmarks/flower_sim.py --clients 1000 --rounds 2 --json result.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
os.environ.setdefault("FLWR_TELEMETRY_ENABLED", "0")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")


def write_initial(path: Path) -> None:
    """The ServerApp's initial arrays, as a safetensors file for ``--initial-arrays``."""
    import torch
    from safetensors.numpy import save_file

    sys.path.insert(0, str(HERE))
    import flower_peer

    torch.manual_seed(flower_peer.SEED)
    model = flower_peer.build_model()
    save_file({k: v.detach().numpy() for k, v in model.state_dict().items()}, str(path))


def run_orchard(clients: int, measured_rounds: int, initial: Path, backend: str, workers: int | None
                ) -> dict[str, Any]:
    """Orchard's side, in this (child) process: the recipe of ``orchard simulate
    --flower-app``, measured as the module docstring says."""
    import torch

    sys.path.insert(0, str(HERE))
    import flower_peer
    from flwr.app import Array, ArrayRecord

    from orchard.simulation.cli import flower_app_overrides
    from orchard.simulation.config import build_simulation_config
    from orchard.simulation.runner import run_simulation

    torch.set_num_threads(1)
    from orchard.simulation.config import DEFAULT_PROFILES

    # Every SuperNode of Flower's engine is there for every round: the same of Orchard's
    # devices (an edge box that is always available and never drops out).
    always_on = DEFAULT_PROFILES["edge_box"].model_copy(update={"availability": [1.0] * 24, "dropout": 0.0})
    overrides = {
        **flower_app_overrides("flower_peer:client_app", initial, None),
        "clients": clients, "clients_per_round": clients, "rounds": measured_rounds + 1, "backend": backend,
        **({} if workers is None else {"workers": workers}),
        "profiles": {"always_on": always_on.model_dump()}, "devices": {"always_on": 1.0},
        "evaluate_every": 0, "progress": False,
        "run.cohort.over_selection": 1.0, "run.cohort.min_fraction": 1.0,
    }
    cfg = build_simulation_config({}, overrides)
    t0 = time.perf_counter()
    cpu0 = os.times()
    marks: list[float] = []  # the process tree's CPU seconds as each round ends (workers alive)
    with flower_peer.TreeMemorySampler(period_s=0.25) as mem:
        report = run_simulation(cfg, progress=lambda row: marks.append(flower_peer.tree_cpu_seconds()))
    total = time.perf_counter() - t0
    cpu1 = os.times()
    # This process and its reaped workers, start-up and warm-up round included (the
    # workers exit before run_simulation returns, so their time is in the children's).
    tree_cpu = (cpu1.user + cpu1.system + cpu1.children_user + cpu1.children_system
                - cpu0.user - cpu0.system - cpu0.children_user - cpu0.children_system)
    rounds = report.rounds
    if report.status != "completed" or len(rounds) != measured_rounds + 1:
        raise RuntimeError(f"Orchard's run ended {report.status!r} after {len(rounds)} rounds")
    measured = rounds[1:]
    trained = sum(int(r["participants"]) for r in measured)
    secs = sum(float(r["seconds"]) for r in measured)
    measured_cpu = marks[-1] - marks[0] if len(marks) == len(rounds) else None
    final = ArrayRecord({k: Array(v) for k, v in report.final_arrays.items()})
    return {
        "path": "orchard",
        "engine": f"orchard simulate --flower-app: {cfg.backend_choice.line()}",
        "clients_per_round": clients,
        "rounds": len(measured),
        "trained_per_round": trained / len(measured),
        "clients_per_second": round(trained / secs, 1),
        "seconds_per_round": round(secs / len(measured), 3),
        "tree_cpu_clients_per_second": round(trained / measured_cpu, 1) if measured_cpu else None,
        "tree_cpu_seconds_per_round": round(measured_cpu / len(measured), 3) if measured_cpu else None,
        "warmup_round_seconds": round(float(rounds[0]["seconds"]), 3),
        "peak_rss_mib": round(mem.peak_rss / flower_peer.MIB, 1),
        "processes_at_peak": mem.peak_names,
        "peak_pss_mib": round(mem.peak_pss / flower_peer.MIB, 1) if mem.peak_pss else None,
        "total_seconds": round(total, 2),
        "tree_cpu_seconds_all_rounds": round(tree_cpu, 2),
        "tree_cpu_ms_per_client_all_rounds": round(1e3 * tree_cpu / sum(int(r["participants"]) for r in rounds), 2),
        "final_accuracy": flower_peer._final_accuracy(final),
    }


def _child(args: list[str], timeout: float) -> dict[str, Any]:
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join(
            [str(HERE), *filter(None, [os.environ.get("PYTHONPATH")])]))
        res = subprocess.run([sys.executable, *args, "--out", f.name], env=env, timeout=timeout,
                             capture_output=True, text=True)
        if res.returncode != 0:
            raise RuntimeError(f"{' '.join(args[:2])} failed ({res.returncode}):\n{res.stderr[-4000:]}")
        return json.loads(Path(f.name).read_text())  # type: ignore[no-any-return]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--clients", type=int, default=1000, help="clients a round (all of them train)")
    ap.add_argument("--rounds", type=int, default=2, help="measured rounds, after one warm-up round")
    ap.add_argument("--backend", default="auto", choices=["auto", "process", "local"],
                    help="Orchard's backend (default: auto, as orchard simulate chooses it)")
    ap.add_argument("--workers", type=int, default=None,
                    help="Orchard's worker processes (default: as orchard simulate chooses them)")
    ap.add_argument("--ray-cpus", type=int, default=os.cpu_count() or 2, help="Flower's Ray CPUs")
    ap.add_argument("--timeout", type=float, default=3600.0, help="seconds each path may take")
    ap.add_argument("--json", default=None, help="write the result here")
    ap.add_argument("--orchard-child", default=None, help=argparse.SUPPRESS)  # internal: the initial arrays
    ap.add_argument("--out", default=None, help=argparse.SUPPRESS)  # internal: the child's result file
    a = ap.parse_args()

    if a.orchard_child:
        row = run_orchard(a.clients, a.rounds, Path(a.orchard_child), a.backend,
                          None if a.workers is None or a.workers < 1 else a.workers)
        Path(a.out).write_text(json.dumps(row))
        return

    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="orchard-flower-sim-") as tmp:
        initial = Path(tmp) / "initial.safetensors"
        write_initial(initial)
        orchard = _child([str(Path(__file__).resolve()), "--orchard-child", str(initial), "--clients", str(a.clients),
                          "--rounds", str(a.rounds), "--backend", a.backend,
                          "--workers", str(a.workers or 0)], a.timeout)
        flower = _child([str(HERE / "flower_peer.py"), "--clients", str(a.clients), "--rounds", str(a.rounds),
                         "--ray-cpus", str(a.ray_cpus)], a.timeout)
    result = {
        "benchmark": "flower_sim",
        "clients_per_round": a.clients,
        "measured_rounds": a.rounds,
        "cores": os.cpu_count(),
        # 1-minute load average before and after (the host is shared: wall figures move with it)
        "load_average": [round(load_before[0], 2), round(os.getloadavg()[0], 2)],
        "orchard": orchard,
        "flower": flower,
        "orchard_vs_flower_clients_per_second_ratio": round(orchard["clients_per_second"] / flower["clients_per_second"], 2),
        "orchard_vs_flower_peak_rss_ratio": round(orchard["peak_rss_mib"] / flower["peak_rss_mib"], 3),
        # CPU seconds of each process tree over the measured rounds: less load-dependent
        "orchard_vs_flower_tree_cpu_clients_per_second_ratio": (
            round(orchard["tree_cpu_clients_per_second"] / flower["tree_cpu_clients_per_second"], 2)
            if orchard.get("tree_cpu_clients_per_second") and flower.get("tree_cpu_clients_per_second") else None),
        "accuracy_difference_points": round(100 * abs(orchard["final_accuracy"] - flower["final_accuracy"]), 2),
        "targets": {"clients_per_second_ratio": ">= 10", "peak_rss_ratio": "<= 0.5", "accuracy_points": "<= 1"},
    }
    result["met"] = {
        "clients_per_second_ratio": result["orchard_vs_flower_clients_per_second_ratio"] >= 10,
        "peak_rss_ratio": result["orchard_vs_flower_peak_rss_ratio"] <= 0.5,
        "accuracy_points": result["accuracy_difference_points"] <= 1.0,
    }
    print(f"{'path':<8} {'clients/s':>10} {'peak RSS MiB':>13} {'accuracy':>9} {'s/round':>8}")
    for name, row in (("orchard", orchard), ("flower", flower)):
        print(f"{name:<8} {row['clients_per_second']:>10.1f} {row['peak_rss_mib']:>13.1f} "
              f"{row['final_accuracy']:>9.4f} {row['seconds_per_round']:>8.2f}")
    print(f"orchard/flower: clients/s x{result['orchard_vs_flower_clients_per_second_ratio']}, "
          f"peak RSS x{result['orchard_vs_flower_peak_rss_ratio']}, accuracy "
          f"{result['accuracy_difference_points']} points apart; met: {result['met']}")
    print(f"tree CPU clients/s x{result['orchard_vs_flower_tree_cpu_clients_per_second_ratio']}; "
          f"load average {result['load_average']}")
    if a.json:
        Path(a.json).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
