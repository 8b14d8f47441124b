"""Differential privacy and robustness, measured in simulation through the real code.

Simulated MNIST (the shipped 10,000 training images, 20 drawn with replacement per
client), a 10,000-device population, 100 clients per round, uniform weighting, the same
rounds for every case. No over-selection by default (``--over-selection``): a plain round
folds its first ``target`` arrivals but a secure cohort sums every masked input, so with
over-selection the secure and distributed cases would sum more clients than the plain
and central ones, and the comparison would measure cohort size, not DP. The accountant claims no
amplification by sampling: every round is charged as if every device took part, under
replace-one adjacency (``orchard.aggregation.accounting``). Cases, all in one
invocation:

- **non-private**: the baseline every accuracy is compared with (epsilon = infinity);
- **central DP** at each target epsilon (delta 1e-5 over the run): clipping at the
  lowest tier, Gaussian noise at the root, the noise multiplier from dp-accounting's RDP
  accountant;
- **DP-FTRL** at each target epsilon (``privacy.mode = "dpftrl"``): the same clipping,
  tree-aggregated noise at the root (Kairouz et al. 2021), each device selected at most
  ``--max-participations`` times, ``--min-separation`` rounds apart (default: the run's
  rounds, so once), which the selection enforces on the simulator's availability model
  (a device online but past its bound is not checked in); accounted as one Gaussian
  mechanism over the tree's nodes (``orchard.aggregation.ftrl``). Its test
  (``tests/simulation/test_privacy_benchmark.py``) recomputes the epsilon the ledger
  reports with a reference implementation. Its epsilon does not depend on how many
  clients a round sums (the bound is per device), while the noise relative to the mean
  update falls with them: its figure runs ``--population 100000 --per-round 500``
  (each device at most once: 20,000 of them over 40 rounds; delta 1e-5 = 1 / population);
- **secure aggregation, no DP**, and **distributed DP** at each target epsilon: SecAgg+
  with each client's share of discrete Gaussian noise (the cost of DP is read against
  the secure run: same transport). ``--scope tree`` (the default) runs one session per
  round over every selected client, owned by the root, with the aggregators relaying:
  one noise serves the round, as central DP's does. One more case at the smallest
  epsilon runs the other scope (``cohort``: a session per aggregator, each cohort sum
  carrying the whole noise, so k cohorts put k noises into the root's sum). Each noise
  share is sized for ``(1 - --dropout-rate)`` of the session's clients (default 0.1,
  Orchard's default tolerance; the population's real dropout is a few percent a round);
- **robustness**: 10% of devices send their update scaled by 100, or sign-flipped, each
  with no defence, with norm bounding (robust.norm_bound, which also works under secure
  aggregation), and with the coordinate-wise trimmed mean and median of each lowest
  tier's cohort (plain cohorts only). These run for ``--robust-rounds`` (100 by default)
  and are read against their own clean run of that length: the claim is about the
  *final* accuracy, and sign-flipped updates of ordinary norm (the sum keeps about 0.8 of
  the honest direction) slow training rather than derail it, so a run stopped well
  before convergence measures the slowdown, not where the run ends.

Every case runs once per seed (``--seeds``: the population, data, attackers and
training all follow the seed); the table shows the mean over seeds with its spread
(sample standard deviation), and every difference is taken between means, and again
paired by seed. For each: final test accuracy, its difference from its reference (the
non-private run, or for the robustness cases the clean run of their length), epsilon spent, wall
seconds per round, upload bytes per round, CPU seconds of the whole run; and the ratios
DP on / off for time and bytes. Prints a table, writes JSON with --json.

    python benchmarks/privacy.py [--rounds 30] [--robust-rounds 100] [--seeds 0 1 2] [--epsilons 1 4 8]
                                 [--only CASE ...] [--json out.json] [--quick]
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import time
from typing import Any

BASE_TRAIN = {"epochs": 1, "batch_size": 10, "learning_rate": 0.05}


def _case(task: str, rounds: int, population: int, per_round: int, aggregators: int, *, privacy: dict | None = None,
          secure: bool = False, robust: dict | None = None, attack: dict | None = None,
          clip: float = 0.1, seed: int = 0, dropout_rate: float = 0.1, eval_every: int = 0,
          over_selection: float = 1.0, scope: str = "tree") -> dict[str, Any]:
    from orchard.simulation import SimulationConfig, run_simulation

    run: dict[str, Any] = {"task": task, "task_params": {"with_replacement": True, "samples_per_client": 20},
                           "train": BASE_TRAIN, "cohort": {"weighting": "uniform", "over_selection": over_selection},
                           "server_optimizer": {"name": "fedavgm", "lr": 1.0, "momentum": 0.9}}
    if privacy is not None:
        run["privacy"] = {"clip_norm": clip, "delta": 1e-5, **privacy}
    if secure:
        # Phones drop out: the session tolerates dropout_rate of its clients going silent,
        # and distributed DP sizes every noise share for the rest.
        run["secure_aggregation"] = {"enabled": True, "dropout_rate": dropout_rate, "modulus_bits": 32,
                                     "scope": scope}
    if robust is not None:
        run["robust"] = robust
    cfg = SimulationConfig.model_validate(dict(
        clients=population, clients_per_round=per_round, rounds=rounds, aggregators=aggregators, seed=seed,
        evaluate_every=eval_every, progress=False, run=run, **({"attack": attack} if attack else {})))
    t0, c0 = time.perf_counter(), time.process_time()
    rep = run_simulation(cfg)
    done = rep.rounds
    return {
        "status": rep.status,
        "accuracy": rep.final_accuracy,
        "rounds": len(done),
        # Test accuracy after every ``eval_every``-th round and the last (evaluation draws
        # no randomness: the run is the same with or without it).
        "accuracy_by_round": {r["round"]: r["accuracy"] for r in done if r.get("accuracy") is not None},
        "epsilon": rep.privacy["epsilon"] if rep.privacy else None,
        "noise_multiplier": rep.privacy["noise_multiplier"] if rep.privacy else None,
        # The delta the run reports with its epsilon (distributed DP: clamped noise shares included).
        "delta": rep.privacy["delta"] if rep.privacy else None,
        # What an independent recomputation of epsilon needs: the attempts charged and the
        # run's privacy table as the ledger read it.
        "rounds_charged": rep.privacy["rounds_charged"] if rep.privacy else None,
        "privacy_config": cfg.run.privacy.model_dump() if privacy is not None else None,
        "seconds_per_round": round(sum(r["seconds"] for r in done) / max(1, len(done)), 3),
        "bytes_up_per_round": round(sum(r["bytes_up"] for r in done) / max(1, len(done))),
        "participants_per_round": round(sum(r["participants"] for r in done) / max(1, len(done)), 1),
        "total_seconds": round(time.perf_counter() - t0, 1),
        "total_cpu_seconds": round(time.process_time() - c0, 1),
    }


MEASURES = ("accuracy", "epsilon", "noise_multiplier", "seconds_per_round", "bytes_up_per_round",
            "participants_per_round", "total_seconds", "total_cpu_seconds")


def _mean_over_seeds(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Each measure's mean over the seeds' runs, and the accuracy's spread (sample
    standard deviation; 0 with one seed) and range."""
    out: dict[str, Any] = {"status": sorted({r["status"] for r in runs}), "rounds": min(r["rounds"] for r in runs)}
    for k in MEASURES:
        vals = [r[k] for r in runs if r[k] is not None]
        out[k] = None if not vals else round(statistics.fmean(vals), 4 if k == "accuracy" else 3)
    acc = [r["accuracy"] for r in runs if r["accuracy"] is not None]
    out["accuracy_spread"] = round(statistics.stdev(acc), 4) if len(acc) > 1 else 0.0
    out["accuracy_range"] = [min(acc), max(acc)] if acc else None
    out["per_seed"] = runs
    return out


