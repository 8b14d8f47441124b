"""Continual learning on devices: class-incremental MNIST with on-device replay, run by the simulator.

Every case is an ``orchard simulate`` run (:func:`orchard.simulation.run_simulation`, the
engine a user gets with ``[run.continual]``): the shipped 10,000 MNIST training images,
``--samples`` drawn with replacement per device (a near-uniform class mix: Dirichlet
alpha 100), arrive as a stream in 5 periods of 2 classes (``orchard.tasks.stream``);
each selected device trains with the continual trainer on what arrived by its virtual
time, with its replay buffer in ``OUT/devices/device-N``; the tiers aggregate with
FedAvg. Devices are always on and never drop (the ``box`` profile below), so what
differs between the cases is the buffer only.

Timing: a period lasts ``PERIOD_S`` virtual seconds and rounds are ``PERIOD_S /
--rounds-per-period`` apart (``round_gap_s``; a round itself closes within its 600 s
deadline). Round 1's
first attempt opens at time 0, when no sample has arrived: it fails and is retried a
round gap later, so round ``k`` reads what arrived by ``k * round_gap_s`` and the last
round of each period ends it. The model is scored on the 10,000 test images after each
period's last round (the simulator's ``accuracy_period_<p>``: the accuracy on period
p's classes).

Cases (one stream, model and seed for all three):

- **no replay**: ``replay_ratio = 0``;
- **replay**: ``replay_ratio = --ratio``, each buffer held to ``--fraction`` (10%) of
  the samples its device has seen so far (``simulated_budget_fraction``): after every
  round the benchmark reads every device's buffer file and checks it;
- **upper bound**: the same ratio, a buffer that keeps every sample (fraction 1).

Reported: final accuracy over all classes, and average forgetting (Chaudhry et al.,
2018): over the periods before the last, the best accuracy a period's classes had at
the end of any earlier period minus their final accuracy. Each case runs once per seed;
the table shows the mean over seeds and the spread (sample standard deviation).
``forgetting_reduction`` is ``1 - replay's forgetting / no replay's`` and
``upper_bound_minus_replay_points`` the final accuracy gap, in points, both from means.

Cost (``--part cost``): client CPU time of a round with replay and Ditto
(``[run.personalization] kind = "ditto"``: each device keeps its personal adapter across
rounds) against a plain round (no replay, no personalization), over ``--cost-rounds``
rounds of the same population and cohort, a round a period (each selected device
trains on a period's samples). The simulator runs clients in this process, so the
round's process CPU time (``cpu_seconds``, taken before the round's evaluation) is the
clients' (with the tiers' small share); ``replay_ditto_cpu_ratio`` is the ratio of the
two runs' median round from round 2 on (in round 1 no buffer has anything to replay),
target <= 2.2.

    .venv/bin/python benchmarks/continual.py [--devices 1000] [--seeds 0 1 2] [--part all] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

from orchard.client.replay import FILE_NAME, ReplayBuffer
from orchard.simulation import SimulationConfig, run_simulation

PERIODS = [[0, 1], [2, 3], [4, 5], [6, 7], [8, 9]]
PERIOD_S = 10_000_000.0
CASES = ("no replay", "replay", "upper bound")
SAMPLE_SHAPE = (1, 28, 28)
BOX = {"gflops": 10.0, "battery": False, "availability": [1.0] * 24, "dropout": 0.0, "latency_s": 0.05}


def task_params(a: argparse.Namespace) -> dict[str, Any]:
    return {"partitioner": "dirichlet", "alpha": 100.0, "with_replacement": True, "samples_per_client": a.samples,
            "test_samples_per_client": a.test_samples, "channels": a.channels, "hidden": 32}


def sim_config(a: argparse.Namespace, seed: int, out: Path, *, ratio: float, fraction: float,
               rounds: int, ditto: bool = False, per_period: int | None = None) -> SimulationConfig:
    r = a.rounds_per_period if per_period is None else per_period
    run: dict[str, Any] = {
        "task": "mnist", "task_params": task_params(a),
        "train": {"epochs": a.epochs, "batch_size": a.batch, "learning_rate": a.lr, "optimizer": a.optimizer,
                  "momentum": a.momentum},
        # Round 1's first attempt finds nothing arrived: one retry (see the module). A
        # round closes within the deadline (virtual seconds), small against a round gap, so
        # rounds stay on the periods' clock (a selected device with nothing new sends nothing).
        "cohort": {"target": a.cohort, "over_selection": 1.0, "min_fraction": 0.1, "deadline_s": 600.0,
                   "max_retries": 1},
        "continual": {"periods": PERIODS, "period_s": PERIOD_S, "replay_ratio": ratio, "sampling": a.sampling,
                      "hot_samples": a.hot, "simulated_budget_fraction": fraction},
    }
    if ditto:
        run["personalization"] = {"kind": "ditto", "steps": a.ditto_steps, "lam": a.ditto_lam}
    return SimulationConfig.model_validate({
        "clients": a.devices, "clients_per_round": a.cohort, "rounds": rounds, "seed": seed, "progress": False,
        "profiles": {"box": BOX}, "devices": {"box": 1.0}, "backend": "local", "vectorize": False,
        "governor": False, "evaluate_every": r if per_period is None else rounds, "round_gap_s": PERIOD_S / r, "out": str(out), "run": run})


def buffer_fractions(out: Path) -> list[float]:
    """Each device's buffer as a share of the samples it has seen, read from its file."""
    got = []
    for d in sorted((out / "devices").glob("device-*")):
        if not (d / FILE_NAME).is_file():
            continue
        # A budget as large as the file can be: the buffer is read whole, never trimmed.
        buf = ReplayBuffer(d, SAMPLE_SHAPE, (d / FILE_NAME).stat().st_size * 4 + (1 << 16))
        got.append(len(buf) / buf.seen if buf.seen else 0.0)
    return got


