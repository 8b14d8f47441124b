"""Pretraining recipe for the federation's base model (ARCHITECTURE section 6).

``run(config)`` trains; ``load_base_model(dir)`` reads its output. See
:mod:`orchard.pretrain.recipe` for the order of things and
:mod:`orchard.pretrain.export` for the files in an output directory.
"""

from orchard.pretrain.config import PretrainConfig, load_pretrain_config, parse_pretrain_config
from orchard.pretrain.export import load_base_model
from orchard.pretrain.recipe import PretrainResult, run

__all__ = [
    "PretrainConfig",
    "PretrainResult",
    "load_base_model",
    "load_pretrain_config",
    "parse_pretrain_config",
    "run",
]
