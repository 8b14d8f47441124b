"""Model quality through the simulator (real trainer, codec, secure aggregation, tiers).

Cases (each with a round budget; pass more rounds for the full targets):

- ``mnist``: the MNIST CNN, Dirichlet(alpha=0.5) over 100 clients, 10 per round;
  rounds until 98% test accuracy (or ``--mnist-rounds``). Target: reach 98%.
- ``shakespeare``: federated FFA-LoRA on the pretrained character GPT, 10 roles per
  round; final accuracy against the centralised baseline
  (``orchard.tasks.baseline.run_baseline``). Target: within 2 accuracy points.
- ``shakespeare-secure``: the same with secure aggregation and an 8-bit codec (qsgd,
  fixed scale: linear in SecAgg's field). Target: at most 0.5 points below the plain
  federated run.

Prints rounds-to-target and final accuracy per case and writes ``--json PATH``.

    python benchmarks/quality.py [--cases mnist shakespeare shakespeare-secure]
        [--mnist-rounds 60] [--shakespeare-rounds 40] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

import torch

from orchard.config import RunConfig
from orchard.simulation import SimulationConfig, run_simulation
from orchard.tasks.baseline import run_baseline

ALWAYS_ON = {"gflops": 20.0, "battery": False, "availability": [1.0] * 24, "dropout": 0.0}


def _sim(run: dict[str, Any], clients: int, per_round: int, rounds: int, aggregators: int,
         evaluate_every: int) -> SimulationConfig:
    # Quality, not device behaviour, is measured here: devices that are always there, so
    # every round aggregates exactly ``per_round`` clients.
    run = {**run, "cohort": {"over_selection": 1.0, "min_fraction": 1.0, "deadline_s": 3600.0}}
    return SimulationConfig(clients=clients, clients_per_round=per_round, rounds=rounds, aggregators=aggregators,
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


def mnist(rounds: int, every: int) -> dict[str, Any]:
    t0 = time.perf_counter()
    run = {"task": "mnist", "task_params": {"alpha": 0.5},
           "train": {"epochs": 2, "batch_size": 32, "learning_rate": 0.1},
           "server_optimizer": {"name": "fedavgm", "lr": 1.0, "momentum": 0.9}}
    cfg = _sim(run, clients=100, per_round=10, rounds=rounds, aggregators=2, evaluate_every=every)
    rep = run_simulation(cfg, stop=lambda r: r.get("accuracy") is not None and r["accuracy"] >= 0.98)
    return _summary("mnist", rep, 0.98, t0)


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
    ap.add_argument("--mnist-rounds", type=int, default=60)
    ap.add_argument("--shakespeare-rounds", type=int, default=40)
    ap.add_argument("--baseline-steps", type=int, default=None, help="centralised baseline steps (recipe: 400)")
    ap.add_argument("--eval-every", type=int, default=5)
    ap.add_argument("--json", dest="json_path", default=None)
    a = ap.parse_args()
    torch.set_num_threads(1)
    rows: list[dict[str, Any]] = []
    baseline = None
    if "mnist" in a.cases:
        rows.append(mnist(a.mnist_rounds, a.eval_every))
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
    print(f"{'case':<24} {'rounds':>6} {'to target':>9} {'final acc':>9} {'vs ref (pts)':>12} {'seconds':>8}")
    for r in rows:
        gap = r.get("points_below_centralised", r.get("points_below_plain"))
        print(f"{r['case']:<24} {r.get('rounds_run', '-')!s:>6} {r.get('rounds_to_target') or '-'!s:>9} "
              f"{r['final_accuracy'] if r['final_accuracy'] is None else round(r['final_accuracy'], 4)!s:>9} "
              f"{'-' if gap is None else gap!s:>12} {r['seconds']:>8}")
    if a.json_path:
        with open(a.json_path, "w") as f:
            json.dump(rows, f, indent=2)


if __name__ == "__main__":
    main()
