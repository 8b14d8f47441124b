"""Cross-package config checks that need the codec registry (run before round 1).

Returns every problem at once; ``orchard validate`` and ``Control.StartRun`` call it.
"""

from __future__ import annotations

from orchard.config import RunConfig
from orchard.errors import ConfigError


def run_config_problems(cfg: RunConfig) -> list[str]:
    from orchard.compression import build_codec, validate_codec_for_secure_aggregation

    problems: list[str] = []
    try:
        build_codec(cfg.codec)
    except ConfigError as err:
        problems += [f"codec: {p}" for p in err.problems]
    if cfg.secure_aggregation.enabled:
        try:
            validate_codec_for_secure_aggregation(cfg.codec)
        except ConfigError as err:
            problems += [f"secure_aggregation: {p}" for p in err.problems]
    return problems


def validate_run_config(cfg: RunConfig) -> None:
    problems = run_config_problems(cfg)
    if problems:
        raise ConfigError(problems)
