"""The best config of a study is a run config: ``orchard run start --config`` starts a
gRPC run with it unchanged (and ``orchard simulate --config`` runs it)."""

from __future__ import annotations

import json
import sys
import tomllib
from pathlib import Path

import pytest
from operator_harness import LiveRoot
from typer.testing import CliRunner

from orchard.cli import app

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "simulation"))
from tune_cases import sim_table, tune_table, write  # noqa: E402


@pytest.mark.slow  # a few minutes on a shared 2-core host (spawned workers, several studies)
def test_the_best_config_starts_a_grpc_run_and_a_simulation(tmp_path: Path) -> None:
    sim, space = write(tmp_path, sim_table(rounds=2, clients_per_round=3), tune_table(2, pruner="none"))
    out = tmp_path / "out"
    res = CliRunner().invoke(app, ["tune", "--config", str(sim), "--space", str(space), "--out", str(out)])
    assert res.exit_code == 0, res.output
    best = out / "best.toml"
    data = tomllib.loads(best.read_text())
    chosen = json.loads((out / "trials.json").read_text())
    winner = max((t for t in chosen if t["state"] == "complete"), key=lambda t: t["value"])
    assert data["run"]["train"]["learning_rate"] == winner["params"]["run.train.learning_rate"]
    assert data["run"]["server_optimizer"]["name"] == winner["params"]["run.server_optimizer.name"]
    assert data["run"]["cohort"]["target"] == 3 and data["run"]["rounds"] == 2

    live = LiveRoot(tmp_path / "root", clients=3)
    try:
        res = CliRunner().invoke(app, ["run", "start", *live.cli(), "--config", str(best)])
        assert res.exit_code == 0, res.output
        (run,) = json.loads(CliRunner().invoke(app, ["run", "list", *live.cli(), "--json"]).output)
        assert run["status"] == "completed", run
        assert run["config"]["train"]["learning_rate"] == winner["params"]["run.train.learning_rate"]
        assert run["config"]["server_optimizer"]["name"] == winner["params"]["run.server_optimizer.name"]
    finally:
        live.stop()
    res = CliRunner().invoke(app, ["simulate", "--config", str(best), "--out", str(tmp_path / "sim")])
    assert res.exit_code == 0, res.output
    report = json.loads((tmp_path / "sim" / "report.json").read_text())
    assert report["status"] == "completed" and len(report["rounds"]) == 2
