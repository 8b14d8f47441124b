"""Uneven clients: how many training examples each client of a with-replacement
partition holds (``size_spread``, a lognormal sigma; 0 is every client alike).

Device data is long-tailed: a few phones hold many photos, most hold a few. A lognormal
with ``mu = -sigma^2 / 2`` has mean 1, so scaling it by ``samples_per_client`` keeps the
population's mean size (before rounding and clipping) and only spreads it.
"""

from __future__ import annotations

import numpy as np

from orchard.errors import ConfigError

# A client holds at most this many times samples_per_client examples: the lognormal's
# tail cut where it is rarer than 0.3% at size_spread 1, so one client does not hold a
# round's worth of steps.
MAX_SIZE_FACTOR = 10
MAX_SIZE_SPREAD = 3.0


def client_sizes(num_partitions: int, mean: int, spread: float, rng: np.random.Generator) -> np.ndarray:
    """Training-set sizes ``n_i = round(mean * exp(z_i))``, ``z_i ~ N(-spread^2 / 2, spread^2)``
    (so ``E[exp(z)] = 1``: the mean stays about ``mean``), clipped to
    ``[1, MAX_SIZE_FACTOR * mean]``; int64, one per client."""
    z = rng.normal(-spread * spread / 2.0, spread, size=num_partitions)
    return np.clip(np.rint(mean * np.exp(z)), 1, MAX_SIZE_FACTOR * mean).astype(np.int64)


def check_size_spread(spread: float) -> None:
    """Refuse a ``size_spread`` outside ``[0, MAX_SIZE_SPREAD]`` (nan included)."""
    if not 0.0 <= spread <= MAX_SIZE_SPREAD:
        raise ConfigError(f"size_spread must be in [0, {MAX_SIZE_SPREAD}] (the lognormal sigma of client "
                          f"sizes; 0 = every client holds samples_per_client), got {spread}")
