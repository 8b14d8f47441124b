"""``benchmarks/pretrain.py`` on CPU, cut short: it runs, writes the JSON the issue names,
and its two loops (recipe and plain) compute the same losses."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "pretrain.py"


def test_cpu_benchmark_writes_ratio_and_resume_difference(tmp_path) -> None:
    out = tmp_path / "pretrain.json"
    args = ["--device", "cpu", "--warmup", "1", "--rounds", "2", "--block", "2"]
    args += ["--resume-steps", "4", "--json", str(out)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), *args], env=env, capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    got = json.loads(out.read_text())
    assert got["device"] == "cpu" and got["compile"] is False and got["steps_timed"] == 4
    assert got["ratio_vs_plain_loop"] > 0
    # Same weights, batches and optimizer: the recipe's step is the plain loop's, exactly.
    assert got["max_abs_loss_diff_vs_plain"] == 0.0
    assert got["resume_stopped_at"] == 2 and got["resume_max_abs_loss_diff"] == 0.0
    assert "ratio recipe / plain" in proc.stdout
