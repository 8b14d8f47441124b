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
- phase_seconds_per_round: the engine's own account of a measured round (the round
  record's ``phase_seconds``, mean per round): check-in, opening the tiers and
  selecting, dispatch (and the device models within it), arrivals (training, uploads,
  folds), leaving; wall seconds in the engine process, printed under the table;
- peak_rss_mib: the engine process's peak resident set (``resource.getrusage``); with
  the process backend each worker's peak is reported too (``worker_peak_rss_mib``);
- tree_cpu_us_per_client: CPU microseconds a trained client costs over every process of
  the case (the engine, and the workers' CPU read with psutil at each round's end), and
  core_bound_clients_per_second: trained clients per second if that CPU were spread
  over every core with none idle -- the most this machine gives at this cost per client,
  however the work is split between the engine and the workers.

With ``--profile DIR`` (py-spy must be installed: ``pip install py-spy``) py-spy samples
the vectorised cases' engine and worker through the measured rounds without pausing
them, keeps the stacks in DIR, and the table says where a round's CPU went: training,
device models, building uploads, tier folds, check-in, hand-out and the rest, engine and
workers apart. Sampling costs the processes some time, so a profiled run's clients per
second are not the headline figure.

The per-client path (one TorchTrainer per client, the way a device trains) runs in the
same invocation as the baseline, on fewer clients per round, and the table prints the
throughput ratio.

Flower's simulation engine is the reference peer (benchmarks/flower_peer.py): a
ServerApp with FedAvg and a ClientApp doing the same local training, through
``flwr.simulation.run_simulation`` on Ray with one Ray CPU per core, in its own process
tree, ``--flower-per-round`` SuperNodes all training in every round, one warm-up round
and the same measured rounds. Its clients per second and seconds per round are timed
inside the strategy (start-up excluded); its RSS is a sampled sum over the driver and
every Ray process (see that module), and its CPU column is blank because the Orchard
column is the engine process's alone (the row's JSON has the whole tree's CPU). When
--per-round has no case at Flower's size, an Orchard case at that size runs too, and the
table prints Orchard/Flower clients per second at equal clients per round. Without flwr
or Ray the row says so instead of making a number up.

    python benchmarks/simulation.py [--quick] [--json PATH] [--rounds 2] [--population 100000]
        [--flower-per-round 1000] [--no-flower] [--baseline-per-round 500 (0: none)]

