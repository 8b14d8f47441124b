"""Model quality through the simulator (real trainer, codec, secure aggregation, tiers).

Cases (each with a round budget; pass more rounds for the full targets):

- ``mnist``: the MNIST CNN, Dirichlet(alpha=0.5) over 100 clients, 10 per round,
  ``--mnist-rounds`` rounds for each of ``--seeds``, test accuracy at the fixed rounds
  ``--report-rounds``; beside it the centralised baseline per seed: the same model on the
  pooled training data (the task's recipe, one epoch at a time) until the test
  accuracy plateaus (:func:`plateaued`: the best of the last ``--plateau-epochs`` epochs
  is less than ``--plateau-points`` above the best before them). Targets: reach 98%;
  ``federated_minus_central_points`` (the seeds' mean federated accuracy at the last
  fixed round minus their mean plateau accuracy, in points).
- ``shakespeare``: federated FFA-LoRA on the pretrained character GPT, 10 roles per
  round; final accuracy against the centralised baseline
  (``orchard.tasks.baseline.run_baseline``). Target: within 2 accuracy points.
- ``shakespeare-secure``: the same with secure aggregation and an 8-bit codec (qsgd,
  fixed scale: linear in SecAgg's field). Target: at most 0.5 points below the plain
  federated run.

Prints rounds-to-target and final accuracy per case and writes ``--json PATH``.

    python benchmarks/quality.py [--cases mnist shakespeare shakespeare-secure]
        [--seeds 0 1 2] [--mnist-rounds 90] [--report-rounds 30 60 90]
        [--shakespeare-rounds 40] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from dataclasses import replace
from typing import Any

import torch

from orchard.config import RunConfig
from orchard.simulation import SimulationConfig, run_simulation
from orchard.tasks.baseline import RECIPES, run_baseline
from orchard.tasks.registry import get_task

ALWAYS_ON = {"gflops": 20.0, "battery": False, "availability": [1.0] * 24, "dropout": 0.0}


def _sim(run: dict[str, Any], clients: int, per_round: int, rounds: int, aggregators: int,
         evaluate_every: int, seed: int = 0) -> SimulationConfig:
    # Quality, not device behaviour, is measured here: devices that are always there, so
    # every round aggregates exactly ``per_round`` clients.
    run = {**run, "cohort": {"over_selection": 1.0, "min_fraction": 1.0, "deadline_s": 3600.0}}
    return SimulationConfig(clients=clients, clients_per_round=per_round, rounds=rounds, aggregators=aggregators, seed=seed,
                            progress=False, evaluate_every=evaluate_every, profiles={"box": ALWAYS_ON},
                            devices={"box": 1.0}, governor=False, run=RunConfig.model_validate(run))


def _summary(name: str, report: Any, target: float | None, started: float) -> dict[str, Any]:
    evals = [(r["round"], r["accuracy"]) for r in report.rounds if r.get("accuracy") is not None]
    hit = next((rnd for rnd, acc in evals if target is not None and acc >= target), None)
    return {"case": name, "rounds_run": len(report.rounds), "rounds_to_target": hit, "target": target,
            "final_accuracy": report.final_accuracy, "final_loss": report.final_loss,
            "best_accuracy": max((a for _, a in evals), default=None),
            "bytes_up": sum(r["bytes_up"] for r in report.rounds), "seconds": round(time.perf_counter() - started, 1),
            "status": report.status}


def plateaued(history: list[float], epochs: int = 3, min_gain: float = 0.001) -> bool:
    """Whether accuracies ``history`` (one per epoch) have plateaued: the best of the last
    ``epochs`` is less than ``min_gain`` above the best before them (0.001 = 0.1 point)."""
    if len(history) <= epochs:
        return False
    return max(history[-epochs:]) - max(history[:-epochs]) < min_gain


def central_plateau(task_name: str, seed: int, epochs: int, min_gain: float, max_epochs: int) -> dict[str, Any]:
    """The task's model trained centrally (its baseline recipe, one epoch a call, each
    epoch shuffled by its own seed; the optimizer's state starts afresh each epoch) until
    :func:`plateaued`, or ``max_epochs``. Reports the best test accuracy seen and when."""
    t0 = time.perf_counter()
    task = get_task(task_name)
    arrays = task.initial_arrays(seed)
    trainer = task.pooled_trainer(seed)
    history: list[float] = []
    while len(history) < max_epochs and not plateaued(history, epochs, min_gain):
        cfg = replace(RECIPES[task_name], epochs=1, steps=None, seed=seed * 1000 + len(history))
        arrays = trainer.train(arrays, cfg).arrays
        history.append(task.evaluate(arrays)["accuracy"])
    best = max(history)
    return {"case": f"{task_name}-centralised", "seed": seed, "epochs": len(history),
            "plateaued": plateaued(history, epochs, min_gain), "final_accuracy": history[-1],
            "best_accuracy": best, "best_epoch": history.index(best) + 1, "accuracy_by_epoch": history,
            "seconds": round(time.perf_counter() - t0, 1)}


def mnist(rounds: int, every: int, seed: int, report_rounds: list[int]) -> dict[str, Any]:
    t0 = time.perf_counter()
    run = {"task": "mnist", "task_params": {"alpha": 0.5},
           "train": {"epochs": 2, "batch_size": 32, "learning_rate": 0.1},
           "server_optimizer": {"name": "fedavgm", "lr": 1.0, "momentum": 0.9}}
    cfg = _sim(run, clients=100, per_round=10, rounds=rounds, aggregators=2, evaluate_every=every, seed=seed)
    rep = run_simulation(cfg)
    row = _summary("mnist", rep, 0.98, t0)
    by_round = {r["round"]: r["accuracy"] for r in rep.rounds if r.get("accuracy") is not None}
    return {**row, "seed": seed, "accuracy_at": {str(n): by_round.get(n) for n in report_rounds}}


def _sd(xs: list[float]) -> float:
    return statistics.stdev(xs) if len(xs) > 1 else 0.0


def mnist_comparison(fed: list[dict[str, Any]], central: list[dict[str, Any]], at: int) -> dict[str, Any]:
    """The seeds' mean federated accuracy at round ``at`` against their mean plateau accuracy."""
    accs = [r["accuracy_at"][str(at)] for r in fed]
    if any(a is None for a in accs):
        raise ValueError(f"round {at} was not evaluated in every seed; make it a multiple of --eval-every")
    cen = [c["best_accuracy"] for c in central]
    return {"case": "mnist-comparison", "round": at, "seeds": [r["seed"] for r in fed],
            "federated_mean": statistics.fmean(accs), "federated_sd": _sd(accs),
            "central_mean": statistics.fmean(cen), "central_sd": _sd(cen),
            "federated_minus_central_points": round(100 * (statistics.fmean(accs) - statistics.fmean(cen)), 2)}


