"""Buffered asynchronous aggregation (FedBuff) against the best synchronous closing policy.

Every run goes through the simulator (the real trainer, codec and root coordinator, on
the virtual clock) over the same **correlated** population: ``--clients`` devices
(default 10,000) of the default device kinds (low-end phones, high-end phones, edge
boxes, with their links, battery and heat), whose phones are split into ``--regions``
regions. A kind's availability is an hourly curve (phones mostly online overnight, on
the charger), so devices of one kind and region come and go together with the time of
day; region ``r``'s curve is the kind's shifted by ``r x 24 / regions`` hours (another
time zone). Round 1 starts at ``--start-hour`` local time of region 0. Digits MLP,
with-replacement client data.

Each seed runs, to the same fixed ``--target-accuracy``:

1. **sync**, once per closing policy in :data:`SYNC_POLICIES` (the ``[run.cohort]``
   knobs a synchronous round closes by: ``over_selection``, ``deadline_s`` and
   ``min_fraction``), ``--target`` clients a round, until the target accuracy (or
   ``--max-rounds``). The best policy of the seed is the one that reached the target in
   the least simulated time (:func:`best_sync`).
2. **async**, once per ``--concurrency`` (clients training at once; default
   ``ceil(target x 1.3)``, what the 1.3 sync round selects): buffers of ``--buffer``
   updates, staleness at most ``--max-staleness``, weighted ``(1 + s) ** -0.5``, until
   the target accuracy (or ``--max-versions``). The best of the seed is the fastest.

Reports the simulated wall-clock time each needs to reach the target (the sum of its
rounds' or buffers' simulated seconds; no idle gap between rounds in either), the ratio
best async / best sync per seed and its worst over the seeds as
``async_vs_best_sync_time_ratio`` (target: <= 0.5), the client updates each folded and
trained, and the async runs' staleness. Prints a table and writes ``--json PATH``.

    python benchmarks/async.py [--seeds 0 1 2 3 4] [--clients 10000] [--target 50]
        [--target-accuracy 0.85] [--max-rounds 80] [--buffer 10] [--max-staleness 10]
        [--concurrency 65 100] [--regions 2] [--start-hour 21] [--json PATH]
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
from orchard.simulation.config import DEFAULT_MIX, DEFAULT_PROFILES

DIGITS = {"with_replacement": True, "samples_per_client": 32}
# The synchronous closing policies compared: a round selects ceil(target x over_selection),
# closes at the target, when every selected client settled, or at deadline_s, and fails
# (and is retried) below ceil(target x min_fraction) updates.
SYNC_POLICIES: dict[str, dict[str, float]] = {
    "over-selection 1.0": {"over_selection": 1.0, "min_fraction": 0.5, "deadline_s": 600.0},
    "over-selection 1.3": {"over_selection": 1.3, "min_fraction": 0.5, "deadline_s": 600.0},
    "over-selection 2.0": {"over_selection": 2.0, "min_fraction": 0.5, "deadline_s": 600.0},
    "over-selection 3.0": {"over_selection": 3.0, "min_fraction": 0.5, "deadline_s": 600.0},
    "over-selection 1.3, deadline 0.5 s": {"over_selection": 1.3, "min_fraction": 0.5, "deadline_s": 0.5},
    "over-selection 2.0, deadline 0.15 s": {"over_selection": 2.0, "min_fraction": 0.5, "deadline_s": 0.15},
}
ASYNC_CONCURRENCY_FACTOR = 1.3


def correlated_population(regions: int) -> tuple[dict[str, Any], dict[str, float]]:
    """(profiles, mix): the default kinds, each battery-powered kind split into ``regions``
    copies whose hourly availability is shifted by ``24 / regions`` hours per region."""
    if regions < 1 or 24 % regions:
        raise ValueError(f"--regions must divide 24 (1, 2, 3, 4, 6, ...), got {regions}")
    profiles: dict[str, Any] = {}
    mix: dict[str, float] = {}
    for kind, share in DEFAULT_MIX.items():
        prof = DEFAULT_PROFILES[kind]
        if not prof.battery or regions == 1:
            profiles[kind], mix[kind] = prof, share
            continue
        shift = 24 // regions
        for r in range(regions):
            # Region r's local hour h is region 0's hour h - r * shift.
            hours = [prof.availability[(h - r * shift) % 24] for h in range(24)]
            profiles[f"{kind}-r{r}"] = prof.model_copy(update={"availability": hours})
            mix[f"{kind}-r{r}"] = share / regions
    return profiles, mix


def best_sync(rows: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The row (a sync policy, or an async concurrency) that reached the target in the least
    simulated time; None if none did."""
    reached = [r for r in rows if r.get("to_target")]
    return min(reached, key=lambda r: r["to_target"]["simulated_s"], default=None)


def time_ratio(async_row: dict[str, Any], sync_row: dict[str, Any] | None) -> float | None:
    """Async simulated seconds to target over the best sync's; None unless both reached it."""
    if sync_row is None or not async_row.get("to_target") or not sync_row.get("to_target"):
        return None
    return async_row["to_target"]["simulated_s"] / sync_row["to_target"]["simulated_s"]


