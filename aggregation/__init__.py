"""Pure aggregation math: zero / accumulate / merge / finalize, and server optimizers.

No I/O, no logging, no global RNG. Middle tiers ``accumulate`` and ``merge``; only the
root ``finalize``s (divides by the total weight) and applies a server optimizer to the
pseudo-gradient (Reddi et al., 2021, "Adaptive Federated Optimization", Algorithm 2).

Sums are kept in float64 so that the order in which a tree folds its updates changes
the result only at the level of float64 rounding: a hierarchy of any shape gives the
flat result to far better than 1e-6 relative.
"""

from orchard.aggregation.fedavg import (
    Accumulator,
    MetricSums,
    Partial,
    capped_weight,
    finalize,
    merge,
    prescale_factor,
    weighted_metric_means,
)
from orchard.aggregation.step import FEDNOVA_TAU, fednova_rescale, server_step


def __getattr__(name: str):  # PEP 562: torch is imported only by whoever needs a server optimizer
    if name in ("ServerOptimizer", "Yogi", "build_server_optimizer"):
        from orchard.aggregation import server_opt

        return getattr(server_opt, name)
    raise AttributeError(f"module 'orchard.aggregation' has no attribute {name!r}")


__all__ = [
    "FEDNOVA_TAU",
    "Accumulator",
    "MetricSums",
    "Partial",
    "ServerOptimizer",
    "Yogi",
    "build_server_optimizer",
    "capped_weight",
    "finalize",
    "fednova_rescale",
    "merge",
    "prescale_factor",
    "server_step",
    "weighted_metric_means",
]
