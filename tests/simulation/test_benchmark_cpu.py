"""benchmarks/simulation.py accounts for every process's CPU, not only the engine's."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path


def test_the_benchmark_counts_the_workers_cpu_and_the_core_bound(tmp_path) -> None:
    # One worker process trains most of the round's clients, so the whole tree's CPU must
    # exceed the engine's own, and the core bound is what that CPU per client allows on
    # the cores this process may use. (At 60 clients a round a fast host's engine trains
    # them all itself while it waits for the worker's first job, and the two are equal.)
    out = tmp_path / "sim.json"
    script = Path(__file__).resolve().parents[2] / "benchmarks" / "simulation.py"
    args = ["--per-round", "600", "--population", "3000", "--rounds", "1", "--baseline-per-round", "0",
            "--no-flower", "--backend", "process", "--json", str(out)]
    proc = subprocess.run([sys.executable, str(script), *args], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    (case,) = json.loads(out.read_text())["cases"]
    assert case["tree_cpu_seconds_per_round"] > case["cpu_seconds_per_round"] > 0
    trained = case["trained_per_round"] * case["rounds"]
    per_client = case["tree_cpu_seconds_per_round"] * case["rounds"] / trained
    # The per-round CPU in the JSON is rounded to the millisecond, the figures derived from
    # it are not: they may differ by that rounding (half a millisecond a round) and no more.
    # At this size a round is about a tenth of a CPU-second: under 1%.
    tol = 0.0005 / case["tree_cpu_seconds_per_round"] + 0.001
    assert abs(case["tree_cpu_us_per_client"] / (1e6 * per_client) - 1) < tol
    assert abs(case["core_bound_clients_per_second"] * per_client / case["cores"] - 1) < tol
    assert "CPU-us a client" in proc.stdout and "clients/s on" in proc.stdout


def _bench_module():
    import importlib.util

    path = Path(__file__).resolve().parents[2] / "benchmarks" / "simulation.py"
    spec = importlib.util.spec_from_file_location("orchard_bench_simulation", path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_profile_samples_are_put_in_their_components(tmp_path) -> None:
    # --profile reads py-spy's raw stacks ("frame;frame;... count"): a sample goes to the
    # first component, in the table's order, that one of its frames names, so device
    # models inside the hand-out are device models, and training the engine does while it
    # waits is training.
    bench = _bench_module()
    f = "{} (simulation/engine.py:1)"
    engine = [
        (";".join(f.format(n) for n in ["run_simulation", "Engine.round", "Dispatch.dispatch", "DeviceRuns.results",
                                        "device_training", "Governor.before_step"]), 30),
        (";".join(f.format(n) for n in ["run_simulation", "Engine.round", "Dispatch.dispatch", "Coordinator.assign"]), 20),
        (";".join(f.format(n) for n in ["Engine.round", "Arrivals.process", "Coordinator.upload_now",
                                        "Coordinator._fold"]), 50),
        (";".join(f.format(n) for n in ["Arrivals.process", "ProcessBackend.run_here", "run_jobs", "train_many"]), 10),
        (";".join(f.format(n) for n in ["run_simulation", "Engine._finalize"]), 4),
        # The engine waiting for a worker's result: sampled, but not work.
        (";".join(f.format(n) for n in ["Arrivals.process", "Call.result", "WorkerPool.pump", "_wait_ready"]), 8),
    ]
    worker = [
        (";".join(f.format(n) for n in ["_serve", "_process_run", "run_jobs", "build_uploads"]), 40),
        (";".join(f.format(n) for n in ["_serve", "_serve.<locals>.reply"]), 6),
    ]
    for name, rows in (("engine", engine), ("worker0", worker)):
        (tmp_path / f"{name}.txt").write_text("".join(f"{s} {n}\n" for s, n in rows))
    done = {name: subprocess.Popen([sys.executable, "-c", "pass"]) for name in ("engine", "worker0")}
    for p in done.values():
        p.wait()
    got = {r["component"]: r for r in bench._stop_sampling(done, tmp_path, rounds=2)}
    rate = bench._SAMPLE_RATE
    assert got["device models (governor)"]["engine_s"] == round(30 / rate / 2, 3)
    assert got["hand-out"]["engine_s"] == round(20 / rate / 2, 3)
    assert got["tier folds"]["engine_s"] == round(50 / rate / 2, 3)
    assert got["training"]["engine_s"] == round(10 / rate / 2, 3)
    assert got["building uploads"]["workers_s"] == round(40 / rate / 2, 3)
    assert got["job transfer"]["workers_s"] == round(6 / rate / 2, 3)
    assert got["other"]["engine_s"] == round(4 / rate / 2, 3)
    assert got["waiting (sampled as busy)"]["engine_s"] == round(8 / rate / 2, 3)
    assert got["waiting (sampled as busy)"]["share"] == 0.0
    assert abs(sum(r["share"] for r in got.values()) - 1) < 0.01  # of the busy samples only
    assert got["tier folds"]["share"] == round(50 / 160, 3)
