"""`orchard tasks list`, and --task taking an import path in every command."""

import json

import pytest
from typer.testing import CliRunner

from orchard.cli.app import app
from orchard.cli.common import out

MODULE = '''
import numpy as np
from torch import nn
from orchard.tasks import IID, make_task

def build(*, hidden: int = 8, rows: int = 240):
    """Two blobs, a user's own."""
    rng = np.random.default_rng(1)
    y = rng.integers(0, 2, rows)
    x = (rng.normal(size=(rows, 4)) + 2.0 * y[:, None]).astype(np.float32)
    return make_task(name="blobs", model=lambda: nn.Sequential(nn.Linear(4, hidden), nn.ReLU(), nn.Linear(hidden, 2)),
                     data=(x, y), partitioner=IID(), params={"hidden": hidden, "rows": rows})
'''


def test_tasks_list_shows_builtins_and_an_import_path(tmp_path, monkeypatch) -> None:
    (tmp_path / "blobs_task.py").write_text(MODULE)
    monkeypatch.chdir(tmp_path)  # found from the folder the command runs in, as `python -m` would
    # The CLI's console takes its width when first built (COLUMNS of whichever test built it
    # first in this process): set it wide, so no name is folded across lines.
    monkeypatch.setattr(out, "width", 200)
    res = CliRunner().invoke(app, ["tasks", "list", "--task", "blobs_task:build"])
    assert res.exit_code == 0, res.output
    for text in ("digits", "shakespeare", "orchard.tasks.heart:build", "blobs_task:build", "hidden=8", "rows=240",
                 "Two blobs, a user's own."):
        assert text in res.output, text


def test_baseline_takes_an_import_path_and_its_parameters(tmp_path, monkeypatch) -> None:
    (tmp_path / "blobs_task.py").write_text(MODULE)
    monkeypatch.chdir(tmp_path)
    res = CliRunner().invoke(app, ["baseline", "--task", "blobs_task:build", "--task-param", "hidden=16",
                                   "--epochs", "30"])
    assert res.exit_code == 0, res.output
    out = json.loads(res.stdout)
    assert out["params"] == {"hidden": 16, "rows": 240}
    assert out["accuracy"] > 0.9 > out["initial_accuracy"]


def test_a_task_that_does_not_resolve_is_one_line(tmp_path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    res = CliRunner().invoke(app, ["baseline", "--task", "nowhere_module:build"])
    assert res.exit_code == 2
    assert "module 'nowhere_module' cannot be imported" in res.output and "Traceback" not in res.output


SAMPLED = MODULE.replace("from orchard.tasks import IID, make_task", "from orchard.tasks import Dirichlet, make_task") \
    .replace("partitioner=IID()", "partitioner=Dirichlet(alpha=1.0, samples_per_client=20)")


def _simulate_from_a_folder(tmp_path, backend: str) -> dict:
    """`orchard simulate` run from the folder that holds the task's module, not installed:
    every worker must import it as the command did."""
    import os
    import subprocess
    import sys

    (tmp_path / "blobs_task.py").write_text(SAMPLED)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    res = subprocess.run([sys.executable, "-m", "orchard.cli", "simulate", "--task", "blobs_task:build",
                          "--backend", backend, "--workers", "2", "--clients", "60", "--clients-per-round", "10",
                          "--rounds", "2", "--out", "out"],
                         cwd=tmp_path, env={**env, "RAY_USAGE_STATS_ENABLED": "0"}, capture_output=True, text=True,
                         timeout=600)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    return json.loads((tmp_path / "out" / "report.json").read_text())


def test_process_workers_import_a_module_from_the_commands_folder(tmp_path) -> None:
    report = _simulate_from_a_folder(tmp_path, "process")
    assert report["backend"] == "process" and report["status"] == "completed"
    assert report["final_accuracy"] > 0.8


@pytest.mark.slow
def test_ray_workers_import_a_module_from_the_commands_folder(tmp_path) -> None:
    pytest.importorskip("ray")
    report = _simulate_from_a_folder(tmp_path, "ray")
    assert report["backend"] == "ray" and report["status"] == "completed"
