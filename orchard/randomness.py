"""Randomness nobody can replay or predict, for DP noise: the operating system's CSPRNG
behind the numpy Generator methods Orchard's samplers call
(``orchard.aggregation.privacy``: the discrete Gaussian, conditional rounding)."""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from typing import Any, cast

import numpy as np

from orchard.errors import ConfigError


def os_random() -> np.random.Generator:
    """A :class:`SecureGenerator` over ``os.urandom``, typed as the Generator it stands in for."""
    return cast(np.random.Generator, SecureGenerator(lambda n: np.frombuffer(os.urandom(8 * n), np.uint64)))


class SecureGenerator:
    """What the samplers here draw from, built on a cryptographically secure source of
    64-bit words (``words(n)``: a root passes the operating system's, ``os.urandom``),
    instead of a seeded generator whose stream could be replayed or predicted. The
    methods are numpy Generator's that the samplers call, with the same laws: uniforms
    from 53-bit words, normals by Box and Muller, exponentials by inversion, a binomial
    count as a count of uniforms, a subset without replacement by sorting words."""

    def __init__(self, words: Callable[[int], np.ndarray]) -> None:
        self._words = words

    def _uniform(self, n: int) -> np.ndarray:
        w = np.asarray(self._words(n), np.uint64)
        return (w >> np.uint64(11)).astype(np.float64) * (1.0 / 9007199254740992.0)  # [0, 1)

    def random(self, size: int | None = None, out: np.ndarray | None = None) -> Any:
        n = out.size if out is not None else (1 if size is None else int(size))
        u = self._uniform(n)
        if out is not None:
            out[...] = u.reshape(out.shape)
            return out
        return float(u[0]) if size is None else u

    def standard_normal(self, size: int | None = None, out: np.ndarray | None = None) -> Any:
        n = out.size if out is not None else (1 if size is None else int(size))
        m = (n + 1) // 2
        u = self._uniform(2 * m)
        r = np.sqrt(-2.0 * np.log1p(-u[:m]))  # 1 - u in (0, 1]
        theta = 2.0 * math.pi * u[m:]
        z = np.concatenate([r * np.cos(theta), r * np.sin(theta)])[:n]
        if out is not None:
            out[...] = z.reshape(out.shape)
            return out
        return float(z[0]) if size is None else z

    def normal(self, loc: float = 0.0, scale: float = 1.0, size: int | None = None) -> Any:
        return loc + scale * self.standard_normal(size)

    def standard_exponential(self, size: int) -> np.ndarray:
        return -np.log1p(-self._uniform(int(size)))

    def binomial(self, n: int, p: float) -> int:
        return int(np.count_nonzero(self._uniform(int(n)) < p))

    def choice(self, m: int, k: int, replace: bool = False) -> np.ndarray:
        if replace:
            raise ConfigError("SecureGenerator.choice draws without replacement only")
        return np.argsort(np.asarray(self._words(int(m)), np.uint64), kind="stable")[: int(k)]
