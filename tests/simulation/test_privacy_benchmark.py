"""``benchmarks/privacy.py`` at a toy size: the robustness cases run for their own number
of rounds and are read against a clean run of that length, not the shorter DP baseline;
testing the model along the way does not change the run."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "privacy.py"
TOY = ["--task", "digits", "--population", "60", "--per-round", "10", "--aggregators", "1", "--epsilons"]


def _bench(tmp_path: Path, *args: str) -> dict[str, Any]:
    out = tmp_path / "privacy.json"
    res = subprocess.run([sys.executable, str(SCRIPT), *TOY, *args, "--json", str(out)],
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    got: dict[str, Any] = json.loads(out.read_text())
    return got


def test_attacks_are_read_against_a_clean_run_of_their_length(tmp_path: Path) -> None:
    got = _bench(tmp_path, "--rounds", "2", "--robust-rounds", "3", "--eval-every", "2", "--seeds", "0", "1",
                 "--only", "sign_flip, norm")
    assert got["complete"] and got["rounds"] == 2 and got["robust_rounds"] == 3
    # Only the asked case and what it is read against: the 2-round baseline is not run.
    clean, attacked = got["cases"]
    assert (clean["case"], attacked["case"]) == ("no attack, 3 rounds", "10% sign_flip, norm bound")
    assert clean["rounds"] == attacked["rounds"] == 3
    assert clean["reference"] is None and attacked["reference"] == clean["case"]
    assert attacked["accuracy_minus_reference"] == round(attacked["accuracy"] - clean["accuracy"], 4)
    diffs = [a["accuracy"] - c["accuracy"] for a, c in zip(attacked["per_seed"], clean["per_seed"], strict=True)]
    assert attacked["paired_minus_reference"][0] == round(sum(diffs) / 2, 4)
    for x in attacked["per_seed"]:  # tested after round 2 and after the last
        assert sorted(x["accuracy_by_round"]) == ["2", "3"] and x["accuracy_by_round"]["3"] == x["accuracy"]

    # Equal lengths: the attacks are read against the non-private run, and the same
    # seed's attacked run, now tested only at its end, ends where it did.
    again = _bench(tmp_path, "--rounds", "3", "--robust-rounds", "3", "--seeds", "0", "--only", "sign_flip, norm")
    assert [(c["case"], c["reference"]) for c in again["cases"]] == [
        ("non-private", None), ("10% sign_flip, norm bound", "non-private")]
    assert again["cases"][1]["per_seed"][0]["accuracy"] == attacked["per_seed"][0]["accuracy"]
    assert again["cases"][0]["per_seed"][0]["accuracy"] == clean["per_seed"][0]["accuracy"]
