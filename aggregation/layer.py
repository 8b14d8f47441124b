"""The aggregation layer: one protocol, weighted sums as its implementations, and
transforms that wrap them (clip, noise, robust statistics, staleness).

An :class:`Aggregator` is what a tier folds one round through::

    state = agg.zero()
    state = agg.accumulate(state, update, weight, metrics)   # a client's decoded update
    state = agg.merge(state, partial)                        # a partial from below, or a
                                                             # sum kept aside (compressed,
                                                             # secure cohort)
    partial, measurements = agg.finalize(state)

States are mutable and folded in place (O(model) memory for the sums); every method
returns the state so that stacks compose. Transforms wrap an inner aggregator, as
TensorFlow Federated's factories do: ``clip(norm, inner)``, ``noise(stddev, inner, rng, clip)``,
``robust(statistic, inner)``, ``stale(weighting, inner)``. An update or partial may come
with its ``staleness`` (asynchronous mode: server steps since its model was pulled);
every stage passes it inward, the stale stage turns it into FedBuff's weight, and a
sum with no stale stage refuses a stale update rather than fold it at full weight. Each declares ``linear``: whether its result is a sum that
commutes with the other tiers' sums, which is what secure aggregation and merging
across a tree need (``orchard validate`` refuses a non-linear statistic under secure
aggregation, naming the linear ones).

With no transform the layer is exactly the weighted sum tiers always folded
(:class:`WeightedSum` is :class:`~orchard.aggregation.fedavg.Accumulator`), bit for bit.
Pure: no I/O; randomness comes in as a Generator.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from orchard.aggregation.fedavg import Accumulator, MetricSums, Partial
from orchard.aggregation.privacy import add_gaussian_noise, clip_l2
from orchard.aggregation.staleness import STALENESS_WEIGHTINGS, staleness_weight
from orchard.errors import ConfigError
from orchard.typing import NDArrays, TensorSpec

Measurements = dict[str, float]

CLIP_BELOW = "clip_below"  # metric: the fraction of clients whose update was within the clip norm


class Aggregator(Protocol):
    """Zero / accumulate / merge / finalize for one round at one tier."""

    linear: bool

    def zero(self) -> Any: ...

    def accumulate(self, state: Any, update: NDArrays, weight: float, metrics: MetricSums | None = None,
                   staleness: int = 0) -> Any: ...

    def merge(self, state: Any, partial: Partial, owned: bool = False, staleness: int = 0) -> Any: ...

    def finalize(self, state: Any) -> tuple[Partial, Measurements]: ...

    def count(self, state: Any) -> int: ...


class WeightedSum:
    """``sum_i w_i x_i`` and ``sum_i w_i`` in float64: the FedAvg family's sufficient
    statistic (one float64 copy of the model, whatever the cohort size)."""

    linear = True

    def __init__(self, schema: list[TensorSpec] | tuple[TensorSpec, ...]) -> None:
        self.schema = list(schema)

    def zero(self) -> Accumulator:
        return Accumulator(self.schema)

    def accumulate(self, state: Accumulator, update: NDArrays, weight: float,
                   metrics: MetricSums | None = None, staleness: int = 0) -> Accumulator:
        if staleness:
            _unweighted_staleness()
        state.accumulate(update, weight, checked=True)  # tiers check updates as they decode them
        if metrics is not None:
            state.partial.metrics.merge(metrics)
        return state

    def merge(self, state: Accumulator, partial: Partial, owned: bool = False, staleness: int = 0) -> Accumulator:
        if staleness:
            _unweighted_staleness()
        state.merge(partial, owned=owned)
        return state

    def finalize(self, state: Accumulator) -> tuple[Partial, Measurements]:
        return state.partial, {}

    def count(self, state: Accumulator) -> int:
        return state.count


@dataclass
class ClipStats:
    """What clipping saw of a cohort: how many clients, how many were clipped, how many
    were within the norm (the bit adaptive clipping counts), the sum of their norms."""

    clients: int = 0
    clipped: int = 0
    norm_sum: float = 0.0

    @property
    def below(self) -> int:
        return self.clients - self.clipped

    def record(self, norm: float, bound: float) -> None:
        self.clients += 1
        self.clipped += int(not norm <= bound)  # a NaN norm counts as clipped, never as within
        self.norm_sum += norm

    def merge(self, other: ClipStats) -> None:
        self.clients += other.clients
        self.clipped += other.clipped
        self.norm_sum += other.norm_sum


@dataclass
class _ClipState:
    inner: Any
    stats: ClipStats = field(default_factory=ClipStats)


class Clip:
    """Per-client L2 clipping before the inner sum: every contribution has norm <= ``norm``.

    The count of clients within the norm travels up the tree as the metric
    ``clip_below`` (a mean over clients), which adaptive clipping steers by. Updates a
    tier sums in the compressed domain are clipped there, by scaling their weight with
    :func:`~orchard.aggregation.privacy.clip_factor` of the norm read from the payload;
    their :class:`ClipStats` join this stage's through :meth:`merge_stats`."""

    def __init__(self, norm: float, inner: Aggregator) -> None:
        if not norm > 0:
            raise ConfigError(f"clip norm must be > 0, got {norm}")
        self.norm = float(norm)
        self.inner = inner
        self.linear = inner.linear

    def zero(self) -> _ClipState:
        return _ClipState(self.inner.zero())

    def accumulate(self, state: _ClipState, update: NDArrays, weight: float,
                   metrics: MetricSums | None = None, staleness: int = 0) -> _ClipState:
        clipped, n = clip_l2(update, self.norm)
        state.inner = self.inner.accumulate(state.inner, clipped, weight, metrics, staleness)
        state.stats.record(n, self.norm)
        return state

    def merge(self, state: _ClipState, partial: Partial, owned: bool = False, staleness: int = 0) -> _ClipState:
        state.inner = self.inner.merge(state.inner, partial, owned, staleness)
        return state

    def merge_stats(self, state: _ClipState, stats: ClipStats) -> _ClipState:
        """Count clients clipped outside this stage (summed in the compressed domain)."""
        state.stats.merge(stats)
        return state

    def finalize(self, state: _ClipState) -> tuple[Partial, Measurements]:
        partial, m = self.inner.finalize(state.inner)
        st = state.stats
        if st.clients:
            partial.metrics.merge(MetricSums({CLIP_BELOW: float(st.below)}, {CLIP_BELOW: float(st.clients)}))
        return partial, {**m, "clipped": float(st.clipped), "clip_clients": float(st.clients),
                         "mean_norm": st.norm_sum / st.clients if st.clients else 0.0}

    def count(self, state: _ClipState) -> int:
        return self.inner.count(state.inner)


