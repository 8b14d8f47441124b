"""``benchmarks/privacy.py`` at a toy size: the robustness cases run for their own number
of rounds and are read against a clean run of that length, not the shorter DP baseline."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "privacy.py"


def test_attacks_are_read_against_a_clean_run_of_their_length(tmp_path: Path) -> None:
    out = tmp_path / "privacy.json"
    res = subprocess.run([sys.executable, str(SCRIPT), "--task", "digits", "--population", "60", "--per-round", "10",
                          "--aggregators", "1", "--rounds", "2", "--robust-rounds", "3", "--seeds", "0", "1",
                          "--epsilons", "--only", "sign_flip, norm", "--json", str(out)],
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    got = json.loads(out.read_text())
    assert got["complete"] and got["rounds"] == 2 and got["robust_rounds"] == 3
    # Only the asked case and what it is read against: the 2-round baseline is not run.
    clean, attacked = got["cases"]
    assert (clean["case"], attacked["case"]) == ("no attack, 3 rounds", "10% sign_flip, norm bound")
    assert clean["rounds"] == attacked["rounds"] == 3
    assert clean["reference"] is None and attacked["reference"] == clean["case"]
    assert attacked["accuracy_minus_reference"] == round(attacked["accuracy"] - clean["accuracy"], 4)
    diffs = [a["accuracy"] - c["accuracy"] for a, c in zip(attacked["per_seed"], clean["per_seed"], strict=True)]
    assert attacked["paired_minus_reference"][0] == round(sum(diffs) / 2, 4)


def test_equal_lengths_read_the_attacks_against_the_non_private_run(tmp_path: Path) -> None:
    out = tmp_path / "privacy.json"
    res = subprocess.run([sys.executable, str(SCRIPT), "--task", "digits", "--population", "60", "--per-round", "10",
                          "--aggregators", "1", "--rounds", "2", "--robust-rounds", "2", "--seeds", "0",
                          "--epsilons", "--only", "scale, no defence", "--json", str(out)],
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    names = [(c["case"], c["reference"]) for c in json.loads(out.read_text())["cases"]]
    assert names == [("non-private", None), ("10% scale, no defence", "non-private")]
