"""Neighbour graph and the choice of k and t."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from orchard.config import SecureAggregationConfig
from orchard.secure_agg import (
    NeighbourGraph,
    SecAggConfigError,
    choose_parameters,
    parameters_from_config,
)


@settings(max_examples=50, deadline=None)
@given(n=st.integers(3, 300), data=st.data())
def test_graph_is_k_regular_symmetric_and_agreed(n: int, data: st.DataObject) -> None:
    k = data.draw(st.sampled_from([n - 1] + [k for k in range(2, n - 1, 2)]))
    seed = data.draw(st.binary(min_size=32, max_size=32))
    g = NeighbourGraph(n, k, seed)
    adj = g.adjacency()
    for u, nb in enumerate(adj):
        assert len(nb) == k and u not in nb
        for v in nb:
            assert u in adj[v]
    # Every party derives the same graph from the same public seed.
    assert NeighbourGraph(n, k, seed).adjacency() == adj


def test_graph_depends_on_the_seed() -> None:
    a = NeighbourGraph(200, 10, b"\x00" * 32).adjacency()
    b = NeighbourGraph(200, 10, b"\x01" + b"\x00" * 31).adjacency()
    assert a != b


def test_graph_refuses_odd_sparse_degree() -> None:
    with pytest.raises(SecAggConfigError, match="even"):
        NeighbourGraph(10, 3, b"\x00" * 32)
    with pytest.raises(SecAggConfigError):
        NeighbourGraph(10, 10, b"\x00" * 32)


@pytest.mark.parametrize("dropout", [0.0, 0.1, 0.3])
def test_parameters_meet_their_bounds(dropout: float) -> None:
    for n in (100, 1000, 10_000):
        p = choose_parameters(n, dropout)
        assert p.neighbours // 2 < p.threshold <= p.neighbours
        assert p.reasoning
        if not p.complete_graph:
            assert p.neighbours % 2 == 0
            assert p.log2_correctness_failure <= -20
            assert p.log2_secret_leak <= -40
            assert p.log2_disconnection <= -40


def test_k_grows_like_log_n() -> None:
    ks = [choose_parameters(n, 0.1).neighbours for n in (1000, 10_000, 100_000, 1_000_000)]
    assert ks == sorted(ks)
    # From n = 10^3 to 10^6 log n doubles; k must grow far slower than n.
    assert ks[-1] < 2.5 * ks[0]
    assert all(k < 15 * math.log2(n) for k, n in zip(ks, (1e3, 1e4, 1e5, 1e6), strict=True))


def test_small_cohorts_use_the_complete_graph() -> None:
    p = choose_parameters(10, 0.1)
    assert p.complete_graph and p.neighbours == 9
    assert "complete graph" in " ".join(p.reasoning)


def test_overrides_and_refusals() -> None:
    p = choose_parameters(1000, 0.1, neighbours=40, threshold=0.6)
    assert (p.neighbours, p.threshold) == (40, 24)
    with pytest.raises(SecAggConfigError, match="odd"):
        choose_parameters(1000, 0.1, neighbours=41)
    with pytest.raises(SecAggConfigError, match="lies about dropouts"):
        choose_parameters(1000, 0.1, neighbours=40, threshold=0.5)
    with pytest.raises(SecAggConfigError) as err:
        choose_parameters(1000, 0.45, corrupt_fraction=0.1)
    assert "below 0.5" in str(err.value)


def test_from_config() -> None:
    cfg = SecureAggregationConfig(enabled=True, dropout_rate=0.1)
    assert parameters_from_config(cfg, 1000) == choose_parameters(1000, 0.1)
