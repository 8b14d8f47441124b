"""The real launcher: ``torchrun --standalone --nproc-per-node 2 -m orchard.pretrain`` and
SIGTERM to torchrun, which forwards it to both workers. Slow: three launches."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from orchard.pretrain import checkpoint
from tests.pretrain.flags import cli_flags

pytestmark = pytest.mark.slow


def _torchrun(cfg, **popen) -> subprocess.Popen:
    exe = shutil.which("torchrun", path=str(Path(sys.executable).parent)) or "torchrun"
    args = [exe, "--standalone", "--nproc-per-node", "2", "-m", "orchard.pretrain"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.Popen(args + cli_flags(cfg.model_dump(mode="json")), env=env, **popen)


def _run_to_end(cfg) -> list[float]:
    """Run under torchrun to completion; returns this launch's losses from metrics.jsonl."""
    metrics = cfg.output_dir / "metrics.jsonl"
    before = len(metrics.read_text().splitlines()) if metrics.is_file() else 0
    proc = _torchrun(cfg, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    out, _ = proc.communicate(timeout=240)
    assert proc.returncode == 0, out
    rows = [json.loads(line) for line in metrics.read_text().splitlines()[before:]]
    return [r["loss"] for r in rows]


def test_torchrun_sigterm_then_resume_matches_uninterrupted(tmp_path, tiny_config) -> None:
    # log_every far away: both ranks must agree, step by step, on when to stop.
    base = {"steps": 100000, "checkpoint_every": 2, "log_every": 100000, "eval_batches": 0}
    out = tmp_path / "stopped"
    proc = _torchrun(
        tiny_config(out, **base), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True
    )
    deadline = time.monotonic() + 180
    while not (out / "checkpoints" / "latest").is_file():
        assert proc.poll() is None, proc.communicate()[1]
        assert time.monotonic() < deadline, "no checkpoint in time"
        time.sleep(0.1)
    proc.send_signal(signal.SIGTERM)
    proc.communicate(timeout=120)
    stopped = checkpoint.latest(out / "checkpoints")
    k = int((stopped / "done").read_text())

    # It stopped at the step it checkpointed, with that step's losses logged.
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, k + 1))
    resumed = _run_to_end(tiny_config(out, stop_after=3, **base))
    straight = _run_to_end(tiny_config(tmp_path / "straight", stop_after=k + 3, **base))
    assert len(resumed) == 3 and len(straight) == k + 3
    assert straight[:k] == [r["loss"] for r in rows]
    assert straight[k:] == resumed
