"""Chi-square test of uniformity for the bytes of masked vectors.

The statistic over the 256 byte values has 255 degrees of freedom; the critical value
at significance ALPHA = 1e-3 comes from the Wilson-Hilferty approximation
(chi2_{0.999}(255) = 330.5), accurate to well under 1% at this many degrees of freedom.
With fixed seeds the tests are deterministic; ALPHA bounds how often a correct
implementation would fail on a fresh seed.
"""

from __future__ import annotations

import numpy as np

ALPHA = 1e-3
_Z_999 = 3.090232  # standard normal quantile at 1 - ALPHA


def chi2_critical(df: int, z: float = _Z_999) -> float:
    a = 2.0 / (9.0 * df)
    return df * (1.0 - a + z * np.sqrt(a)) ** 3


def chi_square_uniform_bytes(values: np.ndarray) -> tuple[bool, float, float]:
    """(passes, statistic, critical value) for 'the bytes of ``values`` are uniform'."""
    raw = np.frombuffer(np.ascontiguousarray(values).tobytes(), dtype=np.uint8)
    counts = np.bincount(raw, minlength=256).astype(np.float64)
    expected = raw.size / 256.0
    stat = float(((counts - expected) ** 2 / expected).sum())
    crit = chi2_critical(255)
    return stat <= crit, stat, crit