class BoundBroken(RuntimeError):
    """A device's replay buffer held more than its share of the samples it had seen."""


def run_case(a: argparse.Namespace, case: str, seed: int) -> dict[str, Any]:
    """One case and seed; with ``--runs DIR`` its result is kept there and read back by
    a later run with the same settings (a long sitting can be resumed)."""
    kept = _kept_path(a, case, seed)
    if kept is not None and kept.is_file():
        return json.loads(kept.read_text())
    got = _simulate_case(a, case, seed)
    if kept is not None:
        kept.parent.mkdir(parents=True, exist_ok=True)
        kept.write_text(json.dumps(got))
    return got


def _kept_path(a: argparse.Namespace, case: str, seed: int) -> Path | None:
    if a.runs is None:
        return None
    key = (f"m{a.channels}-d{a.devices}-c{a.cohort}-s{a.samples}-r{a.rounds_per_period}-e{a.epochs}-b{a.batch}-lr{a.lr}"
           f"-{a.optimizer}{a.momentum}"
           f"-x{a.ratio}-f{a.fraction}-{a.sampling}-h{a.hot}")
    return Path(a.runs) / key / f"{case.replace(' ', '_')}-{seed}.json"


def _simulate_case(a: argparse.Namespace, case: str, seed: int) -> dict[str, Any]:
    ratio = 0.0 if case == "no replay" else a.ratio
    fraction = 1.0 if case == "upper bound" else a.fraction
    acc: list[list[float]] = []
    worst = 0.0
    rounds = len(PERIODS) * a.rounds_per_period
    with tempfile.TemporaryDirectory(prefix="orchard-continual-") as tmp:
        out = Path(tmp)

        def after_round(row: dict[str, Any]) -> None:
            nonlocal worst
            if case == "replay":  # the bound holds after every round, on every device
                shares = buffer_fractions(out)
                worst = max([worst, *shares])
                if worst > a.fraction + 1e-12:
                    raise BoundBroken(f"round {row['round']}: a buffer holds {worst:.3f} of its samples seen, "
                                      f"above {a.fraction}")
            if row.get("accuracy_period_0") is not None:
                acc.append([row[f"accuracy_period_{p}"] for p in range(len(PERIODS))] + [row["accuracy"]])
                print(f"  seed {seed} {case}: round {row['round']} accuracy {row['accuracy']:.3f} "
                      f"periods {[round(v, 2) for v in acc[-1][:-1]]}", flush=True)

        report = run_simulation(sim_config(a, seed, out, ratio=ratio, fraction=fraction, rounds=rounds),
                                progress=after_round)
    if report.status != "completed" or len(acc) != len(PERIODS):
        raise RuntimeError(f"seed {seed} {case}: the simulation ended '{report.status}' after {len(acc)} periods")
    t = len(PERIODS) - 1
    forgetting = statistics.fmean(max(acc[p][g] for p in range(g, t)) - acc[t][g] for g in range(t))
    return {"final_accuracy": acc[t][-1], "forgetting": forgetting, "accuracy_by_period": acc,
            "largest_buffer_fraction_of_seen": worst, "failed_attempts": report.failed_attempts,
            "simulated_seconds": report.simulated_seconds, "wall_s": report.total_seconds}


