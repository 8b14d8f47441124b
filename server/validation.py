"""Cross-package config checks that need the codec registry (run before round 1).

Returns every problem at once; ``orchard validate`` and ``Control.StartRun`` call it.
"""

from __future__ import annotations

import math

from orchard.config import RunConfig
from orchard.errors import ConfigError


def run_config_problems(cfg: RunConfig) -> list[str]:
    from orchard.compression import build_codec, validate_codec_for_secure_aggregation

    problems: list[str] = []
    try:
        build_codec(cfg.codec)
    except ConfigError as err:
        problems += [f"codec: {p}" for p in err.problems]
    problems += downlink_problems(cfg)
    if cfg.secure_aggregation.enabled:
        try:
            validate_codec_for_secure_aggregation(cfg.codec)
        except ConfigError as err:
            problems += [f"secure_aggregation: {p}" for p in err.problems]
    problems += async_problems(cfg)
    return problems + aggregation_problems(cfg)


def downlink_problems(cfg: RunConfig) -> list[str]:
    """The downlink codec must decode a delta on its own: a tier encodes each (base,
    target) pair once for every node that holds the base, so it keeps no per-node state."""
    from orchard.compression import build_codec

    try:
        codec = build_codec(cfg.downlink_codec)
    except ConfigError as err:
        return [f"downlink_codec: {p}" for p in err.problems]
    if codec.algebra.stateful:
        return [f"downlink_codec {cfg.downlink_codec.name!r} is stateful (its encoder keeps a residual per "
                "client); a downlink delta is taken from what the node holds, which already re-sends what the "
                "last delta left out: use a stateless codec such as qsgd or a pipeline of topk and qsgd"]
    return []


def aggregation_problems(cfg: RunConfig) -> list[str]:
    """Stacks the aggregation layer cannot run, from what each stage declares: under
    secure aggregation a tier sees only a sum, so every stage must be linear."""
    from orchard.aggregation.layer import STATISTICS

    stat = STATISTICS[cfg.robust.statistic]
    if cfg.secure_aggregation.enabled and not stat.linear:
        linear = ", ".join(repr(s.name) for s in STATISTICS.values() if s.linear)
        return [f"robust.statistic {stat.name!r} is not linear and a secure cohort reveals only its sum: under "
                f"secure aggregation use a linear statistic ({linear}), with robust.norm_bound to bound each update"]
    return []


def async_problems(cfg: RunConfig) -> list[str]:
    """Asynchronous mode's impossible combinations, each with what would work."""
    m = cfg.mode
    if not m.is_async:
        return []
    problems: list[str] = []
    k = cfg.buffer_target
    if cfg.secure_aggregation.enabled and math.ceil(k * cfg.cohort.over_selection) < 2:
        problems.append(
            f"mode: a secure buffer is one SecAgg+ session over ceil(buffer_size x over_selection) = "
            f"{math.ceil(k * cfg.cohort.over_selection)} client; the protocol needs at least 2: raise "
            "mode.buffer_size or cohort.over_selection")
    if m.staleness not in (None, "hinge") and m.staleness_exponent is not None and m.weighting == "constant":
        problems.append("mode: staleness = \"constant\" takes no staleness_exponent; remove it or pick "
                        "\"polynomial\" or \"hinge\"")
    if m.weighting == "hinge" and m.hinge >= m.max_stale:
        problems.append(f"mode: hinge_after = {m.hinge} is not below max_staleness = {m.max_stale}: every update "
                        "that is taken would weigh 1; lower hinge_after or use staleness = \"constant\"")
    return problems


def validate_run_config(cfg: RunConfig) -> None:
    problems = run_config_problems(cfg)
    if problems:
        raise ConfigError(problems)
