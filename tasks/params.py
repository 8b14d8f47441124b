"""Task parameters from outside a config file: ``--task-param KEY=VALUE`` flags, and the
parameters that make a LoRA task adapt a base written by ``orchard pretrain``.

Both ``orchard run start`` (against a live root) and ``orchard simulate`` (in-process)
take these, so they live with the tasks rather than with either command.
"""

from __future__ import annotations

import json
import tomllib
from pathlib import Path
from typing import Any

from orchard.errors import ConfigError, OrchardError


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


def base_model_params(task: str, base_dir: Path) -> dict[str, Any]:
    """Task parameters that make a LoRA task adapt a base written by `orchard pretrain`.

    Clients load the base from this path, so it must exist where they run (the demo and
    the simulator share the machine; devices get the base in their bundle)."""
    from orchard.config import BASE_CONFIG, BASE_WEIGHTS, base_model_dir
    from orchard.tasks.registry import task_params

    base_dir = base_model_dir(base_dir)
    cfg_path, weights = base_dir / BASE_CONFIG, base_dir / BASE_WEIGHTS
    accepted = task_params(task)
    arch = json.loads(cfg_path.read_text())["model"]
    wanted = {"base": str(weights.resolve()), **{k: arch[k] for k in ("seq_len", "n_layer", "n_head", "d_model")}}
    missing = [k for k in wanted if k not in accepted]
    if missing:
        raise OrchardError(f"task {task!r} cannot take a pretrained base (it has no parameters {missing}); "
                           "use a LoRA task such as shakespeare")
    return wanted
