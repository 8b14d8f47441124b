"""DP-FTRL's tree noise and its accountant: prefix sums carry exactly their nodes' noise,
and the sensitivity bound holds over every participation pattern (brute force)."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest

from orchard.aggregation.ftrl import (
    TreeState,
    add_tree_noise,
    decomposition,
    ftrl_epsilon,
    ftrl_noise_multiplier_for,
    max_node_counts_squared,
    tree_step,
)


def _true_max(rounds: int, b: int) -> int:
    """max over patterns (rounds b apart) of sum over complete tree nodes of c_node^2."""
    nodes = [(h, j) for h in range(rounds.bit_length()) for j in range(rounds >> h)]
    best = 0
    for k in range(1, math.ceil(rounds / b) + 1):
        for pat in itertools.combinations(range(1, rounds + 1), k):
            if any(y - x < b for x, y in itertools.pairwise(pat)):
                continue
            total = sum(sum(1 for t in pat if j * 2 ** h < t <= (j + 1) * 2 ** h) ** 2 for h, j in nodes)
            best = max(best, total)
    return best


@pytest.mark.parametrize("rounds", [1, 2, 3, 5, 8, 11, 13])
@pytest.mark.parametrize("b", [1, 2, 3, 5])
def test_the_sensitivity_bound_holds_for_every_participation_pattern(rounds: int, b: int) -> None:
    assert _true_max(rounds, b) <= max_node_counts_squared(rounds, b)


def test_separation_is_what_buys_privacy() -> None:
    eps = [ftrl_epsilon(10.0, 1000, b, 1e-5) for b in (1, 10, 100, 1000)]
    assert eps == sorted(eps, reverse=True) and eps[0] > 5 * eps[-1]


def test_the_accountant_is_one_gaussian_mechanism_over_the_nodes() -> None:
    import dp_accounting
    from dp_accounting.rdp import RdpAccountant

    z, rounds, b = 6.0, 200, 20
    acc = RdpAccountant()  # replace-one: a contribution's difference is at most 2C per participation
    acc.compose(dp_accounting.GaussianDpEvent(z / (2.0 * math.sqrt(max_node_counts_squared(rounds, b)))))
    assert ftrl_epsilon(z, rounds, b, 1e-5) == pytest.approx(acc.get_epsilon(1e-5), rel=1e-12)
    zt = ftrl_noise_multiplier_for(8.0, 1e-5, rounds, b)
    assert ftrl_epsilon(zt, rounds, b, 1e-5) <= 8.0 * (1 + 1e-9)


def test_each_prefix_carries_exactly_its_nodes_noise() -> None:
    shapes = {"w": (40_000,)}
    rng = np.random.default_rng(4)
    state, prefix = TreeState(), np.zeros(40_000)
    gamma = 1e-6 * 1.0 / math.sqrt(40_000)
    for t in range(1, 12):
        state, inc = tree_step(state, shapes, 2.0, 1.0, rng)
        assert np.array_equal(inc["w"], np.rint(inc["w"]))  # lattice units
        prefix += inc["w"]
        nodes = dict(state.nodes)
        assert [n for n, _ in state.nodes] == decomposition(t)
        np.testing.assert_array_equal(prefix, sum(nodes[n]["w"] for n in decomposition(t)))
        # popcount(t) independent nodes of stddev 2 (in float units)
        assert (prefix * gamma).std() == pytest.approx(2.0 * math.sqrt(bin(t).count("1")), rel=0.03)
    released = add_tree_noise({"w": np.full(40_000, 0.37)}, inc, 1.0)["w"] / gamma
    assert np.abs(released - np.rint(released)).max() < 1e-3
