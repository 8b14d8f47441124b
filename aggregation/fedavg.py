"""Streaming weighted sums (the FedAvg family).

A ``Partial`` is what a tier knows about its cohort: the weighted sum of the updates,
the total weight, how many updates went in, and weighted sums of their metrics. It is
O(model) in size whatever the cohort size, and partials add: ``merge`` is associative
and commutative (up to float64 rounding), which is what makes a tree of any depth
equal to the flat computation.

    sum_i w_i * u_i  /  sum_i w_i   =   (sum over subtrees of their partial sums) / (sum of their weights)
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np

from orchard.errors import UpdateSchemaError
from orchard.typing import Metrics, NDArrays, TensorSpec


@dataclass
class MetricSums:
    """Per metric: sum of w * value and sum of w, so means stay exact under merging.

    Not every update reports every metric, hence a weight per metric name.
    """

    sums: dict[str, float] = field(default_factory=dict)
    weights: dict[str, float] = field(default_factory=dict)

    def add(self, metrics: Metrics, weight: float) -> None:
        for k, v in metrics.items():
            fv = float(v)
            if not np.isfinite(fv):
                continue  # a non-finite metric says nothing useful about the cohort
            self.sums[k] = self.sums.get(k, 0.0) + weight * fv
            self.weights[k] = self.weights.get(k, 0.0) + weight

    def merge(self, other: MetricSums) -> None:
        self.merge_sums(other.sums, other.weights)

    def merge_sums(self, sums: Mapping[str, float], weights: Mapping[str, float]) -> None:
        """:meth:`merge` of ``MetricSums(sums, weights)``, without building it (a tier
        merges an upload header's two dicts this way; both are only read)."""
        mine, mine_w = self.sums, self.weights
        for k, v in sums.items():
            mine[k] = mine.get(k, 0.0) + v
            mine_w[k] = mine_w.get(k, 0.0) + weights.get(k, 0.0)

    def means(self) -> Metrics:
        return weighted_metric_means(self)


def weighted_metric_means(m: MetricSums) -> Metrics:
    return {k: m.sums[k] / m.weights[k] for k in m.sums if m.weights.get(k, 0.0) > 0}


@dataclass
class Partial:
    """The sufficient statistic of a cohort for linear aggregation."""

    sums: NDArrays  # name -> float64 array: sum_i w_i * u_i
    weight: float = 0.0  # sum_i w_i
    count: int = 0  # number of client updates folded in (at any depth below)
    metrics: MetricSums = field(default_factory=MetricSums)

    @property
    def schema(self) -> list[TensorSpec]:
        return [TensorSpec(k, tuple(v.shape), "float32") for k, v in self.sums.items()]


class Accumulator:
    """Folds updates into a running weighted sum, one at a time, in place.

    Memory is one float64 copy of the model, however many updates are folded, allocated
    when the first one is (or when ``partial`` is read). The caller serialises calls
    (one fold at a time); this class holds no lock.
    """

    def __init__(self, schema: list[TensorSpec]) -> None:
        self._schema = {s.name: tuple(s.shape) for s in schema}
        self._partial: Partial | None = None

    @property
    def partial(self) -> Partial:
        if self._partial is None:
            self._partial = Partial(sums={k: np.zeros(s, np.float64) for k, s in self._schema.items()})
        return self._partial

    @partial.setter
    def partial(self, p: Partial) -> None:
        self._partial = p

    @property
    def count(self) -> int:
        return 0 if self._partial is None else self._partial.count

    @property
    def weight(self) -> float:
        return 0.0 if self._partial is None else self._partial.weight

    def check(self, update: NDArrays) -> None:
        """Raise UpdateSchemaError unless ``update`` matches the schema exactly and is finite."""
        check_update(self._schema, update)

    def accumulate(self, update: NDArrays, weight: float, metrics: Metrics | None = None,
                   metric_weight: float | None = None, checked: bool = False) -> None:
        """sum += weight * update. ``metric_weight`` defaults to ``weight``.

        ``checked=True`` skips the schema and finiteness check for an update the caller
        already passed through :meth:`check` (a tier checks while decoding, in parallel,
        and folds serially)."""
        if not (np.isfinite(weight) and weight > 0):
            raise UpdateSchemaError(f"update weight must be a positive finite number, got {weight!r}")
        if not checked:
            self.check(update)
        for k, v in update.items():
            acc = self.partial.sums[k]
            # acc += weight * v, without a float64 temporary the size of the tensor.
            np.add(acc, np.multiply(v, weight, dtype=np.float64), out=acc)
        self.partial.weight += float(weight)
        self.partial.count += 1
        if metrics:
            self.partial.metrics.add(metrics, weight if metric_weight is None else metric_weight)

    def merge(self, other: Partial, owned: bool = False) -> None:
        """Fold a partial from a lower tier (already weighted).

        ``owned=True``: the caller gives ``other`` up (its float64 arrays, its metrics); an
        accumulator that holds nothing yet then takes them as they are instead of adding
        them to a fresh float64 copy of the model."""
        if other.count == 0:
            return
        check_update(self._schema, other.sums, allow_float64=True)
        if not (np.isfinite(other.weight) and other.weight > 0):
            raise UpdateSchemaError(f"partial weight must be positive and finite, got {other.weight!r}")
        if owned and self._partial is None and all(v.dtype == np.float64 for v in other.sums.values()):
            self._partial = Partial(sums={k: other.sums[k] for k in self._schema}, weight=float(other.weight),
                                    count=other.count, metrics=other.metrics)
            return
        for k, v in other.sums.items():
            np.add(self.partial.sums[k], v, out=self.partial.sums[k])
        self.partial.weight += other.weight
        self.partial.count += other.count
        self.partial.metrics.merge(other.metrics)


def check_update(schema: dict[str, tuple[int, ...]], update: NDArrays, allow_float64: bool = False) -> None:
    """Names, order-insensitive; shapes exact; float dtype; all values finite."""
    missing = [k for k in schema if k not in update]
    extra = [k for k in update if k not in schema]
    if missing or extra:
        raise UpdateSchemaError(
            f"update tensors do not match the round's schema: missing {missing[:5]}, unexpected {extra[:5]}; "
            "send exactly the tensors named in the task spec"
        )
    ok_dtypes = (np.float32, np.float64) if allow_float64 else (np.float32,)
    for k, shape in schema.items():
        v = update[k]
        if tuple(v.shape) != shape:
            raise UpdateSchemaError(f"tensor {k!r} has shape {tuple(v.shape)}, expected {shape}")
        if v.dtype not in ok_dtypes:
            raise UpdateSchemaError(f"tensor {k!r} has dtype {v.dtype}, expected float32")
        if not np.isfinite(v).all():
            raise UpdateSchemaError(f"tensor {k!r} holds NaN or Inf values; refusing the update")


def prescale_factor(weight: float, weight_scale: float) -> float:
    """``min(w, S) / S``: what a client multiplies its update by under secure aggregation.

    The field holds sums, not weighted sums, so under secure aggregation each client
    weights its own update before masking it. Dividing by ``S`` keeps weighted values
    within the range the update had; weights above ``S`` are capped at ``S``. The tier
    then reports ``S * sum`` with weight ``sum_i min(w_i, S)``: the weighted mean with
    weights ``min(w_i, S)``. Nothing else pre-scales or caps: a tier that sums in the
    compressed domain weights each payload itself, exactly."""
    return min(float(weight), float(weight_scale)) / float(weight_scale)


def capped_weight(weight: float, weight_scale: float) -> float:
    """``min(w, S)``: the weight a pre-scaled (secure) update carries (see :func:`prescale_factor`)."""
    return min(float(weight), float(weight_scale))


def merge(a: Partial, b: Partial) -> Partial:
    """A new partial equal to a + b (inputs untouched)."""
    out = Partial(sums={k: v.copy() for k, v in a.sums.items()}, weight=a.weight, count=a.count)
    out.metrics.merge(a.metrics)
    acc = Accumulator(a.schema)
    acc.partial = out
    acc.merge(b)
    return out


def finalize(p: Partial) -> tuple[NDArrays, Metrics]:
    """The weighted mean update (float32) and the weighted metric means."""
    if p.count == 0 or p.weight <= 0:
        raise UpdateSchemaError("cannot finalize an empty cohort: no update was accumulated")
    mean: NDArrays = {k: np.divide(v, p.weight, dtype=np.float64).astype(np.float32) for k, v in p.sums.items()}
    return mean, p.metrics.means()
