"""Where tasks come from: ``get_task(ref, **params)``.

A task is made by a *builder*, a function of keyword-only parameters with defaults that
returns a :class:`~orchard.tasks.core.Task`. ``ref`` names one of two ways, and there is
no third:

- an import path, ``package.module:build`` (any importable module, installed or on
  ``sys.path``);
- a registered name, an entry point of the group ``orchard.tasks`` whose value is such
  an import path. Orchard's own tasks (digits, mnist, heart, shakespeare) are entry
  points of Orchard's distribution, declared in its ``pyproject.toml``; a package a user
  installs registers its tasks the same way.

Parameters are checked against the builder's signature before it is called, so a typo
in ``task_params`` is reported with the accepted names, and what the builder returns is
checked against the Task protocol. Modules are imported on first use: asking for
``digits`` does not load the Shakespeare text or peft.
"""

from __future__ import annotations

import importlib
import inspect
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from importlib.metadata import EntryPoint, distributions
from types import ModuleType
from typing import Any

from orchard.errors import ConfigError
from orchard.tasks.core import Task

ENTRY_POINT_GROUP = "orchard.tasks"
_REQUIRED = inspect.Parameter.empty

TaskBuilder = Callable[..., Task]


class TaskNotFound(ConfigError):
    """A task reference names no registered task, or an import path that does not import."""


class TaskParamError(ConfigError):
    """Parameters a task's builder does not accept."""


class TaskTypeError(ConfigError):
    """A builder that is not callable, or that returned something other than a Task."""


@dataclass(frozen=True)
class TaskParam:
    """One parameter of a task's builder: its name, default (``required`` when it has
    none) and annotation as written."""

    name: str
    default: Any
    annotation: str
    required: bool


@dataclass(frozen=True)
class TaskEntry:
    """A task ``orchard tasks list`` shows: its name, the import path it resolves to,
    the distribution that registered it, the first line of its builder's docstring and
    its parameters."""

    name: str
    target: str
    distribution: str
    summary: str
    params: tuple[TaskParam, ...]


def is_import_path(ref: str) -> bool:
    return ":" in ref


def _entry_points() -> dict[str, EntryPoint]:
    """Name -> entry point of group ``orchard.tasks`` over every distribution found.

    Not ``importlib.metadata.entry_points(group=...)``: that reads one copy of each
    distribution's metadata, the first on ``sys.path``, and a stale ``*.egg-info`` in
    the folder a command runs from (a source checkout) would hide the installed one's
    entry points. The first copy that declares a name wins."""
    out: dict[str, EntryPoint] = {}
    for dist in distributions():
        for ep in dist.entry_points:
            if ep.group == ENTRY_POINT_GROUP and ep.name not in out:
                out[ep.name] = ep
    return out


def registered_tasks() -> dict[str, str]:
    """Registered name -> import path, from the ``orchard.tasks`` entry points of every
    installed distribution."""
    return {name: ep.value for name, ep in _entry_points().items()}


def _distributions() -> dict[str, str]:
    out: dict[str, str] = {}
    for name, ep in _entry_points().items():
        dist = getattr(ep, "dist", None)
        out[name] = dist.name if dist is not None else "?"
    return out


def available_tasks() -> list[str]:
    """The registered task names, sorted."""
    return sorted(registered_tasks())


def _target(ref: str) -> str:
    if is_import_path(ref):
        return ref
    registered = registered_tasks()
    if ref in registered:
        return registered[ref]
    names = ", ".join(sorted(registered)) or "none"
    hint = ""
    if not registered:
        hint = (" (no entry points of group 'orchard.tasks' are installed: reinstall Orchard, "
                "`pip install -e .`, so that its own tasks are registered)")
    raise TaskNotFound(
        f"task {ref!r} is not a registered task{hint}; available: {names}. A task of your own is "
        "named by its import path, package.module:build, or registered by its package as an "
        "entry point of group 'orchard.tasks'"
    )


def task_module(ref: str) -> ModuleType:
    """The module that holds ``ref``'s builder, imported."""
    target = _target(ref)
    module_name, _, attr = target.partition(":")
    if not module_name or not attr:
        raise TaskNotFound(f"task {ref!r}: an import path is package.module:function, got {target!r}")
    if is_import_path(ref):
        # As `python -m` would: a module in the folder the command runs from is found
        # (a console script's sys.path[0] is its own bin/ folder).
        extend_search_path([os.getcwd()])
    try:
        return importlib.import_module(module_name)
    except ModuleNotFoundError as err:
        where = f"task {ref!r} ({target})" if target != ref else f"task {ref!r}"
        raise TaskNotFound(
            f"{where}: module {module_name!r} cannot be imported: {err}. Install the package that "
            f"holds it, or run from the folder it is in (this one is {os.getcwd()})"
        ) from None


def task_builder(ref: str) -> TaskBuilder:
    """The builder ``ref`` names (a registered name or ``module:function``)."""
    target = _target(ref)
    module = task_module(ref)
    attr = target.partition(":")[2]
    obj: Any = module
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise TaskNotFound(f"task {ref!r}: module {module.__name__!r} has no attribute {attr!r}")
        obj = getattr(obj, part)
    if not callable(obj):
        raise TaskTypeError(
            f"task {ref!r}: {target} is a {type(obj).__name__}, not a function; a task's builder is a "
            "function of keyword parameters that returns a Task (see orchard.tasks.make_task)"
        )
    return obj  # type: ignore[no-any-return]


