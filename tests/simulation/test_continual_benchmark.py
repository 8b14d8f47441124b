"""``benchmarks/continual.py`` at a toy size: it runs the three cases over the same streams
and writes the figures the benchmark table reads."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "continual.py"


def test_the_benchmark_runs_small_and_reports_its_figures(tmp_path: Path) -> None:
    out = tmp_path / "continual.json"
    res = subprocess.run([sys.executable, str(SCRIPT), "--devices", "4", "--samples", "20", "--epochs", "1",
                          "--eval-limit", "500", "--seeds", "0", "--json", str(out)], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    (got,) = json.loads(out.read_text())
    assert set(got["cases"]) == {"no replay", "replay", "upper bound"}
    for case in got["cases"].values():
        assert 0.0 <= case["final_accuracy_mean"] <= 1.0
    none, replay = got["cases"]["no replay"], got["cases"]["replay"]
    if none["forgetting_mean"] > 0:
        assert got["forgetting_reduction"] == 1 - replay["forgetting_mean"] / none["forgetting_mean"]
    else:  # nothing learnt to forget at this size: no ratio to report
        assert math.isnan(got["forgetting_reduction"])
    gap = 100 * (got["cases"]["upper bound"]["final_accuracy_mean"] - replay["final_accuracy_mean"])
    assert abs(got["upper_bound_minus_replay_points"] - gap) < 1e-9
    # A replay buffer of 10% of a 20-sample stream keeps 2 samples, never more.
    assert all(r["largest_buffer_fraction_of_stream"] <= 0.1 for r in got["runs"]["replay"])
    assert [len(r["accuracy_by_period"]) for r in got["runs"]["replay"]] == [5]