def _paired(r: dict[str, Any], ref: dict[str, Any], after: int | None = None) -> list[float] | None:
    """Mean and sample stddev over the seeds both ran of ``r``'s final accuracy minus
    ``ref``'s (or their accuracies after round ``after``, where both were tested then)."""
    def acc(x: dict[str, Any]) -> float | None:
        return x["accuracy"] if after is None else x["accuracy_by_round"].get(after)

    mine = {x["seed"]: acc(x) for x in r["per_seed"] if acc(x) is not None}
    theirs = {x["seed"]: acc(x) for x in ref["per_seed"] if acc(x) is not None}
    diffs = [mine[k] - theirs[k] for k in sorted(mine.keys() & theirs.keys())]
    if not diffs:
        return None
    return [round(statistics.fmean(diffs), 4), round(statistics.stdev(diffs), 4) if len(diffs) > 1 else 0.0]


def _pm(v: list[float] | None) -> str:
    return "-" if v is None else f"{100 * v[0]:+.2f} ± {100 * v[1]:.2f}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--task", default="mnist")
    ap.add_argument("--rounds", type=int, default=30, help="rounds of the non-private, DP and secure cases")
    ap.add_argument("--robust-rounds", type=int, default=100,
                    help="rounds of the robustness cases and of the clean run they are read against")
    ap.add_argument("--eval-every", type=int, default=0,
                    help="also test the model after every N-th round (0: only the final model); the attacks' gap "
                         "to their clean run is then shown at each of those rounds")
    ap.add_argument("--population", type=int, default=10_000)
    ap.add_argument("--per-round", type=int, default=100)
    ap.add_argument("--aggregators", type=int, default=2)
    ap.add_argument("--seeds", type=int, nargs="+", default=[0], help="one run of every case per seed")
    ap.add_argument("--epsilons", type=float, nargs="*", default=[1.0, 4.0, 8.0])
    ap.add_argument("--max-participations", type=int, default=1, help="DP-FTRL: rounds a device may take part in")
    ap.add_argument("--min-separation", type=int, default=None,
                    help="DP-FTRL: rounds between a device's participations (default: the run's rounds)")
    ap.add_argument("--restart-every", type=int, default=None, help="DP-FTRL: leaves per tree (default: one tree)")
    ap.add_argument("--clip", type=float, default=0.1, help="L2 clip norm (DP) and norm bound (robustness)")
    ap.add_argument("--dropout-rate", type=float, default=0.1,
                    help="secure aggregation's dropout tolerance: distributed DP sizes each noise share for "
                         "(1 - rate) of the session")
    ap.add_argument("--scope", choices=("tree", "cohort"), default="tree",
                    help="secure aggregation's scope for the secure and distributed cases: one session per round "
                         "at the root (tree), or one per aggregator's cohort; one case runs the other")
    ap.add_argument("--over-selection", type=float, default=1.0,
                    help="devices selected per round over the target (default 1.0: every case sums the same "
                         "clients). A plain round folds its first target arrivals and a secure cohort every "
                         "masked input, so above 1 the secure cases sum more clients than the plain ones")
    ap.add_argument("--no-scope-case", action="store_true", help="skip the case that runs the other scope")
    ap.add_argument("--trim-fraction", type=float, default=0.2, help="trimmed mean: the share cut at each end")
    ap.add_argument("--no-robustness", action="store_true")
    ap.add_argument("--only", nargs="*", default=None, help="run only the cases whose name contains one of these")
    ap.add_argument("--threads", type=int, default=1, help="torch threads for the simulated training")
    ap.add_argument("--quick", action="store_true", help="digits, 1,000 devices, 50 per round, 8 rounds")
    ap.add_argument("--json", dest="json_path", default=None)
    a = ap.parse_args()
    logging.getLogger("absl").setLevel(logging.ERROR)  # the accountant's convergence chatter
    import torch

    # One thread, as benchmarks/simulation.py: the vectorised training is small, and on a
    # shared host two spinning OpenMP threads cost several times the CPU (and wall) of one.
    torch.set_num_threads(a.threads)
    if a.quick:
        a.task, a.population, a.per_round, a.rounds, a.robust_rounds, a.epsilons = "digits", 1000, 50, 8, 8, [8.0]
    load_before = os.getloadavg()
    common = dict(task=a.task, rounds=a.rounds, population=a.population, per_round=a.per_round,
                  aggregators=a.aggregators, clip=a.clip, dropout_rate=a.dropout_rate, eval_every=a.eval_every,
                  over_selection=a.over_selection, scope=a.scope)
    # (name, kind, target epsilon, the case's arguments, the case its accuracy is read against)
    plan: list[tuple[str, str, float | None, dict[str, Any], str]] = [("non-private", "baseline", None, {}, "")]
    plan += [(f"central DP eps={eps:g}", "central", eps, {"privacy": {"mode": "central", "target_epsilon": eps}},
              "non-private") for eps in a.epsilons]
    ftrl = {"mode": "dpftrl", "max_participations": a.max_participations,
            "min_separation": a.min_separation or a.rounds, "restart_every": a.restart_every}
    plan += [(f"DP-FTRL eps={eps:g}", "dpftrl", eps, {"privacy": {**ftrl, "target_epsilon": eps}}, "non-private")
             for eps in a.epsilons]
    plan.append(("secure, no DP", "secure", None, {"secure": True}, "non-private"))
    plan += [(f"distributed DP eps={eps:g}", "distributed", eps,
              {"secure": True, "privacy": {"mode": "distributed", "target_epsilon": eps}}, "non-private")
             for eps in a.epsilons]
    if a.epsilons and a.aggregators and not a.no_scope_case:
        # The other scope at the smallest epsilon. With a session per cohort, every cohort
        # sum must carry the whole noise (no tier is trusted), so a tree of k cohorts
        # releases k times the noise central DP adds once; one session over the tree does not.
        eps = min(a.epsilons)
        other = "cohort" if a.scope == "tree" else "tree"
        plan.append((f"distributed DP eps={eps:g}, scope {other}", "distributed", eps,
                     {"secure": True, "scope": other, "privacy": {"mode": "distributed", "target_epsilon": eps}},
                     "non-private"))
    if not a.no_robustness:
        defences: list[tuple[str, dict[str, Any] | None]] = [
            ("no defence", None), ("norm bound", {"norm_bound": a.clip}),
            ("trimmed mean", {"statistic": "trimmed_mean", "trim_fraction": a.trim_fraction}),
            ("median", {"statistic": "median"})]
        # The attacks' clean reference: same length, same seeds (so the same population,
        # data and client draws), no attackers, no defence.
        clean = "non-private"
        if a.robust_rounds != a.rounds:
            clean = f"no attack, {a.robust_rounds} rounds"
            plan.append((clean, "baseline", None, {"rounds": a.robust_rounds}, ""))
        for kind in ("scale", "sign_flip"):
            plan += [(f"10% {kind}, {name}", "attack", None,
                      {"rounds": a.robust_rounds, "attack": {"fraction": 0.1, "kind": kind},
                       **({"robust": robust} if robust else {})}, clean)
                     for name, robust in defences]
    if a.only:  # and the references they are read against
        wanted = [c for c in plan if any(o in c[0] for o in a.only)]
        refs = {c[4] for c in wanted} | ({"secure, no DP"} if any(c[1] == "distributed" for c in wanted) else set())
        plan = [c for c in plan if c in wanted or c[0] in refs]
    rows: list[dict[str, Any]] = []

    def write(rows: list[dict[str, Any]], complete: bool) -> None:
        if not a.json_path:
            return
        with open(a.json_path, "w") as fh:
            json.dump({"task": a.task, "population": a.population, "per_round": a.per_round, "rounds": a.rounds,
                       "robust_rounds": a.robust_rounds, "eval_every": a.eval_every,
                       "aggregators": a.aggregators, "clip": a.clip, "delta": 1e-5, "seeds": a.seeds,
                       "dropout_rate": a.dropout_rate, "max_participations": a.max_participations,
                       "min_separation": a.min_separation or a.rounds, "restart_every": a.restart_every, "scope": a.scope, "over_selection": a.over_selection, "trim_fraction": a.trim_fraction, "complete": complete,
                       "cases": rows, "load_average": {"before": list(load_before), "now": list(os.getloadavg())}},
                      fh, indent=2)

    for name, kind, target, kw, ref_name in plan:
        runs = []
        for seed in a.seeds:
            r = _case(**{**common, **kw}, seed=seed)  # type: ignore[arg-type]
            runs.append({"seed": seed, **r})
            print(f"  {name}, seed {seed}: accuracy {r['accuracy']}, epsilon {r['epsilon']}, "
                  f"{r['seconds_per_round']} s/round, {r['total_cpu_seconds']} CPU s in {r['total_seconds']} s",
                  flush=True)
        rows.append({"case": name, "kind": kind, "target_epsilon": target, "reference": ref_name or None,
                     **_mean_over_seeds(runs)})
        write(rows, complete=False)  # what is done survives an interrupted run
    by_name = {r["case"]: r for r in rows}
    secure = by_name.get("secure, no DP")
    for r in rows:
        base = by_name.get(r["reference"]) if r["reference"] else None
        r["accuracy_minus_reference"] = (None if r["accuracy"] is None or base is None or base["accuracy"] is None
                                         else round(r["accuracy"] - base["accuracy"], 4))
        # The other scope's costs are not comparable with this scope's secure run: no ratios.
        ref = None if ", scope " in r["case"] else secure if r["kind"] == "distributed" else base
        for k, out in (("seconds_per_round", "time_vs_off"), ("bytes_up_per_round", "bytes_vs_off"),
                       ("total_cpu_seconds", "cpu_vs_off")):
            r[out] = round(r[k] / ref[k], 3) if ref is not None and ref[k] else None
        # Paired by seed (same population, data and attackers): the seed-to-seed spread of
        # the accuracies themselves cancels, what is left is the case's own effect.
        r["paired_minus_reference"] = None if base is None else _paired(r, base)
    central = {r["target_epsilon"]: r for r in rows if r["kind"] == "central"}
    for r in rows:
        if r["kind"] == "distributed" and r["target_epsilon"] in central and r["accuracy"] is not None:
            c = central[r["target_epsilon"]]["accuracy"]
            r["minus_central_at_equal_epsilon"] = None if c is None else round(r["accuracy"] - c, 4)
            r["paired_minus_central"] = _paired(r, central[r["target_epsilon"]])
    load_after = os.getloadavg()
    print(f"\n{a.task}, population {a.population}, {a.per_round} per round, {a.rounds} rounds "
          f"({a.robust_rounds} for the attacks), clip {a.clip}, delta 1e-5, seeds {a.seeds} (accuracy: mean ± "
          f"sample stddev over seeds); accuracy is read against the non-private run of the same length (the "
          f"attacks: against their clean run), DP cost against the run without DP on the same transport")
    print(f"{'case':<36} {'rounds':>6} {'target eps':>10} {'eps spent':>9} {'z':>6} {'accuracy':>16} {'vs ref':>8} "
          f"{'paired':>14} {'s/round':>8} {'x time':>7} {'CPU s':>7} {'x CPU':>6} {'bytes up/rd':>12} {'x bytes':>7}")

    def f(v: Any, fmt: str) -> str:
        width = int("".join(c for c in fmt.split(".")[0] if c.isdigit()) or 0)
        return format(v, fmt) if isinstance(v, int | float) else "-".rjust(width)

    for r in rows:
        acc = "-" if r["accuracy"] is None else f"{100 * r['accuracy']:.2f} ± {100 * r['accuracy_spread']:.2f}"
        diff = r["accuracy_minus_reference"]
        print(f"{r['case']:<36} {r['rounds']:>6} {f(r['target_epsilon'], '10g')} {f(r['epsilon'], '9.3f')} "
              f"{f(r['noise_multiplier'], '6.3f')} {acc:>16} {f(None if diff is None else 100 * diff, '+8.2f')} "
              f"{_pm(r['paired_minus_reference']):>14} "
              f"{f(r['seconds_per_round'], '8.2f')} {f(r['time_vs_off'], '7.2f')} {f(r['total_cpu_seconds'], '7.1f')} "
              f"{f(r['cpu_vs_off'], '6.2f')} {f(round(r['bytes_up_per_round']), '12,d')} {f(r['bytes_vs_off'], '7.3f')}")
    for r in rows:
        if "minus_central_at_equal_epsilon" in r:
            print(f"{r['case']} - central at epsilon {r['target_epsilon']:g}: "
                  f"{100 * r['minus_central_at_equal_epsilon']:+.2f} points (means over seeds); paired by seed "
                  f"{_pm(r['paired_minus_central'])}")
    checkpoints = sorted({k for r in rows if r["kind"] == "attack" for x in r["per_seed"]
                          for k in x["accuracy_by_round"]})
    if a.eval_every and checkpoints:
        # The same runs tested along the way: how the gap to the clean run evolves (a
        # slowdown closes as both runs converge; a derailed run does not).
        print("\nattacks minus their clean run, paired by seed, after round: "
              + ", ".join(str(c) for c in checkpoints))
        for r in rows:
            base = by_name.get(r["reference"]) if r["reference"] else None
            if r["kind"] != "attack" or base is None:
                continue
            print(f"{r['case']:<36} " + " ".join(f"{_pm(_paired(r, base, c)):>14}" for c in checkpoints))
    print(f"load average {load_before[0]:.2f} before, {load_after[0]:.2f} after")
    write(rows, complete=True)

if __name__ == "__main__":
    main()
