"""The privacy and robustness layer against plain references: clipping bounds every
contribution, noise off is today's sum bit for bit in any tree shape, the distributed
discrete Gaussian's shares carry the target variance and never wrap, and epsilon is the
accountant library's."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from orchard.aggregation import Accumulator, MetricSums, Partial
from orchard.aggregation.accounting import epsilon_spent, noise_multiplier_for
from orchard.aggregation.layer import STATISTICS, Clip, WeightedSum, clip, noise, robust
from orchard.aggregation.ledger import PrivacyLedger
from orchard.aggregation.privacy import _BLOCK as privacy_block
from orchard.aggregation.privacy import (
    NOISE_SHARE_BOUND,
    DDGParams,
    clip_l2,
    ddg_decode,
    ddg_encode,
    ddg_params,
    discrete_gaussian,
    global_norm,
    min_contributors,
)
from orchard.config import RunConfig
from orchard.errors import ConfigError, PrivacyBudgetExceeded
from orchard.typing import TensorSpec

SCHEMA = [TensorSpec("a", (3, 4), "float32"), TensorSpec("b", (5,), "float32")]


def _updates(seed: int, n: int, scale: float = 1.0) -> list[dict[str, np.ndarray]]:
    rng = np.random.default_rng(seed)
    return [{s.name: (scale * rng.standard_normal(s.shape)).astype(np.float32) for s in SCHEMA} for _ in range(n)]


# ---------------------------------------------------------------------- clipping


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), scale=st.floats(1e-4, 1e4), norm=st.floats(1e-3, 1e3))
def test_clip_bounds_every_contribution(seed: int, scale: float, norm: float) -> None:
    (u,) = _updates(seed, 1, scale)
    clipped, before = clip_l2(u, norm)
    assert before == pytest.approx(global_norm(u))
    assert global_norm(clipped) <= norm
    if before <= norm:
        assert clipped is u  # untouched, not a copy
    else:  # the direction is kept
        for k in u:
            np.testing.assert_allclose(clipped[k] * (before / global_norm(clipped)), u[k], rtol=1e-4, atol=1e-6)


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), norm=st.floats(0.01, 10.0))
def test_the_clip_stage_bounds_what_it_sums(seed: int, norm: float) -> None:
    ups = _updates(seed, 6, 3.0)
    agg = clip(norm, WeightedSum(SCHEMA))
    state = agg.zero()
    for u in ups:
        state = agg.accumulate(state, u, 1.0)
    partial, m = agg.finalize(state)
    # Each summand had norm <= C, so the sum of 6 has norm <= 6 C.
    assert global_norm(partial.sums) <= 6 * norm * (1 + 1e-9)
    assert m["clipped"] == sum(global_norm(u) > norm for u in ups)
    below = partial.metrics.means()["clip_below"]
    assert below == pytest.approx(sum(global_norm(u) <= norm for u in ups) / 6)


# ---------------------------------------------------------------------- noise off == today's sums


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), n=st.integers(1, 12), data=st.data())
def test_with_noise_off_the_layer_is_todays_sum_in_every_tree_shape(seed: int, n: int, data: st.DataObject) -> None:
    """A random tree: clients split into leaves (each a stack with an inactive clip and
    zero noise), leaves merged at the root; against the plain Accumulator folding the
    same updates, leaf by leaf, in the same order: equal to the last bit."""
    ups = _updates(seed, n)
    weights = [float(w) for w in data.draw(st.lists(st.integers(1, 500), min_size=n, max_size=n))]
    cuts = sorted(data.draw(st.sets(st.integers(1, max(1, n - 1)), max_size=max(0, n - 1))))
    groups = [list(range(a, b)) for a, b in zip([0, *cuts], [*cuts, n], strict=True) if a < b]
    rng = np.random.default_rng(0)

    def layer_leaf(idx: list[int]) -> Partial:
        agg = noise(0.0, clip(1e9, WeightedSum(SCHEMA)), rng, 1e9)
        state = agg.zero()
        for i in idx:
            state = agg.accumulate(state, ups[i], weights[i], MetricSums({"loss": 1.0}, {"loss": weights[i]}))
        return agg.finalize(state)[0]

    def plain_leaf(idx: list[int]) -> Partial:
        acc = Accumulator(SCHEMA)
        for i in idx:
            acc.accumulate(ups[i], weights[i], checked=True)
            acc.partial.metrics.merge(MetricSums({"loss": 1.0}, {"loss": weights[i]}))
        return acc.partial

    root_layer, root_plain = WeightedSum(SCHEMA), Accumulator(SCHEMA)
    state = root_layer.zero()
    for g in groups:
        state = root_layer.merge(state, layer_leaf(g))
        root_plain.merge(plain_leaf(g))
    got = root_layer.finalize(state)[0]
    assert got.weight == root_plain.partial.weight and got.count == root_plain.partial.count == n
    for k in got.sums:
        assert got.sums[k].tobytes() == root_plain.partial.sums[k].tobytes()


@pytest.mark.parametrize("secure", [False, True])
def test_noise_has_the_stated_stddev_and_is_added_once(secure: bool) -> None:
    from orchard.randomness import os_random

    rng = os_random() if secure else np.random.default_rng(1)
    agg = noise(2.0, WeightedSum([TensorSpec("x", (200_000,), "float32")]), rng, 1.0)
    state = agg.zero()
    state = agg.accumulate(state, {"x": np.full(200_000, 0.7, np.float32)}, 1.0)
    partial, m = agg.finalize(state)
    residual = partial.sums["x"] - np.float32(0.7)
    assert abs(residual.mean()) < 0.02 and residual.std() == pytest.approx(2.0, rel=0.01)
    assert m["noise_stddev"] == 2.0
    # Every released value is on the noise lattice, whatever the sum was: no low bits to read.
    gamma = 1e-6 * 1.0 / np.sqrt(200_000)
    on = partial.sums["x"] / gamma
    assert np.abs(on - np.rint(on)).max() < 1e-3


# ---------------------------------------------------------------------- robust statistics


def test_robust_statistics_against_numpy_and_their_declared_linearity() -> None:
    ups = _updates(3, 9)
    for name, ref in [("median", lambda s: np.median(s, axis=0)),
                      ("trimmed_mean", lambda s: np.sort(s, axis=0)[1:8].mean(axis=0))]:
        agg = robust(name, WeightedSum(SCHEMA), trim_fraction=0.12)
        state = agg.zero()
        for u in ups:
            state = agg.accumulate(state, u, 7.0)  # weights are ignored: every client counts 1
        partial, _ = agg.finalize(state)
        assert partial.count == 9 and partial.weight == 9.0
        for k in partial.sums:
            stack = np.stack([u[k].astype(np.float64) for u in ups])
            np.testing.assert_allclose(partial.sums[k] / 9, ref(stack), rtol=1e-12)
        assert not agg.linear
    assert STATISTICS["mean"].linear and not STATISTICS["median"].linear
    assert Clip(1.0, WeightedSum(SCHEMA)).linear


def test_a_robust_statistic_shrugs_off_a_scaled_attacker() -> None:
    ups = _updates(4, 10)
    ups[0] = {k: v * 100 for k, v in ups[0].items()}
    agg = robust("median", WeightedSum(SCHEMA))
    state = agg.zero()
    for u in ups:
        state = agg.accumulate(state, u, 1.0)
    med = agg.finalize(state)[0]
    honest_scale = max(float(np.abs(u[k]).max()) for u in ups[1:] for k in u)
    assert all(float(np.abs(v).max()) / 10 <= honest_scale for v in med.sums.values())


# ---------------------------------------------------------------------- distributed discrete Gaussian


@pytest.mark.parametrize("sigma", [0.8, 3.0, 40.0])
def test_discrete_gaussian_has_its_variance(sigma: float) -> None:
    x = discrete_gaussian(sigma, 400_000, np.random.default_rng(5))
    assert x.dtype == np.int64 and abs(x.mean()) < 5 * sigma / math.sqrt(x.size)
    # The discrete Gaussian's variance is within a hair of sigma^2 once sigma >= ~0.8.
    assert x.var() == pytest.approx(sigma ** 2, rel=0.02)


def _exact_pmf(sigma: float) -> tuple[np.ndarray, np.ndarray]:
    """The discrete Gaussian's pmf on [-30 sigma - 3, 30 sigma + 3] (mass beyond: < 1e-190)."""
    half = int(30 * sigma) + 3
    ks = np.arange(-half, half + 1)
    w = np.exp(-(ks.astype(np.float64) ** 2) / (2 * sigma * sigma))
    return ks, w / w.sum()