def _config(a: argparse.Namespace, seed: int, cohort: dict[str, float], mode: dict[str, Any],
            rounds: int) -> SimulationConfig:
    run = RunConfig.model_validate({
        "task": "digits", "task_params": DIGITS,
        "train": {"epochs": 2, "batch_size": 16, "learning_rate": 0.1},
        "cohort": cohort, "mode": mode,
    })
    profiles, mix = correlated_population(a.regions)
    return SimulationConfig(clients=a.clients, clients_per_round=a.target, rounds=rounds, seed=seed,
                            progress=False, round_gap_s=0.0, start_hour=a.start_hour,
                            profiles=profiles, devices=mix, run=run)


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


def _reached(target: float) -> Any:
    return lambda row: row.get("accuracy") is not None and row["accuracy"] >= target


def run_seed(a: argparse.Namespace, seed: int) -> dict[str, Any]:
    sync_rows = []
    for name, cohort in SYNC_POLICIES.items():
        t0 = time.perf_counter()
        rep = run_simulation(_config(a, seed, cohort, {}, a.max_rounds), stop=_reached(a.target_accuracy))
        sync_rows.append({**_summary(f"sync: {name}", rep, a.target_accuracy, time.perf_counter() - t0),
                          "cohort": cohort})
    async_rows = []
    mode = {"kind": "async", "buffer_size": a.buffer, "max_staleness": a.max_staleness, "staleness": "polynomial"}
    for concurrency in a.concurrency or [math.ceil(a.target * ASYNC_CONCURRENCY_FACTOR)]:
        # cohort.over_selection is the concurrency in async mode: ceil(buffer x over_selection).
        cohort = {"over_selection": concurrency / a.buffer, "min_fraction": 0.5, "deadline_s": 600.0}
        t0 = time.perf_counter()
        rep = run_simulation(_config(a, seed, cohort, mode, a.max_versions), stop=_reached(a.target_accuracy))
        async_rows.append({**_summary(f"async: concurrency {concurrency}", rep, a.target_accuracy,
                                      time.perf_counter() - t0), "concurrency": concurrency})
    best, best_async = best_sync(sync_rows), best_sync(async_rows)
    return {"seed": seed, "sync": sync_rows, "async": async_rows, "best_sync": best["mode"] if best else None,
            "best_async": best_async["mode"] if best_async else None,
            "ratio": time_ratio(best_async or async_rows[0], best)}


def _print_seed(row: dict[str, Any]) -> None:
    print(f"seed {row['seed']}")
    print(f"  {'mode':42} {'versions':>8} {'sim s to target':>16} {'updates folded':>15} {'clients trained':>16} "
          f"{'staleness p50/p90/max':>22}")
    for r in (*row["sync"], *row["async"]):
        hit = r["to_target"] or {}
        stale = (f"{r['staleness_p50']:.0f}/{r['staleness_p90']:.0f}/{r['staleness_max']}"
                 if r["staleness"] else "-")
        print(f"  {r['mode']:42} {hit.get('versions', '-')!s:>8} {hit.get('simulated_s', float('nan')):>16.1f} "
              f"{hit.get('updates_folded', '-')!s:>15} {hit.get('clients_trained', '-')!s:>16} {stale:>22}")
    ratio = row["ratio"]
    print(f"  best async ({row['best_async']}) / best sync ({row['best_sync']}): {ratio:.3f}" if ratio is not None
          else "  no ratio: async or every sync policy missed the target accuracy", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4])
    ap.add_argument("--clients", type=int, default=10_000)
    ap.add_argument("--target", type=int, default=50, help="clients a sync round aggregates")
    ap.add_argument("--target-accuracy", type=float, default=0.85)
    ap.add_argument("--max-rounds", type=int, default=80)
    ap.add_argument("--buffer", type=int, default=10)
    ap.add_argument("--max-staleness", type=int, default=10)
    ap.add_argument("--concurrency", type=int, nargs="+", default=None,
                    help="async clients training at once, one run each (default: ceil(target x 1.3))")
    ap.add_argument("--max-versions", type=int, default=1000)
    ap.add_argument("--regions", type=int, default=2)
    ap.add_argument("--start-hour", type=float, default=21.0)
    ap.add_argument("--json", dest="json_path", default=None)
    a = ap.parse_args()
    correlated_population(a.regions)  # refuse a bad --regions before any run
    too_many = [c for c in a.concurrency or [] if not a.buffer <= c <= 10 * a.buffer]
    if too_many:  # cohort.over_selection (concurrency / buffer) lies in [1, 10]
        ap.error(f"--concurrency {too_many} must lie between --buffer and 10 x --buffer ({a.buffer}..{10 * a.buffer})")

    print(f"digits, {a.clients:,} devices (default kinds, phones in {a.regions} regions, start "
          f"{a.start_hour:g}:00), {a.target} per sync round, async K={a.buffer} S={a.max_staleness}; "
          f"target accuracy {a.target_accuracy}", flush=True)
    seeds = []
    for seed in a.seeds:
        seeds.append(run_seed(a, seed))
        _print_seed(seeds[-1])
    ratios = [s["ratio"] for s in seeds]
    worst = None if any(r is None for r in ratios) else max(ratios)
    print(f"async / best sync per seed: {ratios}; worst {worst} (target <= 0.5)")
    if a.json_path:
        with open(a.json_path, "w") as f:
            json.dump({"config": vars(a), "sync_policies": SYNC_POLICIES, "async_vs_best_sync_time_ratio": worst,
                       "ratios": ratios, "seeds": seeds}, f, indent=2)


if __name__ == "__main__":
    main()
