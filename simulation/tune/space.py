"""The ``[tune]`` table: a search space over a simulation's run, an objective, a budget.

A tune file holds one table::

    [tune]
    objective = "accuracy"      # or "loss": the task's held-out evaluation
    at = "last"                 # the trial's value: its last round's, or its best round's
    trials = 32                 # budget: trials that end (complete, pruned, or failed by their config)
    client_rounds = 200000      # budget: client-rounds trained, over every trial
    wall_time_s = 3600          # budget: no trial starts after this
    parallel = 2                # trials at once

    [tune.space."run.train.learning_rate"]
    kind = "log_uniform"        # uniform, log_uniform, int, categorical
    low = 0.01
    high = 1.0

A key names a field of the simulation's ``[run]`` table, dotted (``run.train.epochs``,
``run.server_optimizer.name``, ``run.task_params.alpha``). ``run.cohort.target`` is the
simulation's ``clients_per_round`` (the one place it is set); ``run.rounds`` is the
pruner's resource and ``run.seed`` the trials' common seed, so neither is searched.

:func:`space_problems` returns every problem at once, each naming its key, before any
trial starts: an unknown key, an empty range, a value the config refuses.
"""

from __future__ import annotations

import dataclasses
import typing
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from orchard.config import RunConfig

# Keys of [run] the simulation table sets itself: searched under another name, or not at all.
_RENAMED = {"run.cohort.target": "clients_per_round"}
_FIXED = {
    "run.rounds": "rounds are the pruner's resource: every trial runs the config's [simulation] rounds",
    "run.seed": "every trial runs the config's seed, so that trials differ by their parameters alone",
}


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class Param(_Strict):
    """One dimension of the space: a range (``low``..``high``, both included; ``step``
    for ``int``) or a list of ``choices``."""

    kind: Literal["uniform", "log_uniform", "int", "categorical"]
    low: float | None = None
    high: float | None = None
    step: int | None = Field(None, ge=1)
    choices: list[Any] | None = None

    def probes(self) -> list[Any]:
        """The values the config must accept for this dimension to be searchable: each
        choice, or both ends of the range."""
        if self.kind == "categorical":
            return list(self.choices or [])
        if self.kind == "int":
            return [int(self.low or 0), int(self.high or 0)]
        return [self.low, self.high]

    def suggest(self, trial: Any, key: str) -> Any:
        """The value ``trial`` (an ``optuna.Trial``) draws for ``key``."""
        if self.kind == "categorical":
            return trial.suggest_categorical(key, self.choices)
        assert self.low is not None and self.high is not None  # space_problems checked
        if self.kind == "int":
            return trial.suggest_int(key, int(self.low), int(self.high), step=self.step or 1)
        return trial.suggest_float(key, self.low, self.high, log=self.kind == "log_uniform")


