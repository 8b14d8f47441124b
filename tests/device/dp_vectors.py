"""Vectors for differential privacy under secure aggregation in liborchard_device
(device/tests/test_dp.cpp), written by ``orchard.aggregation.privacy`` itself: the
session parameters of both DP modes (central DP's bounded rounding, distributed DP's
discrete Gaussian) over fields of 20 to 62 bits, the refusals, and encodings and noise
drawn from a stream of 64-bit words both sides read (``SecureGenerator``: the same
draws for the same words; above 48 bits, where float64 cannot tell the sum orders
apart, the encodings are checked against their bounds instead). Part of ``device_vectors.write_all``."""

from __future__ import annotations

from typing import Any

import numpy as np

from orchard.aggregation.privacy import (
    DDGParams,
    _DiscreteGaussian,
    bounded_params,
    ddg_encode,
    ddg_params,
    min_contributors,
)
from orchard.errors import ConfigError
from orchard.randomness import SecureGenerator


def _words(seed: int) -> SecureGenerator:
    """The words the native test reads too: PCG64(seed)'s raw 64-bit outputs."""
    bits = np.random.PCG64(seed)
    return SecureGenerator(lambda n: bits.random_raw(int(n)))


def _params_json(p: DDGParams) -> dict[str, Any]:
    return {"clip": p.clip, "gamma": p.gamma, "delta2": p.delta2, "sigma": p.sigma, "share_sigma": p.share_sigma,
            "participants": p.participants, "min_contributors": p.min_contributors,
            "modulus_bits": p.modulus_bits, "beta": p.beta, "tau": p.tau}


def dp_vectors() -> dict[str, Any]:
    params = []
    # (mode, clip, noise multiplier, participants, dropout rate, dim, modulus bits)
    for mode, clip, z, n, drop, dim, bits in (
            ("central", 1.0, None, 4, 0.1, 1000, 32), ("central", 0.3, None, 50, 0.1, 400_000, 32),
            ("central", 2.5, None, 7, 0.2, 123, 48), ("central", 1.0, None, 1000, 0.1, 10_000_000, 62),
            ("central", 1.0, None, 2000, 0.1, 3_000_000, 20),  # too small a field: refused
            ("distributed", 1.0, 1.1, 4, 0.1, 1000, 32), ("distributed", 0.5, 0.8, 30, 0.3, 50_000, 48),
            ("distributed", 1.0, 2.0, 100, 0.1, 10_000_000, 62),
            ("distributed", 1.0, 1.0, 1000, 0.1, 10_000_000, 24),
            ("distributed", 1.0, 0.0001, 8, 0.1, 10, 16),  # shares too small to sum to a DG: refused
            ("distributed", 1.0, 1.0, 5000, 0.1, 50_000_000, 20)):  # too small a field: refused
        case: dict[str, Any] = {"mode": mode, "clip": clip, "noise_multiplier": z, "participants": n,
                                "dropout_rate": drop, "dim": dim, "modulus_bits": bits}
        try:
            p = bounded_params(clip, n, dim, bits) if mode == "central" else \
                ddg_params(clip, z, n, min_contributors(n, drop), dim, bits)
            case["params"] = _params_json(p)
        except ConfigError as err:
            case["error"] = str(err)
        params.append(case)
    assert sum("error" in c for c in params) == 3, params

    encodes = []
    g = np.random.default_rng(11)
    for k, (mode, dim, bits, scale) in enumerate((
            ("central", 300, 32, 0.1), ("central", 20_000, 48, 0.01), ("central", 50, 62, 5.0),
            ("distributed", 300, 32, 0.1), ("distributed", 20_000, 48, 0.01), ("distributed", 20_000, 62, 0.01),
            ("distributed", 40, 48, 0.0))):
        x = g.standard_normal(dim) * scale
        p = bounded_params(1.0, 5, dim, bits) if mode == "central" else ddg_params(1.0, 1.0, 5, 4, dim, bits)
        seed = 1000 + k
        v = ddg_encode(x, p, _words(seed))  # type: ignore[arg-type]
        # Above 48 bits a field unit is below a float64 ulp of the scaled values and of the
        # squared norm the rounding is conditioned on: the order of a sum decides the last
        # bits, so there the native encoding is checked against the bounds, not these words.
        encodes.append({"mode": mode, "x": x.tolist(), "params": _params_json(p), "seed": seed,
                        "encoded": [int(w) for w in v], "exact": bits <= 48})
    # Noise shares of small sigmas (the sampler's rejection branch) and large ones (its
    # thinning branch), in an encoding built by hand so that its share is that small.
    for k, share in enumerate((0.6, 2.5)):
        x = g.standard_normal(500) * 0.05
        p = DDGParams(clip=1.0, gamma=1.0 / 400.0, delta2=420.0, sigma=share * 2.0, share_sigma=share, participants=4,
                      min_contributors=4, modulus_bits=32, beta=float(np.exp(-0.5)), tau=0.0)
        seed = 2000 + k
        v = ddg_encode(x, p, _words(seed))  # type: ignore[arg-type]
        encodes.append({"mode": "distributed", "x": x.tolist(), "params": _params_json(p), "seed": seed,
                        "encoded": [int(w) for w in v], "exact": True})

    samples = []
    for k, sigma in enumerate((0.3, 1.0, 7.5, 300.0, 1e5)):
        out = np.empty(2000)
        _DiscreteGaussian(sigma).fill(out, _words(3000 + k))  # type: ignore[arg-type]
        samples.append({"sigma": sigma, "seed": 3000 + k, "draws": [int(d) for d in out]})
    return {"params": params, "encodes": encodes, "samples": samples}
