"""``benchmarks/privacy_audit.py --quick``: canaries are plain to see in the final model of
a run without noise, and the private runs' estimates stay at or below what their
accountant charged."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "privacy_audit.py"


def test_the_audit_tells_a_private_run_from_one_without_noise(tmp_path: Path) -> None:
    out = tmp_path / "audit.json"
    res = subprocess.run([sys.executable, str(SCRIPT), "--quick", "--json", str(out)], capture_output=True, text=True,
                         timeout=900)
    assert res.returncode == 0, res.stderr[-3000:]
    got = json.loads(out.read_text())
    nonprivate = got["nonprivate_empirical_epsilon"]
    for key in ("central", "dpftrl"):
        emp, acc = got[f"{key}_empirical_epsilon"], got[f"{key}_accounted_epsilon"]
        assert acc <= 8.0 * (1 + 1e-6)
        assert emp <= acc, (key, emp, acc)
        assert nonprivate > 4 * acc > emp, (key, nonprivate, emp)
    for case in got["cases"]:
        assert case["observed_canaries"] >= 10 and case["dimension"] > 1000
