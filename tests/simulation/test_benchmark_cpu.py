"""benchmarks/simulation.py accounts for every process's CPU, not only the engine's."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path


def test_the_benchmark_counts_the_workers_cpu_and_the_core_bound(tmp_path) -> None:
    # One worker process trains the round's clients (its first job takes them all at this
    # size), so the whole tree's CPU must exceed the engine's own, and the core bound is
    # what that CPU per client allows on the cores this process may use.
    out = tmp_path / "sim.json"
    script = Path(__file__).resolve().parents[2] / "benchmarks" / "simulation.py"
    args = ["--per-round", "60", "--population", "300", "--rounds", "1", "--baseline-per-round", "0",
            "--no-flower", "--backend", "process", "--json", str(out)]
    proc = subprocess.run([sys.executable, str(script), *args], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    (case,) = json.loads(out.read_text())["cases"]
    assert case["tree_cpu_seconds_per_round"] > case["cpu_seconds_per_round"] > 0
    trained = case["trained_per_round"] * case["rounds"]
    per_client = case["tree_cpu_seconds_per_round"] * case["rounds"] / trained
    # (the per-round CPU in the JSON is rounded to milliseconds: 2% covers it at this size)
    assert abs(case["tree_cpu_us_per_client"] / (1e6 * per_client) - 1) < 0.02
    assert abs(case["core_bound_clients_per_second"] * per_client / case["cores"] - 1) < 0.02
    assert "CPU-us a client" in proc.stdout and "clients/s on" in proc.stdout
