"""``[tune]``: every bad space, budget or objective refused before a trial starts, by key."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest

from orchard.errors import ConfigError
from orchard.simulation.tune import plan_study

SIM: dict[str, Any] = {"simulation": {
    "clients": 40, "clients_per_round": 8, "rounds": 4, "seed": 3, "governor": False,
    "run": {"task": "digits", "task_params": {"with_replacement": True, "samples_per_client": 20},
            "train": {"epochs": 1, "batch_size": 10, "learning_rate": 0.1}}}}


def _tune(space: dict[str, Any], **tune: Any) -> dict[str, Any]:
    return {"tune": {"trials": 4, **tune, "space": space}}


LR = {"kind": "log_uniform", "low": 0.01, "high": 1.0}


def _problems(tmp_path: Path, tune: dict[str, Any], sim: dict[str, Any] | None = None) -> list[str]:
    with pytest.raises(ConfigError) as err:
        plan_study(copy.deepcopy(sim or SIM), tune, tmp_path)
    return err.value.problems


def test_a_good_space_plans(tmp_path: Path) -> None:
    setup = plan_study(SIM, _tune({"run.train.learning_rate": LR,
                                   "run.cohort.target": {"kind": "int", "low": 4, "high": 8, "step": 2},
                                   "run.server_optimizer.name": {"kind": "categorical", "choices": ["fedavg", "fedadam"]},
                                   "run.task_params.alpha": {"kind": "uniform", "low": 0.1, "high": 1.0}}),
                       tmp_path)
    assert setup.rounds == 4 and setup.storage_url.startswith("sqlite:///")
    assert setup.spec.overrides({"run.cohort.target": 6, "run.train.epochs": 2}) == {
        "clients_per_round": 6, "run.train.epochs": 2}


def test_an_unknown_key_is_named(tmp_path: Path) -> None:
    problems = _problems(tmp_path, _tune({"run.train.learning_rat": LR, "clients": LR, "run.cohort.target": LR}))
    assert any("'run.train.learning_rat': unknown key" in p for p in problems)
    assert any("'clients': unknown key" in p for p in problems)
    # a real key with a float range is checked by the config itself (target is an int)
    assert len(problems) == 3, problems


def test_an_empty_range_is_named(tmp_path: Path) -> None:
    problems = _problems(tmp_path, _tune({"run.train.learning_rate": {"kind": "uniform", "low": 0.5, "high": 0.5},
                                          "run.train.epochs": {"kind": "int", "low": 3, "high": 1},
                                          "run.train.momentum": {"kind": "categorical", "choices": []}}))
    assert any("'run.train.learning_rate': empty range" in p for p in problems)
    assert any("'run.train.epochs': empty range" in p for p in problems)
    assert any("'run.train.momentum': choices is empty" in p for p in problems)


def test_a_value_the_config_refuses_is_named(tmp_path: Path) -> None:
    problems = _problems(tmp_path, _tune({
        "run.server_optimizer.name": {"kind": "categorical", "choices": ["fedavg", "fedsgdx"]},
        "run.cohort.target": {"kind": "int", "low": 4, "high": 80},  # above the population of 40
        "run.task_params.no_such_param": {"kind": "categorical", "choices": [1]}}))
    assert any("'run.server_optimizer.name': the config refuses 'fedsgdx'" in p for p in problems), problems
    assert any("'run.cohort.target': the config refuses 80" in p for p in problems), problems
    assert any("'run.task_params.no_such_param': the config refuses 1" in p for p in problems), problems
    assert not any("fedavg" in p and "refuses 'fedavg'" in p for p in problems)


def test_rounds_and_seed_are_not_searched(tmp_path: Path) -> None:
    problems = _problems(tmp_path, _tune({"run.rounds": {"kind": "int", "low": 1, "high": 3},
                                          "run.seed": {"kind": "int", "low": 1, "high": 3}}))
    assert any("'run.rounds': not searchable" in p for p in problems)
    assert any("'run.seed': not searchable" in p for p in problems)


def test_budget_and_shape_problems(tmp_path: Path) -> None:
    problems = _problems(tmp_path, {"tune": {"space": {"run.train.learning_rate": {"kind": "log_uniform", "low": 0,
                                                                                   "high": 1}}}})
    assert any(p.startswith("tune: no budget") for p in problems)
    assert any("log_uniform range needs low > 0" in p for p in problems)
    problems = _problems(tmp_path, _tune({}, objective="f1", parallel=0))
    assert any(p.startswith("tune.objective") for p in problems)
    assert any(p.startswith("tune.parallel") for p in problems)


def test_the_pruners_first_rung(tmp_path: Path) -> None:
    """Successive halving by default, its first rung at rounds // reduction_factor**2 (at
    least 1) unless min_rounds is set; a first rung at or past the last round is refused."""
    from orchard.simulation.tune.space import TuneSpec
    from orchard.simulation.tune.study import make_pruner

    spec = TuneSpec()
    assert spec.pruner == "successive_halving"
    assert [spec.first_rung(r) for r in (2, 8, 9, 20, 100)] == [1, 1, 1, 2, 11]
    assert TuneSpec(reduction_factor=2).first_rung(20) == 5
    assert TuneSpec(min_rounds=3).first_rung(20) == 3
    assert make_pruner(spec, 20)._min_resource == 2
    assert make_pruner(TuneSpec(pruner="hyperband"), 20)._min_resource == 2
    problems = _problems(tmp_path, _tune({"run.train.learning_rate": LR}, min_rounds=4))
    assert any(p.startswith("tune.min_rounds (4) must be below the config's rounds (4)") for p in problems)
    problems = _problems(tmp_path, _tune({"run.train.learning_rate": LR}),
                         sim={"simulation": {**SIM["simulation"], "rounds": 1}})
    assert any(p.startswith("tune.min_rounds (1) must be below") for p in problems)
    plan_study(SIM, _tune({"run.train.learning_rate": LR}, min_rounds=4, pruner="none"), tmp_path)


def test_an_objective_the_task_does_not_report(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A task whose held-out evaluation has no finite accuracy (a Flower app without an
    evaluate handler reports NaN) is refused before any trial."""
    import orchard.tasks.digits as digits

    real = digits.build

    def no_accuracy(**kw: Any) -> Any:
        task = real(**kw)
        evaluate = task.evaluate
        task.evaluate = lambda arrays, split="test": {"loss": evaluate(arrays, split)["loss"], "accuracy": float("nan")}
        return task

    monkeypatch.setattr(digits, "build", no_accuracy)
    problems = _problems(tmp_path, _tune({"run.train.learning_rate": LR}))
    assert problems and problems[0].startswith("tune.objective: task 'digits' does not report 'accuracy'"), problems
    # loss it reports
    plan_study(SIM, _tune({"run.train.learning_rate": LR}, objective="loss"), tmp_path)


def test_a_bad_base_config_is_reported_first(tmp_path: Path) -> None:
    bad = copy.deepcopy(SIM)
    bad["simulation"]["clients_per_round"] = 400
    problems = _problems(tmp_path, _tune({"run.train.learning_rate": LR}), bad)
    assert any("clients_per_round" in p for p in problems)
