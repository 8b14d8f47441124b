"""Task registry: ``get_task(name, **params)``.

A task module exposes ``build(**params) -> Task`` with keyword-only parameters and
defaults; the registry maps names to those builders and checks parameter names before
calling, so a typo in ``task_params`` is reported with the accepted names instead of
surfacing as a ``TypeError``. Modules are imported on first use: asking for ``digits``
does not load the Shakespeare text or peft.
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable
from typing import Any

from orchard.errors import ConfigError
from orchard.tasks.core import Task

# name -> module whose ``build`` makes the task. A constant, not a mutable registry.
_TASK_MODULES: dict[str, str] = {
    "digits": "orchard.tasks.digits",
    "heart": "orchard.tasks.heart",
    "mnist": "orchard.tasks.mnist",
    "shakespeare": "orchard.tasks.shakespeare",
}


def available_tasks() -> list[str]:
    return sorted(_TASK_MODULES)


def task_builder(name: str) -> Callable[..., Task]:
    if name not in _TASK_MODULES:
        raise ConfigError(f"unknown task {name!r}; available tasks: {', '.join(available_tasks())}")
    return importlib.import_module(_TASK_MODULES[name]).build  # type: ignore[no-any-return]


def task_params(name: str) -> dict[str, Any]:
    """The parameters a task accepts and their defaults."""
    sig = inspect.signature(task_builder(name))
    return {p.name: p.default for p in sig.parameters.values() if p.kind is p.KEYWORD_ONLY}


def get_task(name: str, **params: Any) -> Task:
    """Build task ``name`` with ``params`` (each task documents its own in ``build``)."""
    accepted = task_params(name)
    unknown = sorted(set(params) - set(accepted))
    if unknown:
        raise ConfigError(
            [
                f"task {name!r} has no parameter {u!r}; accepted: {', '.join(sorted(accepted))}"
                for u in unknown
            ]
        )
    return task_builder(name)(**params)