@pytest.mark.parametrize("sigma", [0.3, 0.8, 1.7, 6.0])
def test_discrete_gaussian_follows_the_exact_pmf(sigma: float) -> None:
    """Pearson's chi-square against the exact pmf (cells with >= 20 expected draws, the
    rest pooled into one tail cell): a wrong law by a relative 1% in any well-populated
    cell fails it; the threshold is the 1e-6 upper quantile, so an exact sampler fails
    one run in a million."""
    from scipy import stats

    n = 1_000_000
    x = discrete_gaussian(sigma, n, np.random.default_rng(int(sigma * 1000)))
    ks, pmf = _exact_pmf(sigma)
    counts = np.bincount(x - ks[0], minlength=ks.size)
    assert counts.size == ks.size  # nothing outside 30 sigma
    big = pmf * n >= 20
    obs = np.append(counts[big], counts[~big].sum())
    exp = np.append(pmf[big] * n, pmf[~big].sum() * n)
    keep = exp > 0
    chi2 = float(((obs[keep] - exp[keep]) ** 2 / exp[keep]).sum())
    assert chi2 < stats.chi2.isf(1e-6, keep.sum() - 1), (chi2, keep.sum())
    # The sampler's first two moments are the pmf's.
    k2 = ks.astype(np.float64) ** 2
    var, m4 = float((pmf * k2).sum()), float((pmf * k2 * k2).sum())
    assert abs(x.mean()) < 6 * math.sqrt(var / n)
    assert abs(x.var() - var) < 6 * math.sqrt((m4 - var * var) / n)


