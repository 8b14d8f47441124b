"""A study, planned and checked before any trial starts.

:func:`plan_study` reads the simulation config and the ``[tune]`` table, applies the
command's overrides, and refuses the plan with every problem at once (each naming its
key): the config's own, the space's, a budget that is missing, an objective the task
does not report.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from orchard.errors import ConfigError
from orchard.simulation.tune.objective import TrialSetup, objective_problems
from orchard.simulation.tune.space import parse_tune_spec, space_problems
from orchard.simulation.tune.study import storage_url


def plan_study(sim_data: dict[str, Any], tune_data: dict[str, Any], out: Path, *,
               overrides: dict[str, Any] | None = None, storage: str | None = None,
               study_name: str | None = None, tensorboard: Path | None = None, mlflow_uri: str | None = None,
               mlflow_experiment: str = "orchard") -> TrialSetup:
    """The checked :class:`TrialSetup`; ``overrides`` replace ``[tune]`` fields (None: not
    given). The study's storage defaults to ``out/study.db`` (SQLite), its name to
    ``tune``."""
    from orchard.simulation.config import build_simulation_config, simulation_problems

    base = simulation_problems(sim_data)
    if base:
        raise ConfigError(base)
    raw = dict(tune_data.get("tune", {})) if isinstance(tune_data.get("tune"), dict) else tune_data.get("tune")
    if isinstance(raw, dict):
        raw.update({k: v for k, v in (overrides or {}).items() if v is not None})
    spec, problems = parse_tune_spec({"tune": raw} if raw is not None else {})
    if spec is None:
        raise ConfigError(problems)
    rounds = build_simulation_config(sim_data, {}).rounds
    problems = space_problems(spec, sim_data, rounds)
    if problems:
        raise ConfigError(problems)
    out.mkdir(parents=True, exist_ok=True)
    setup = TrialSetup(sim_data=sim_data, spec=spec,
                       storage_url=storage_url(storage if storage is not None else str(out / "study.db")),
                       study_name=study_name or "tune", rounds=rounds,
                       tensorboard=None if tensorboard is None else str(tensorboard.resolve()),
                       mlflow_uri=mlflow_uri, mlflow_experiment=mlflow_experiment)
    problems = objective_problems(setup)
    if problems:
        raise ConfigError(problems)
    return setup