class Stateless:
    """A stage with no state of its own: its state is its inner stack's, and every step
    it does not override passes straight through (:class:`Noise` changes finalize,
    :class:`Stale` what goes in). What walks a stack's state (:func:`running_sum`,
    :func:`clip_stage`) steps through such a stage to its inner one."""

    inner: Aggregator
    linear: bool

    def zero(self) -> Any:
        return self.inner.zero()

    def accumulate(self, state: Any, update: NDArrays, weight: float, metrics: MetricSums | None = None,
                   staleness: int = 0) -> Any:
        return self.inner.accumulate(state, update, weight, metrics, staleness)

    def merge(self, state: Any, partial: Partial, owned: bool = False, staleness: int = 0) -> Any:
        return self.inner.merge(state, partial, owned, staleness)

    def finalize(self, state: Any) -> tuple[Partial, Measurements]:
        return self.inner.finalize(state)

    def count(self, state: Any) -> int:
        return self.inner.count(state)


class Noise(Stateless):
    """Gaussian noise of stddev ``stddev`` on every coordinate of the finished sum, drawn
    as a discrete Gaussian on a lattice fine against ``clip``
    (:func:`~orchard.aggregation.privacy.add_gaussian_noise`): the trusted root's step of
    central DP. Merging before finalize stays linear; the noise is added once, at
    finalize."""

    def __init__(self, stddev: float, inner: Aggregator, rng: np.random.Generator, clip: float) -> None:
        if not stddev >= 0:
            raise ConfigError(f"noise stddev must be >= 0, got {stddev}")
        self.stddev = float(stddev)
        self.clip = float(clip)  # the norm each contribution is clipped to: sets the noise lattice
        self.inner = inner
        self.rng = rng
        self.linear = inner.linear

    def finalize(self, state: Any) -> tuple[Partial, Measurements]:
        partial, m = self.inner.finalize(state)
        if self.stddev == 0 or partial.count == 0:
            return partial, m
        noised = Partial(sums=add_gaussian_noise(partial.sums, self.stddev, self.clip, self.rng), weight=partial.weight,
                         count=partial.count, metrics=partial.metrics)
        return noised, {**m, "noise_stddev": self.stddev}


