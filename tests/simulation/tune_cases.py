"""Small studies for the tune tests: a config, a space, and the study's trials read back."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import tomli_w


def sim_table(rounds: int = 4, clients_per_round: int = 4, **extra: Any) -> dict[str, Any]:
    return {"simulation": {
        "clients": 40, "clients_per_round": clients_per_round, "rounds": rounds, "seed": 3, "governor": False,
        "backend": "local", "progress": False, **extra,
        "run": {"task": "digits", "task_params": {"with_replacement": True, "samples_per_client": 20},
                "train": {"epochs": 1, "batch_size": 10, "learning_rate": 0.1},
                "cohort": {"over_selection": 1.0, "min_fraction": 0.5, "deadline_s": 60.0}}}}


def tune_table(trials: int, **extra: Any) -> dict[str, Any]:
    return {"tune": {"trials": trials, "parallel": 1, "heartbeat_s": 1, "grace_s": 6, "startup_trials": 2,
                     **extra, "space": {
                         "run.train.learning_rate": {"kind": "log_uniform", "low": 0.05, "high": 0.5},
                         "run.server_optimizer.name": {"kind": "categorical", "choices": ["fedavg", "fedavgm"]}}}}


def write(tmp: Path, sim: dict[str, Any], tune: dict[str, Any]) -> tuple[Path, Path]:
    (tmp / "sim.toml").write_text(tomli_w.dumps(sim))
    (tmp / "space.toml").write_text(tomli_w.dumps(tune))
    return tmp / "sim.toml", tmp / "space.toml"


def trials(db: Path, name: str = "tune") -> list[Any]:
    """The study's trials, read from its SQLite file (empty while it does not exist yet)."""
    import optuna

    if not db.is_file():
        return []
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    try:
        return optuna.load_study(study_name=name, storage=f"sqlite:///{db}").get_trials(deepcopy=False)
    except KeyError:  # the study is not created yet
        return []
