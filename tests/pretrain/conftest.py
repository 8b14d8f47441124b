"""Shared settings for the pretraining tests: a tiny GPT that trains in seconds on CPU."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from orchard.pretrain.config import PretrainConfig, parse_pretrain_config


def tiny(output_dir: Path, **overrides: Any) -> PretrainConfig:
    """A CPU-sized config; ``overrides`` are dotted keys (``optim__lr`` -> ``optim.lr``)."""
    base: dict[str, Any] = {
        "output_dir": str(output_dir),
        "steps": 20,
        "batch_size": 8,
        "device": "cpu",
        "model": {"seq_len": 32, "n_layer": 2, "n_head": 2, "d_model": 32},
        "optim": {"lr": 3e-3, "min_lr": 3e-4, "warmup_steps": 5},
        "data": {"shards": 4, "prefetch": 2},
        "checkpoint_every": 0,
        "log_every": 5,
        "eval_batches": 2,
        "progress": False,
        "export": False,
    }
    return parse_pretrain_config(base, {k.replace("__", "."): v for k, v in overrides.items()})


@pytest.fixture
def tiny_config():
    return tiny