def _median(stack: np.ndarray, trim: float) -> np.ndarray:
    return np.median(stack, axis=0)


def _trimmed_mean(stack: np.ndarray, trim: float) -> np.ndarray:
    n = stack.shape[0]
    k = int(np.floor(trim * n))
    if 2 * k >= n:
        k = (n - 1) // 2
    s = np.sort(stack, axis=0)
    return s[k:n - k].mean(axis=0)


@dataclass(frozen=True)
class Statistic:
    name: str
    linear: bool
    fn: Any = None


# The cohort statistics a tier can compute, and whether each is a sum (linear): only
# linear ones run under secure aggregation, where the tier sees nothing but the sum.
STATISTICS: dict[str, Statistic] = {
    "mean": Statistic("mean", True),
    "median": Statistic("median", False, _median),
    "trimmed_mean": Statistic("trimmed_mean", False, _trimmed_mean),
}


@dataclass
class _RobustState:
    updates: list[NDArrays] = field(default_factory=list)
    metrics: MetricSums = field(default_factory=MetricSums)
    below: Any = None  # partials merged from lower tiers (already robust), summed linearly


class Robust:
    """A coordinate-wise robust statistic (median, trimmed mean) of the cohort's client
    updates, reported as a partial worth ``count`` updates of weight 1. Holds every
    update of its cohort (memory bounded by cohort size, not O(model)); partials from
    lower tiers are merged into the inner sum linearly. Not linear: never under secure
    aggregation."""

    linear = False

    def __init__(self, statistic: str, inner: Aggregator, trim_fraction: float = 0.1) -> None:
        if statistic not in STATISTICS or STATISTICS[statistic].linear:
            raise ConfigError(f"robust statistic must be one of median, trimmed_mean; got {statistic!r}")
        if not 0 <= trim_fraction < 0.5:
            raise ConfigError(f"trim_fraction must be in [0, 0.5), got {trim_fraction}")
        self.statistic = STATISTICS[statistic]
        self.trim = trim_fraction
        self.inner = inner

    def zero(self) -> _RobustState:
        return _RobustState(below=self.inner.zero())

    def accumulate(self, state: _RobustState, update: NDArrays, weight: float,
                   metrics: MetricSums | None = None, staleness: int = 0) -> _RobustState:
        if staleness:
            raise ConfigError("a robust statistic takes fresh updates only: it has no staleness weighting "
                              "(asynchronous mode runs the weighted sum)")
        state.updates.append(update)
        if metrics is not None:
            state.metrics.merge(metrics)
        return state

    def merge(self, state: _RobustState, partial: Partial, owned: bool = False, staleness: int = 0) -> _RobustState:
        state.below = self.inner.merge(state.below, partial, owned, staleness)
        return state

    def finalize(self, state: _RobustState) -> tuple[Partial, Measurements]:
        if state.updates:
            n = len(state.updates)
            stat = {k: self.statistic.fn(np.stack([np.asarray(u[k], np.float64) for u in state.updates]), self.trim)
                    for k in state.updates[0]}
            own = Partial(sums={k: v * n for k, v in stat.items()}, weight=float(n), count=n, metrics=state.metrics)
            state.below = self.inner.merge(state.below, own)
            state.updates = []
        partial, m = self.inner.finalize(state.below)
        return partial, {**m, "robust_updates": float(partial.count)}

    def count(self, state: _RobustState) -> int:
        return len(state.updates) + self.inner.count(state.below)


def _unweighted_staleness() -> None:
    raise ConfigError("a stale update (staleness > 0) reached a sum without a stale stage: asynchronous rounds "
                      "fold through stale(weighting, inner)")