class TuneSpec(_Strict):
    """``[tune]``: what is searched, what is optimised, how much may be spent."""

    objective: Literal["accuracy", "loss"] = "accuracy"
    at: Literal["last", "best"] = "last"
    trials: int | None = Field(None, ge=1)
    client_rounds: int | None = Field(None, ge=1)
    wall_time_s: float | None = Field(None, gt=0)
    parallel: int = Field(1, ge=1)
    sampler: Literal["tpe", "random"] = "tpe"
    # Successive halving by default (asynchronous, as ASHA: Li et al. 2020). Under a
    # client-round budget Hyperband's hedge costs too much: its brackets that prune late
    # or never run most of their trials in full, and each bracket's first trials always
    # do (benchmarks/tune.py and docs/tuning.md have the figures).
    pruner: Literal["hyperband", "successive_halving", "none"] = "successive_halving"
    seed: int = 0  # the sampler's; every trial's simulation runs the config's own seed
    startup_trials: int = Field(10, ge=0)  # TPE samples at random until this many trials ended
    reduction_factor: int = Field(3, ge=2)  # the pruner's: keep one trial in this many per rung
    # The pruner's smallest resource, its first rung; None: rounds // reduction_factor**2
    # (at least 1), so that a trial promoted twice runs to the last rungs. A federation's
    # first round says little (in benchmarks/tune.py's random search, accuracy after round
    # 1 ranks 64 configs by their final accuracy with Spearman 0.59; after round 2, 0.81).
    min_rounds: int | None = Field(None, ge=1)
    # A trial's process records a heartbeat every heartbeat_s; a running trial silent for
    # grace_s is failed (and retried once) by whoever looks next.
    heartbeat_s: int = Field(10, ge=1)
    grace_s: int = Field(60, ge=2)
    space: dict[str, Param] = Field(default_factory=dict)

    def first_rung(self, rounds: int) -> int:
        """The round of the pruner's first rung, for a config of ``rounds`` rounds."""
        if self.min_rounds is not None:
            return self.min_rounds
        return max(1, rounds // self.reduction_factor**2)

    @property
    def direction(self) -> str:
        return "maximize" if self.objective == "accuracy" else "minimize"

    def overrides(self, params: dict[str, Any]) -> dict[str, Any]:
        """A trial's parameters as dotted overrides of the ``[simulation]`` table."""
        return {_RENAMED.get(k, k): v for k, v in params.items()}


def parse_tune_spec(data: dict[str, Any]) -> tuple[TuneSpec | None, list[str]]:
    """The ``[tune]`` table of a parsed TOML file, or every problem with its shape."""
    raw = data.get("tune")
    if not isinstance(raw, dict):
        return None, ["tune: no [tune] table in this file (see docs/tuning.md)"]
    try:
        return TuneSpec.model_validate(raw), []
    except ValidationError as err:
        return None, [f"tune.{'.'.join(str(p) for p in e['loc'])}: {e['msg']}" for e in err.errors()]


def _fields(cls: Any) -> dict[str, Any] | None:
    """A table type's fields and their annotations: a pydantic model's or a dataclass's
    (``TrainConfig``); None for anything else."""
    if isinstance(cls, type) and issubclass(cls, BaseModel):
        return {k: f.annotation for k, f in cls.model_fields.items()}
    if isinstance(cls, type) and dataclasses.is_dataclass(cls):
        return typing.get_type_hints(cls)
    return None


def _known(cls: Any, parts: list[str]) -> bool:
    """Whether the dotted path ``parts`` names a field below the table type ``cls`` (any
    key below a free-form table such as ``task_params``)."""
    fields = _fields(cls)
    if fields is None or parts[0] not in fields:
        return False
    if len(parts) == 1:
        return True
    for inner in (fields[parts[0]], *typing.get_args(fields[parts[0]])):
        if inner is dict or typing.get_origin(inner) is dict:
            return True
        if _fields(inner) is not None:
            return _known(inner, parts[1:])
    return False


def _shape_problems(key: str, p: Param) -> list[str]:
    name = f"tune.space.{key!r}"
    if p.kind == "categorical":
        if p.low is not None or p.high is not None or p.step is not None:
            return [f"{name}: a categorical dimension takes choices = [...], not low/high/step"]
        if not p.choices:
            return [f"{name}: choices is empty; list at least one value"]
        bad = [c for c in p.choices if not isinstance(c, (str, int, float, bool))]
        if bad:
            return [f"{name}: choices must be strings, numbers or booleans, got {bad[:3]}"]
        return []
    if p.choices is not None:
        return [f"{name}: a {p.kind} dimension takes low and high, not choices"]
    if p.low is None or p.high is None:
        return [f"{name}: a {p.kind} dimension needs low and high"]
    if p.kind == "int" and (p.low != int(p.low) or p.high != int(p.high)):
        return [f"{name}: an int dimension needs whole-number low and high, got {p.low}..{p.high}"]
    if p.step is not None and p.kind != "int":
        return [f"{name}: step applies to int dimensions only"]
    if p.low >= p.high:
        return [f"{name}: empty range {p.low}..{p.high}: low must be below high"]
    if p.kind == "log_uniform" and p.low <= 0:
        return [f"{name}: a log_uniform range needs low > 0, got {p.low}"]
    return []


def space_problems(spec: TuneSpec, sim_data: dict[str, Any], rounds: int) -> list[str]:
    """Every problem of ``spec`` against the parsed simulation config ``sim_data``: each
    key must name a ``[run]`` field, each range be non-empty, and each value the space
    can take at its ends (each choice, each end of a range) be one the config accepts.
    The base config itself is assumed valid (the caller checks it first)."""
    from orchard.errors import ConfigError
    from orchard.simulation.config import build_simulation_config

    problems: list[str] = []
    if spec.trials is None and spec.client_rounds is None and spec.wall_time_s is None:
        problems.append("tune: no budget: set trials, client_rounds or wall_time_s")
    if not spec.space:
        problems.append("tune.space: empty; add at least one [tune.space.\"run.KEY\"] table")
    if spec.grace_s <= spec.heartbeat_s:
        problems.append(f"tune.grace_s ({spec.grace_s}) must exceed tune.heartbeat_s ({spec.heartbeat_s}): "
                        "a trial is declared dead only after several missed heartbeats")
    if spec.pruner != "none" and spec.first_rung(rounds) >= rounds:
        problems.append(f"tune.min_rounds ({spec.first_rung(rounds)}) must be below the config's rounds ({rounds}) "
                        "for the pruner to stop a trial early; lower it, or set pruner = \"none\"")
    for key, p in spec.space.items():
        name = f"tune.space.{key!r}"
        if key in _FIXED:
            problems.append(f"{name}: not searchable: {_FIXED[key]}")
            continue
        parts = key.split(".")
        if parts[0] != "run" or len(parts) < 2 or not _known(RunConfig, parts[1:]):
            problems.append(f"{name}: unknown key: not a field of the run table (keys are dotted paths such "
                            "as run.train.learning_rate, run.server_optimizer.name, run.task_params.alpha)")
            continue
        shape = _shape_problems(key, p)
        if shape:
            problems += shape
            continue
        target = spec.overrides({key: None}).popitem()[0]
        for value in p.probes():
            try:
                build_simulation_config(sim_data, {target: value})
            except ConfigError as err:
                problems.append(f"{name}: the config refuses {value!r}: {'; '.join(err.problems)}")
    return problems
