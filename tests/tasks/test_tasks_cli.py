"""`orchard tasks list`, and --task taking an import path in every command."""

import json

from typer.testing import CliRunner

from orchard.cli.app import app

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
    res = CliRunner().invoke(app, ["tasks", "list", "--task", "blobs_task:build"], env={"COLUMNS": "200"})
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