class Stale(Stateless):
    """FedBuff's staleness weight as a stage (Nguyen et al., 2022, Algorithm 1).

    An update ``x_i`` of weight ``w_i`` trained on a model ``s_i`` server steps old joins
    the buffer scaled by ``f(s_i)`` (``orchard.aggregation.staleness``) while its weight
    joins unscaled, so the buffer's mean is::

        sum_i w_i f(s_i) x_i  /  sum_i w_i

    A partial from a lower tier arrives with its own staleness at this tier: its sums
    are scaled by ``f(s)``, its weight is not (its updates' staleness below is already in
    its sums). ``f(0) = 1`` for every weighting, and a fresh update passes through
    untouched, so a buffer of fresh updates is the inner sum bit for bit. Since
    ``0 < f <= 1``, the stage never raises an update's norm: a clip stage outside it
    (clip, then weight by staleness) bounds each client's contribution by the clip norm,
    which is what central DP's sensitivity needs. Linear: it scales terms of a sum."""

    def __init__(self, weight: Callable[[int], float], inner: Aggregator) -> None:
        self.weight = weight
        self.inner = inner
        self.linear = inner.linear

    def accumulate(self, state: Any, update: NDArrays, weight: float, metrics: MetricSums | None = None,
                   staleness: int = 0) -> Any:
        f = self.weight(staleness)
        if f != 1.0:
            update = {k: np.multiply(v, f, dtype=np.float64) for k, v in update.items()}
        return self.inner.accumulate(state, update, weight, metrics)

    def merge(self, state: Any, partial: Partial, owned: bool = False, staleness: int = 0) -> Any:
        f = self.weight(staleness)
        if f != 1.0:
            partial = Partial(sums={k: np.multiply(v, f) for k, v in partial.sums.items()}, weight=partial.weight,
                              count=partial.count, metrics=partial.metrics)
            owned = True
        return self.inner.merge(state, partial, owned)


def running_sum(agg: Aggregator, state: Any) -> Accumulator:
    """The weighted sum a stack has folded so far, before finalize (no noise drawn): the
    state an asynchronous buffer journals and moves into the next buffer. Refuses a
    stack whose state is not a running sum (a robust statistic holds its updates)."""
    if isinstance(agg, WeightedSum):
        return state  # type: ignore[no-any-return]
    if isinstance(agg, Clip):
        return running_sum(agg.inner, state.inner)
    if isinstance(agg, Stateless):
        return running_sum(agg.inner, state)
    raise ConfigError(f"{type(agg).__name__} keeps no running weighted sum to journal or move")


def clip_stage(agg: Aggregator, state: Any) -> tuple[Clip, Any] | None:
    """The clip stage of a stack and its state, when the stack clips the updates it is
    given (a clip under noise; not one under a robust statistic, which takes no sums of
    client updates from outside)."""
    if isinstance(agg, Clip):
        return agg, state
    if isinstance(agg, Stateless):
        return clip_stage(agg.inner, state)
    return None


def clip(norm: float, inner: Aggregator) -> Clip:
    return Clip(norm, inner)


def noise(stddev: float, inner: Aggregator, rng: np.random.Generator, clip: float) -> Noise:
    return Noise(stddev, inner, rng, clip)


dp = noise  # central DP's transform, ``dp(stddev, inner, rng, clip)``: Gaussian noise on the finalized sum


def robust(statistic: str, inner: Aggregator, trim_fraction: float = 0.1) -> Robust:
    return Robust(statistic, inner, trim_fraction)


def stale(weighting: str, inner: Aggregator, exponent: float = 0.5, hinge_after: int = 2) -> Stale:
    """FedBuff's staleness stage with ``f`` = ``staleness_weight(s, weighting, exponent,
    hinge_after)`` (``orchard.aggregation.staleness``)."""
    if weighting not in STALENESS_WEIGHTINGS:  # now, not at the first stale update
        raise ConfigError(f"unknown staleness weighting {weighting!r}; expected one of "
                          f"{', '.join(STALENESS_WEIGHTINGS)}")
    return Stale(lambda s: staleness_weight(s, weighting, exponent, hinge_after), inner)