def shakespeare(rounds: int, every: int, secure: bool) -> dict[str, Any]:
    t0 = time.perf_counter()
    run: dict[str, Any] = {"task": "shakespeare",
                           "train": {"epochs": 1, "batch_size": 16, "learning_rate": 1e-2, "optimizer": "adam"}}
    if secure:
        run["codec"] = {"name": "qsgd", "params": {"bits": 8, "scale": 0.05}}
        run["secure_aggregation"] = {"enabled": True, "bits": 16, "clip": 0.05}
    cfg = _sim(run, clients=1170, per_round=10, rounds=rounds, aggregators=0, evaluate_every=every)
    rep = run_simulation(cfg)
    return _summary("shakespeare-secure" if secure else "shakespeare", rep, None, t0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cases", nargs="*", default=["mnist", "shakespeare", "shakespeare-secure"])
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2], help="MNIST seeds")
    ap.add_argument("--mnist-rounds", type=int, default=90)
    ap.add_argument("--report-rounds", type=int, nargs="+", default=[30, 60, 90])
    ap.add_argument("--plateau-epochs", type=int, default=3)
    ap.add_argument("--plateau-points", type=float, default=0.1)
    ap.add_argument("--max-central-epochs", type=int, default=40)
    ap.add_argument("--shakespeare-rounds", type=int, default=40)
    ap.add_argument("--baseline-steps", type=int, default=None, help="centralised baseline steps (recipe: 400)")
    ap.add_argument("--eval-every", type=int, default=5)
    ap.add_argument("--json", dest="json_path", default=None)
    a = ap.parse_args()
    torch.set_num_threads(1)
    rows: list[dict[str, Any]] = []
    baseline = None
    if "mnist" in a.cases:
        fed = [mnist(a.mnist_rounds, a.eval_every, seed, a.report_rounds) for seed in a.seeds]
        central = [central_plateau("mnist", seed, a.plateau_epochs, a.plateau_points / 100, a.max_central_epochs)
                   for seed in a.seeds]
        rows += [*fed, *central, mnist_comparison(fed, central, max(a.report_rounds))]
    if any(c.startswith("shakespeare") for c in a.cases):
        t0 = time.perf_counter()
        base = run_baseline("shakespeare", steps=a.baseline_steps) if a.baseline_steps else run_baseline("shakespeare")
        baseline = {"case": "shakespeare-centralised", "final_accuracy": base["accuracy"],
                    "final_loss": base["loss"], "steps": base["num_steps"],
                    "seconds": round(time.perf_counter() - t0, 1)}
        rows.append(baseline)
    if "shakespeare" in a.cases:
        rows.append(shakespeare(a.shakespeare_rounds, a.eval_every, secure=False))
    if "shakespeare-secure" in a.cases:
        rows.append(shakespeare(a.shakespeare_rounds, a.eval_every, secure=True))
    plain = next((r for r in rows if r["case"] == "shakespeare"), None)
    for r in rows:
        if r["case"].startswith("shakespeare-") and r is not baseline and plain and plain["final_accuracy"] is not None:
            r["points_below_plain"] = round(100 * (plain["final_accuracy"] - r["final_accuracy"]), 2)
        if r["case"] == "shakespeare" and baseline:
            r["points_below_centralised"] = round(100 * (baseline["final_accuracy"] - r["final_accuracy"]), 2)
    for r in rows:
        if r["case"] == "mnist":
            print(f"mnist seed {r['seed']}: accuracy at rounds {r['accuracy_at']}")
        elif r["case"] == "mnist-centralised":
            print(f"mnist centralised seed {r['seed']}: {r['best_accuracy']:.4f} (epoch {r['best_epoch']} of "
                  f"{r['epochs']}, plateaued {r['plateaued']})")
        elif r["case"] == "mnist-comparison":
            print(f"mnist at round {r['round']}: federated {r['federated_mean']:.4f} +- {r['federated_sd']:.4f}, "
                  f"centralised {r['central_mean']:.4f} +- {r['central_sd']:.4f}: "
                  f"federated_minus_central_points {r['federated_minus_central_points']}")
    print(f"{'case':<24} {'rounds':>6} {'to target':>9} {'final acc':>9} {'vs ref (pts)':>12} {'seconds':>8}")
    for r in (r for r in rows if "final_accuracy" in r):
        gap = r.get("points_below_centralised", r.get("points_below_plain"))
        print(f"{r['case']:<24} {r.get('rounds_run', '-')!s:>6} {r.get('rounds_to_target') or '-'!s:>9} "
              f"{r['final_accuracy'] if r['final_accuracy'] is None else round(r['final_accuracy'], 4)!s:>9} "
              f"{'-' if gap is None else gap!s:>12} {r['seconds']:>8}")
    if a.json_path:
        with open(a.json_path, "w") as f:
            json.dump(rows, f, indent=2)


if __name__ == "__main__":
    main()