@pytest.mark.parametrize("sigma", [250.0, 9.9e5])
def test_large_sigma_draws_have_the_exact_variance_and_tails(sigma: float) -> None:
    """Where the sampler thins its coin tosses (rejections are rare): mean, variance and
    the two tails P(|X| > 2 sigma), P(|X| > 3.5 sigma) against the exact pmf's, within
    6 standard errors."""
    n = 2_000_000
    x = discrete_gaussian(sigma, n, np.random.default_rng(7))
    ks, pmf = _exact_pmf(sigma)
    var = float((pmf * ks.astype(np.float64) ** 2).sum())
    assert abs(x.mean()) < 6 * math.sqrt(var / n)
    assert x.var() == pytest.approx(var, rel=6 * math.sqrt(2 / n))
    for t in (2.0, 3.5):
        p = float(pmf[np.abs(ks) > t * sigma].sum())
        got = float(np.mean(np.abs(x) > t * sigma))
        assert abs(got - p) < 6 * math.sqrt(p * (1 - p) / n), (t, got, p)


def test_discrete_gaussian_refuses_what_is_not_a_sigma() -> None:
    for bad in (0.0, -1.0, float("nan"), float("inf")):
        with pytest.raises(ConfigError, match="sigma"):
            discrete_gaussian(bad, 10, np.random.default_rng(0))
    assert discrete_gaussian(2.0, 0, np.random.default_rng(0)).shape == (0,)


def test_noise_shares_sum_to_the_target_variance() -> None:
    """n_min clients' shares add up to the cohort's target sigma^2 (statistical test)."""
    p = ddg_params(clip=1.0, noise_multiplier=1.0, participants=12, min_contributors=10, dim=64, modulus_bits=32)
    # Work at a small scale so the variance is measurable: shares of a unit-ish sigma.
    share = 2.5
    total = sum(discrete_gaussian(share, 200_000, np.random.default_rng(100 + i)) for i in range(10))
    assert total.var() == pytest.approx(10 * share ** 2, rel=0.02)
    assert p.share_sigma == pytest.approx(p.sigma / math.sqrt(10))


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), n=st.integers(2, 40), dim=st.integers(1, 300), bits=st.sampled_from([32, 40, 62]),
       z=st.floats(0.3, 5.0), dropout=st.floats(0.0, 0.45))