def _params_of(builder: TaskBuilder) -> tuple[dict[str, TaskParam], bool]:
    """The builder's keyword parameters, and whether it takes any keyword (``**kw``)."""
    out: dict[str, TaskParam] = {}
    open_ended = False
    for p in inspect.signature(builder).parameters.values():
        if p.kind is p.VAR_KEYWORD:
            open_ended = True
        elif p.kind in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD):
            ann = p.annotation if isinstance(p.annotation, str) else getattr(p.annotation, "__name__", "")
            out[p.name] = TaskParam(p.name, None if p.default is _REQUIRED else p.default,
                                    "" if p.annotation is _REQUIRED else str(ann), p.default is _REQUIRED)
    return out, open_ended


def task_params(ref: str) -> dict[str, Any]:
    """The parameters a task accepts and their defaults (None for a required one)."""
    return {name: p.default for name, p in _params_of(task_builder(ref))[0].items()}


def trains_with(**fields: Any) -> Callable[[TaskBuilder], TaskBuilder]:
    """Declare the local training a task's builder is tuned for (``TrainConfig`` fields:
    ``epochs``, ``learning_rate``, ``momentum``, ...). A live run that does not set its own
    ``[run.train]`` (``orchard run start`` from flags, ``orchard demo``) trains with these,
    so that every command gives the task the same recipe.

        @trains_with(epochs=3, learning_rate=0.2, momentum=0.9, batch_size=16)
        def build(...): ...
    """
    from orchard.trainer import TrainConfig

    TrainConfig(**fields)  # a misspelt field fails where the task is defined

    def mark(builder: TaskBuilder) -> TaskBuilder:
        builder.train_defaults = dict(fields)  # type: ignore[attr-defined]
        return builder

    return mark


def train_defaults(ref: str) -> dict[str, Any]:
    """The training a task declares with :func:`trains_with` ({} when it declares none)."""
    return dict(getattr(task_builder(ref), "train_defaults", {}))


def get_task(ref: str, **params: Any) -> Task:
    """Build task ``ref`` (a registered name or ``module:function``) with ``params``."""
    builder = task_builder(ref)
    accepted, open_ended = _params_of(builder)
    unknown = [] if open_ended else sorted(set(params) - set(accepted))
    problems = [
        f"task {ref!r} has no parameter {u!r}; accepted: {', '.join(sorted(accepted)) or 'none'}"
        for u in unknown
    ]
    problems += [f"task {ref!r} needs parameter {p.name!r} (task_params.{p.name} = ...)"
                 for p in accepted.values() if p.required and p.name not in params]
    if problems:
        raise TaskParamError(problems)
    task = builder(**params)
    if not isinstance(task, Task):
        missing = [m for m in ("name", "initial_arrays", "partition", "client_trainer", "evaluate")
                   if not hasattr(task, m)]
        raise TaskTypeError(
            f"task {ref!r}: its builder returned a {type(task).__module__}.{type(task).__qualname__}, "
            f"not a Task (it lacks {', '.join(missing)}); return orchard.tasks.make_task(...), or an object "
            "with name, initial_arrays, partition, client_trainer and evaluate"
        )
    return task


def describe_tasks(extra: list[str] | None = None) -> list[TaskEntry]:
    """Every registered task (and each import path in ``extra``) with its parameters."""
    registered = registered_tasks()
    dists = _distributions()
    out = []
    for ref in [*sorted(registered), *(extra or [])]:
        builder = task_builder(ref)
        doc = inspect.getdoc(builder) or ""
        params = tuple(_params_of(builder)[0].values())
        out.append(TaskEntry(ref, registered.get(ref, ref), dists.get(ref, "(import path)"),
                             doc.strip().splitlines()[0] if doc.strip() else "", params))
    return out


def search_path() -> list[str]:
    """This process's ``sys.path``: what a worker process adds to its own before it builds
    a task, so that a user's module importable here (from the current folder, say) is
    importable there."""
    return [p for p in sys.path]


def extend_search_path(paths: list[str]) -> None:
    """Append the entries of ``paths`` this process's ``sys.path`` lacks (a worker's
    side of :func:`search_path`)."""
    for p in paths:
        if p not in sys.path:
            sys.path.append(p)


def task_problems(ref: str, params: dict[str, Any]) -> list[str]:
    """What is wrong with task ``ref`` and ``params`` before anything is built: a name
    that resolves to nothing, a module that does not import, a parameter the builder
    does not take. Empty when the task can be built (its builder is not called)."""
    try:
        builder = task_builder(ref)
    except ConfigError as err:
        return [f"task: {p}" for p in err.problems]
    accepted, open_ended = _params_of(builder)
    problems = [] if open_ended else [
        f"task_params.{u}: task {ref!r} has no parameter {u!r}; accepted: {', '.join(sorted(accepted)) or 'none'}"
        for u in sorted(set(params) - set(accepted))
    ]
    return problems + [f"task_params.{p.name}: task {ref!r} needs it" for p in accepted.values()
                       if p.required and p.name not in params]
