"""A study survives its worker dying and its own process being killed with SIGKILL.

One study of four trials, one at a time: the worker running the first trial is killed
mid-trial (the driver fails that trial and retries it once); later the study's process
itself is killed mid-trial (the trial it ran is left running, with no heartbeat); a
restart keeps the finished trials, fails the interrupted one, reruns it with the same
parameters, and ends with the budget's four trials.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psutil
import pytest
from tune_cases import sim_table, trials, tune_table, write


def _wait_for(db: Path, pred: Callable[[list[Any]], bool], proc: subprocess.Popen[bytes], what: str,
              timeout: float = 240.0) -> list[Any]:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        ts = trials(db)
        if pred(ts):
            return ts
        if proc.poll() is not None:
            raise AssertionError(f"the study ended (rc {proc.returncode}) before {what}: {proc.stdout and proc.stdout.read()}")
        time.sleep(0.1)
    raise AssertionError(f"no {what} within {timeout} s")


def _running_mid_trial(ts: list[Any]) -> Any:
    from optuna.trial import TrialState

    return next((t for t in ts if t.state == TrialState.RUNNING and t.intermediate_values), None)


def _tune(sim: Path, space: Path, out: Path) -> subprocess.Popen[bytes]:
    return subprocess.Popen([sys.executable, "-m", "orchard.cli", "tune", "--config", str(sim), "--space", str(space),
                             "--out", str(out)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT)


@pytest.mark.slow  # a few minutes on a shared 2-core host (spawned workers, several studies)
def test_a_dead_worker_and_a_killed_study_lose_nothing(tmp_path: Path) -> None:
    from optuna.trial import TrialState

    sim, space = write(tmp_path, sim_table(rounds=6), tune_table(4, pruner="none", sampler="random"))
    out = tmp_path / "out"
    db = out / "study.db"
    proc = _tune(sim, space, out)
    try:
        # 1. The worker dies mid-trial: the driver fails its trial and queues one retry.
        first = _running_mid_trial(_wait_for(db, lambda ts: _running_mid_trial(ts) is not None, proc, "a trial mid-run"))
        workers = [c for c in psutil.Process(proc.pid).children() if "spawn_main" in " ".join(c.cmdline())]
        assert len(workers) == 1, workers
        workers[0].kill()
        retried = _wait_for(db, lambda ts: any(t.system_attrs.get("failed_trial") == first.number for t in ts),
                            proc, "the dead worker's trial retried")
        assert retried[first.number].state == TrialState.FAIL
        # 2. SIGKILL the study's process once a trial has completed and another is mid-run.
        ts = _wait_for(db, lambda ts: any(t.state == TrialState.COMPLETE for t in ts)
                       and _running_mid_trial(ts) is not None, proc, "a completed trial and one mid-run")
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(30)
    finally:
        if proc.poll() is None:
            proc.kill()
    completed = {t.number: (t.value, t.params) for t in ts if t.state == TrialState.COMPLETE}
    interrupted = _running_mid_trial(ts)
    assert interrupted is not None
    # 3. Restart: finished trials kept, the interrupted one failed and rerun, the budget met.
    again = _tune(sim, space, out)
    output = again.communicate(timeout=300)[0].decode()
    assert again.returncode == 0, output
    final = trials(db)
    for number, (value, params) in completed.items():
        assert final[number].state == TrialState.COMPLETE and (final[number].value, final[number].params) == (value, params)
    assert final[interrupted.number].state == TrialState.FAIL
    reruns = [t for t in final if t.system_attrs.get("failed_trial") == interrupted.number]
    assert len(reruns) == 1 and reruns[0].state == TrialState.COMPLETE, [(t.number, t.state) for t in final]
    assert reruns[0].params == interrupted.params
    assert sum(t.state == TrialState.COMPLETE for t in final) == 4, [(t.number, t.state) for t in final]
    assert not any(t.state in (TrialState.RUNNING, TrialState.WAITING) for t in final)
    assert (out / "best.toml").is_file() and (out / "intermediate_values.png").is_file()
