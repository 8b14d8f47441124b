"""What a run's DP mechanism costs and adds, one sibling per mechanism, behind the one
interface the privacy ledger (``orchard.aggregation.ledger``) calls.

- :class:`GaussianRounds` (``privacy.mode`` "central" or "distributed"): every round
  attempt is its own Gaussian mechanism on the round's clipped sum, accounted as if every
  device took part in it (``orchard.aggregation.accounting``). Its noise is added by the
  aggregation stack (the root's ``noise`` stage, or the clients' shares).
- :class:`TreeRounds` (``privacy.mode`` "dpftrl"): DP-FTRL's tree-aggregated noise
  (``orchard.aggregation.ftrl``), accounted as one Gaussian mechanism over the tree's
  nodes under the participation bound the selection enforces. The ledger draws each
  leaf's noise when it charges the attempt and adds it to a completed round's sum at the
  root, before the server step.

Both express what ``attempts`` charged attempts spent as Gaussian rounds ``(z, count)``
(:meth:`charges`): a composition of Gaussian mechanisms is one Gaussian mechanism whose
squared sensitivity-over-noise is the sum of theirs, so the population ledger composes
runs of either mechanism exactly, as it composes rounds.

Pure: numbers, arrays and explicit randomness in, numbers and arrays out.
"""

from __future__ import annotations

import math
from typing import Protocol

import numpy as np

from orchard.aggregation import ftrl
from orchard.aggregation.accounting import epsilon_of, noise_multiplier_for
from orchard.config import PrivacyConfig
from orchard.errors import ConfigError
from orchard.typing import NDArrays


class Mechanism(Protocol):
    participation: str  # what the accountant assumes of who takes part (reported)

    def epsilon(self, z: float, attempts: int, delta: float) -> float:
        """Epsilon after ``attempts`` charged attempts at noise multiplier ``z``."""
        ...

    def calibrate(self, epsilon: float, delta: float, attempts: int) -> float:
        """The smallest ``z`` whose ``attempts`` attempts spend at most ``epsilon``."""
        ...

    def charges(self, z: float, attempts: int) -> list[tuple[float, int]]:
        """``attempts`` attempts as Gaussian rounds ``(z_i, count_i)`` of the same cost."""
        ...

    def charge_multiplier(self, z: float, attempt: int) -> float:
        """Attempt number ``attempt`` (1-based) alone, as one Gaussian round's multiplier
        (what the population ledger records for it; ``inf``: it adds nothing)."""
        ...

    def root_noise_stddev(self, z: float, clip: float) -> float:
        """What the root's aggregation stack adds to a round's sum (``noise`` stage)."""
        ...

    def draw(self, shapes: dict[str, tuple[int, ...]], z: float, clip: float, rng: np.random.Generator | None) -> None:
        """The charged attempt's noise, drawn before it opens (none for Gaussian rounds)."""
        ...

    def release(self, sums: NDArrays, clip: float) -> NDArrays:
        """A completed round's sum as released to the server step."""
        ...

    def snapshot(self) -> NDArrays | None:
        """What the mechanism keeps between rounds, for a journal (None: nothing)."""
        ...

    def resume(self, snapshot: NDArrays | None, attempts: int, released_at: int, shapes: dict[str, tuple[int, ...]],
               z: float, clip: float, rng: np.random.Generator | None) -> None:
        """Continue from a journal after ``attempts`` charged attempts, the last completed
        one (its noise released) at attempt ``released_at``."""
        ...


class GaussianRounds:
    """Central and distributed DP: a Gaussian mechanism per attempt, every device in every one."""

    participation = "every round (no amplification by sampling)"

    def __init__(self, cfg: PrivacyConfig) -> None:
        self.adjacency = cfg.adjacency
        self.at_root = cfg.mode == "central"

    def epsilon(self, z: float, attempts: int, delta: float) -> float:
        return epsilon_of([(z, attempts)], delta, self.adjacency)

    def calibrate(self, epsilon: float, delta: float, attempts: int) -> float:
        return noise_multiplier_for(epsilon, delta, attempts, self.adjacency)

    def charges(self, z: float, attempts: int) -> list[tuple[float, int]]:
        return [(z, attempts)]

    def charge_multiplier(self, z: float, attempt: int) -> float:
        return z

    def root_noise_stddev(self, z: float, clip: float) -> float:
        return z * clip if self.at_root else 0.0

    def draw(self, shapes: dict[str, tuple[int, ...]], z: float, clip: float, rng: np.random.Generator | None) -> None:
        return None

    def release(self, sums: NDArrays, clip: float) -> NDArrays:
        return sums

    def snapshot(self) -> NDArrays | None:
        return None

    def resume(self, snapshot: NDArrays | None, attempts: int, released_at: int, shapes: dict[str, tuple[int, ...]],
               z: float, clip: float, rng: np.random.Generator | None) -> None:
        return None


