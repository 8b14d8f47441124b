"""``benchmarks/continual.py`` at a toy size: the three cases and the cost runs go through
the simulator, the buffer bound is checked, and the figures the table reads are written."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "continual.py"


# Five simulations, each scoring the 10,000 test images after every period: minutes on
# a shared host.
@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_the_benchmark_runs_small_and_reports_its_figures(tmp_path: Path) -> None:
    out = tmp_path / "continual.json"
    res = subprocess.run([sys.executable, str(SCRIPT), "--devices", "4", "--samples", "30", "--epochs", "1",
                          "--seeds", "0", "--cost-rounds", "2", "--ditto-steps", "1", "--json", str(out)],
                         capture_output=True, text=True, timeout=1700)
    assert res.returncode == 0, res.stderr[-3000:]
    (got,) = json.loads(out.read_text())
    assert got["engine"].startswith("orchard.simulation.run_simulation")
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
    # Read from every device's buffer file after every round: never above 10% of what it saw.
    assert 0.0 < got["largest_buffer_fraction_of_seen"] <= 0.1
    assert [len(r["accuracy_by_period"]) for r in got["runs"]["replay"]] == [5]
    assert got["runs"]["replay"][0]["failed_attempts"] == 1  # round 1 opened before any sample arrived
    assert len(got["plain_round_cpu_s"]) == len(got["replay_ditto_round_cpu_s"]) == 2
    assert got["replay_ditto_cpu_ratio"] > 0
