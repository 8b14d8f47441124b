"""FedBuff's staleness stage (``aggregation.layer.stale``) against a plain reference:
the buffer's sum is sum_i w_i f(s_i) x_i over sum_i w_i, alone, under clipping (clip,
then weight) and merged across tiers; fresh updates pass through bit for bit; a sum
without the stage refuses a stale update instead of folding it at full weight."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from orchard.aggregation import MetricSums, Partial
from orchard.aggregation.layer import WeightedSum, clip, noise, robust, running_sum, stale
from orchard.aggregation.privacy import clip_l2
from orchard.aggregation.staleness import STALENESS_WEIGHTINGS, staleness_weight
from orchard.errors import ConfigError
from orchard.typing import TensorSpec

SCHEMA = [TensorSpec("a", (3, 4), "float32"), TensorSpec("b", (5,), "float32")]

clients = st.lists(st.tuples(st.floats(0.1, 50.0), st.integers(0, 6)), min_size=1, max_size=8)
weightings = st.sampled_from(STALENESS_WEIGHTINGS)


def _updates(seed: int, n: int, scale: float = 1.0) -> list[dict[str, np.ndarray]]:
    rng = np.random.default_rng(seed)
    return [{s.name: (scale * rng.standard_normal(s.shape)).astype(np.float32) for s in SCHEMA} for _ in range(n)]


def _reference(updates: list[dict[str, np.ndarray]], ws: list[tuple[float, int]], kind: str, exponent: float,
               hinge: int) -> tuple[dict[str, np.ndarray], float]:
    """FedBuff Alg. 1 written out: sum_i w_i f(s_i) x_i and sum_i w_i, in float64."""
    sums = {s.name: np.zeros(s.shape) for s in SCHEMA}
    for u, (w, s) in zip(updates, ws, strict=True):
        f = staleness_weight(s, kind, exponent, hinge)
        for k in sums:
            sums[k] += w * f * u[k].astype(np.float64)
    return sums, sum(w for w, _ in ws)


@settings(max_examples=80, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), ws=clients, kind=weightings, exponent=st.floats(0.1, 2.0),
       hinge=st.integers(0, 3))
def test_the_stage_is_fedbuffs_weighted_sum(seed: int, ws: list[tuple[float, int]], kind: str, exponent: float,
                                            hinge: int) -> None:
    ups = _updates(seed, len(ws))
    agg = stale(kind, WeightedSum(SCHEMA), exponent, hinge)
    state = agg.zero()
    for u, (w, s) in zip(ups, ws, strict=True):
        state = agg.accumulate(state, u, w, MetricSums({"loss": 1.0}, {"loss": w}), staleness=s)
    got, _ = agg.finalize(state)
    want, weight = _reference(ups, ws, kind, exponent, hinge)
    assert got.count == len(ws) and got.weight == pytest.approx(weight)  # the weights are not scaled
    for k in want:
        np.testing.assert_allclose(got.sums[k], want[k], rtol=1e-12, atol=1e-12)
    assert got.metrics.weights["loss"] == pytest.approx(weight)


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), ws=clients, kind=weightings, norm=st.floats(0.05, 5.0),
       scale=st.floats(0.01, 10.0))
def test_under_clipping_each_update_is_clipped_then_weighted(seed: int, ws: list[tuple[float, int]], kind: str,
                                                            norm: float, scale: float) -> None:
    ups = _updates(seed, len(ws), scale)
    agg = clip(norm, stale(kind, WeightedSum(SCHEMA)))
    state = agg.zero()
    for u, (w, s) in zip(ups, ws, strict=True):
        state = agg.accumulate(state, u, w, staleness=s)
    got, m = agg.finalize(state)
    want, _ = _reference([clip_l2(u, norm)[0] for u in ups], ws, kind, 0.5, 2)
    for k in want:
        np.testing.assert_allclose(got.sums[k], want[k], rtol=1e-10, atol=1e-10)
    assert m["clip_clients"] == len(ws)
    # The stage never raises a contribution above the clip norm: f <= 1.
    for u, (_, s) in zip(ups, ws, strict=True):
        f = staleness_weight(s, kind)
        n = np.sqrt(sum(float(np.sum((f * clip_l2(u, norm)[0][k].astype(np.float64)) ** 2)) for k in u))
        assert n <= norm * (1 + 1e-6)


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), ws=clients, s_partial=st.integers(0, 5), kind=weightings)
def test_a_partial_from_below_is_weighted_by_its_own_staleness(seed: int, ws: list[tuple[float, int]],
                                                                s_partial: int, kind: str) -> None:
    """A lower tier folds its updates (each weighted by its staleness there); the partial
    it pushes is weighted again by its own staleness here, its weight left as it was."""
    ups = _updates(seed, len(ws))
    leaf = stale(kind, WeightedSum(SCHEMA))
    st_ = leaf.zero()
    for u, (w, s) in zip(ups, ws, strict=True):
        st_ = leaf.accumulate(st_, u, w, staleness=s)
    below, _ = leaf.finalize(st_)
    root = stale(kind, WeightedSum(SCHEMA))
    got, _ = root.finalize(root.merge(root.zero(), below, staleness=s_partial))
    want, weight = _reference(ups, [(w, s) for w, s in ws], kind, 0.5, 2)
    f = staleness_weight(s_partial, kind)
    assert got.weight == pytest.approx(weight) and got.count == len(ws)
    for k in want:
        np.testing.assert_allclose(got.sums[k], f * want[k], rtol=1e-10, atol=1e-12)


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), ws=st.lists(st.floats(0.1, 50.0), min_size=1, max_size=6), kind=weightings)
def test_fresh_updates_are_the_plain_sum_bit_for_bit(seed: int, ws: list[float], kind: str) -> None:
    ups = _updates(seed, len(ws))
    plain, staged = WeightedSum(SCHEMA), stale(kind, WeightedSum(SCHEMA))
    a, b = plain.zero(), staged.zero()
    for u, w in zip(ups, ws, strict=True):
        a = plain.accumulate(a, u, w)
        b = staged.accumulate(b, u, w, staleness=0)
    pa, pb = plain.finalize(a)[0], staged.finalize(b)[0]
    for k in pa.sums:
        assert pa.sums[k].tobytes() == pb.sums[k].tobytes()
    assert pa.weight == pb.weight


def test_a_stale_update_needs_the_stage() -> None:
    (u,) = _updates(0, 1)
    with pytest.raises(ConfigError, match="without a stale stage"):
        WeightedSum(SCHEMA).accumulate(WeightedSum(SCHEMA).zero(), u, 1.0, staleness=1)
    with pytest.raises(ConfigError, match="without a stale stage"):
        WeightedSum(SCHEMA).merge(WeightedSum(SCHEMA).zero(), Partial({k: v.astype(np.float64) for k, v in u.items()},
                                                                      1.0, 1), staleness=2)
    agg = robust("median", WeightedSum(SCHEMA))
    with pytest.raises(ConfigError, match="fresh updates only"):
        agg.accumulate(agg.zero(), u, 1.0, staleness=1)
    with pytest.raises(ConfigError, match="unknown staleness weighting"):
        stale("linear", WeightedSum(SCHEMA))


def test_the_running_sum_is_read_through_clip_noise_and_stale_without_drawing_noise() -> None:
    ups = _updates(3, 3)
    agg = noise(1.0, clip(10.0, stale("polynomial", WeightedSum(SCHEMA))), np.random.default_rng(0), 10.0)
    state = agg.zero()
    for i, u in enumerate(ups):
        state = agg.accumulate(state, u, 2.0, staleness=i)
    acc = running_sum(agg, state)
    want, _ = _reference(ups, [(2.0, 0), (2.0, 1), (2.0, 2)], "polynomial", 0.5, 2)
    for k in want:
        np.testing.assert_allclose(acc.partial.sums[k], want[k], rtol=1e-12)
    noised, m = agg.finalize(state)
    assert m["noise_stddev"] == 1.0 and not np.allclose(noised.sums["a"], want["a"])
    with pytest.raises(ConfigError):
        running_sum(robust("median", WeightedSum(SCHEMA)), robust("median", WeightedSum(SCHEMA)).zero())
