"""Every fuzz target (``fuzz/``) runs a short budget from its committed seeds: no crash, no
hang, no unexpected exception. ``make fuzz`` runs the long one (docs/fuzzing.md).

Each target runs as its own process: atheris's engine takes over the process it runs in
and ends it when the budget is spent."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "fuzz"))

from targets import TARGETS  # noqa: E402

pytest.importorskip("atheris")

RUNS = 2000
SECONDS = 1


def test_every_target_has_seeds() -> None:
    for t in TARGETS:
        assert any((REPO / "fuzz" / "corpus" / t.name).iterdir()), f"{t.name} has no seed corpus"


@pytest.mark.parametrize("target", [t.name for t in TARGETS])
def test_a_short_fuzz_run_finds_nothing(target: str, tmp_path: Path) -> None:
    cmd = [sys.executable, str(REPO / "fuzz" / "run.py"), target, f"-runs={RUNS}", f"-max_total_time={SECONDS}",
           "-timeout=30", f"-artifact_prefix={tmp_path}/", str(tmp_path), str(REPO / "fuzz" / "corpus" / target)]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=240)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0 and "Done " in out, f"{target} failed (rc {proc.returncode}):\n{out[-4000:]}"
    assert not list(tmp_path.glob("crash-*")) and not list(tmp_path.glob("timeout-*"))