class TreeRounds:
    """DP-FTRL: tree-aggregated noise of stddev ``z C`` per node, the whole run one
    Gaussian mechanism of sensitivity ``k C sqrt(S(t))`` after ``t`` leaves (``k``: the
    adjacency's factor; ``S``: :func:`ftrl.restarted_counts_squared` under the bound)."""

    def __init__(self, cfg: PrivacyConfig, state: ftrl.TreeNoise | None = None) -> None:
        if cfg.max_participations is None or cfg.min_separation is None:
            raise ConfigError("privacy.mode 'dpftrl' needs privacy.max_participations and privacy.min_separation")
        self.adjacency = cfg.adjacency
        self.max_participations: int = cfg.max_participations
        self.min_separation: int = cfg.min_separation
        self.restart_every = cfg.restart_every
        self.state = state if state is not None else ftrl.TreeNoise()
        self.participation = (f"at most {self.max_participations} rounds per device, {self.min_separation} or more "
                              "apart (enforced by the selection)")

    def counts_squared(self, attempts: int) -> int:
        if attempts <= 0:
            return 0
        return ftrl.restarted_counts_squared(attempts, self.min_separation, self.max_participations,
                                             self.restart_every)

    def epsilon(self, z: float, attempts: int, delta: float) -> float:
        return epsilon_of(self.charges(z, attempts), delta, self.adjacency)

    def calibrate(self, epsilon: float, delta: float, attempts: int) -> float:
        return ftrl.ftrl_noise_multiplier_for(epsilon, delta, attempts, self.min_separation, self.adjacency,
                                              self.max_participations, self.restart_every)

    def charges(self, z: float, attempts: int) -> list[tuple[float, int]]:
        s = self.counts_squared(attempts)
        return [(z / math.sqrt(s), 1)] if s > 0 else []

    def charge_multiplier(self, z: float, attempt: int) -> float:
        grew = self.counts_squared(attempt) - self.counts_squared(attempt - 1)
        return z / math.sqrt(grew) if grew > 0 else math.inf

    def root_noise_stddev(self, z: float, clip: float) -> float:
        return 0.0

    def draw(self, shapes: dict[str, tuple[int, ...]], z: float, clip: float, rng: np.random.Generator | None) -> None:
        if rng is None:
            raise ConfigError("DP-FTRL draws its tree noise from the ledger's generator; none was given")
        self.state = ftrl.advance(self.state, shapes, z * clip, clip, rng, self.restart_every)

    def release(self, sums: NDArrays, clip: float) -> NDArrays:
        out, self.state = ftrl.release(self.state, sums, clip)
        return out

    def snapshot(self) -> NDArrays | None:
        return ftrl.to_arrays(self.state)

    def resume(self, snapshot: NDArrays | None, attempts: int, released_at: int, shapes: dict[str, tuple[int, ...]],
               z: float, clip: float, rng: np.random.Generator | None) -> None:
        """The journaled tree, with its pending noise dropped if the completed round at
        ``released_at`` released it; then a fresh leaf for every attempt charged but not
        journaled (its noise was never used: drawing it again releases nothing twice).
        Never a leaf drawn again for an attempt that may have released its sum."""
        state = ftrl.from_arrays(snapshot) if snapshot is not None else ftrl.TreeNoise()
        if state.leaves > attempts:
            raise ConfigError(f"the DP-FTRL journal holds {state.leaves} leaves but only {attempts} attempts were "
                              "charged: the journal and the population ledger disagree")
        if released_at >= state.leaves:
            state = ftrl.TreeNoise(state.tree, state.leaves, None)
        self.state = state
        while self.state.leaves < attempts:
            self.draw(shapes, z, clip, rng)


def mechanism_for(cfg: PrivacyConfig) -> Mechanism:
    return TreeRounds(cfg) if cfg.mode == "dpftrl" else GaussianRounds(cfg)
