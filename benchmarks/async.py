"""Buffered asynchronous aggregation (FedBuff) against synchronous rounds, in one run.

Both runs go through the simulator (the real trainer, codec and root coordinator, on the
virtual clock) over the same population: ``--clients`` devices (default 10,000) of the
default device mix (low-end phones, high-end phones, edge boxes, with their
availability, links, battery and heat), digits MLP, with-replacement client data.

1. **sync**: ``--rounds`` rounds of ``--target`` clients (over-selected by
   ``--over-selection``); its final accuracy is the target.
2. **async**: buffers of ``--buffer`` updates, the same number of clients training at
   once (``ceil(target x over_selection)``), staleness at most ``--max-staleness``,
   weighted ``(1 + s) ** -0.5``; it runs until it reaches the sync run's final accuracy
   (or ``--max-versions``).

Reports the simulated wall-clock time each needs to reach that accuracy (the sum of
its rounds' or buffers' simulated seconds; no idle gap between rounds in either), their
ratio (target: async <= 0.5x sync), the client updates each folded and trained, and the
async run's staleness distribution. Prints a table and writes ``--json PATH``.

    python benchmarks/async.py [--clients 10000] [--rounds 30] [--target 50] [--buffer 10]
        [--max-staleness 10] [--seed 0] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import math
import time
from typing import Any

from orchard.aggregation.staleness import histogram_quantile, merge_histograms
from orchard.config import RunConfig
from orchard.simulation import SimulationConfig, run_simulation

DIGITS = {"with_replacement": True, "samples_per_client": 32}


def _config(a: argparse.Namespace, mode: dict[str, Any], rounds: int) -> SimulationConfig:
    run = RunConfig.model_validate({
        "task": "digits", "task_params": DIGITS,
        "train": {"epochs": 2, "batch_size": 16, "learning_rate": 0.1},
        "cohort": {"over_selection": a.over_selection, "min_fraction": 0.5, "deadline_s": 600.0},
        "mode": mode,
    })
    return SimulationConfig(clients=a.clients, clients_per_round=a.target, rounds=rounds, seed=a.seed,
                            progress=False, round_gap_s=0.0, run=run)


def _summary(name: str, rep: Any, target_acc: float | None, wall_s: float) -> dict[str, Any]:
    elapsed, hit, used, trained = 0.0, None, 0, 0
    hist: dict[int, int] = {}
    for r in rep.rounds:
        elapsed += r.get("simulated_seconds", 0.0)
        used += r.get("participants", 0)
        trained += r.get("trained", 0)
        hist = merge_histograms(hist, {int(k): v for k, v in r.get("staleness", {}).items()})
        acc = r.get("accuracy")
        if hit is None and target_acc is not None and acc is not None and acc >= target_acc:
            hit = {"simulated_s": round(elapsed, 3), "versions": r["round"], "updates_folded": used,
                   "clients_trained": trained}
    return {"mode": name, "versions": len(rep.rounds), "final_accuracy": rep.final_accuracy,
            "simulated_s": round(elapsed, 3), "updates_folded": used, "clients_trained": trained,
            "to_target": hit, "staleness": {str(k): v for k, v in hist.items()},
            "staleness_p50": histogram_quantile(hist, 0.5), "staleness_p90": histogram_quantile(hist, 0.9),
            "staleness_max": max(hist) if hist else None, "status": rep.status, "host_seconds": round(wall_s, 1)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--clients", type=int, default=10_000)
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--target", type=int, default=50)
    ap.add_argument("--over-selection", type=float, default=1.3)
    ap.add_argument("--buffer", type=int, default=10)
    ap.add_argument("--max-staleness", type=int, default=10)
    ap.add_argument("--max-versions", type=int, default=None, help="default: 20 x --rounds")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", dest="json_path", default=None)
    a = ap.parse_args()

    t0 = time.perf_counter()
    sync = run_simulation(_config(a, {}, a.rounds))
    sync_row = _summary("sync", sync, sync.final_accuracy, time.perf_counter() - t0)
    target_acc = sync.final_accuracy
    assert target_acc is not None
    # The same clients training at once as the sync round selects: ceil(target x over_selection).
    concurrency = math.ceil(a.target * a.over_selection)
    mode = {"kind": "async", "buffer_size": a.buffer, "max_staleness": a.max_staleness, "staleness": "polynomial"}
    async_cfg = _config(a, mode, a.max_versions or 20 * a.rounds)
    async_cfg = async_cfg.model_copy(update={"run": async_cfg.run.model_copy(update={
        "cohort": async_cfg.run.cohort.model_copy(update={"over_selection": concurrency / a.buffer})})})
    t0 = time.perf_counter()
    asyn = run_simulation(async_cfg, stop=lambda row: row.get("accuracy") is not None
                          and row["accuracy"] >= target_acc)
    async_row = _summary("async", asyn, target_acc, time.perf_counter() - t0)

    s_hit, a_hit = sync_row["to_target"], async_row["to_target"]
    ratio = a_hit["simulated_s"] / s_hit["simulated_s"] if s_hit and a_hit else None
    print(f"digits, {a.clients:,} devices (default mix), {a.target} per sync round "
          f"(over-selection {a.over_selection}), async K={a.buffer} S={a.max_staleness} concurrency {concurrency}; "
          f"target accuracy = sync final {target_acc:.4f}")
    print(f"{'mode':6} {'versions':>8} {'sim s to target':>16} {'updates folded':>15} {'clients trained':>16} "
          f"{'staleness p50/p90/max':>22}")
    for row in (sync_row, async_row):
        hit = row["to_target"] or {}
        stale = (f"{row['staleness_p50']:.0f}/{row['staleness_p90']:.0f}/{row['staleness_max']}"
                 if row["staleness"] else "-")
        print(f"{row['mode']:6} {hit.get('versions', '-')!s:>8} {hit.get('simulated_s', float('nan')):>16.1f} "
              f"{hit.get('updates_folded', '-')!s:>15} {hit.get('clients_trained', '-')!s:>16} {stale:>22}")
    print(f"async / sync simulated time to target: {ratio:.3f} (target <= 0.5)" if ratio is not None
          else "async did not reach the target accuracy")
    print(f"async staleness distribution: {async_row['staleness']}")
    if a.json_path:
        with open(a.json_path, "w") as f:
            json.dump({"config": vars(a), "target_accuracy": target_acc, "ratio": ratio, "concurrency": concurrency,
                       "sync": sync_row, "async": async_row}, f, indent=2)


if __name__ == "__main__":
    main()