def test_the_sum_never_wraps_and_decodes_exactly(seed: int, n: int, dim: int, bits: int, z: float,
                                                 dropout: float) -> None:
    """Worst case: every client's whole norm in one coordinate, all the same sign. The
    field sum decodes to the exact integer sum of what the clients encoded, times gamma."""
    nmin = min_contributors(n, dropout)
    try:
        p = ddg_params(1.0, z, n, nmin, dim, bits)
    except ConfigError:
        return  # a field too small for this cohort is refused up front, never wrapped
    rng = np.random.default_rng(seed)
    x = np.zeros(dim)
    x[0] = 5.0  # clipped to 1.0 by the encoder
    words = [ddg_encode(x, p, rng) for _ in range(n)]
    mask = (1 << bits) - 1
    signed = [np.where(w.astype(np.uint64) >= (1 << (bits - 1)), w.astype(np.int64) - (1 << bits) if bits < 63
                       else w.astype(np.int64), w.astype(np.int64)) for w in words]
    exact = np.sum(signed, axis=0)  # int64: no modulus
    assert np.abs(exact).max() < 2 ** (bits - 1)
    field = np.zeros(dim, np.uint64)
    for w in words:
        field = (field + w.astype(np.uint64)) & np.uint64(mask)
    np.testing.assert_array_equal(ddg_decode(field, p), exact.astype(np.float64) * p.gamma)
    # Each client's share is bounded, so the bound the parameters were chosen by holds.
    assert (np.abs(np.array(signed)[:, 1:]) <= p.delta2 + NOISE_SHARE_BOUND * p.share_sigma + 1).all()


@settings(max_examples=15, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), blocks=st.floats(0.3, 3.5), slack=st.floats(0.0, 2.0))
def test_conditional_rounding_holds_across_blocks(seed: int, blocks: float, slack: float) -> None:
    """With no noise, an encoding is x clipped and scaled, each coordinate rounded down or
    up, and its norm within delta2: also when the vector spans several of the encoder's
    blocks and delta2 is so tight that most passes are thrown away and retried."""
    dim = max(1, int(blocks * privacy_block))
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(dim)
    scale = 64.0
    y = x * (1.0 / np.linalg.norm(x)) * scale  # clipped to norm 1, then 1 / gamma = 64
    # E|rounded|^2 = |y|^2 + sum frac (1 - frac); delta2 a few stddevs of it either side.
    frac = y - np.floor(y)
    mean2 = float(y @ y + (frac * (1 - frac)).sum())
    sd2 = float(2 * np.sqrt((y * y * frac * (1 - frac)).sum()))
    delta2 = math.sqrt(mean2 + (slack - 0.5) * sd2)
    p = DDGParams(clip=1.0, gamma=1.0 / scale, delta2=delta2, sigma=1e-9, share_sigma=1e-9, participants=1,
                  min_contributors=1, modulus_bits=32, beta=0.5, tau=0.0)
    w = ddg_encode(x * 3.0, p, rng)  # clipped back to norm 1
    got = ddg_decode(w, p) * scale
    assert np.all((got == np.floor(y)) | (got == np.ceil(y)))
    assert float(got @ got) <= delta2 ** 2


def test_the_decoded_cohort_sum_is_the_clipped_sum_plus_the_target_noise() -> None:
    n, dim = 20, 2000
    p = ddg_params(clip=1.0, noise_multiplier=0.5, participants=n, min_contributors=n, dim=dim, modulus_bits=32)
    rng = np.random.default_rng(9)
    xs = [rng.standard_normal(dim) * 0.05 for _ in range(n)]
    xs[0] = xs[0] * 100  # clipped
    field = np.zeros(dim, np.uint64)
    for x in xs:
        field = (field + ddg_encode(x, p, rng).astype(np.uint64)) & np.uint64((1 << 32) - 1)
    got = ddg_decode(field, p)
    want = sum(x * min(1.0, 1.0 / np.linalg.norm(x)) for x in xs)
    err = got - want
    # The noise on the sum has stddev sigma * gamma (plus rounding, far smaller).
    assert err.std() == pytest.approx(p.sigma * p.gamma, rel=0.05)


