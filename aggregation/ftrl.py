"""DP-FTRL's noise: tree aggregation of the rounds' clipped sums (Kairouz, McMahan, Song,
Thakkar, Thakurta and Xu, 2021, "Practical and private (deep) learning without sampling
or shuffling", Alg. 1 and §4), and what it costs under a minimum separation between a
device's participations, with no sampling assumption.

Pure: shapes, a noise stddev and explicit randomness in, arrays and numbers out.

The tree. Round ``t``'s clipped sum ``g_t`` is a leaf; a node at level ``h`` covers
``2^h`` consecutive rounds and carries its own noise ``N_node ~ N(0, sigma^2)`` per
coordinate, drawn once. The noisy prefix sum after ``t`` rounds is
``sum_{s <= t} g_s + N(t)``, ``N(t)`` the sum of the noises of the nodes of ``t``'s
binary decomposition (one per set bit of ``t``: at most ``ceil(log2(T + 1))``). A
model that takes ``theta_t = theta_0 - eta P_t`` (FTRL without momentum) is the server
optimizer's plain step applied to each round's increment ``g_t + N(t) - N(t - 1)``:
:func:`tree_step` returns that increment of noise. Everything released is a function of
the node values, each noised once: one Gaussian mechanism over the whole run.

Its sensitivity. A device that takes part at most once every ``b`` rounds (``b`` the
minimum separation) over ``T`` rounds adds its contribution (L2 norm ``<= C``) to every
node whose interval holds one of its rounds; the nodes' L2 sensitivity is
``C sqrt(sum_nodes c_node^2)`` with ``c_node`` its participations under the node.
:func:`max_node_counts_squared` bounds ``max sum c^2`` level by level: at level ``h`` the
nodes split at most ``k = ceil(T / b)`` participations, at most ``m_h = ceil(2^h / b)``
under any one node (two participations in one node are ``b`` apart), so the level adds
at most ``floor(k / m_h) m_h^2 + (k mod m_h)^2``. An upper bound on the sensitivity: the
epsilon charged is an upper bound on the epsilon spent.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from orchard.aggregation.accounting import sensitivity_factor
from orchard.aggregation.privacy import LATTICE_SLACK, _DiscreteGaussian
from orchard.errors import ConfigError
from orchard.typing import NDArrays


def max_node_counts_squared(rounds: int, min_separation: int) -> int:
    """An upper bound on ``sum_nodes c_node^2`` over every participation pattern of one
    device in a ``rounds``-leaf tree with participations ``min_separation`` apart."""
    if rounds < 1 or min_separation < 1:
        raise ConfigError(f"need rounds >= 1 and min_separation >= 1, got {rounds} and {min_separation}")
    k = math.ceil(rounds / min_separation)
    total, h = 0, 0
    while True:
        m = min(k, math.ceil(2 ** h / min_separation))
        total += (k // m) * m * m + (k % m) ** 2
        if 2 ** h >= rounds:  # the root's level: one node over every round
            return total
        h += 1


def _event(noise_multiplier: float, rounds: int, min_separation: int, adjacency: str):  # -> dp_accounting.DpEvent
    import dp_accounting

    s = math.sqrt(max_node_counts_squared(rounds, min_separation)) * sensitivity_factor(adjacency)
    return dp_accounting.GaussianDpEvent(noise_multiplier / s)


def ftrl_epsilon(noise_multiplier: float, rounds: int, min_separation: int, delta: float,
                 adjacency: str = "replace_one") -> float:
    """Epsilon of ``rounds`` rounds of tree-aggregated noise at ``noise_multiplier``
    (each node's stddev over the clip norm) under ``min_separation``."""
    from dp_accounting.rdp import RdpAccountant

    acc = RdpAccountant()
    acc.compose(_event(noise_multiplier, rounds, min_separation, adjacency))
    return float(acc.get_epsilon(delta))


def ftrl_noise_multiplier_for(epsilon: float, delta: float, rounds: int, min_separation: int,
                              adjacency: str = "replace_one") -> float:
    """The smallest per-node noise multiplier whose run spends at most ``epsilon``."""
    if not (epsilon > 0 and 0 < delta < 1):
        raise ConfigError(f"need epsilon > 0 and 0 < delta < 1, got {epsilon} and {delta}")
    import dp_accounting
    from dp_accounting.rdp import RdpAccountant

    return float(dp_accounting.calibrate_dp_mechanism(
        RdpAccountant, lambda z: _event(z, rounds, min_separation, adjacency), epsilon, delta))


def decomposition(t: int) -> list[tuple[int, int]]:
    """The nodes ``(level, index)`` whose intervals tile rounds ``1..t``, highest first;
    node ``(h, j)`` covers rounds ``j 2^h + 1 .. (j + 1) 2^h``."""
    out, start = [], 0
    for h in range(max(t, 1).bit_length() - 1, -1, -1):
        if t >> h & 1:
            out.append((h, start >> h))
            start += 1 << h
    return out


@dataclass(frozen=True)
class TreeState:
    """The noise of the nodes of ``step``'s decomposition (the only ones a later prefix
    can still use), by node."""

    step: int = 0
    nodes: tuple[tuple[tuple[int, int], NDArrays], ...] = ()


def _lattice(clip: float, shapes: dict[str, tuple[int, ...]]) -> float:
    """The noise lattice's step, as central DP's (``privacy.add_gaussian_noise``)."""
    dim = sum(math.prod(sh) for sh in shapes.values())
    return LATTICE_SLACK * clip / math.sqrt(max(dim, 1))


def _total(nodes: dict[tuple[int, int], NDArrays], shapes: dict[str, tuple[int, ...]]) -> NDArrays:
    out = {k: np.zeros(s, np.float64) for k, s in shapes.items()}
    for noise in nodes.values():
        for k in out:
            out[k] += noise[k]
    return out


def tree_step(state: TreeState, shapes: dict[str, tuple[int, ...]], stddev: float, clip: float,
              rng: np.random.Generator) -> tuple[TreeState, NDArrays]:
    """The next round's noise increment ``N(t + 1) - N(t)`` and the new state, in units
    of the noise lattice (integers in float64; see :func:`add_tree_noise`). A node's
    noise, a discrete Gaussian of stddev ``stddev (1 + LATTICE_SLACK)`` in float units,
    is drawn from ``rng`` when the node first enters a decomposition and kept while it
    stays in one."""
    if not (stddev > 0 and clip > 0):
        raise ConfigError(f"tree noise needs stddev > 0 and a clip norm > 0, got {stddev} and {clip}")
    sampler = _DiscreteGaussian(stddev * (1.0 + LATTICE_SLACK) / _lattice(clip, shapes))
    before = dict(state.nodes)
    t = state.step + 1
    after: dict[tuple[int, int], NDArrays] = {}
    for node in decomposition(t):
        if node in before:
            after[node] = before[node]
            continue
        drawn = {}
        for k, sh in shapes.items():
            v = np.empty(math.prod(sh), np.float64)
            sampler.fill(v, rng)
            drawn[k] = v.reshape(sh)
        after[node] = drawn
    prev, new = _total(before, shapes), _total(after, shapes)
    return TreeState(t, tuple(after.items())), {k: new[k] - prev[k] for k in shapes}


def add_tree_noise(sums: NDArrays, increment: NDArrays, clip: float) -> NDArrays:
    """A round's released sum: ``gamma (round(S / gamma) + increment)``, on the lattice
    as central DP's noise is (``privacy.add_gaussian_noise`` says why)."""
    gamma = _lattice(clip, {k: np.shape(v) for k, v in sums.items()})
    return {k: (np.rint(np.asarray(v, np.float64) / gamma) + increment[k]) * gamma for k, v in sums.items()}
