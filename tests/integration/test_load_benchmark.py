"""benchmarks/load.py at a small size: devices join one aggregator through the real link,
idle, and a round among them closes; the JSON holds what the issue's target is read from."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "load.py"


def test_devices_join_idle_and_a_round_among_them_closes(tmp_path: Path) -> None:
    out = tmp_path / "load.json"
    res = subprocess.run([sys.executable, str(SCRIPT), "--sizes", "60", "--selected", "20", "--idle-s", "2",
                          "--generators", "1", "--per-connection", "25", "--json", str(out)],
                         capture_output=True, text=True, timeout=300)
    assert out.is_file(), res.stderr[-3000:]
    got = json.loads(out.read_text())
    (row,) = got["rows"]
    assert row["devices"] == row["joined"] == 60 and row["pool_reached"], row
    assert row["round_closed"] and row["round_participants"] == 20, row
    assert row["broke"] == "" and got["breaking_point_devices"] is None
    assert got["most_devices_held"] == 60
    assert {"connected_devices", "aggregator_peak_rss_mib", "round_closed"} <= set(got)
    assert row["aggregator_rss_mib"] > 0 and row["generator_failures"] == 0, row
    assert "held: 60 devices" in res.stdout
