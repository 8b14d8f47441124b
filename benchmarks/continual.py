"""Continual learning on devices: class-incremental MNIST with on-device replay.

The shipped 10,000 MNIST training images, ``--samples`` drawn with replacement per
device (a near-uniform class mix: Dirichlet alpha 100), arrive as a stream in 5 periods
of 2 classes (``[run.continual] periods``, ``orchard.tasks.stream``). Every device trains
with :class:`orchard.tasks.continual.ContinualTrainer`, the client trainer a real device
and the simulator run, over its own stream read up to the round's clock, with its replay
buffer in its own directory. The server side is FedAvg (the new samples' count as the
weight), over every device each round (``--cohort`` to sample fewer): this driver does
not go through the simulator's engine (tiers, codecs, virtual device timing), whose
per-round cost at a thousand devices for 3 cases x 3 seeds does not fit a shared host;
what differs between the cases is the device's buffer only.

Cases (one stream, model and seed for all three):

- **no replay**: ``replay_ratio = 0``;
- **replay**: ``replay_ratio = --ratio``, each buffer's budget the smallest that keeps
  10% of the device's stream (``simulated_budget_fraction = 0.1``; of its whole stream,
  so before the last period it is more than 10% of what it has seen so far);
- **upper bound**: the same ratio, a budget that keeps every sample of the stream.

Measured after each period on the official 10,000 test images: the accuracy on each
period's classes. Reported: final accuracy over all classes, and average forgetting
(Chaudhry et al., 2018): over the periods before the last, the best accuracy a period's
classes had at the end of any earlier period minus their final accuracy. Each case runs
once per seed; the table shows the mean over seeds and the spread (sample standard
deviation). ``forgetting_reduction`` is ``1 - replay's forgetting / no replay's`` and
``upper_bound_minus_replay_points`` the final accuracy gap, in points, both from means.

    .venv/bin/python benchmarks/continual.py [--devices 1000] [--seeds 0 1 2] [--quick] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from orchard.config import ContinualConfig
from orchard.tasks import get_task
from orchard.tasks.stream import StreamingTask
from orchard.tasks.torch_trainer import load_arrays
from orchard.trainer import TrainConfig

PERIODS = [[0, 1], [2, 3], [4, 5], [6, 7], [8, 9]]
CASES = ("no replay", "replay", "upper bound")


def per_group_accuracy(task, arrays, limit: int | None = None) -> list[float]:
    model = task.build_model()
    load_arrays(model, arrays, task.trainable)
    model.eval()
    x, y = task.test_data.x[:limit], task.test_data.y[:limit]
    with torch.no_grad():
        pred = torch.cat([model(x[i:i + 2000]).argmax(-1) for i in range(0, len(y), 2000)])
    hits = (pred == y).numpy()
    yy = y.numpy()
    return [float(hits[np.isin(yy, g)].mean()) for g in PERIODS] + [float(hits.mean())]


def run_case(task, case: str, a, seed: int) -> dict:
    ratio = 0.0 if case == "no replay" else a.ratio
    fraction = 1.0 if case == "upper bound" else a.fraction
    cfg = ContinualConfig(periods=PERIODS, period_s=float(a.rounds_per_period), replay_ratio=ratio,
                          sampling=a.sampling, hot_samples=a.hot, simulated_budget_fraction=fraction)
    arrays = task.initial_arrays(seed)
    names = list(arrays)
    rng = np.random.default_rng([seed, 0xC0])
    acc: list[list[float]] = []
    worst_fraction = 0.0
    with tempfile.TemporaryDirectory(prefix="orchard-continual-") as root:
        st = StreamingTask(task, cfg, root)
        rounds = len(PERIODS) * a.rounds_per_period
        for r in range(rounds):
            now = float(r + 1)  # the end of round r on the stream's clock (period_s = rounds per period)
            cohort = np.arange(a.devices) if a.cohort >= a.devices else np.sort(
                rng.choice(a.devices, a.cohort, replace=False))
            total = {n: np.zeros_like(v, dtype=np.float64) for n, v in arrays.items()}
            weight = 0.0
            for d in cohort.tolist():
                tr = st.client_trainer(d, a.devices, seed)
                tr.stream.arrive(now)
                res = tr.train(arrays, TrainConfig(epochs=a.epochs, batch_size=a.batch, learning_rate=a.lr,
                                                   seed=seed * 1_000 + r))
                if res.weight <= 0:
                    continue
                for n in names:
                    total[n] += res.weight * res.arrays[n]
                weight += res.weight
                if r == rounds - 1 and case != "upper bound":
                    buf = tr.buffer()
                    worst_fraction = max(worst_fraction, len(buf) / max(len(tr.stream), 1))
            if weight > 0:
                arrays = {n: (total[n] / weight).astype(np.float32) for n in names}
            if (r + 1) % a.rounds_per_period == 0:
                acc.append(per_group_accuracy(task, arrays, a.eval_limit))
                print(f"  seed {seed} {case}: period {len(acc)} accuracy {acc[-1][-1]:.3f} "
                      f"groups {[round(v, 2) for v in acc[-1][:-1]]}", flush=True)
    t = len(PERIODS) - 1
    forgetting = statistics.fmean(max(acc[p][g] for p in range(g, t)) - acc[t][g] for g in range(t))
    return {"final_accuracy": acc[t][-1], "forgetting": forgetting, "accuracy_by_period": acc,
            "largest_buffer_fraction_of_stream": worst_fraction}


def _commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              cwd=Path(__file__).parent, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def _mean_spread(xs: list[float]) -> tuple[float, float]:
    return statistics.fmean(xs), (statistics.stdev(xs) if len(xs) > 1 else 0.0)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--devices", type=int, default=1000)
    ap.add_argument("--cohort", type=int, default=1000, help="devices trained a round (all by default)")
    ap.add_argument("--samples", type=int, default=50, help="samples in each device's stream")
    ap.add_argument("--rounds-per-period", type=int, default=1)
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--batch", type=int, default=10)
    ap.add_argument("--lr", type=float, default=0.05)
    ap.add_argument("--ratio", type=float, default=0.5, help="replay ratio of the replay and upper-bound cases")
    ap.add_argument("--fraction", type=float, default=0.1, help="replay buffer: this share of each stream")
    ap.add_argument("--sampling", default="reservoir", choices=["reservoir", "class_balanced"])
    ap.add_argument("--hot", type=int, default=64, help="hot samples (at most the buffer's capacity)")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--eval-limit", type=int, default=None, help="test on the first N test images (default all)")
    ap.add_argument("--quick", action="store_true", help="a small run: 60 devices, 1 seed")
    ap.add_argument("--json", dest="json_path", default=None)
    a = ap.parse_args(argv)
    if a.quick:
        a.devices, a.cohort, a.seeds = 60, 60, a.seeds[:1]
    a.cohort = min(a.cohort, a.devices)
    torch.set_num_threads(1)
    task = get_task("mnist", partitioner="dirichlet", alpha=100.0, with_replacement=True,
                    samples_per_client=a.samples, test_samples_per_client=1, channels=8, hidden=32)
    load = os.getloadavg()[0]
    started = time.perf_counter()
    runs: dict[str, list[dict]] = {c: [] for c in CASES}
    for seed in a.seeds:
        for case in CASES:
            runs[case].append(run_case(task, case, a, seed))
    wall = time.perf_counter() - started
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
    print(f"\nforgetting_reduction {reduction:.3f} (target >= 0.5); "
          f"upper_bound_minus_replay_points {gap:.2f} (target <= 5)")
    result = {
        "commit": _commit(), "command": " ".join([".venv/bin/python", "benchmarks/continual.py", *(argv or sys.argv[1:])]),
        "host": f"{os.cpu_count()}-core {platform.machine()} shared development host",
        "load_average_before": round(load, 2), "wall_s": round(wall, 1),
        "devices": a.devices, "cohort": a.cohort, "samples_per_device": a.samples, "periods": PERIODS,
        "rounds_per_period": a.rounds_per_period, "epochs": a.epochs, "batch_size": a.batch,
        "learning_rate": a.lr, "replay_ratio": a.ratio, "buffer_fraction_of_stream": a.fraction,
        "sampling": a.sampling, "seeds": a.seeds, "test_images": a.eval_limit or 10_000, "cases": summary, "runs": runs,
        "forgetting_reduction": reduction, "upper_bound_minus_replay_points": gap,
        "targets_met": bool(reduction >= 0.5 and gap <= 5.0),
    }
    if a.json_path:
        path = Path(a.json_path)
        history = json.loads(path.read_text()) if path.is_file() else []
        history.append(result)
        path.write_text(json.dumps(history, indent=1) + "\n")
    return result


if __name__ == "__main__":
    main()
