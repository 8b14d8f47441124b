"""``benchmarks/personal.py --quick``: every method measured on each device's own held-out
data, the headline margins and the cost ratio written to its JSON."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "personal.py"


@pytest.mark.slow  # minutes on a shared 2-core host: MNIST, a simulation and four evaluations
def test_quick_run_writes_every_method_and_the_margins(tmp_path: Path) -> None:
    out = tmp_path / "personal.json"
    res = subprocess.run([sys.executable, str(SCRIPT), "--quick", "--splits", "pathological", "--json", str(out)],
                         capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    got = json.loads(out.read_text())
    (run,) = got["runs"]
    for m in ("global_only", "local_only", "finetune", "ditto"):
        assert 0.0 <= run["methods"][m]["p10"] <= run["methods"][m]["mean"] <= 1.0
        assert run["methods"][m]["devices"] > 0
    best = max(run["methods"]["global_only"]["mean"], run["methods"]["local_only"]["mean"])
    assert abs(run["ditto_minus_best_baseline_points"]["mean"] - 100 * (run["methods"]["ditto"]["mean"] - best)) < 0.02
    assert "pathological_ditto_minus_best_baseline_points" in got
    assert got["ditto_round_cpu_ratio"] > 1.0  # Ditto trains twice
