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


def max_node_counts_squared(rounds: int, min_separation: int, max_participations: int | None = None) -> int:
    """An upper bound on ``sum_nodes c_node^2`` over every participation pattern of one
    device in a ``rounds``-leaf tree with participations ``min_separation`` apart, at
    most ``max_participations`` of them (None: as many as the separation allows)."""
    if rounds < 1 or min_separation < 1 or (max_participations is not None and max_participations < 0):
        raise ConfigError(f"need rounds >= 1, min_separation >= 1 and max_participations >= 0, got {rounds}, "
                          f"{min_separation} and {max_participations}")
    k = math.ceil(rounds / min_separation)
    if max_participations is not None:
        k = min(k, max_participations)
    if k == 0:
        return 0
    total, h = 0, 0
    while True:
        m = min(k, math.ceil(2 ** h / min_separation))
        total += (k // m) * m * m + (k % m) ** 2
        if 2 ** h >= rounds:  # the root's level: one node over every round
            return total
        h += 1


def restarted_counts_squared(rounds: int, min_separation: int, max_participations: int | None = None,
                             restart_every: int | None = None) -> int:
    """The bound of :func:`max_node_counts_squared` over ``rounds`` leaves cut into trees of
    ``restart_every`` leaves (the last one shorter), each with its own noise: the trees'
    node sets are disjoint, so their ``sum c^2`` add. A device's participations are split
    among the trees in the worst way the cap allows (a knapsack over the trees: tree ``i``
    takes ``k_i <= ceil(R_i / b)`` of at most ``max_participations`` in all, and adds its
    bound at ``k_i``). Each tree is bounded as if its participations could sit anywhere
    ``b`` apart inside it: an upper bound."""
    if rounds < 1:
        raise ConfigError(f"need rounds >= 1, got {rounds}")
    size = rounds if restart_every is None else restart_every
    lengths = [min(size, rounds - s) for s in range(0, rounds, size)]
    cap = sum(math.ceil(r / min_separation) for r in lengths)
    if max_participations is not None:
        cap = min(cap, max_participations)
    best = [0] * (cap + 1)  # best[j]: the largest sum with j participations over the trees so far
    for r in lengths:
        gains = [max_node_counts_squared(r, min_separation, k) for k in range(min(cap, math.ceil(r / min_separation)) + 1)]
        best = [max(best[j - k] + g for k, g in enumerate(gains) if k <= j) for j in range(cap + 1)]
    return max(best)


def _event(noise_multiplier: float, rounds: int, min_separation: int, adjacency: str,
           max_participations: int | None = None, restart_every: int | None = None):  # -> dp_accounting.DpEvent
    import dp_accounting

    s = math.sqrt(restarted_counts_squared(rounds, min_separation, max_participations, restart_every))
    return dp_accounting.GaussianDpEvent(noise_multiplier / (s * sensitivity_factor(adjacency)))


def ftrl_epsilon(noise_multiplier: float, rounds: int, min_separation: int, delta: float,
                 adjacency: str = "replace_one", max_participations: int | None = None,
                 restart_every: int | None = None) -> float:
    """Epsilon of ``rounds`` rounds of tree-aggregated noise at ``noise_multiplier``
    (each node's stddev over the clip norm) under ``min_separation``, at most
    ``max_participations`` per device, trees of ``restart_every`` leaves."""
    from dp_accounting.rdp import RdpAccountant

    acc = RdpAccountant()
    acc.compose(_event(noise_multiplier, rounds, min_separation, adjacency, max_participations, restart_every))
    return float(acc.get_epsilon(delta))


def ftrl_noise_multiplier_for(epsilon: float, delta: float, rounds: int, min_separation: int,
                              adjacency: str = "replace_one", max_participations: int | None = None,
                              restart_every: int | None = None) -> float:
    """The smallest per-node noise multiplier whose run spends at most ``epsilon``."""
    if not (epsilon > 0 and 0 < delta < 1):
        raise ConfigError(f"need epsilon > 0 and 0 < delta < 1, got {epsilon} and {delta}")
    import dp_accounting
    from dp_accounting.rdp import RdpAccountant

    return float(dp_accounting.calibrate_dp_mechanism(
        RdpAccountant, lambda z: _event(z, rounds, min_separation, adjacency, max_participations, restart_every),
        epsilon, delta))


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
    out: NDArrays = {k: np.zeros(s, np.float64) for k, s in shapes.items()}
    for noise in nodes.values():
        for k in out:
            out[k] = np.add(out[k], noise[k])
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
        drawn: NDArrays = {}
        for k, sh in shapes.items():
            v = np.empty(math.prod(sh), np.float64)
            sampler.fill(v, rng)
            drawn[k] = v.reshape(sh)
        after[node] = drawn
    prev, new = _total(before, shapes), _total(after, shapes)
    return TreeState(t, tuple(after.items())), {k: np.subtract(new[k], prev[k]) for k in shapes}


def add_tree_noise(sums: NDArrays, increment: NDArrays, clip: float) -> NDArrays:
    """A round's released sum: ``gamma (round(S / gamma) + increment)``, on the lattice
    as central DP's noise is (``privacy.add_gaussian_noise`` says why)."""
    gamma = _lattice(clip, {k: np.shape(v) for k, v in sums.items()})
    return {k: (np.rint(np.asarray(v, np.float64) / gamma) + increment[k]) * gamma for k, v in sums.items()}


@dataclass(frozen=True)
class TreeNoise:
    """A run's tree noise between rounds: the current tree (restarted every
    ``restart_every`` leaves), the leaves drawn in all, and ``carry``, the noise drawn
    since the last released round, in lattice units (None: nothing pending).

    Every charged round attempt is a leaf. A completed round releases its clipped sum
    plus ``carry``: ``P(t) - P(s)``, the difference of the noisy prefix sums at this leaf
    and at the last released one ``s``, where a failed attempt's leaf holds no data (its
    sum is never released), so what is released is post-processing of the noisy nodes.
    At a restart the finished tree's noise stays in the model and a new tree starts from
    zero: its first increment is its first leaf's noise."""

    tree: TreeState = TreeState()
    leaves: int = 0
    carry: NDArrays | None = None


def advance(state: TreeNoise, shapes: dict[str, tuple[int, ...]], stddev: float, clip: float,
            rng: np.random.Generator, restart_every: int | None = None) -> TreeNoise:
    """One more leaf: its noise increment joins ``carry``."""
    tree = state.tree
    if restart_every is not None and tree.step >= restart_every:
        tree = TreeState()
    tree, inc = tree_step(tree, shapes, stddev, clip, rng)
    carry = inc if state.carry is None else {k: np.add(state.carry[k], inc[k]) for k in inc}
    return TreeNoise(tree, state.leaves + 1, carry)


def release(state: TreeNoise, sums: NDArrays, clip: float) -> tuple[NDArrays, TreeNoise]:
    """A completed round's sum with the pending noise added (on the lattice), and the
    state with nothing pending."""
    if state.carry is None:
        raise ConfigError("DP-FTRL releases a round only after its leaf was drawn (charge the attempt first)")
    return add_tree_noise(sums, state.carry, clip), TreeNoise(state.tree, state.leaves, None)


def to_arrays(state: TreeNoise) -> NDArrays:
    """The state as named arrays (a journal writes them; :func:`from_arrays` reads them)."""
    arrays: NDArrays = {"counters": np.array([state.tree.step, state.leaves, int(state.carry is not None)], np.int64)}
    for (h, j), noise in state.tree.nodes:
        for k, v in noise.items():
            arrays[f"node/{h}/{j}/{k}"] = v
    for k, v in (state.carry or {}).items():
        arrays[f"carry/{k}"] = v
    return arrays


def from_arrays(arrays: NDArrays) -> TreeNoise:
    """The state :func:`to_arrays` wrote; ConfigError if it is not one."""
    nodes: dict[tuple[int, int], NDArrays] = {}
    carry: NDArrays = {}
    counters = None
    for name, v in arrays.items():
        kind, _, rest = name.partition("/")
        if kind == "counters" and np.shape(v) == (3,):
            counters = [int(x) for x in np.asarray(v)]
        elif kind == "node" and rest.count("/") >= 2:
            h, j, key = rest.split("/", 2)
            nodes.setdefault((int(h), int(j)), {})[key] = np.asarray(v, np.float64)
        elif kind == "carry" and rest:
            carry[rest] = np.asarray(v, np.float64)
        else:
            raise ConfigError(f"a DP-FTRL journal holds an unknown array {name!r}")
    if counters is None:
        raise ConfigError("a DP-FTRL journal has no counters")
    step, leaves, pending = counters
    order = decomposition(step) if step else []
    if sorted(nodes) != sorted(order):
        raise ConfigError(f"a DP-FTRL journal at step {step} holds nodes {sorted(nodes)}, expected {sorted(order)}")
    return TreeNoise(TreeState(step, tuple((n, nodes[n]) for n in order)), leaves, carry if pending else None)
