"""One-shot empirical privacy estimation (Andrew, Kairouz, Oh, Oprea, McMahan and
Suriyakumar, 2023, "One-shot Empirical Privacy Estimation for Federated Learning"), run on
the simulator through the real code path.

A share of the population (``--canary-fraction``) are canary devices: each sends, instead
of its update, ``--clip`` times a random unit direction of the whole model drawn from the
seed and the device (``[simulation.attack] kind = "canary"``, ``orchard.simulation.canary``).
After training, the statistic is the cosine between the final model's change
``theta_T - theta_0`` and each canary's direction: for the canaries whose update was
folded into a round ("observed") and for as many directions of the same law that no
device sent ("unseen"; in high dimension their cosines are about N(0, 1/d)). A Gaussian
is fitted to each set, and the estimate is the epsilon at which those two Gaussians are
(epsilon, delta)-indistinguishable at ``--delta`` (default 1 / population), computed
numerically from their privacy profile (both directions, unequal variances allowed).
It is an estimate of what the final model reveals about one device, not a bound, and it
only sees the final model (the paper's one-shot setting), so it sits below what the
accountant charges for every release.

Cases, all clipped at ``--clip`` (``robust.norm_bound`` for the non-private run, the DP
clip for the others), the same seeds, population, canaries and rounds:

- **non-private**: clipping, no noise;
- **central DP** at ``--epsilon`` (every round charged as if every device took part);
- **DP-FTRL** at ``--epsilon`` (each device at most once: ``max_participations = 1``,
  ``min_separation`` = the rounds).

Prints a table; writes JSON with ``--json`` (``nonprivate_empirical_epsilon``,
``central_empirical_epsilon``, ``central_accounted_epsilon``, ``dpftrl_empirical_epsilon``,
``dpftrl_accounted_epsilon``, and each case's fits). ``--quick``: a few minutes on two
cores (the digits task).

    python benchmarks/privacy_audit.py [--rounds 20] [--per-round 10] [--population 2000]
                                       [--epsilon 8] [--seeds 0] [--json out.json] [--quick]
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import statistics
import time
from typing import Any

import numpy as np


def _delta_of(m0: float, s0: float, m1: float, s1: float, eps: float) -> float:
    """delta(eps) between N(m1, s1^2) and N(m0, s0^2), the larger of both directions
    (the privacy profile, integrated on a fine grid, in log space)."""
    lo, hi = min(m0, m1) - 40 * max(s0, s1), max(m0, m1) + 40 * max(s0, s1)
    x = np.linspace(lo, hi, 400_001)
    dx = x[1] - x[0]

    def logpdf(m: float, s: float) -> np.ndarray:
        return -0.5 * ((x - m) / s) ** 2 - math.log(s * math.sqrt(2 * math.pi))

    lp, lq = logpdf(m1, s1), logpdf(m0, s0)
    with np.errstate(over="ignore"):  # exp of a large loss: that point adds nothing (clipped to 0)
        one = float(np.sum(np.exp(lp) * np.clip(-np.expm1(eps + lq - lp), 0.0, None)) * dx)
        two = float(np.sum(np.exp(lq) * np.clip(-np.expm1(eps + lp - lq), 0.0, None)) * dx)
    return max(one, two)


def epsilon_of_gaussians(m0: float, s0: float, m1: float, s1: float, delta: float) -> float:
    """The smallest epsilon at which N(m0, s0^2) and N(m1, s1^2) are (epsilon, delta)-
    indistinguishable (bisection on the privacy profile; 0 when they already are at 0)."""
    if _delta_of(m0, s0, m1, s1, 0.0) <= delta:
        return 0.0
    lo, hi = 0.0, 1.0
    while _delta_of(m0, s0, m1, s1, hi) > delta:
        lo, hi = hi, 2 * hi
        if hi > 1e6:
            return math.inf
    while hi - lo > 1e-4 * hi:
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if _delta_of(m0, s0, m1, s1, mid) > delta else (lo, mid)
    return hi


def _cosines(delta: dict[str, np.ndarray], dirs: list[dict[str, np.ndarray]]) -> list[float]:
    norm = math.sqrt(sum(float(np.dot(v.ravel(), v.ravel())) for v in delta.values()))
    return [sum(float(np.dot(delta[k].ravel(), d[k].ravel())) for k in delta) / norm for d in dirs]


def _case(name: str, a: argparse.Namespace, seed: int, privacy: dict[str, Any] | None) -> dict[str, Any]:
    from orchard.simulation import SimulationConfig, canary, run_simulation
    from orchard.tasks import get_task

    run: dict[str, Any] = {"task": a.task, "task_params": {"with_replacement": True, "samples_per_client": 20},
                           "train": {"epochs": 1, "batch_size": 10, "learning_rate": 0.05},
                           "cohort": {"weighting": "uniform", "over_selection": 1.0},
                           "server_optimizer": {"name": "fedavgm", "lr": 1.0, "momentum": 0.9}}
    if privacy is None:
        run["robust"] = {"norm_bound": a.clip}
    else:
        run["privacy"] = {"clip_norm": a.clip, "delta": a.delta, "target_epsilon": a.epsilon, **privacy}
    cfg = SimulationConfig.model_validate(dict(
        clients=a.population, clients_per_round=a.per_round, rounds=a.rounds, aggregators=1, seed=seed,
        evaluate_every=0, progress=False, run=run,
        attack={"fraction": a.canary_fraction, "kind": "canary", "multiplier": a.clip}))
    t0 = time.perf_counter()
    rep = run_simulation(cfg)
    run_cfg = cfg.run_config()
    initial = get_task(run_cfg.task, **run_cfg.task_params).initial_arrays(run_cfg.seed)
    change = {k: np.asarray(rep.final_arrays[k], np.float64) - np.asarray(v, np.float64) for k, v in initial.items()}
    shapes = {k: np.shape(v) for k, v in initial.items()}
    observed = sorted(int(p) for p, n in (rep.canary_folds or {}).items() if n > 0)
    if len(observed) < 3:
        raise SystemExit(f"{name}: only {len(observed)} canaries were folded; raise --canary-fraction or --rounds")
    seen = _cosines(change, [canary.direction(shapes, seed, p) for p in observed])
    unseen = _cosines(change, [canary.unseen_direction(shapes, seed, k) for k in range(a.unseen)])
    m1, s1 = statistics.fmean(seen), statistics.stdev(seen)
    m0, s0 = statistics.fmean(unseen), statistics.stdev(unseen)
    return {"case": name, "seed": seed, "status": rep.status, "accuracy": rep.final_accuracy,
            "accounted_epsilon": rep.privacy["epsilon"] if rep.privacy else None,  # None: no guarantee
            "noise_multiplier": rep.privacy["noise_multiplier"] if rep.privacy else None,
            "empirical_epsilon": epsilon_of_gaussians(m0, s0, m1, s1, a.delta),
            "observed_canaries": len(observed), "unseen_directions": a.unseen,
            "observed_cosine": [m1, s1], "unseen_cosine": [m0, s0], "dimension": sum(math.prod(s) for s in shapes.values()),
            "seconds": round(time.perf_counter() - t0, 1)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--task", default="mnist")
    ap.add_argument("--population", type=int, default=2000)
    ap.add_argument("--per-round", type=int, default=10)
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--canary-fraction", type=float, default=0.25, help="share of the population that are canaries")
    ap.add_argument("--unseen", type=int, default=1000, help="directions no device sent")
    ap.add_argument("--clip", type=float, default=0.3, help="clip norm of every case, and each canary's norm")
    ap.add_argument("--epsilon", type=float, default=8.0, help="the private cases' target epsilon")
    ap.add_argument("--delta", type=float, default=None, help="default: 1 / population")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0])
    ap.add_argument("--threads", type=int, default=1, help="torch threads for the simulated training")
    ap.add_argument("--quick", action="store_true",
                    help="digits, 400 devices, 10 a round, 8 rounds, 300 unseen directions")
    ap.add_argument("--json", dest="json_path", default=None)
    a = ap.parse_args()
    logging.getLogger("absl").setLevel(logging.ERROR)
    import torch

    torch.set_num_threads(a.threads)
    if a.quick:
        a.task, a.population, a.rounds, a.per_round, a.unseen = "digits", 400, 8, 10, 300
    a.delta = a.delta if a.delta is not None else 1.0 / a.population
    load_before = os.getloadavg()
    plan: list[tuple[str, str, dict[str, Any] | None]] = [
        ("non-private", "nonprivate", None),
        (f"central DP eps={a.epsilon:g}", "central", {"mode": "central"}),
        (f"DP-FTRL eps={a.epsilon:g}", "dpftrl", {"mode": "dpftrl", "max_participations": 1,
                                                  "min_separation": a.rounds})]
    out: dict[str, Any] = {"task": a.task, "population": a.population, "per_round": a.per_round, "rounds": a.rounds,
                           "canary_fraction": a.canary_fraction, "clip": a.clip, "delta": a.delta,
                           "target_epsilon": a.epsilon, "seeds": a.seeds, "cases": []}
    for name, key, privacy in plan:
        runs = [_case(name, a, seed, privacy) for seed in a.seeds]
        for r in runs:
            print(f"  {name}, seed {r['seed']}: empirical epsilon {r['empirical_epsilon']:.3f}, accounted "
                  f"{r['accounted_epsilon']}, {r['observed_canaries']} canaries observed, {r['seconds']} s", flush=True)
        emp = statistics.fmean(r["empirical_epsilon"] for r in runs)
        out[f"{key}_empirical_epsilon"] = emp
        out[f"{key}_empirical_epsilon_per_seed"] = [r["empirical_epsilon"] for r in runs]
        if key != "nonprivate":
            out[f"{key}_accounted_epsilon"] = max(r["accounted_epsilon"] for r in runs)
        out["cases"] += runs
    out["load_average"] = {"before": list(load_before), "now": list(os.getloadavg())}
    print(f"\n{a.task}, population {a.population}, {a.per_round} a round, {a.rounds} rounds, clip {a.clip}, "
          f"delta {a.delta:.3g}, canaries {a.canary_fraction:g} of the population, seeds {a.seeds}")
    print(f"{'case':<22} {'accounted eps':>13} {'empirical eps':>13} {'observed':>9} {'cos observed':>22} "
          f"{'cos unseen':>22} {'accuracy':>9}")
    for r in out["cases"]:
        acc = "inf" if r["accounted_epsilon"] is None else f"{r['accounted_epsilon']:.3f}"
        print(f"{r['case']:<22} {acc:>13} {r['empirical_epsilon']:>13.3f} "
              f"{r['observed_canaries']:>9} {r['observed_cosine'][0]:>+11.5f} ± {r['observed_cosine'][1]:.5f} "
              f"{r['unseen_cosine'][0]:>+11.5f} ± {r['unseen_cosine'][1]:.5f} {100 * (r['accuracy'] or 0):>8.2f}")
    print(f"load average {load_before[0]:.2f} before, {out['load_average']['now'][0]:.2f} after")
    if a.json_path:
        with open(a.json_path, "w") as fh:
            json.dump(out, fh, indent=2, allow_nan=False)


if __name__ == "__main__":
    main()