def test_a_field_too_small_is_refused_with_what_to_do() -> None:
    with pytest.raises(ConfigError, match="modulus_bits"):
        ddg_params(1.0, 1.0, 10_000, 9_000, 1_000_000, 16)


# ---------------------------------------------------------------------- accounting


@pytest.mark.parametrize(("z", "rounds", "adjacency"), [(1.0, 100, "replace_one"), (0.7, 30, "add_remove"),
                                                      (2.0, 5, "replace_one")])
def test_epsilon_is_the_accountant_librarys(z: float, rounds: int, adjacency: str) -> None:
    import dp_accounting
    from dp_accounting.rdp import RdpAccountant

    acc = RdpAccountant()
    for _ in range(rounds):  # sensitivity 2C under replace-one, C under add/remove
        acc.compose(dp_accounting.GaussianDpEvent(z / (2.0 if adjacency == "replace_one" else 1.0)))
    assert epsilon_spent(z, rounds, 1e-5, adjacency) == pytest.approx(acc.get_epsilon(1e-5), rel=1e-9)


def _dp_config(**privacy: object) -> RunConfig:
    return RunConfig.model_validate({"rounds": 20, "cohort": {"target": 100, "weighting": "uniform"},
                                     "privacy": {"mode": "central", **privacy}})


def test_the_ledger_spends_exactly_its_target_and_stops_there() -> None:
    ledger = PrivacyLedger.plan(_dp_config(target_epsilon=4.0), population=10_000)
    assert ledger is not None
    assert ledger.noise_multiplier == pytest.approx(noise_multiplier_for(4.0, 1e-5, 20))
    for _ in range(20):
        ledger.check_next()
        ledger.charge()
    assert ledger.epsilon <= 4.0 and ledger.epsilon == pytest.approx(4.0, rel=1e-3)
    with pytest.raises(PrivacyBudgetExceeded, match="epsilon"):
        ledger.check_next()
    assert ledger.noise_stddev == pytest.approx(ledger.noise_multiplier * 1.0)


def test_the_ledger_refuses_what_cannot_work() -> None:
    with pytest.raises(ConfigError, match="privacy.population"):
        PrivacyLedger.plan(_dp_config(target_epsilon=4.0))  # no population
    with pytest.raises(ConfigError, match="raise the noise multiplier"):
        PrivacyLedger.plan(_dp_config(target_epsilon=1.0, noise_multiplier=0.3, population=1000))
    assert PrivacyLedger.plan(RunConfig()) is None


def test_adaptive_clipping_moves_towards_the_quantile() -> None:
    ledger = PrivacyLedger.plan(_dp_config(target_epsilon=8.0, adaptive={"target_quantile": 0.5}, clip_norm=1.0),
                                population=10_000)
    assert ledger is not None and ledger.update_noise_multiplier > ledger.noise_multiplier
    rng = np.random.default_rng(0)
    ledger.adapt(1.0, 100, 0.5, 0.2, rng)  # every client within the norm: shrink it
    assert ledger.clip_norm < 1.0
    c = ledger.clip_norm
    ledger.adapt(0.0, 100, 0.5, 0.2, rng)  # none within: grow it
    assert ledger.clip_norm > c


def test_stacks_that_cannot_work_are_refused_with_what_would() -> None:
    from orchard.server.validation import aggregation_problems

    with pytest.raises(ValueError, match="weighting = 'uniform'"):
        RunConfig.model_validate({"privacy": {"mode": "central", "target_epsilon": 1.0}})
    with pytest.raises(ValueError, match="secure_aggregation.enabled = true"):
        RunConfig.model_validate({"cohort": {"weighting": "uniform"},
                                  "privacy": {"mode": "distributed", "noise_multiplier": 1.0}})
    cfg = RunConfig.model_validate({"cohort": {"weighting": "uniform"}, "secure_aggregation": {"enabled": True},
                                    "robust": {"statistic": "median"}})
    (problem,) = aggregation_problems(cfg)
    assert "not linear" in problem and "'mean'" in problem
