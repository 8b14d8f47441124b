"""benchmarks/simulation.py's Flower case: an honest "not run" row without Ray, and with
Ray a small run of benchmarks/flower_peer.py through Flower's simulation engine."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


def _load_simulation_benchmark():
    spec = importlib.util.spec_from_file_location("simulation_benchmark", BENCHMARKS / "simulation.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_flower_row_is_not_run_without_ray(monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("flwr")
    bench = _load_simulation_benchmark()
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "ray" else real(name, *a))
    row = bench._flower(10, 1, ray_cpus=1, timeout_s=5)
    assert row["path"] == "flower"
    assert row["status"].startswith("not run") and "Ray" in row["status"]
    assert "clients_per_second" not in row


@pytest.mark.timeout(120)
def test_flower_peer_trains_every_supernode(tmp_path: Path) -> None:
    pytest.importorskip("flwr")
    pytest.importorskip("ray")
    out = tmp_path / "row.json"
    env = dict(os.environ, FLWR_TELEMETRY_ENABLED="0", RAY_USAGE_STATS_ENABLED="0")
    proc = subprocess.run([sys.executable, str(BENCHMARKS / "flower_peer.py"), "--clients", "4", "--rounds", "1",
                           "--ray-cpus", "1", "--out", str(out)],
                          capture_output=True, text=True, env=env, timeout=110, check=False)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    row = json.loads(out.read_text())
    assert row["path"] == "flower" and row["clients_per_round"] == 4 and row["rounds"] == 1
    assert row["trained_per_round"] == 4 and row["failed_per_round"] == 0
    assert row["clients_per_second"] > 0 and row["seconds_per_round"] > 0
    # The sampled sum covers the driver and Ray's processes (GCS, raylet, a worker).
    assert row["peak_rss_mib"] > 0 and sum(row["processes_at_peak"].values()) >= 3
    assert 0.0 <= row["final_accuracy"] <= 1.0