Against an earlier commit (``--against REV``): the vectorised case at each ``--per-round``
runs alternately on the code at REV (exported with ``git archive`` and imported in place
of this checkout's) and on this checkout, ``--repeat`` times each, in one invocation; the
table prints both and their ratio (this checkout / REV, medians), the regression check
for a change that should not cost throughput.

    python benchmarks/simulation.py --against d387a09 --per-round 10000 [--repeat 3] [--json PATH]

On a GPU (``--device cuda``): the vectorised path on cuda against the CPU path in the same
run, for the digits MLP and the MNIST CNN at 100,000 clients per round, with the largest
difference between the two global models.

    python benchmarks/simulation.py --device cuda [--per-round 100000] [--check-per-round 5000] [--json PATH]

``--check-per-round`` runs the CPU baseline and the model comparison at a smaller size
(the device also runs it, so the two models come from one configuration), for hosts where
the CPU path at 100,000 clients per round would take too long.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import itertools
import json
import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
# Sibling modules (benchmarks/ is not a package): what a case process runs, and the
# --profile sampling; the names the tests load from this script stay importable here.
from simulation_case import _case, _phases  # noqa: E402
from simulation_profile import _SAMPLE_RATE, _print_profile, _stop_sampling  # noqa: E402, F401

# Flower's default size: 1,000 SuperNodes finish three rounds in a few minutes on the
# two-core benchmark host (Ray start-up and the warm-up round take most of it).
FLOWER_PER_ROUND = 1000


def _flower(per_round: int, rounds: int, ray_cpus: int, timeout_s: float) -> dict[str, Any]:
    """Flower's simulation engine on the same workload (benchmarks/flower_peer.py), in its
    own process tree; an honest "not run" row when flwr or Ray is missing."""
    try:
        import flwr
    except ImportError as err:
        return {"path": "flower", "status": f"not run: flwr is not importable ({err})"}
    if importlib.util.find_spec("ray") is None:
        return {"path": "flower", "status": f"not run: flwr {flwr.__version__}'s simulation engine needs Ray, "
                                            "which is not installed here (pip install 'flwr[simulation]')"}
    peer = Path(__file__).with_name("flower_peer.py")
    env = dict(os.environ, FLWR_TELEMETRY_ENABLED="0", RAY_USAGE_STATS_ENABLED="0")
    with tempfile.TemporaryDirectory(prefix="flower-peer-") as tmp:
        out_path = Path(tmp) / "row.json"
        log_path = Path(tmp) / "log.txt"
        cmd = [sys.executable, str(peer), "--clients", str(per_round), "--rounds", str(rounds),
               "--ray-cpus", str(ray_cpus), "--out", str(out_path)]
        with open(log_path, "wb") as log:
            # Its own session, so that on a timeout the whole tree (Ray's GCS, raylet and
            # workers included) can be stopped with one signal to the group.
            proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
            try:
                rc = proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
                return {"path": "flower", "clients_per_round": per_round,
                        "status": f"failed: Flower did not finish {rounds + 1} rounds of {per_round} clients "
                                  f"within {timeout_s:.0f} s"}
        tail = log_path.read_text(errors="replace")[-2000:]
        if rc != 0 or not out_path.is_file():
            return {"path": "flower", "clients_per_round": per_round, "status": f"failed (exit code {rc})",
                    "error": tail}
        return json.loads(out_path.read_text())


# Imported first by every process of an old revision's case (PYTHONPATH): drops this
# checkout's editable-install finder, so that `orchard` resolves to the exported revision.
_SITECUSTOMIZE = """import sys
sys.meta_path[:] = [f for f in sys.meta_path if not getattr(f, "__module__", "").startswith("__editable__")]
"""


@contextlib.contextmanager
def _revision(rev: str) -> Any:
    """An importable copy of the code at ``rev``: yields (environment, commit)."""
    import shutil
    import tomllib

    repo = Path(__file__).resolve().parents[1]
    commit = subprocess.run(["git", "-C", str(repo), "rev-parse", "--verify", f"{rev}^{{commit}}"],
                            capture_output=True, text=True, check=True).stdout.strip()
    tmp = Path(tempfile.mkdtemp(prefix="orchard-rev-"))
    try:
        src, pkg = tmp / "src", tmp / "pkg"
        src.mkdir()
        archive = subprocess.run(["git", "-C", str(repo), "archive", "--format=tar", commit],
                                 capture_output=True, check=True).stdout
        subprocess.run(["tar", "-x", "-C", str(src)], input=archive, check=True)
        # The one import package as pyproject maps it: orchard/ plus its subpackage folders.
        dirs = tomllib.loads((src / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
        shutil.copytree(src / dirs.get("orchard", "orchard"), pkg / "orchard")
        for name, folder in dirs.items():
            if name.startswith("orchard."):
                (pkg / "orchard" / name.split(".", 1)[1]).symlink_to(src / folder, target_is_directory=True)
        (pkg / "sitecustomize.py").write_text(_SITECUSTOMIZE)
        yield {"PYTHONPATH": str(pkg)}, commit
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _spawn(args: dict[str, Any], env: dict[str, str] | None = None) -> dict[str, Any]:
    """Run one case in a fresh process; with ``args["verbose"]`` its stderr (round by round)
    is echoed as it comes, else kept for the error message only."""
    cmd = [sys.executable, __file__, "--case", json.dumps(args)]
    with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                          env=None if env is None else {**os.environ, **env}) as proc:
        assert proc.stdout is not None and proc.stderr is not None
        err: list[str] = []
        for line in proc.stderr:  # stdout holds one JSON line: its pipe cannot fill meanwhile
            err.append(line)
            if args.get("verbose"):
                sys.stderr.write(line)
                sys.stderr.flush()
        stdout = proc.stdout.read()
    if proc.returncode != 0:
        return {"path": "vectorized" if args["vectorize"] else "per-client", "status": "failed",
                "clients_per_round": args["clients_per_round"], "error": "".join(err)[-2000:]}
    return json.loads(stdout.strip().splitlines()[-1])


def _fmt(v: Any, width: int, digits: int) -> str:
    return f"{v:>{width}.{digits}f}" if isinstance(v, int | float) else f"{'-':>{width}}"


def _against(a: argparse.Namespace) -> None:
    """This checkout against ``a.against``, case by case, alternating, in one invocation."""
    import statistics

    governor = not a.no_governor
    load_before = os.getloadavg()
    head = subprocess.run(["git", "-C", str(Path(__file__).resolve().parents[1]), "rev-parse", "HEAD"],
                          capture_output=True, text=True, check=False).stdout.strip()
    rows = []
    tasks = a.tasks or ["digits"]
    with _revision(a.against) as (env, commit):
        for task, n in itertools.product(tasks, a.per_round):
            args = dict(clients_per_round=n, population=a.population, aggregators=max(1, n // 250),
                        rounds=a.rounds, vectorize=True, governor=governor, workers=a.workers, backend=a.backend,
                        task=task)
            runs: dict[str, list[dict[str, Any]]] = {"old": [], "new": []}
            for _ in range(a.repeat):
                runs["old"].append(_spawn(args, env))
                runs["new"].append(_spawn(args))
            for side in ("old", "new"):
                bad = [r for r in runs[side] if "clients_per_second" not in r]
                if bad:
                    raise SystemExit(f"the {side} code failed at {n} per round:\n{bad[0].get('error', '')}")
            med = {k: statistics.median(r["clients_per_second"] for r in v) for k, v in runs.items()}
            cpu = {k: statistics.median(r["cpu_clients_per_second"] for r in v) for k, v in runs.items()}
            rows.append({"task": task, "clients_per_round": n, "old": runs["old"], "new": runs["new"],
                         "old_clients_per_second": med["old"], "new_clients_per_second": med["new"],
                         "ratio": round(med["new"] / med["old"], 3),
                         "old_cpu_clients_per_second": cpu["old"], "new_cpu_clients_per_second": cpu["new"],
                         "cpu_ratio": round(cpu["new"] / cpu["old"], 3)})
    load_after = os.getloadavg()
    print(f"this checkout ({head[:10]}) against {a.against} ({commit[:10]}), vectorised path, "
          f"{a.repeat} runs each, alternating; medians")
    print(f"{'task':<7} {'per round':>9} {'old cl/s':>9} {'new cl/s':>9} {'new/old':>8} {'old cpu':>8} {'new cpu':>8} "
          f"{'cpu n/o':>8}  all runs (old | new)")
    for r in rows:
        runs_txt = (" ".join(f"{x['clients_per_second']:.0f}" for x in r["old"]) + " | "
                    + " ".join(f"{x['clients_per_second']:.0f}" for x in r["new"]))
        print(f"{r['task']:<7} {r['clients_per_round']:>9} {r['old_clients_per_second']:>9.0f} {r['new_clients_per_second']:>9.0f} "
              f"{r['ratio']:>8.3f} {r['old_cpu_clients_per_second']:>8.0f} {r['new_cpu_clients_per_second']:>8.0f} "
              f"{r['cpu_ratio']:>8.3f}  {runs_txt}")
    print(f"population {a.population}, governor {'on' if governor else 'off'}, workers {a.workers} "
          f"({a.backend} backend); load average {load_before[0]:.2f} before, {load_after[0]:.2f} after")
    if a.json_path:
        with open(a.json_path, "w") as f:
            json.dump({"against": a.against, "against_commit": commit, "head": head, "cases": rows,
                       "population": a.population, "governor": governor, "workers": a.workers,
                       "backend": a.backend, "repeat": a.repeat,
                       "load_average": {"before": list(load_before), "after": list(load_after)}}, f, indent=2)


def _devices(a: argparse.Namespace) -> None:
    """The vectorised path on ``a.device`` against the CPU path, same run, per task.

    At ``--per-round`` the device's clients/s; at ``--check-per-round`` (default: the
    same size) the device and the CPU path run the same configuration, which gives the
    CPU's clients/s (the ratio's baseline) and the largest difference between the two
    global models. A smaller check size is for hosts where the CPU path would take too long
    at the headline size (the MNIST CNN on a CPU trains ~100 clients/s per worker)."""
    import numpy as np
    import torch

    if a.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda needs a CUDA GPU and a CUDA build of torch; this machine has none "
                         "(torch.cuda.is_available() is False): use --device cpu to check the script")
    n, check = a.per_round[0], a.check_per_round or a.per_round[0]
    rows: list[dict[str, Any]] = []

    def case(task: str, device: str, per_round: int, save: str | None) -> dict[str, Any]:
        # A device is online with some probability: the population is 3x the round's size
        # (at least), so that a round fills.
        r = _spawn(dict(clients_per_round=per_round, population=max(a.population, 3 * per_round),
                        aggregators=max(1, per_round // 250), rounds=a.rounds, vectorize=True,
                        governor=not a.no_governor, workers=a.workers, backend=a.backend, task=task,
                        device=device, save=save, verbose=True))
        if "clients_per_second" not in r:
            raise SystemExit(f"{task} on {device} at {per_round} per round failed:\n{r.get('error', '')}")
        print(f"  {task} on {device}, {per_round} per round: {r['clients_per_second']:,.0f} clients/s "
              f"({r['seconds_per_round']:.2f} s/round)", flush=True)
        return r

    with tempfile.TemporaryDirectory(prefix="orchard-device-") as tmp:
        for task in a.tasks or ["digits", "mnist"]:
            paths = {d: str(Path(tmp) / f"{task}-{d}.npz") for d in (a.device, "cpu")}
            headline = case(task, a.device, n, paths[a.device] if check == n else None)
            pair = [headline] if check == n else [case(task, a.device, check, paths[a.device])]
            pair.append(case(task, "cpu", check, paths["cpu"]))
            models = {d: dict(np.load(p)) for d, p in paths.items()}
            diff = max(float(np.abs(models[a.device][k] - models["cpu"][k]).max()) for k in models["cpu"])
            pair[0]["max_abs_diff_vs_cpu"] = diff
            cases = pair if check == n else [headline, *pair]
            for r in cases:
                r["x_cpu"] = r["clients_per_second"] / pair[-1]["clients_per_second"]
            rows += cases
    print(f"{'task':<8} {'device':<6} {'per round':>9} {'clients/s':>10} {'s/round':>8} {'x cpu':>7} {'max |diff|':>11}")
    for r in rows:
        diff = r.get("max_abs_diff_vs_cpu")
        print(f"{r['task']:<8} {r['device']:<6} {r['clients_per_round']:>9} {r['clients_per_second']:>10.0f} "
              f"{r['seconds_per_round']:>8.2f} {r['x_cpu']:>7.2f} {'-' if diff is None else format(diff, '.2e'):>11}")
        if r.get("phase_seconds_per_round"):
            print(f"{'':<8} {_phases(r['phase_seconds_per_round'])}")
    print("x cpu: against the CPU path at the check size, same task; max |diff|: the two global "
          "models at the check size")
    if a.json_path:
        with open(a.json_path, "w") as f:
            json.dump({"device": a.device, "per_round": n, "check_per_round": check, "cases": rows,
                       "population": a.population, "workers": a.workers}, f, indent=2)


def _variants(a: argparse.Namespace) -> None:
    """What users turn on, against the float32 case at the same size in one invocation:
    8-bit qsgd, secure aggregation (SecAgg+ per cohort) and uneven client sizes (float32,
    ``size_spread`` 1.0: lognormal sizes of mean about 20), each as a ratio of clients/s."""
    n = a.per_round[0]
    cases = {"float32": {}, "qsgd": {"codec": {"name": "qsgd", "params": {"bits": 8}}}, "secure": {"secure": True},
             "uneven": {"size_spread": 1.0}}
    chosen = a.variant_cases or list(cases)
    rows = {}
    for name, extra in ((k, cases[k]) for k in ["float32", *[c for c in chosen if c != "float32"]]):
        print(f"  {name} at {n} per round ...", file=sys.stderr, flush=True)
        rows[name] = _spawn(dict(clients_per_round=n, population=a.population, aggregators=max(1, n // 250),
                                 rounds=1 if a.quick else a.rounds, vectorize=True, governor=not a.no_governor,
                                 workers=a.workers, backend=a.backend, **extra))
    base = rows["float32"]
    out: dict[str, Any] = {"clients_per_round": n, "cases": rows, "load_average": list(os.getloadavg())}
    print(f"{'case':<9} {'clients/s':>9} {'cpu cl/s':>9} {'x float32':>9} {'x cpu':>7}")
    for name, r in rows.items():
        cps, cpu = r.get("clients_per_second"), r.get("cpu_clients_per_second")
        ratio = cps / base["clients_per_second"] if cps and base.get("clients_per_second") else None
        cpu_ratio = cpu / base["cpu_clients_per_second"] if cpu and base.get("cpu_clients_per_second") else None
        if name == "uneven":  # the name: uneven sizes against even ones (float32 both)
            out["uneven_vs_even_ratio"] = ratio
            out["uneven_vs_even_cpu_ratio"] = cpu_ratio
        elif name != "float32":
            out[f"{name}_vs_float32_ratio"] = ratio
            out[f"{name}_vs_float32_cpu_ratio"] = cpu_ratio
        print(f"{name:<9} {_fmt(cps, 9, 0)} {_fmt(cpu, 9, 0)} {_fmt(ratio, 9, 2)} {_fmt(cpu_ratio, 7, 2)}"
              + ("" if cps else f"  {r.get('status', '')} {r.get('error', '')}"))
    print("targets (issue: >= 0.8x for qsgd, >= 0.3x for secure aggregation, >= 0.8x for uneven sizes); load average "
          f"{out['load_average'][0]:.1f}")
    if a.json_path:
        Path(a.json_path).write_text(json.dumps(out, indent=2))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", dest="json_path", default=None)
    ap.add_argument("--rounds", type=int, default=2, help="measured rounds per case (after one warm-up)")
    ap.add_argument("--population", type=int, default=100_000)
    ap.add_argument("--per-round", type=int, nargs="*", default=[1000, 10_000])
    ap.add_argument("--baseline-per-round", type=int, default=500,
                    help="clients per round of the per-client baseline (0: no baseline)")
    ap.add_argument("--no-governor", action="store_true", help="device time from work alone, no pacing")
    # One worker process on a 2-core host: clients train and encode there while the
    # engine process checks in, paces and folds, and trains the next clients itself
    # whenever it would wait on the worker. A second worker adds a process's memory
    # (torch alone is ~300 MiB) for little: the engine's check-in is the serial part.
    ap.add_argument("--workers", type=int, default=1)
    ap.add_argument("--backend", choices=["local", "process"], default="process",
                    help="where clients train: worker processes, or this process (threads if workers > 1)")
    ap.add_argument("--quick", action="store_true", help="1,000 clients per round only, one measured round")
    ap.add_argument("--flower-per-round", type=int, default=FLOWER_PER_ROUND,
                    help="SuperNodes in the Flower case (all train every round); Orchard runs a case at "
                         "the same size if --per-round has none")
    ap.add_argument("--no-flower", action="store_true", help="skip the Flower case")
    ap.add_argument("--flower-timeout", type=float, default=900.0, help="seconds before the Flower case is stopped")
    ap.add_argument("--against", default=None, metavar="REV",
                    help="compare this checkout with the code at git revision REV, alternating runs")
    ap.add_argument("--repeat", type=int, default=3, help="with --against: runs of each side per case")
    ap.add_argument("--device", default=None, choices=["cuda", "cpu"],
                    help="the vectorised path on a GPU against the CPU path, digits and MNIST, at --per-round "
                         "(default 100000 here)")
    ap.add_argument("--tasks", nargs="+", default=None, choices=["digits", "mnist"],
                    help="with --device: the tasks to measure (default digits and mnist); with --against: "
                         "the tasks to compare (default digits)")
    ap.add_argument("--check-per-round", type=int, default=None,
                    help="with --device: clients per round of the CPU baseline and the model check "
                         "(default: --per-round)")
    ap.add_argument("--profile", default=None, metavar="DIR",
                    help="sample the vectorised cases' engine and workers with py-spy (if installed) through the "
                         "measured rounds, keep the stacks in DIR and print where a round's CPU went")
    ap.add_argument("--variants", action="store_true",
                    help="at the first --per-round: float32 against 8-bit qsgd, secure aggregation and uneven "
                         "client sizes, as ratios")
    ap.add_argument("--variant-cases", nargs="+", default=None, choices=["float32", "qsgd", "secure", "uneven"],
                    help="with --variants: the cases to run (default all; float32, the baseline, always runs)")
    ap.add_argument("--case", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.case:
        print(json.dumps(_case(**json.loads(a.case))))
        return
    if a.against:
        _against(a)
        return
    if a.variants:
        _variants(a)
        return
    if a.device:
        if a.per_round == [1000, 10_000]:  # the default: the GPU case's own size
            a.per_round = [100_000]
        _devices(a)
        return
    per_round = [1000] if a.quick else a.per_round
    rounds = 1 if a.quick else a.rounds
    governor = not a.no_governor
    load_before = os.getloadavg()

    def vectorized_case(n: int) -> dict[str, Any]:
        # About 250 clients per lowest-tier aggregator, as a deployment would shard them
        # (the coordinator scans its cohort's assignments on every upload, so a tier's
        # cost grows with the square of its cohort).
        return _spawn(dict(clients_per_round=n, population=a.population, aggregators=max(1, n // 250),
                           rounds=rounds, vectorize=True, governor=governor, workers=a.workers,
                           backend=a.backend, profile=str(Path(a.profile) / str(n)) if a.profile else None))

    rows = [vectorized_case(n) for n in per_round]
    base: dict[str, Any] = {}
    if a.baseline_per_round > 0:
        base = _spawn(dict(clients_per_round=a.baseline_per_round, population=a.population,
                           aggregators=max(1, a.baseline_per_round // 250),
                           rounds=rounds, vectorize=False, governor=governor, workers=a.workers,
                           backend=a.backend))
        rows.append(base)
    comparisons = []
    if not a.no_flower:
        # Flower gets every core of the host as Ray CPUs (Orchard's engine and worker use both too).
        flower = _flower(a.flower_per_round, rounds, ray_cpus=max(a.workers, os.cpu_count() or 1),
                         timeout_s=a.flower_timeout)
        if "clients_per_second" in flower and a.flower_per_round not in per_round:
            # Like for like: Orchard at the clients per round Flower ran.
            rows.append(vectorized_case(a.flower_per_round))
        rows.append(flower)
        for r in rows:
            if (r.get("path") == "vectorized" and r.get("clients_per_round") == a.flower_per_round
                    and r.get("clients_per_second") and flower.get("clients_per_second")):
                # Orchard over-selects and trains some clients whose uploads arrive after
                # their tier closed; Flower aggregates every reply. So both bases.
                agg = round(r["participants_per_round"] / r["seconds_per_round"], 1)
                flower_agg = round(flower["trained_per_round"] / flower["seconds_per_round"], 1)
                tree = r["peak_rss_mib"] + (r["workers"] * (r.get("worker_peak_rss_mib") or 0)
                                            if r["backend"] == "process" else 0)
                comparisons.append({
                    "clients_per_round": a.flower_per_round,
                    "orchard_clients_per_second": r["clients_per_second"],
                    "flower_clients_per_second": flower["clients_per_second"],
                    "orchard_over_flower": round(r["clients_per_second"] / flower["clients_per_second"], 2),
                    "orchard_aggregated_per_second": agg,
                    "flower_aggregated_per_second": flower_agg,
                    "orchard_over_flower_aggregated": round(agg / flower_agg, 2),
                    "orchard_peak_rss_mib": r["peak_rss_mib"],
                    # Engine peak + each worker at the largest worker's peak: an upper bound
                    # on the tree's summed RSS (the peaks need not coincide).
                    "orchard_tree_rss_upper_mib": round(tree, 1),
                    "flower_peak_rss_mib": flower["peak_rss_mib"],
                })
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
        print(f"{r['path']:<11} {r['clients_per_round']:>9} {_fmt(r['clients_per_second'], 9, 0)} "
              f"{_fmt(r['cpu_clients_per_second'], 9, 0)} {_fmt(r['seconds_per_round'], 8, 2)} "
              f"{_fmt(r['cpu_seconds_per_round'], 8, 2)} {_fmt(r['simulated_seconds_per_round'], 8, 1)} "
              f"{_fmt(r['peak_rss_mib'], 8, 0)} {_fmt(r.get('worker_peak_rss_mib'), 8, 0)} {ratio:>7}")
    if base_cpu:
        for r in rows:
            if r.get("path") == "vectorized" and r.get("cpu_clients_per_second"):
                print(f"vectorized/per-client at {r['clients_per_round']} per round: "
                      f"{r['clients_per_second'] / base_cps:.1f}x wall, "
                      f"{r['cpu_clients_per_second'] / base_cpu:.1f}x CPU")
    for r in rows:
        if r.get("phase_seconds_per_round"):
            print(f"{r['path']} at {r['clients_per_round']} per round, {_phases(r['phase_seconds_per_round'])}")
    for r in rows:
        if r.get("core_bound_clients_per_second"):
            print(f"{r['path']} at {r['clients_per_round']} per round, every process (engine and workers): "
                  f"{r['tree_cpu_us_per_client']:.0f} CPU-us a client, {r['tree_cpu_seconds_per_round']:.2f} "
                  f"CPU-s a round; at most {r['core_bound_clients_per_second']:.0f} clients/s on "
                  f"{r['cores']} cores at that cost ({r['clients_per_second'] / r['core_bound_clients_per_second']:.0%} "
                  f"reached)")
    for r in rows:
        if r.get("path") == "flower" and "clients_per_second" in r:
            pss = f", PSS {r['peak_pss_mib']:.0f} MiB" if r.get("peak_pss_mib") else ""
            print(f"flower: {r['engine']}, {r['ray_cpus']} Ray CPUs, population = clients per round; "
                  f"RSS is a {r['peak_rss_is']}{pss}; whole-tree CPU {r['tree_cpu_seconds_per_round']:.2f} "
                  f"s/round ({r['tree_cpu_clients_per_second']:.0f} clients per CPU second); "
                  f"warm-up round {r['warmup_round_seconds']:.1f} s")
    for c in comparisons:
        print(f"orchard/flower at {c['clients_per_round']} per round: {c['orchard_over_flower']:.1f}x clients "
              f"trained/s (Orchard {c['orchard_clients_per_second']:.0f}, Flower "
              f"{c['flower_clients_per_second']:.0f}); {c['orchard_over_flower_aggregated']:.1f}x clients "
              f"aggregated/s (Orchard {c['orchard_aggregated_per_second']:.0f}, Flower "
              f"{c['flower_aggregated_per_second']:.0f}); process-tree RSS: Orchard <= "
              f"{c['orchard_tree_rss_upper_mib']:.0f} MiB (sum of per-process peaks), Flower "
              f"{c['flower_peak_rss_mib']:.0f} MiB (peak sampled sum)")
    for r in rows:
        _print_profile(r)
    load_after = os.getloadavg()
    print(f"population {a.population}, governor {'on' if governor else 'off'}, workers {a.workers} "
          f"({a.backend} backend); load average {load_before[0]:.2f} before, {load_after[0]:.2f} after")
    if a.json_path:
        with open(a.json_path, "w") as f:
            json.dump({"cases": rows, "population": a.population, "governor": governor, "workers": a.workers,
                       "backend": a.backend, "flower_comparisons": comparisons,
                       "load_average": {"before": list(load_before), "after": list(load_after)}}, f, indent=2)


if __name__ == "__main__":
    main()
