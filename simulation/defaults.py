"""Defaults that let ``orchard simulate`` run every shipped task from flags alone.

A config file says how a population is split (``task_params``); flags alone do not, so
``orchard simulate --task digits --clients 10000`` would ask a without-replacement
Dirichlet split for 10,000 clients of 1,438 examples and stop. The rules here fill in
only what the user left unsaid, and say what they chose:

- a task with a fixed set of natural clients (heart's 4 hospitals) takes that set as
  its population when no population is given, as always-on edge boxes;
- a population that the task's default split cannot serve, for a task that can draw
  with replacement (digits, mnist), draws with replacement (each client a fixed number
  of examples under its own Dirichlet class mix): the population is then unbounded;
- the number of clients per round is capped at the population when it was not given.

Whatever the user set (a flag, ``--task-param``, or the config's own table) is kept as
it is: an explicit ``with_replacement = false`` still fails with the task's message.
"""

from __future__ import annotations

import tomllib
from dataclasses import dataclass, field
from typing import Any

from orchard.config import RunConfig
from orchard.errors import ConfigError
from orchard.simulation.config import merged_simulation_table


def parse_task_params(items: list[str] | None) -> dict[str, Any]:
    """``["alpha=0.1", "with_replacement=true", "base=random"]`` as typed values.

    Each value is read as a TOML value (numbers, booleans, quoted strings, arrays) and
    taken as a plain string when it is not one, so ``base=random`` needs no quotes."""
    out: dict[str, Any] = {}
    for item in items or []:
        key, sep, raw = item.partition("=")
        key = key.strip()
        if not sep or not key:
            raise ConfigError(f"--task-param takes KEY=VALUE (e.g. --task-param alpha=0.1), got {item!r}")
        try:
            out[key] = tomllib.loads(f"v = {raw.strip()}")["v"]
        except tomllib.TOMLDecodeError:
            out[key] = raw.strip()
    return out


@dataclass
class PopulationFit:
    """Overrides to add to the simulation's, and one line per choice made."""

    overrides: dict[str, Any] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)


def fit_population(data: dict[str, Any], overrides: dict[str, Any]) -> PopulationFit:
    """What to add to ``overrides`` so that the simulation's task can split its population.

    ``data`` is the parsed TOML (possibly empty), ``overrides`` the dotted flag overrides
    (None: not given). Raises the task's own ConfigError when no default can help."""
    from orchard.simulation.config import SimulationConfig
    from orchard.tasks import get_task, task_params

    sim = merged_simulation_table(data, overrides)
    run = sim.get("run", {})
    task_name = run.get("task", RunConfig().task)
    params = dict(run.get("task_params", {}))
    seed = int(sim.get("seed", SimulationConfig.model_fields["seed"].default))
    fit = PopulationFit()
    task = get_task(task_name, **params)

    natural = task.info.get("clients")
    if "clients" in sim:
        clients = int(sim["clients"])
    elif isinstance(natural, list) and natural:
        clients = len(natural)
        fit.overrides["clients"] = clients
        fit.notes.append(f"{task_name} has {clients} natural clients ({', '.join(map(str, natural))}): "
                         f"population {clients}")
        if "devices" not in sim:
            # Natural clients are institutions (hospitals), online all day, not phones.
            fit.overrides["devices"] = {"edge_box": 1.0}
            fit.notes.append("its clients are always-on edge boxes")
    else:
        clients = int(SimulationConfig.model_fields["clients"].default)

    try:
        task.partition(clients, seed)
    except ConfigError:
        if "with_replacement" not in task_params(task_name) or "with_replacement" in params:
            raise
        sampled = get_task(task_name, **params, with_replacement=True)
        sampled.partition(clients, seed)  # raises the task's message if this cannot help either
        fit.overrides["run.task_params.with_replacement"] = True
        per = sampled.params.get("samples_per_client")
        fit.notes.append(f"{clients} clients exceed what {task_name}'s {len(task.train_labels)} training examples "
                         f"split without replacement: each client draws {per} examples with replacement "
                         "(--task-param with_replacement=false to refuse, samples_per_client=N to change)")

    per_round_default = int(SimulationConfig.model_fields["clients_per_round"].default)
    if "clients_per_round" not in sim and per_round_default > clients:
        fit.overrides["clients_per_round"] = clients
        fit.notes.append(f"{clients} clients per round (the whole population)")
    return fit
