"""The sidecars of a task bundle, readable without torch.

``orchard client bundle`` (:mod:`orchard.edge_runtime.task_bundle`, which needs torch to
export the base) writes them next to ``client.json``; ``orchard client start --bundle``
and ``orchard edge infer`` read them here:

- ``task.json``: the reference task and its parameters (what the client trains), and
  the longest input the base model takes (``context_len``, for sequence models);
- ``tokenizer.json``: the character tokenizer of a text task.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from orchard.text import CharTokenizer

from .bundle import BundleError, read_json_object

TASK_FILE = "task.json"
TOKENIZER_FILE = "tokenizer.json"


@dataclass(frozen=True)
class BundleTask:
    """The ``task.json`` sidecar."""

    task: str
    task_params: dict[str, Any] = field(default_factory=dict)
    context_len: int | None = None  # longest sequence the base model takes

    def to_json(self) -> str:
        return json.dumps(
            {"task": self.task, "task_params": self.task_params, "context_len": self.context_len},
            indent=2,
            sort_keys=True,
        )


def read_bundle_task(bundle_dir: str | os.PathLike[str]) -> BundleTask | None:
    """The bundle's ``task.json``, or None for a bundle written without a task."""
    p = Path(bundle_dir) / TASK_FILE
    if not p.is_file():
        return None
    data = read_json_object(p)
    try:
        ctx = data.get("context_len")
        return BundleTask(str(data["task"]), dict(data.get("task_params") or {}),
                          None if ctx is None else int(ctx))
    except (KeyError, TypeError, ValueError, AttributeError) as err:
        raise BundleError(
            f"{p} is not a task sidecar ({type(err).__name__}: {err}); re-create the bundle"
        ) from None


def read_tokenizer(bundle_dir: str | os.PathLike[str]) -> CharTokenizer:
    p = Path(bundle_dir) / TOKENIZER_FILE
    if not p.is_file():
        raise BundleError(
            f"{Path(bundle_dir)} has no {TOKENIZER_FILE}: it is not a text task's bundle; "
            "run it on an array (--input FILE.npy)"
        )
    return CharTokenizer.load(p)
