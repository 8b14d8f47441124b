"""The epsilon Orchard reports is the epsilon it delivers: recomputed here, independently,
with dp-accounting, under the participation Orchard's selection really has (any device
may be in every round: no amplification by sampling) and the declared adjacency."""

from __future__ import annotations

import math

import pytest

from orchard.aggregation.accounting import update_noise_multiplier
from orchard.aggregation.ledger import PrivacyLedger
from orchard.config import RunConfig
from orchard.errors import ConfigError


def _config(rounds: int, **privacy: object) -> RunConfig:
    return RunConfig.model_validate({
        "rounds": rounds, "cohort": {"target": 100, "over_selection": 1.3, "weighting": "uniform"},
        "privacy": {"mode": "central", "delta": 1e-5, "clip_norm": 0.1, **privacy}})


def _honest_epsilon(noise_stddev_over_clip: float, rounds: int, delta: float) -> float:
    """Every round a Gaussian mechanism on a sum whose sensitivity is 2C (one device's
    data replaced by another's), composed over all rounds (RDP), no sampling."""
    import dp_accounting
    from dp_accounting.rdp import RdpAccountant

    acc = RdpAccountant(neighboring_relation=dp_accounting.NeighboringRelation.REPLACE_ONE)
    acc.compose(dp_accounting.SelfComposedDpEvent(dp_accounting.GaussianDpEvent(noise_stddev_over_clip / 2.0),
                                                  rounds))
    return float(acc.get_epsilon(delta))


# The documented settings: the worked example's epsilon 8 over 50 rounds and the privacy
# benchmark's epsilon 1 over 40 rounds, 100 clients a round among 10,000 devices.
@pytest.mark.parametrize(("target", "rounds"), [(8.0, 50), (1.0, 40)])
def test_the_epsilon_a_run_reports_is_the_honest_one(target: float, rounds: int) -> None:
    ledger = PrivacyLedger.plan(_config(rounds, target_epsilon=target), population=10_000)
    assert ledger is not None
    for _ in range(rounds):
        ledger.check_next()
        ledger.charge()
    honest = _honest_epsilon(ledger.noise_stddev / ledger.clip_norm, rounds, 1e-5)
    assert ledger.epsilon == pytest.approx(honest, rel=1e-9)
    assert ledger.epsilon <= target * (1 + 1e-9)


def test_a_claimed_sampling_rate_is_refused_with_what_to_change() -> None:
    with pytest.raises(ValueError, match="Poisson sampling.*remove it"):
        _config(50, target_epsilon=8.0, sampling_rate=0.013)


def test_add_remove_adjacency_is_refused_while_the_count_is_released() -> None:
    with pytest.raises(ValueError, match="replace_one"):
        _config(50, target_epsilon=8.0, adjacency="add_remove")


def test_delta_must_be_at_most_one_over_the_population() -> None:
    with pytest.raises(ValueError, match="1 / population"):
        _config(50, target_epsilon=8.0, population=1000, delta=1e-2)
    with pytest.raises(ConfigError, match="1 / population"):
        PrivacyLedger.plan(_config(50, target_epsilon=8.0, delta=1e-3), population=10_000)
    with pytest.raises(ConfigError, match="privacy.population"):
        PrivacyLedger.plan(_config(50, target_epsilon=8.0))  # a gRPC run must state it


@pytest.mark.parametrize("adjacency", ["replace_one", "add_remove"])
def test_adaptive_clippings_count_is_charged_at_its_real_sensitivity(adjacency: str) -> None:
    """The pair (sum + N(0, (z_u C)^2), centred count + N(0, sigma_b^2)) is one Gaussian
    mechanism; its sensitivity in noise units, from first principles, must be what the
    accountant charges for z: k / z with k the sum's sensitivity in clip norms."""
    z, sigma_b = 1.0, 0.6
    k = 2.0 if adjacency == "replace_one" else 1.0
    s_b = 1.0 if adjacency == "replace_one" else 0.5  # centred bits: +-1/2 each
    z_u = update_noise_multiplier(z, sigma_b, adjacency)
    assert math.hypot(k / z_u, s_b / sigma_b) == pytest.approx(k / z, rel=1e-12)
    # An uncentred count under add/remove (sensitivity 1) would leave nothing for the updates.
    assert (1.0 / z) ** 2 - (1.0 / sigma_b) ** 2 < 0


def _clamp_delta(epsilon: float, draws: int) -> float:
    """Reference: a client's discrete Gaussian share is clamped at 10 sigma per coordinate;
    a sigma-subgaussian draw lands beyond with probability <= 2 exp(-50), so ``draws``
    draws change the output with probability <= eta = draws * 2 exp(-50), and an
    (epsilon, delta) guarantee becomes (epsilon, delta + (1 + e^epsilon) eta)."""
    return (1 + math.exp(epsilon)) * draws * 2 * math.exp(-50)


def _distributed(delta: float) -> RunConfig:
    return RunConfig.model_validate({
        "rounds": 40, "cohort": {"target": 100, "over_selection": 1.0, "weighting": "uniform"},
        "secure_aggregation": {"enabled": True},
        "privacy": {"mode": "distributed", "target_epsilon": 8.0, "delta": delta, "clip_norm": 0.1,
                    "population": 10_000}})


def test_distributed_dp_reports_the_delta_its_clamped_noise_shares_add() -> None:
    cfg = _distributed(1e-5)
    dim, population = 114_000, 10_000
    ledger = PrivacyLedger.plan(cfg, population=population, dimension=dim)
    assert ledger is not None
    for t in range(1, 41):
        ledger.check_next()
        charge = ledger.charge()
        # Each attempt: at most one share from each device, each of dimension ``dim``.
        want = 1e-5 + _clamp_delta(ledger.epsilon, t * population * dim)
        assert charge["delta"] == pytest.approx(want, rel=1e-9) and charge["delta"] > 1e-5
    shown = ledger.as_dict()
    assert shown["delta"] == pytest.approx(1e-5 + _clamp_delta(ledger.epsilon, 40 * population * dim), rel=1e-9)
    assert shown["accountant_delta"] == 1e-5 and shown["delta"] <= 1 / population
    # Central DP's noise is not clamped: its delta is the accountant's.
    central = PrivacyLedger.plan(_config(40, target_epsilon=8.0), population=population, dimension=dim)
    assert central is not None
    assert central.charge()["delta"] == 1e-5
    with pytest.raises(ConfigError, match="dimension"):
        PrivacyLedger.plan(cfg, population=population)


def test_a_clamp_that_lifts_delta_above_one_over_the_population_is_refused() -> None:
    # delta = 1 / population leaves no room for the clamp: refused, naming the delta that fits.
    cfg = _distributed(1e-4)
    with pytest.raises(ConfigError, match=r"clamping the noise shares.*lower privacy.delta"):
        PrivacyLedger.plan(cfg, population=10_000, dimension=114_000)
    assert PrivacyLedger.plan(cfg.model_copy(update={"privacy": cfg.privacy.model_copy(update={"delta": 9.9e-5})}),
                              population=10_000, dimension=114_000) is not None
