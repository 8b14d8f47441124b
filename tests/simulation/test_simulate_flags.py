"""`orchard simulate` from flags alone: every shipped task runs without a config file."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from orchard.cli import app
from orchard.errors import ConfigError
from orchard.simulation.defaults import fit_population
from orchard.tasks.params import parse_task_params


def test_task_params_are_typed() -> None:
    assert parse_task_params(["alpha=0.1", "with_replacement=true", "base=random", "n=3", "s='x y'"]) == {
        "alpha": 0.1, "with_replacement": True, "base": "random", "n": 3, "s": "x y"}
    with pytest.raises(ConfigError, match="KEY=VALUE"):
        parse_task_params(["alpha"])


def test_a_population_beyond_the_data_draws_with_replacement() -> None:
    fit = fit_population({}, {"run.task": "digits", "clients": 10_000})
    assert fit.overrides == {"run.task_params.with_replacement": True}
    assert "1438 training examples" in fit.notes[0] and "with replacement" in fit.notes[0]
    # A population the default split can serve is left alone.
    assert fit_population({}, {"run.task": "digits", "clients": 200}).overrides == {}


def test_an_explicit_choice_is_kept() -> None:
    with pytest.raises(ConfigError, match="exceeds the 1438 training examples"):
        fit_population({}, {"run.task": "digits", "clients": 10_000, "run.task_params.with_replacement": False})


def test_natural_clients_are_the_default_population() -> None:
    fit = fit_population({}, {"run.task": "heart"})
    assert fit.overrides == {"clients": 4, "devices": {"edge_box": 1.0}, "clients_per_round": 4}
    with pytest.raises(ConfigError, match="exactly 4 natural clients"):
        fit_population({}, {"run.task": "heart", "clients": 10})


@pytest.mark.parametrize("task", ["digits", "mnist", "heart"])
def test_simulate_runs_from_flags_alone(task: str, tmp_path) -> None:
    args = ["simulate", "--task", task, "--rounds", "1", "--out", str(tmp_path)]
    if task != "heart":
        args += ["--clients-per-round", "10"]
    res = CliRunner().invoke(app, args)
    assert res.exit_code == 0, res.output
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["status"] == "completed" and len(report["rounds"]) == 1


def test_the_issue_command_runs(tmp_path) -> None:
    res = CliRunner().invoke(app, ["simulate", "--task", "digits", "--clients", "10000", "--clients-per-round", "20",
                                   "--rounds", "1", "--out", str(tmp_path)])
    assert res.exit_code == 0, res.output
    assert "with replacement" in res.output
    assert json.loads((tmp_path / "report.json").read_text())["population"] == 10_000


@pytest.mark.parametrize("flag", ["--shard", "--no-shard"])
def test_simulate_shards_a_tree_on_worker_processes_or_not(flag: str, tmp_path) -> None:
    # The process backend over a tree: sharded (the workers run part of the tree) by
    # default, or with the workers only training; the same report either way.
    args = ["simulate", "--task", "digits", "--rounds", "1", "--clients-per-round", "10", "--aggregators", "2",
            "--backend", "process", "--workers", "1", flag, "--out", str(tmp_path)]
    res = CliRunner().invoke(app, args)
    assert res.exit_code == 0, res.output
    report = json.loads((tmp_path / "report.json").read_text())
    phases = report["rounds"][0]["phase_seconds"]
    assert ("worker_arrivals" in phases) == (flag == "--shard")
    why = "sharded rounds" if flag == "--shard" else "rounds not sharded: shard = false"
    assert f"backend: process (1 worker; as configured, {why})" in res.output
    assert report["status"] == "completed" and report["rounds"][0]["participants"] == 10
