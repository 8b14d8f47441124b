"""``orchard validate CONFIG``: every problem in a run (or simulation) config, at once.

Like the CLI, this sits at the top of the dependency graph and imports the codec and
task registries lazily.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from orchard.config import RunConfig, load_toml, parse_run_config
from orchard.errors import ConfigError


def run_problems(cfg: RunConfig) -> list[str]:
    from orchard.server.validation import run_config_problems
    from orchard.tasks.registry import task_problems

    problems = run_config_problems(cfg) + task_problems(cfg.task, cfg.task_params)
    if cfg.personalization.enabled and not problems:
        problems += personalization_problems(cfg)
    if cfg.continual is not None and not problems:
        from orchard.tasks.stream import continual_problems

        problems += continual_problems(cfg)
    return problems


def personalization_problems(cfg: RunConfig) -> list[str]:
    """A personal adapter needs a held-out split on every device (the task is built to see)."""
    from orchard.client.personal import held_out_problems
    from orchard.tasks.registry import get_task

    try:
        task = get_task(cfg.task, **cfg.task_params)
    except ConfigError as err:
        return [f"task: {p}" for p in err.problems]
    return held_out_problems(task, cfg.task)


def data_problems(data: dict[str, Any]) -> list[str]:
    """Problems in a parsed config dict: a run config at the top or under [run], or a [simulation]."""
    problems: list[str] = []
    if "simulation" in data:
        try:
            from orchard.simulation.config import simulation_problems
        except ImportError:
            return ["simulation: this installation has no simulator"]
        return simulation_problems(data)
    try:
        cfg = parse_run_config(data.get("run", data))
    except ConfigError as err:
        return list(err.problems)
    problems += run_problems(cfg)
    if isinstance(data.get("policy"), dict) and data["policy"].get("replay") is not None:
        from orchard.tasks.stream import continual_problems

        # A device policy beside the run: its replay budget sized by the run's task's samples.
        problems += continual_problems(cfg.model_copy(update={"continual": None}), data["policy"])
    return problems


def config_problems(path: str | Path) -> list[str]:
    try:
        data = load_toml(path)
    except ConfigError as err:
        return list(err.problems)
    return data_problems(data)
