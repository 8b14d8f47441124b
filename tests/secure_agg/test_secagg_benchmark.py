"""``benchmarks/secagg.py`` at a toy size: every run's sum equals the plain sum, the
keystream bound counts the masks the server really expanded (and the fold floor, the
same masks at the mask folder's speed), and ``--repeat`` runs each
configuration that many times, with the key and unmasking stages batched or interleaved."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "secagg.py"


@pytest.mark.parametrize("mode", [[], ["--interleave"]])
def test_toy_runs_are_correct_and_repeated(tmp_path: Path, mode: list[str]) -> None:
    out = tmp_path / "secagg.json"
    res = subprocess.run([sys.executable, str(SCRIPT), "--n", "12", "--d", "2000", "--dropout", "0", "0.25",
                          "--repeat", "2", *mode, "--json", str(out)], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    rows = json.loads(out.read_text())
    assert [(r["n"], r["dropout"]) for r in rows] == [(12, 0.0), (12, 0.0), (12, 0.25), (12, 0.25)]
    assert all(r["correct"] for r in rows)
    for r in rows:
        dropped = 12 - r["contributors"]
        # One self mask per survivor; each dropped node's pairwise masks with its surviving
        # neighbours (at most k of them, and at least one when anyone dropped).
        masks = r["mask_bytes"] / (4 * r["d"])
        assert r["contributors"] <= masks <= r["contributors"] + dropped * r["neighbours"]
        assert (masks > r["contributors"]) == (dropped > 0)
        assert r["bound_ratio"] == r["server_seconds"] / r["keystream_bound_seconds"]
        # The fold floor: the same masks at the mask folder's own speed (keystream and add),
        # which cannot beat the keystream alone.
        assert 0 < r["fold_gbps_per_core"] <= 1.05 * r["keystream_gbps_per_core"]
        assert r["fold_bound_seconds"] == pytest.approx(r["mask_bytes"] / (r["fold_gbps_per_core"] * 1e9 * r["cores"]))
        assert r["fold_ratio"] == pytest.approx(r["server_seconds"] / r["fold_bound_seconds"])
    assert "medians of 2 runs:" in res.stdout
    assert res.stdout.count("n=12 d=2000") == 2


@pytest.mark.parametrize("credentials", ["roster", "certificate"])
def test_compare_adversary_reports_the_criterion_keys(tmp_path: Path, credentials: str) -> None:
    out = tmp_path / "secagg.json"
    res = subprocess.run([sys.executable, str(SCRIPT), "--n", "12", "--d", "2000", "--dropout", "0.25",
                          "--mask-workers", "0", "--compare-adversary", "--credentials", credentials,
                          "--json", str(out)], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    got = json.loads(out.read_text())
    assert {"active_vs_semi_honest_server_time_ratio", "active_client_extra_seconds"} <= got.keys()
    assert [(r["adversary"], r["credentials"]) for r in got["rows"]] == [("semi_honest", ""), ("active", credentials)]
    assert all(r["correct"] for r in got["rows"])
    # The client's extra is CPU time (thread time in its protocol steps); wall time apart.
    semi, act = got["rows"]
    assert got["active_client_extra_seconds"] == act["client_cpu_seconds"] - semi["client_cpu_seconds"]
    assert got["active_client_extra_wall_seconds"] == act["client_seconds"] - semi["client_seconds"]
