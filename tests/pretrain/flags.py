"""A pretraining config as the command line's overrides, for tests that start the recipe
as a process (``python -m orchard.pretrain`` or torchrun)."""

from __future__ import annotations

import json


def cli_flags(data: dict, prefix: str = "") -> list[str]:
    """``data`` (a config's ``model_dump(mode="json")``) as ``--model.n_layer 2 ...``."""
    out = []
    for key, value in data.items():
        if isinstance(value, dict):
            out += cli_flags(value, f"{prefix}{key}.")
        elif value is not None:
            out += [f"--{prefix}{key}", value if isinstance(value, str) else json.dumps(value)]
    return out