def round_cpu(a: argparse.Namespace, seed: int, *, replay_ditto: bool) -> list[float]:
    """Process CPU seconds of each round of a cost run: a round a period, so each selected
    device reads a period's samples, and from round 2 on its buffer has some to replay."""
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="orchard-continual-cost-") as tmp:
        cfg = sim_config(a, seed, Path(tmp), ratio=a.ratio if replay_ditto else 0.0, fraction=a.fraction,
                         rounds=a.cost_rounds, ditto=replay_ditto, per_period=1)
        report = run_simulation(cfg, progress=rows.append)
    if report.status != "completed":
        raise RuntimeError(f"cost run ended '{report.status}'")
    return [float(r["cpu_seconds"]) for r in rows]  # measured before the round's evaluation


def _one_thread() -> None:
    import torch

    torch.set_num_threads(1)


def _commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              cwd=Path(__file__).parent, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def _mean_spread(xs: list[float]) -> tuple[float, float]:
    return statistics.fmean(xs), (statistics.stdev(xs) if len(xs) > 1 else 0.0)


def accuracy_part(a: argparse.Namespace) -> dict[str, Any]:
    jobs = [(case, seed) for seed in a.seeds for case in CASES]
    if a.jobs > 1:  # each case and seed is its own simulation: run them side by side
        with ProcessPoolExecutor(a.jobs, mp_context=multiprocessing.get_context("spawn"),
                                 initializer=_one_thread) as pool:
            done = list(pool.map(run_case, [a] * len(jobs), *zip(*jobs, strict=True)))
    else:
        done = [run_case(a, case, seed) for case, seed in jobs]
    runs: dict[str, list[dict]] = {c: [] for c in CASES}
    for (case, _), got in zip(jobs, done, strict=True):
        runs[case].append(got)
    summary = {}
    print(f"\n{'case':<12} {'final accuracy':>20} {'avg forgetting':>20}")
    for case in CASES:
        fa = _mean_spread([r["final_accuracy"] for r in runs[case]])
        fg = _mean_spread([r["forgetting"] for r in runs[case]])
        summary[case] = {"final_accuracy_mean": fa[0], "final_accuracy_spread": fa[1],
                         "forgetting_mean": fg[0], "forgetting_spread": fg[1]}
        print(f"{case:<12} {fa[0]:>12.4f} ± {fa[1]:.4f} {fg[0]:>12.4f} ± {fg[1]:.4f}")
    none_f = summary["no replay"]["forgetting_mean"]
    reduction = 1.0 - summary["replay"]["forgetting_mean"] / none_f if none_f > 0 else float("nan")
    gap = 100.0 * (summary["upper bound"]["final_accuracy_mean"] - summary["replay"]["final_accuracy_mean"])
    worst = max(r["largest_buffer_fraction_of_seen"] for r in runs["replay"])
    print(f"\nforgetting_reduction {reduction:.3f} (target >= 0.5); "
          f"upper_bound_minus_replay_points {gap:.2f} (target <= 5); largest buffer {worst:.3f} of samples seen")
    return {"cases": summary, "runs": runs, "forgetting_reduction": reduction,
            "upper_bound_minus_replay_points": gap, "largest_buffer_fraction_of_seen": worst,
            "targets_met": bool(reduction >= 0.5 and gap <= 5.0)}


