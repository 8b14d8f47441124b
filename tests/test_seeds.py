"""orchard.seeds: deterministic, in range, and unrelated for neighbouring inputs."""

from __future__ import annotations

import numpy as np
import pytest

from orchard.seeds import derive_seed


def test_deterministic_and_in_range() -> None:
    assert derive_seed(1, 2, 3) == derive_seed(1, 2, 3)
    for bits in (1, 31, 63, 64):
        vals = [derive_seed(7, i, bits=bits) for i in range(200)]
        assert all(0 <= v < 2**bits for v in vals)
    with pytest.raises(ValueError, match="bits"):
        derive_seed(1, bits=0)


def test_every_part_and_its_position_matter() -> None:
    base = derive_seed(5, 6, 7)
    assert derive_seed(5, 6, 8) != base
    assert derive_seed(6, 5, 7) != base
    assert derive_seed(5, 6) != base
    assert derive_seed(-1) == derive_seed(2**64 - 1)  # parts are taken modulo 2**64


def test_neighbouring_inputs_give_unrelated_seeds() -> None:
    # 20,000 consecutive (seed, partition) pairs: no collisions, and the low bits are
    # balanced (a chi-square over 16 buckets, far inside its 0.1% critical value 37.7).
    vals = np.array([derive_seed(3, p, bits=63) for p in range(20_000)], dtype=np.uint64)
    assert len(set(vals.tolist())) == len(vals)
    counts = np.bincount((vals & np.uint64(15)).astype(np.int64), minlength=16)
    expected = len(vals) / 16
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    assert chi2 < 37.7
