"""Differential privacy: clipping, noise, the distributed discrete Gaussian, accounting.

Pure: arrays and explicit randomness in, arrays and numbers out. What the mechanisms
here cost is :mod:`orchard.aggregation.accounting` (``dp_accounting``'s RDP accountant);
a run's ledger is :mod:`orchard.aggregation.ledger`.

Central DP (McMahan et al., 2018, "Learning differentially private recurrent language
models"; the trusted root adds the noise). Each client's update is clipped to L2 norm
``C``; the root adds ``N(0, (z C)^2)`` to every coordinate of the cohort's sum and
divides by the number of contributions (public under replace-one adjacency: which
devices take part is not what the guarantee hides). One round is a Gaussian mechanism
whose sensitivity is ``2 C`` (replace one device's data), composed over every round a
device may take part in: all of them, as Orchard's selection is not Poisson sampling
and no amplification by sampling is claimed.

Adaptive clipping (Andrew et al., 2021, "Differentially private learning with adaptive
clipping"). Each client also contributes ``b_i = [||x_i|| <= C]``; the root noises the
centred count ``sum (b_i - 1/2)`` with ``N(0, sigma_b^2)`` and moves ``C <- C exp(-eta (b_bar - gamma))`` towards
the target quantile ``gamma``. Their Theorem 1: updates with multiplier ``z_update``
and the count with ``sigma_b`` together are a Gaussian mechanism with
``z = (z_update^-2 + (2 sigma_b)^-2)^(-1/2)``; given the ``z`` the budget allows,
:func:`~orchard.aggregation.accounting.update_noise_multiplier` returns ``z_update``.

Distributed DP under secure aggregation (Kairouz et al., 2021, "The distributed discrete
Gaussian mechanism for federated learning with secure aggregation"). Tiers are not
trusted: each client clips to ``C``, scales by ``1 / gamma``, rounds to integers with
conditional randomized rounding (retrying until the rounded vector's norm is within the
bound ``Delta_2`` of their eq. (4)), adds its share of discrete Gaussian noise and
reduces modulo the field. With ``n`` clients in the session, of whom at least ``n_min``
(the session's dropout tolerance) contribute, each adds variance ``sigma^2 / n_min``, so
the cohort sum carries at least ``sigma^2 = (z Delta_2)^2`` whoever drops. ``gamma`` is
the finest granularity at which ``n`` contributions of norm ``Delta_2`` plus their noise
(each share bounded at 10 standard deviations) stay inside ``(-M/2, M/2)``: the sum
never wraps. The sum of independent discrete Gaussians is not exactly one; their
Theorem 1 bounds the gap by ``tau``, which :func:`ddg_params` folds into the sensitivity
the accountant sees (negligible at the scales chosen here).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import cast

import numpy as np

from orchard.config import RunConfig
from orchard.errors import ConfigError
from orchard.typing import NDArrays
from orchard.updates import squared_norm

_BLOCK = 1 << 14  # elements per step of the samplers' vector loops (128 KiB of float64)
_THIN_BELOW = 64.0  # expected coin tosses per batch below which the sampler thins (see discrete_gaussian)
NOISE_SHARE_BOUND = 10.0  # a client's noise share is clamped at this many standard deviations


def share_clamp_delta(epsilon: float, draws: int) -> float:
    """What clamping noise shares adds to delta: distributed DP's clients clamp each
    coordinate of their discrete Gaussian share at ``NOISE_SHARE_BOUND`` standard
    deviations (so that the field cannot wrap), which changes the mechanism only when a
    draw lands beyond the bound. A discrete Gaussian of parameter sigma is sigma-subgaussian
    (Canonne, Kamath and Steinke 2020), so one draw lands there with probability at most
    ``eta_1 = 2 exp(-NOISE_SHARE_BOUND^2 / 2)`` (3.9e-22 at 10), and ``draws`` of them
    with probability at most ``eta = draws * eta_1``: the clamped mechanism is within total
    variation ``eta`` of the unclamped one on every input. If the unclamped one is
    (epsilon, delta)-DP, the clamped one is (epsilon, delta + (1 + e^epsilon) eta)-DP:
    ``P[M'(D) in S] <= P[M(D) in S] + eta <= e^eps (P[M'(D') in S] + eta) + delta + eta``.
    Returns ``(1 + e^epsilon) eta``."""
    if draws < 0 or not epsilon >= 0:
        raise ConfigError(f"need draws >= 0 and epsilon >= 0, got {draws} and {epsilon}")
    if draws == 0:
        return 0.0
    return (1.0 + math.exp(min(epsilon, 700.0))) * draws * 2.0 * math.exp(-NOISE_SHARE_BOUND ** 2 / 2.0)


# ------------------------------------------------------------------------------ clipping


def global_norm(update: NDArrays) -> float:
    """The L2 norm of all tensors of ``update`` together."""
    return math.sqrt(sum(squared_norm(v) for v in update.values()))


def clip_factor(norm: float, bound: float) -> float:
    """What an update of L2 norm ``norm`` is multiplied by to clip it to ``bound``: 1
    within the bound, else ``bound / norm`` a hair (1e-6 relative) lower, so that float32
    rounding of the scaled values cannot lift their norm above the bound: the bound is
    what sensitivity analyses rely on."""
    return 1.0 if norm <= bound else bound / norm * (1.0 - 1e-6)


def clip_l2(update: NDArrays, norm: float) -> tuple[NDArrays, float]:
    """``update * min(1, norm / ||update||)`` (float32, as it came; :func:`clip_factor`)
    and the norm it had. An update within the bound comes back as the very same arrays."""
    if not norm > 0:
        raise ConfigError(f"a clipping norm must be > 0, got {norm}")
    n = global_norm(update)
    if n <= norm:
        return update, n
    # Scaled in the update's own dtype: one temporary per tensor, not two float64 ones. The
    # scale's rounding to float32 (6e-8 relative) is far inside clip_factor's 1e-6 margin.
    scale = clip_factor(n, norm)
    return {k: v * np.asarray(scale, dtype=v.dtype) for k, v in update.items()}, n


# ------------------------------------------------------------------------------ central noise


LATTICE_SLACK = 1e-6  # the sum's rounding onto the noise lattice may move it by this many clip norms


def add_gaussian_noise(sums: NDArrays, stddev: float, clip: float, rng: np.random.Generator) -> NDArrays:
    """Central DP's noise on a round's sum: ``gamma (round(S / gamma) + K)`` element-wise
    (float64, a new dict), ``K`` discrete Gaussian with stddev ``stddev' / gamma``.

    The output lies on the lattice ``gamma Z`` whatever the sum was, so the floating-point
    attack on continuous noise (Mironov, 2012: the low bits and the holes in the
    support of floating-point noise reveal the value it was added to) has nothing to
    read. ``gamma = LATTICE_SLACK clip / sqrt(d)``: rounding the sum moves it by at most
    ``gamma sqrt(d) = LATTICE_SLACK clip`` in L2, which can add that much to the
    sensitivity (at least ``clip``), so the stddev is raised by the same factor,
    ``stddev' = stddev (1 + LATTICE_SLACK)``: ``stddev' / (Delta + gamma sqrt(d)) >=
    stddev / Delta`` and the accountant's noise multiplier still holds. The discrete
    Gaussian on integers satisfies the Gaussian mechanism's RDP at the same stddev
    (Canonne, Kamath and Steinke, 2020, Thm. 14 for integer-valued queries), and the
    draws come from ``rng`` (a root passes ``orchard.randomness.os_random()``)."""
    if not (stddev > 0 and clip > 0):
        raise ConfigError(f"central noise needs stddev > 0 and a clip norm > 0, got {stddev} and {clip}")
    dim = sum(int(np.size(v)) for v in sums.values())
    gamma = LATTICE_SLACK * clip / math.sqrt(max(dim, 1))
    sampler = _DiscreteGaussian(stddev * (1.0 + LATTICE_SLACK) / gamma)
    out: NDArrays = {}
    for k, v in sums.items():
        lattice = np.rint(np.asarray(v, np.float64) / gamma)
        if lattice.size and float(np.abs(lattice).max()) >= 2.0 ** 52:
            raise ConfigError(f"a sum of norm {global_norm({k: v}):.3g} is too large for the noise lattice at clip "
                              f"{clip}: were the updates clipped?")
        noise = np.empty(lattice.size, np.float64)
        sampler.fill(noise, rng)
        lattice += noise.reshape(lattice.shape)  # integers below 2^53: exact
        out[k] = lattice * gamma
    return out


def adapt_clip(norm: float, below_fraction: float, target_quantile: float, learning_rate: float) -> float:
    """Andrew et al.'s geometric update: ``C exp(-eta (b_bar - gamma))``."""
    return float(norm * math.exp(-learning_rate * (below_fraction - target_quantile)))


# ------------------------------------------------------------------------------ discrete Gaussian


def discrete_gaussian(sigma: float, size: int, rng: np.random.Generator) -> np.ndarray:
    """``size`` independent draws from the discrete Gaussian N_Z(0, sigma^2) (int64):
    ``P(k) ∝ exp(-k^2 / (2 sigma^2))`` on the integers.

    Rejection from a rounded continuous Gaussian, exact in real arithmetic (float64 in
    practice). Draw ``X ~ N(0, s^2)`` with ``s^2 = sigma^2 + D``, let ``k = round(X)``,
    ``u = X - k``; accept ``k`` with probability ``exp(L - B)`` where
    ``L = X^2 / (2 s^2) - k^2 / (2 sigma^2)`` and ``B = 1 / (8 D)`` bounds ``L`` for all
    ``k`` and ``|u| <= 1/2`` (``B - L >= 0``). An accepted ``k`` then has probability
    ``∫ phi_s(k + u) exp(L - B) du = exp(-k^2 / (2 sigma^2) - B) / (sqrt(2 pi) s)``: the
    discrete Gaussian, exactly. ``D = (1 + sqrt(1 + 16 sigma^2)) / 8`` maximises the
    acceptance rate ``~ (sigma / s) exp(-B)``: 0.64 at sigma = 1, ``1 - 1 / (2 sigma)``
    for large sigma. The coin is ``E >= B - L`` with ``E ~ Exp(1)``. Per draw: one normal,
    one exponential (numpy's ziggurats) and a few vector operations, where Canonne,
    Kamath and Steinke's Algorithm 3 (discrete Laplace proposals) takes two geometrics,
    a uniform and an exponential function at a 76% acceptance rate. For large sigma,
    where the coin almost never rejects, only the candidates a thinning step picks toss
    it (same law, see the code)."""
    if size < 0:
        raise ConfigError(f"discrete Gaussian size must be >= 0, got {size}")
    out = np.empty(size, np.int64)
    _DiscreteGaussian(sigma).fill(out, rng)
    return out


class _DiscreteGaussian:
    """:func:`discrete_gaussian`'s constants for one sigma and its scratch blocks: fills
    an array of any numeric dtype with draws, a block at a time (a temporary the size of a
    model costs page faults and cache misses, not only flops)."""

    def __init__(self, sigma: float) -> None:
        if not (math.isfinite(sigma) and sigma > 0):
            raise ConfigError(f"discrete Gaussian sigma must be > 0 and finite, got {sigma}")
        d = (1.0 + math.sqrt(1.0 + 16.0 * sigma * sigma)) / 8.0
        self.s2 = sigma * sigma + d
        self.s = math.sqrt(self.s2)
        self.a = d / (2.0 * sigma * sigma * self.s2)  # 1/(2 sigma^2) - 1/(2 s^2)
        self.bound = 1.0 / (8.0 * d)
        self.rate = (sigma / self.s) * math.exp(-self.bound)  # the acceptance rate, a hair low for sigma < 1
        self._x, self._k, self._gap = np.empty(_BLOCK), np.empty(_BLOCK), np.empty(_BLOCK)

    def fill(self, out: np.ndarray, rng: np.random.Generator) -> None:
        s, s2, a, bound = self.s, self.s2, self.a, self.bound
        size, filled = out.size, 0
        while filled < size:
            need = size - filled
            m = min(_BLOCK, int(need / self.rate * 1.02) + 32)
            xs, ks, gs = self._x[:m], self._k[:m], self._gap[:m]
            rng.standard_normal(out=xs)
            xs *= s
            np.rint(xs, out=ks)
            # B - L = B + a k^2 - (2 k u + u^2) / (2 s^2) <= B + a K^2 + K / (2 s^2) with
            # K = max |k| (|u| <= 1/2): a bound on every candidate's gap from two reductions.
            kmax = max(float(ks.max()), -float(ks.min()))
            top = bound + a * kmax * kmax + kmax / (2.0 * s2)
            if top * m <= _THIN_BELOW:
                # Large sigma: rejections are rare (gap ~ 1 / sigma). Each candidate is
                # still rejected independently with probability r_i = 1 - exp(-gap_i) <=
                # r = 1 - exp(-top): a Binomial(m, r) count of candidates, uniformly
                # chosen, are tested, and each is rejected with probability r_i / r
                # (thinning). Only the tested candidates' gaps are computed.
                r = -math.expm1(-top)
                tested = int(rng.binomial(m, r))
                keep = ks
                if tested:
                    idx = rng.choice(m, tested, replace=False)
                    kt = ks[idx]
                    ut = xs[idx] - kt
                    gt = bound + a * kt * kt - (2.0 * kt + ut) * ut / (2.0 * s2)
                    rejected = idx[rng.random(tested) * r < -np.expm1(-gt)]
                    if rejected.size:
                        keep = np.delete(ks, rejected)
            else:
                xs -= ks  # u, exactly (x and k are within 1/2 of each other)
                np.multiply(ks, 2.0, out=gs)  # B - L, as above
                gs += xs
                gs *= xs
                gs *= -0.5 / s2
                np.multiply(ks, ks, out=xs)
                xs *= a
                gs += xs
                gs += bound
                keep = ks[rng.standard_exponential(m) >= gs]
            got = min(need, keep.size)
            out[filled:filled + got] = keep[:got]
            filled += got


@dataclass(frozen=True)
class DDGParams:
    """One session's distributed discrete Gaussian encoding."""

    clip: float  # C: the L2 bound of each client's update (float units)
    gamma: float  # granularity: a field unit is gamma in float units
    delta2: float  # L2 bound of a rounded client vector, in field units (Kairouz et al. eq. 4)
    sigma: float  # noise stddev the cohort sum carries at least, in field units (z * delta2)
    share_sigma: float  # each client's share: sigma / sqrt(n_min)
    participants: int  # n
    min_contributors: int  # n_min: fewer, and the cohort's sum is not released
    modulus_bits: int
    beta: float  # conditional rounding's slack: P(a rounding is retried) is at most beta
    tau: float  # Kairouz et al. Theorem 1's gap between a sum of n_min shares and one DG(sigma^2)

    def sensitivity(self, dim: int) -> float:
        """The L2 sensitivity the accountant must use: ``delta2`` with the ``tau`` term of
        Kairouz et al.'s Theorem 1 folded in (``sqrt(delta2^2 + sigma^2 tau d / 2)``)."""
        return math.sqrt(self.delta2 ** 2 + self.sigma ** 2 * self.tau * dim / 2.0)

    def noise_multiplier(self, dim: int) -> float:
        return self.sigma / self.sensitivity(dim)


def _delta2(scale: float, dim: int, beta: float) -> float:
    """Kairouz et al. (2021), eq. (4): the norm bound after conditional rounding of a
    vector of norm ``scale``: sqrt(c^2 + d/4 + sqrt(2 ln(1/beta)) (c + sqrt(d)/2))."""
    return math.sqrt(scale ** 2 + dim / 4.0 + math.sqrt(2.0 * math.log(1.0 / beta)) * (scale + math.sqrt(dim) / 2.0))


def _finest_scale(participants: int, dim: int, modulus_bits: int, beta: float, per_share: float) -> float:
    """The largest power-of-two scale at which ``participants`` rounded vectors of norm
    ``delta2(scale)``, each with a noise share of at most ``per_share * delta2`` per
    coordinate, sum inside ``(-M/2, M/2)``; ConfigError when none is useful."""
    limit = float(2 ** (modulus_bits - 1) - 1)

    def worst(scale: float) -> float:  # the largest |coordinate| the sum can reach
        return participants * _delta2(scale, dim, beta) * (1.0 + per_share)

    scale = 2.0 ** 52
    while scale >= 1.0 and worst(scale) >= limit:
        scale /= 2.0
    if scale < 1.0 or scale < math.sqrt(dim):
        raise ConfigError(
            f"a {modulus_bits}-bit field cannot hold the sum of {participants} clients' {dim}-dimensional updates "
            f"with their noise at any useful granularity; raise secure_aggregation.modulus_bits (up to 62) "
            f"or use smaller cohorts")
    return scale


def ddg_params(clip: float, noise_multiplier: float, participants: int, min_contributors: int, dim: int,
               modulus_bits: int, beta: float = math.exp(-0.5)) -> DDGParams:
    """The finest granularity at which the session's sum cannot wrap modulo 2^modulus_bits:
    ``n * (delta2 + NOISE_SHARE_BOUND * share_sigma) < 2^(modulus_bits - 1)``."""
    problems = []
    if not clip > 0:
        problems.append(f"clip must be > 0, got {clip}")
    if not noise_multiplier > 0:
        problems.append(f"noise multiplier must be > 0, got {noise_multiplier}")
    if not 1 <= min_contributors <= participants:
        problems.append(f"need 1 <= min_contributors ({min_contributors}) <= participants ({participants})")
    if dim < 1:
        problems.append(f"dimension must be >= 1, got {dim}")
    if problems:
        raise ConfigError(problems)
    per_share = NOISE_SHARE_BOUND * noise_multiplier / math.sqrt(min_contributors)
    scale = _finest_scale(participants, dim, modulus_bits, beta, per_share)
    delta2 = _delta2(scale, dim, beta)
    sigma = noise_multiplier * delta2
    share = sigma / math.sqrt(min_contributors)
    tau = 10.0 * sum(math.exp(-2.0 * math.pi ** 2 * share ** 2 * k / (k + 1)) for k in range(1, min_contributors))
    if sigma ** 2 * tau * dim / 2.0 > 1e-6 * delta2 ** 2:
        raise ConfigError(f"each client's noise share (stddev {share:.3g} field units) is too small for the sum of "
                          f"{min_contributors} shares to be a discrete Gaussian (Kairouz et al., Theorem 1); "
                          "raise the noise multiplier or secure_aggregation.modulus_bits")
    return DDGParams(clip=clip, gamma=clip / scale, delta2=delta2, sigma=sigma, share_sigma=share,
                     participants=participants, min_contributors=min_contributors, modulus_bits=modulus_bits,
                     beta=beta, tau=tau)


def bounded_params(clip: float, participants: int, dim: int, modulus_bits: int,
                   beta: float = math.exp(-0.5)) -> DDGParams:
    """Central DP under secure aggregation: the encoding of :func:`ddg_params` without
    noise shares, with the clip scaled so that a decoded contribution has norm at most
    ``clip``, rounding included.

    A client clips to ``clip * scale / delta2``, scales by ``1 / gamma`` (``gamma =
    clip / delta2``: norm ``scale``), and rounds conditionally (norm ``<= delta2``):
    decoded, ``gamma * delta2 = clip``. The root's noise, ``z * clip``, is then calibrated
    to what is really summed; a plain stochastic rounding onto a grid (the secure path
    without DP) could move each coordinate by a grid step, far beyond the clip for a
    large model."""
    if not clip > 0:
        raise ConfigError(f"clip must be > 0, got {clip}")
    if dim < 1 or participants < 1:
        raise ConfigError(f"need participants >= 1 and dimension >= 1, got {participants} and {dim}")
    scale = _finest_scale(participants, dim, modulus_bits, beta, 0.0)
    delta2 = _delta2(scale, dim, beta)
    return DDGParams(clip=clip * scale / delta2, gamma=clip / delta2, delta2=delta2, sigma=0.0, share_sigma=0.0,
                     participants=participants, min_contributors=1, modulus_bits=modulus_bits, beta=beta, tau=0.0)


def ddg_encode(x: np.ndarray, p: DDGParams, rng: np.random.Generator, max_tries: int = 1000) -> np.ndarray:
    """A client's field vector: clip ``x`` to ``p.clip``, scale by ``1 / gamma``, round
    conditionally (norm <= delta2), add its noise share (clamped at
    NOISE_SHARE_BOUND sigmas; none with :func:`bounded_params`), reduce modulo
    2^modulus_bits. Unsigned words."""
    x = np.asarray(x).reshape(-1)
    n = math.sqrt(squared_norm(x))
    factor = (min(1.0, p.clip / n) if n > 0 else 1.0) / p.gamma
    size = x.size
    out = np.empty(size, np.uint32 if p.modulus_bits <= 32 else np.uint64)
    mask = (1 << p.modulus_bits) - 1
    limit = float(int(NOISE_SHARE_BOUND * p.share_sigma))
    noise = _DiscreteGaussian(p.share_sigma) if p.share_sigma > 0 else None
    b = min(_BLOCK, size)
    y, r, e, w = np.empty(b), np.empty(b), np.empty(b), np.empty(b, np.int64)
    bound2 = p.delta2 ** 2
    # One pass, a block at a time, with every intermediate in cache: scale, round, add
    # the noise share, reduce. The rounding is conditioned on the whole vector's norm, so
    # a pass whose rounded norm exceeds delta2 starts over (noise and all: the noise is
    # independent of the rounding, so drawing it afresh leaves the law unchanged).
    for _ in range(max_tries):
        total = 0.0
        for i in range(0, size, _BLOCK):
            j = min(i + _BLOCK, size)
            ys, rs, es, ws = y[: j - i], r[: j - i], e[: j - i], w[: j - i]
            np.multiply(x[i:j], factor, out=ys, dtype=np.float64)
            np.floor(ys, out=rs)
            ys -= rs  # the fractional part
            rng.random(out=es)
            np.less(es, ys, out=es, casting="unsafe")  # 1.0 where rounded up
            rs += es
            total += squared_norm(rs)
            if total > bound2:
                break
            if noise is not None:
                noise.fill(es, rng)
                np.clip(es, -limit, limit, out=es)
                rs += es  # integers below 2^53: exact in float64
            np.copyto(ws, rs, casting="unsafe")
            np.bitwise_and(ws, mask, out=ws)
            out[i:j] = ws
        else:
            return out
    # P(failure) <= beta^max_tries: never in practice
    raise ConfigError("conditional rounding failed to meet its norm bound; this is a bug in the parameters")


def ddg_decode(total: np.ndarray, p: DDGParams) -> np.ndarray:
    """The float sum (float64) from the field sum of the contributors' vectors."""
    t = np.asarray(total).astype(np.uint64) & np.uint64((1 << p.modulus_bits) - 1)
    half = np.uint64(1 << (p.modulus_bits - 1))
    signed = t.astype(np.int64) - np.where(t >= half, np.int64(1) << p.modulus_bits, 0).astype(np.int64)
    return signed.astype(np.float64) * p.gamma


# ------------------------------------------------------------------------------ a run's plan


def min_contributors(participants: int, dropout_rate: float) -> int:
    """The fewest contributors a distributed-DP session releases a sum for: the session
    tolerates ``dropout_rate`` of its participants dropping, and every client's noise
    share is sized so that this many carry the full noise."""
    return max(1, math.ceil(participants * (1.0 - dropout_rate)))


def session_params(cfg: RunConfig, participants: int, dim: int) -> DDGParams | None:
    """How the clients of one secure session of ``cfg``'s run encode, and its tier decodes
    (both know the session's participants and the model's size), when DP is on: the
    distributed discrete Gaussian (distributed DP) or the bounded rounding of
    :func:`bounded_params` (central DP). None without DP."""
    p, sa = cfg.privacy, cfg.secure_aggregation
    if not p.enabled:
        return None
    if p.noised_at_root:  # central DP, DP-FTRL: the root adds the noise to the unmasked sum
        return bounded_params(cast(float, cfg.clip_norm), participants, dim, sa.modulus_bits)
    if p.noise_multiplier is None:
        raise ConfigError("distributed DP needs the run's noise multiplier; the root resolves it at start")
    return ddg_params(cast(float, cfg.clip_norm), p.noise_multiplier, participants,
                      min_contributors(participants, sa.dropout_rate), dim, sa.modulus_bits)