def cost_part(a: argparse.Namespace) -> dict[str, Any]:
    seed = a.seeds[0]
    plain = round_cpu(a, seed, replay_ditto=False)
    both = round_cpu(a, seed, replay_ditto=True)
    # Round 1: every buffer is still empty (nothing to replay yet); compared from round 2 on.
    ratio = statistics.median(both[1:] or both) / statistics.median(plain[1:] or plain)
    print(f"\nround CPU s: plain {[round(x, 2) for x in plain]}, replay + ditto {[round(x, 2) for x in both]}; "
          f"replay_ditto_cpu_ratio {ratio:.2f} (target <= 2.2)")
    return {"plain_round_cpu_s": plain, "replay_ditto_round_cpu_s": both, "replay_ditto_cpu_ratio": ratio,
            "ditto_steps": a.ditto_steps, "ditto_lam": a.ditto_lam, "cost_rounds": a.cost_rounds,
            "cost_target_met": bool(ratio <= 2.2)}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--devices", type=int, default=1000)
    ap.add_argument("--cohort", type=int, default=None, help="devices selected a round (default: all)")
    ap.add_argument("--samples", type=int, default=50, help="samples in each device's stream")
    ap.add_argument("--channels", type=int, default=4, help="the MNIST CNN's first conv channels (twice in the second)")
    ap.add_argument("--test-samples", type=int, default=2, help="held-out samples per device (personal figures)")
    ap.add_argument("--rounds-per-period", type=int, default=1)
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--batch", type=int, default=10)
    ap.add_argument("--lr", type=float, default=0.05)
    ap.add_argument("--optimizer", default="sgd", choices=["sgd", "adam", "adamw"])
    ap.add_argument("--momentum", type=float, default=0.0)
    ap.add_argument("--ratio", type=float, default=0.5, help="replay ratio of the replay and upper-bound cases")
    ap.add_argument("--fraction", type=float, default=0.1, help="replay buffer: at most this share of samples seen")
    ap.add_argument("--sampling", default="class_balanced", choices=["reservoir", "class_balanced"])
    ap.add_argument("--hot", type=int, default=4, help="hot samples (at most the buffer's capacity)")
    ap.add_argument("--ditto-steps", type=int, default=2)
    ap.add_argument("--ditto-lam", type=float, default=0.1)
    ap.add_argument("--cost-rounds", type=int, default=3)
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--jobs", type=int, default=1, help="simulations run side by side (processes)")
    ap.add_argument("--runs", default=None, help="keep each case's result in this folder, and reuse it")
    ap.add_argument("--part", default="all", choices=["all", "accuracy", "cost"])
    ap.add_argument("--quick", action="store_true", help="a small run: 60 devices, 1 seed")
    ap.add_argument("--json", dest="json_path", default=None)
    a = ap.parse_args(argv)
    if a.quick:
        a.devices, a.seeds = 60, a.seeds[:1]
    a.cohort = a.devices if a.cohort is None else min(a.cohort, a.devices)
    _one_thread()
    load = os.getloadavg()[0]
    started = time.perf_counter()
    result: dict[str, Any] = {
        "commit": _commit(), "command": " ".join([".venv/bin/python", "benchmarks/continual.py",
                                                   *(sys.argv[1:] if argv is None else argv)]),
        "host": f"{os.cpu_count()}-core {platform.machine()} shared development host",
        "load_average_before": round(load, 2), "engine": "orchard.simulation.run_simulation (local backend)",
        "model": f"mnist CNN, channels {a.channels}, hidden 32", "devices": a.devices, "cohort": a.cohort, "samples_per_device": a.samples, "periods": PERIODS,
        "rounds_per_period": a.rounds_per_period, "epochs": a.epochs, "batch_size": a.batch,
        "learning_rate": a.lr, "optimizer": a.optimizer, "momentum": a.momentum, "replay_ratio": a.ratio, "buffer_fraction_of_seen": a.fraction,
        "sampling": a.sampling, "seeds": a.seeds, "test_images": 10_000,
    }
    if a.part in ("all", "accuracy"):
        result.update(accuracy_part(a))
    if a.part in ("all", "cost"):
        result.update(cost_part(a))
    result["wall_s"] = round(time.perf_counter() - started, 1)
    result["load_average_after"] = round(os.getloadavg()[0], 2)
    if a.json_path:
        path = Path(a.json_path)
        history = json.loads(path.read_text()) if path.is_file() else []
        history.append(result)
        path.write_text(json.dumps(history, indent=1) + "\n")
    return result


if __name__ == "__main__":
    main()
