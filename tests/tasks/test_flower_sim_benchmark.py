"""benchmarks/flower_sim.py at a small scale: one Flower ClientApp through Flower's engine
and through `orchard simulate --flower-app`, every client trained on both paths, the same
rounds, and the ratio keys the benchmark's table is read from."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


@pytest.mark.timeout(300)
def test_both_engines_run_the_same_app(tmp_path: Path) -> None:
    pytest.importorskip("ray")
    out = tmp_path / "result.json"
    env = dict(os.environ, FLWR_TELEMETRY_ENABLED="0", RAY_USAGE_STATS_ENABLED="0")
    proc = subprocess.run([sys.executable, str(BENCHMARKS / "flower_sim.py"), "--clients", "6", "--rounds", "1",
                           "--workers", "1", "--ray-cpus", "1", "--json", str(out)],
                          capture_output=True, text=True, env=env, timeout=290, check=False)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    res = json.loads(out.read_text())
    for path in ("orchard", "flower"):
        row = res[path]
        assert row["trained_per_round"] == 6 and row["rounds"] == 1, row
        assert row["clients_per_second"] > 0 and row["peak_rss_mib"] > 0
        assert 0.0 <= row["final_accuracy"] <= 1.0
    assert res["orchard_vs_flower_clients_per_second_ratio"] == pytest.approx(
        res["orchard"]["clients_per_second"] / res["flower"]["clients_per_second"], rel=0.05)
    assert res["orchard_vs_flower_peak_rss_ratio"] == pytest.approx(
        res["orchard"]["peak_rss_mib"] / res["flower"]["peak_rss_mib"], rel=0.05)
    # The same app from the same start for the same rounds: the same model, near enough.
    assert res["accuracy_difference_points"] <= 5.0
