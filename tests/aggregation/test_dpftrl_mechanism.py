"""DP-FTRL behind the ledger: the bound under a participation cap and tree restarts holds
over every pattern (brute force), the population ledger's per-attempt charges compose to
the run's epsilon exactly, and what a run releases carries exactly the noise of its
prefix sums (failed attempts' leaves hold no data)."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest

from orchard import wire
from orchard.aggregation import ftrl
from orchard.aggregation.accounting import epsilon_of
from orchard.aggregation.ledger import PrivacyLedger
from orchard.aggregation.mechanisms import TreeRounds
from orchard.config import PrivacyConfig, RunConfig


def _true_max(rounds: int, b: int, cap: int, restart: int | None) -> int:
    """max over patterns (b apart, at most cap) of sum over every tree's nodes of c^2."""
    size = rounds if restart is None else restart
    trees = [(s, min(size, rounds - s)) for s in range(0, rounds, size)]
    nodes = [(s + j * 2 ** h, s + min((j + 1) * 2 ** h, n)) for s, n in trees
             for h in range(max(n, 1).bit_length() + 1) for j in range(math.ceil(n / 2 ** h))]
    best = 0
    for k in range(1, cap + 1):
        for pat in itertools.combinations(range(1, rounds + 1), k):
            if any(y - x < b for x, y in itertools.pairwise(pat)):
                continue
            best = max(best, sum(sum(1 for t in pat if lo < t <= hi) ** 2 for lo, hi in set(nodes)))
    return best


@pytest.mark.parametrize("rounds", [1, 4, 7, 10])
@pytest.mark.parametrize("b,cap,restart", [(1, 2, None), (2, 3, None), (1, 10, 4), (2, 2, 3), (3, 1, None)])
def test_the_bound_holds_under_a_cap_and_restarts(rounds: int, b: int, cap: int, restart: int | None) -> None:
    assert _true_max(rounds, b, cap, restart) <= ftrl.restarted_counts_squared(rounds, b, cap, restart)


def test_one_participation_costs_one_per_level() -> None:
    # A device in one round of a 100-leaf tree is in one node per level: 8 levels.
    assert ftrl.restarted_counts_squared(100, 100, 1) == 8
    assert ftrl.restarted_counts_squared(100, 1, 1) == 8  # the cap alone says the same
    # Restarting every 10 leaves: a device in one tree only, 5 levels of a 10-leaf tree.
    assert ftrl.restarted_counts_squared(100, 100, 1, 10) == 5


def _tree_cfg(**kw: object) -> PrivacyConfig:
    base: dict[str, object] = {"mode": "dpftrl", "max_participations": 3, "min_separation": 4,
                               "noise_multiplier": 3.0, "population": 1000, "delta": 1e-4}
    return PrivacyConfig.model_validate({**base, **kw})


def test_per_attempt_charges_compose_to_the_runs_epsilon() -> None:
    mech = TreeRounds(_tree_cfg(restart_every=8))
    z, delta = 3.0, 1e-4
    for t in (1, 5, 12, 30):
        whole = mech.epsilon(z, t, delta)
        per_attempt = [(mech.charge_multiplier(z, a), 1) for a in range(1, t + 1)]
        assert epsilon_of(per_attempt, delta) == pytest.approx(whole, rel=1e-9)
        s = ftrl.restarted_counts_squared(t, 4, 3, 8)
        assert whole == pytest.approx(ftrl.ftrl_epsilon(z, t, 4, delta, "replace_one", 3, 8), rel=1e-12)
        assert mech.charges(z, t) == [(z / math.sqrt(s), 1)]


def test_the_ledger_plans_dpftrl_to_its_target() -> None:
    cfg = RunConfig.model_validate({"rounds": 40, "cohort": {"target": 10, "weighting": "uniform"},
                                    "privacy": {"mode": "dpftrl", "target_epsilon": 8.0, "delta": 1e-4,
                                                "population": 10_000, "max_participations": 1,
                                                "min_separation": 40}})
    ledger = PrivacyLedger.plan(cfg)
    assert ledger is not None and ledger.noise_stddev == 0.0  # nothing added by the tiers' stack
    assert ledger.epsilon_after(40) <= 8.0 * (1 + 1e-9)
    assert ledger.epsilon_after(40) > 7.9
    central = PrivacyLedger.plan(cfg.model_copy(update={"privacy": cfg.privacy.model_copy(update={
        "mode": "central", "max_participations": None, "min_separation": None})}))
    assert central is not None and central.noise_multiplier > 2 * ledger.noise_multiplier


def test_released_rounds_carry_the_prefix_noise_with_failed_attempts_in_between() -> None:
    shapes, clip, z = {"w": (20_000,)}, 1.0, 2.0
    mech = TreeRounds(_tree_cfg(max_participations=100, min_separation=1))
    rng = np.random.default_rng(3)
    model_noise = np.zeros(20_000)
    gamma = ftrl._lattice(clip, shapes)
    outcomes = [True, False, True, True, False, False, True]  # attempt completed?
    for ok in outcomes:
        mech.draw(shapes, z, clip, rng)
        if ok:
            model_noise += mech.release({"w": np.zeros(20_000)}, clip)["w"]
    # What the model holds is the tree's noise at the last leaf, N(7): popcount(7) = 3 nodes.
    nodes = dict(mech.state.tree.nodes)
    expect = sum(nodes[n]["w"] for n in ftrl.decomposition(len(outcomes))) * gamma
    np.testing.assert_allclose(model_noise, expect, atol=1e-12)
    assert model_noise.std() == pytest.approx(z * clip * math.sqrt(3), rel=0.03)


def test_the_journal_round_trips_and_a_restart_drops_only_released_noise() -> None:
    shapes, clip, z = {"a": (3, 4), "b": (5,)}, 0.5, 1.5
    mech = TreeRounds(_tree_cfg(max_participations=100, min_separation=1, restart_every=4))
    rng = np.random.default_rng(0)
    for _ in range(6):
        mech.draw(shapes, z, clip, rng)
    blob = wire.arrays_to_blob(mech.snapshot())  # as the root journals it
    back = TreeRounds(_tree_cfg(max_participations=100, min_separation=1, restart_every=4))
    back.resume(wire.blob_to_arrays(blob), 6, 5, shapes, z, clip, rng)  # last release at attempt 5
    assert back.state.leaves == 6 and back.state.tree.step == 2  # restarted after 4 leaves
    assert back.state.carry is not None
    for k in shapes:
        np.testing.assert_array_equal(back.state.carry[k], mech.state.carry[k])
    released = TreeRounds(_tree_cfg(max_participations=100, min_separation=1, restart_every=4))
    released.resume(wire.blob_to_arrays(blob), 6, 6, shapes, z, clip, rng)  # attempt 6 completed
    assert released.state.carry is None
    behind = TreeRounds(_tree_cfg(max_participations=100, min_separation=1, restart_every=4))
    behind.resume(wire.blob_to_arrays(blob), 8, 6, shapes, z, clip, rng)  # 2 charged, never journaled
    assert behind.state.leaves == 8
    with pytest.raises(Exception, match="disagree"):
        TreeRounds(_tree_cfg(max_participations=100, min_separation=1)).resume(
            wire.blob_to_arrays(blob), 5, 0, shapes, z, clip, rng)
