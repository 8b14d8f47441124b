"""A run's privacy ledger: its mechanism, its clip norm, what it has spent, and what the
runs before it on the same devices spent (the population ledger).

Pure: the root and the simulator keep one each (``orchard.server.runloop``); the root
loads earlier runs' charges from its charge log and records each charge there before the
round it pays for opens.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import cast

import numpy as np

from orchard.aggregation.accounting import epsilon_of, update_noise_multiplier
from orchard.aggregation.mechanisms import GaussianRounds, Mechanism, mechanism_for
from orchard.aggregation.privacy import adapt_clip, share_clamp_delta
from orchard.config import PrivacyConfig, RunConfig
from orchard.errors import ConfigError
from orchard.typing import NDArrays


def population_problems(cfg: RunConfig, population: int | None) -> list[str]:
    """What the run's privacy needs from the population it touches: a size (the δ rule
    and the population ledger are about it), and ``delta <= 1 / population``."""
    p = cfg.privacy
    if not p.enabled:
        return []
    size = p.population if p.population is not None else population
    if size is None:
        return ["privacy.population: state how many devices the run may touch (the guarantee is about them, and "
                "delta must be at most 1 / population)"]
    out = []
    if population is not None and p.population is not None and p.population < population:
        out.append(f"privacy.population = {p.population} is below the {population} devices the run touches; "
                   "raise it or leave it unset")
    if p.delta > 1.0 / size:
        out.append(f"privacy.delta = {p.delta:g} is above 1 / population = {1.0 / size:.3g}: a mechanism may then "
                   f"release one device's data outright with probability delta; lower delta to at most "
                   f"{1.0 / size:.3g}")
    return out


@dataclass
class PrivacyLedger:
    """One run's privacy: its mechanism, its current clip norm, and what it has spent.

    The root and the simulator keep one each and call it around every round attempt:
    ``check_next`` (refuses a round that would exceed the target), ``round_config`` (the
    round's config: the resolved noise multiplier and the current clip norm),
    ``noise_stddev`` (what the root's aggregation stack adds, central DP), ``charge``
    (before an attempt opens: every opened round counts, retried or not, failed or not),
    ``draw`` (the charged attempt's noise, DP-FTRL), ``release`` (a completed round's sum
    as the server step takes it), ``adapt`` (adaptive clipping, after a completed round).
    What differs between mechanisms is the ``mechanism``'s (``orchard.aggregation.mechanisms``).
    Epsilon is always the accountant's, never a running sum.
    """

    mode: str
    noise_multiplier: float  # z of the whole round's Gaussian mechanism (what is accounted)
    update_noise_multiplier: float  # z for the updates (z unless adaptive clipping spends some on the count)
    adjacency: str
    population: int
    delta: float
    target_epsilon: float | None
    clip_norm: float
    count_stddev: float | None = None  # adaptive clipping's noise on the clipped count
    # The population ledger: earlier runs' charges on the same devices, (z, rounds) each,
    # and the budget every run on them together may spend (None: no lifetime budget).
    prior: tuple[tuple[float, int], ...] = ()
    lifetime_epsilon: float | None = None
    rounds: int = 0  # round attempts charged
    # Distributed DP: noise-share coordinates an attempt's clients may draw in all, at most
    # one share each of every device of the population, over the model's dimension (their
    # clamp adds to delta: share_clamp_delta); 0 where no share is clamped.
    share_draws: int = 0
    epsilon: float = 0.0
    # The accountant's last answer, (rounds, epsilon): check_next and charge ask for the same one.
    _last: tuple[int, float] | None = field(default=None, repr=False, compare=False)
    mechanism: Mechanism = field(default_factory=lambda: GaussianRounds(PrivacyConfig(mode="central")))

    @classmethod
    def plan(cls, cfg: RunConfig, population: int | None = None,
             prior: tuple[tuple[float, int], ...] = (), dimension: int | None = None) -> PrivacyLedger | None:
        """The ledger of a run (None when privacy is off). Derives the noise multiplier from
        the target epsilon for ``cfg.rounds`` rounds; refuses a run whose given noise cannot
        meet its target, and one whose delta exceeds 1 / population.

        ``population``: the devices the run touches where the caller knows them (the
        simulator's); a gRPC run states ``privacy.population``. Every round is accounted
        as if every device took part in it (see :func:`_round_event`). ``prior``: the
        charges of earlier runs on the same population (``privacy.population_ledger``),
        which this run's rounds compose with against ``privacy.lifetime_epsilon``.
        ``dimension``: the model's coordinates, which distributed DP needs (each client's
        noise share is clamped coordinate by coordinate, and the reported delta includes
        what that adds: :func:`share_clamp_delta`); refused without it, and when the
        planned rounds' delta, clamp included, would exceed 1 / population."""
        p = cfg.privacy
        if not p.enabled:
            return None
        problems = population_problems(cfg, population)
        if problems:
            raise ConfigError(problems)
        size = p.population if p.population is not None else cast(int, population)
        mech = mechanism_for(p)
        if p.noise_multiplier is not None:
            z = p.noise_multiplier
            if p.target_epsilon is not None:
                planned = mech.epsilon(z, cfg.rounds, p.delta)
                if planned > p.target_epsilon * (1 + 1e-9):
                    need = mech.calibrate(p.target_epsilon, p.delta, cfg.rounds)
                    raise ConfigError(f"privacy: noise multiplier {z} over {cfg.rounds} rounds spends epsilon "
                                      f"{planned:.3f} > target {p.target_epsilon}; raise the noise multiplier to "
                                      f"{need:.4g}, or plan fewer rounds")
        else:
            z = mech.calibrate(cast(float, p.target_epsilon), p.delta, cfg.rounds)
        z_update, count_stddev = z, None
        if p.adaptive is not None:
            count_stddev = p.adaptive.count_stddev or cfg.cohort.target / 20.0
            z_update = update_noise_multiplier(z, count_stddev, p.adjacency)
        draws = 0
        if p.mode == "distributed":
            if dimension is None or dimension < 1:
                raise ConfigError(f"privacy.mode 'distributed' needs the model's dimension to account for its clamped "
                                  f"noise shares, got {dimension}; this is a bug in the caller")
            draws = size * dimension
        ledger = cls(mode=p.mode, noise_multiplier=z, update_noise_multiplier=z_update, adjacency=p.adjacency,
                     population=size, delta=p.delta, target_epsilon=p.target_epsilon, clip_norm=p.clip_norm,
                     count_stddev=count_stddev, prior=tuple(prior), lifetime_epsilon=p.lifetime_epsilon,
                     mechanism=mech, share_draws=draws)
        if draws:
            whole = ledger.delta_after(cfg.rounds, mech.epsilon(z, cfg.rounds, p.delta))
            clamp = whole - p.delta
            if not clamp < 1.0 / size:  # no delta helps: the noise is too small for the clamp's bound
                raise ConfigError(f"privacy: with noise_multiplier {z:g} over {cfg.rounds} rounds, epsilon is so large "
                                  f"that what clamping the noise shares adds to delta ({clamp:.3g}) alone passes "
                                  f"1 / population = {1.0 / size:.3g}: raise privacy.noise_multiplier (or set "
                                  f"privacy.target_epsilon), or plan fewer rounds")
            if whole > 1.0 / size:
                raise ConfigError(f"privacy: delta {p.delta:g} plus what clamping the noise shares adds over "
                                  f"{cfg.rounds} rounds ({whole - p.delta:.3g}) is {whole:.6g} > 1 / population = "
                                  f"{1.0 / size:.3g}: lower privacy.delta to at most "
                                  f"{1.0 / size - (whole - p.delta):.6g}, or plan fewer rounds")
        if p.lifetime_epsilon is not None:
            whole = ledger.population_epsilon_after(cfg.rounds)
            if whole > p.lifetime_epsilon * (1 + 1e-9):
                raise ConfigError(f"privacy: the population ledger {p.population_ledger!r} has spent epsilon "
                                  f"{ledger.population_epsilon_after(0):.3f}; this run's {cfg.rounds} rounds would "
                                  f"bring it to {whole:.3f} > lifetime_epsilon {p.lifetime_epsilon}: plan fewer "
                                  "rounds or more noise, or run on another population")
        return ledger

    def epsilon_after(self, rounds: int) -> float:
        """Epsilon after ``rounds`` charged rounds (the accountant's)."""
        if self._last is not None and self._last[0] == rounds:
            return self._last[1]
        eps = self.mechanism.epsilon(self.noise_multiplier, rounds, self.delta)
        self._last = (rounds, eps)
        return eps

    def delta_after(self, rounds: int, epsilon: float) -> float:
        """The delta of ``rounds`` charged attempts spending ``epsilon``: the accountant's,
        plus what clamping distributed DP's noise shares adds (:func:`share_clamp_delta`)."""
        return self.delta + share_clamp_delta(epsilon, rounds * self.share_draws)

    @property
    def reported_delta(self) -> float:
        """The delta the run reports with its epsilon, clamped shares included."""
        return self.delta_after(self.rounds, self.epsilon)

    def population_epsilon_after(self, rounds: int) -> float:
        """Epsilon of the population's ledger: every earlier run's charges and ``rounds``
        of this run, composed."""
        return epsilon_of([*self.prior, *self.mechanism.charges(self.noise_multiplier, rounds)], self.delta,
                          self.adjacency)

    def check_next(self) -> None:
        """Raise PrivacyBudgetExceeded if one more round would spend more than the run's
        target, or than the population's lifetime budget."""
        from orchard.errors import PrivacyBudgetExceeded

        if self.target_epsilon is not None:
            nxt = self.epsilon_after(self.rounds + 1)
            if nxt > self.target_epsilon * (1 + 1e-9):
                raise PrivacyBudgetExceeded(f"round {self.rounds + 1} would bring epsilon to {nxt:.3f} > the target "
                                            f"{self.target_epsilon} (delta {self.delta}); the run stops here")
        if self.share_draws:
            nxt_delta = self.delta_after(self.rounds + 1, self.epsilon_after(self.rounds + 1))
            if nxt_delta > 1.0 / self.population:
                raise PrivacyBudgetExceeded(f"round {self.rounds + 1} would bring delta, clamped noise shares "
                                            f"included, to {nxt_delta:.6g} > 1 / population = "
                                            f"{1.0 / self.population:.3g}; the run stops here")
        if self.lifetime_epsilon is not None:
            whole = self.population_epsilon_after(self.rounds + 1)
            if whole > self.lifetime_epsilon * (1 + 1e-9):
                raise PrivacyBudgetExceeded(f"round {self.rounds + 1} would bring the population's epsilon, over "
                                            f"every run on it, to {whole:.3f} > its lifetime budget "
                                            f"{self.lifetime_epsilon}; the run stops here")

    def round_config(self, cfg: RunConfig) -> RunConfig:
        """``cfg`` for the next round: the resolved noise multiplier (updates' share) and
        the current clip norm, which tiers and clients read from the round's config."""
        privacy = cfg.privacy.model_copy(update={"noise_multiplier": self.update_noise_multiplier,
                                                 "clip_norm": self.clip_norm})
        return cfg.model_copy(update={"privacy": privacy})

    @property
    def noise_stddev(self) -> float:
        """The Gaussian noise the root's aggregation stack adds to a round's sum: central DP only."""
        return self.mechanism.root_noise_stddev(self.update_noise_multiplier, self.clip_norm)

    @property
    def charge_multiplier(self) -> float:
        """The last charged attempt as one Gaussian round's noise multiplier: what the
        population ledger records for it (``inf`` when it adds nothing)."""
        return self.mechanism.charge_multiplier(self.noise_multiplier, self.rounds)

    def draw(self, shapes: dict[str, tuple[int, ...]], rng: np.random.Generator | None) -> None:
        """The charged attempt's noise, drawn before it opens (DP-FTRL's tree leaf; nothing
        for Gaussian rounds)."""
        self.mechanism.draw(shapes, self.update_noise_multiplier, self.clip_norm, rng)

    def snapshot(self) -> NDArrays | None:
        """What the mechanism keeps between rounds, for the root's journal (None: nothing)."""
        return self.mechanism.snapshot()

    def resume(self, snapshot: NDArrays | None, released_at: int, shapes: dict[str, tuple[int, ...]],
               rng: np.random.Generator | None) -> None:
        """A restarted root's ledger (``rounds`` already restored) takes its mechanism's
        journal back; ``released_at``: the attempt the last completed round was charged as."""
        self.mechanism.resume(snapshot, self.rounds, released_at, shapes, self.update_noise_multiplier,
                              self.clip_norm, rng)

    def release(self, sums: NDArrays) -> NDArrays:
        """A completed round's sum as the server step takes it (DP-FTRL: plus the tree
        noise drawn since the last release; Gaussian rounds: as the tiers finalized it)."""
        return self.mechanism.release(sums, self.clip_norm)

    def charge(self) -> dict[str, float]:
        """Account one more round attempt, before it opens (an attempt whose result never
        comes back is charged all the same); what the round's record says of its privacy:
        the epsilon spent so far, delta, the clip norm it ran with, the noise multiplier."""
        clip_norm = self.clip_norm
        self.rounds += 1
        self.epsilon = self.epsilon_after(self.rounds)
        return {"epsilon": round(self.epsilon, 6), "delta": self.reported_delta, "clip_norm": clip_norm,
                "noise_multiplier": self.noise_multiplier, "attempts_charged": self.rounds}

    def adapt(self, below_fraction: float | None, clients: int, target_quantile: float, learning_rate: float,
              rng: np.random.Generator) -> None:
        """Adaptive clipping after a completed round: the centred count of clients within
        the norm, ``sum (b_i - 1/2)``, is noised with ``count_stddev`` (its share of the
        budget, :func:`update_noise_multiplier`) before it steers; ``clients``, the
        round's number of contributions, is public under replace-one adjacency."""
        if self.count_stddev is None or below_fraction is None or clients <= 0:
            return
        centred = below_fraction * clients - 0.5 * clients
        noisy = (centred + rng.normal(0.0, self.count_stddev)) / clients + 0.5
        self.clip_norm = adapt_clip(self.clip_norm, noisy, target_quantile, learning_rate)

    def as_dict(self) -> dict[str, object]:
        return {"mode": self.mode, "epsilon": round(self.epsilon, 6), "delta": self.reported_delta,
                "accountant_delta": self.delta, "share_clamp_delta": self.reported_delta - self.delta,
                "target_epsilon": self.target_epsilon, "noise_multiplier": self.noise_multiplier,
                "adjacency": self.adjacency, "population": self.population,
                "participation": self.mechanism.participation, "clip_norm": self.clip_norm,
                "rounds_charged": self.rounds, **({} if self.lifetime_epsilon is None else {
                    "population_epsilon": round(self.population_epsilon_after(self.rounds), 6),
                    "lifetime_epsilon": self.lifetime_epsilon})}
