"""Staleness weights of buffered asynchronous aggregation (pure math).

FedBuff (Nguyen et al., 2022, "Federated Learning with Buffered Asynchronous
Aggregation", Algorithm 1) adds each client's update to the buffer scaled by
``f(s)``, where ``s`` is how many server steps happened since the client pulled the
model it trained on, and divides the buffer by the plain weight of its updates. The
functions here are the ``f`` of the paper and of FedAsync (Xie et al., 2019,
"Asynchronous Federated Optimization", section 5.2):

- ``constant``: ``f(s) = 1``;
- ``polynomial``: ``f(s) = (1 + s) ** -a`` (FedBuff's default is ``a = 1/2``);
- ``hinge``: ``f(s) = 1`` for ``s <= b`` and ``1 / (1 + a (s - b))`` beyond.

Every one of them is exactly 1 at ``s = 0``, so a buffer of fresh updates is the
synchronous weighted mean, bit for bit.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

STALENESS_WEIGHTINGS = ("constant", "polynomial", "hinge")


def staleness_weight(s: int, kind: str, exponent: float = 0.5, hinge_after: int = 2) -> float:
    """``f(s)`` for staleness ``s >= 0`` (see the module doc); in (0, 1]."""
    if s < 0:
        raise ValueError(f"staleness is a number of server steps, >= 0; got {s}")
    if kind == "constant" or s == 0:
        return 1.0
    if kind == "polynomial":
        return float((1.0 + s) ** -exponent)
    if kind == "hinge":
        return 1.0 if s <= hinge_after else 1.0 / (1.0 + exponent * (s - hinge_after))
    raise ValueError(f"unknown staleness weighting {kind!r}; expected one of {', '.join(STALENESS_WEIGHTINGS)}")


def merge_histograms(a: Mapping[int, int], b: Mapping[int, int]) -> dict[int, int]:
    """Sum of two staleness histograms (staleness -> updates)."""
    out = dict(a)
    for s, n in b.items():
        out[s] = out.get(s, 0) + n
    return dict(sorted(out.items()))


def histogram_quantile(hist: Mapping[int, int], q: float) -> float:
    """The ``q``-quantile (0..1) of a staleness histogram; NaN when it is empty."""
    total = sum(hist.values())
    if total == 0:
        return math.nan
    need = q * total
    seen = 0
    for s in sorted(hist):
        seen += hist[s]
        if seen >= need:
            return float(s)
    return float(max(hist))
