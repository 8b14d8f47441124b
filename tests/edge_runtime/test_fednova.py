"""FedNova normalisation: reduces to FedAvg with equal steps, removes the bias from
unequal steps, and is linear enough to stream through a tree."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from orchard.edge_runtime.fednova import aggregate, norm_a, normalise
from orchard.errors import UpdateSchemaError


def _u(rng: np.random.Generator) -> dict[str, np.ndarray]:
    return {
        "a": rng.standard_normal((3, 2)).astype(np.float32),
        "b": rng.standard_normal(4).astype(np.float32),
    }


def test_equal_steps_is_the_fedavg_weighted_mean() -> None:
    rng = np.random.default_rng(0)
    ups = [_u(rng) for _ in range(3)]
    w = [10.0, 30.0, 60.0]
    out = aggregate(ups, [5, 5, 5], w)
    for k in ups[0]:
        mean = sum(wi * u[k] for wi, u in zip(w, ups, strict=True)) / sum(w)
        np.testing.assert_allclose(out[k], mean, rtol=1e-5, atol=1e-6)


def test_unequal_steps_follow_the_common_direction() -> None:
    """Clients whose every step moves along g by lr: client i's update is tau_i lr g.
    FedAvg's result depends on who ran longest; FedNova's is tau_eff lr g."""
    g = {"w": np.array([1.0, -2.0], dtype=np.float32)}
    steps = [1, 10, 100]
    ups = [{"w": t * 0.1 * g["w"]} for t in steps]
    out = aggregate(ups, steps, [1.0, 1.0, 1.0])
    tau_eff = sum(steps) / 3
    np.testing.assert_allclose(out["w"], tau_eff * 0.1 * g["w"], rtol=1e-6)
    assert np.all(normalise(ups[2], 100)["w"] == pytest.approx(0.1 * g["w"]))


@settings(max_examples=50, deadline=None)
@given(tau=st.integers(0, 200), rho=st.floats(0.0, 0.99))
def test_norm_a_matches_the_explicit_sum(tau: int, rho: float) -> None:
    # a_i = [1 - rho^tau, ..., 1 - rho] / (1 - rho): the momentum buffer's weights.
    explicit = sum((1.0 - rho**k) / (1.0 - rho) for k in range(1, tau + 1))
    assert norm_a(tau, rho) == pytest.approx(explicit, rel=1e-9, abs=1e-9)


def test_streams_as_sums() -> None:
    """Aggregators can fold p_i d_i and p_i ||a_i|| separately; the root multiplies."""
    rng = np.random.default_rng(1)
    ups = [_u(rng) for _ in range(4)]
    steps, w = [3, 7, 1, 12], np.array([5.0, 1.0, 2.0, 2.0])
    p = w / w.sum()
    d_sum = {
        k: sum(
            pi * normalise(u, t)[k].astype(np.float64)
            for pi, u, t in zip(p, ups, steps, strict=True)
        )
        for k in ups[0]
    }
    tau_eff = float(sum(pi * norm_a(t) for pi, t in zip(p, steps, strict=True)))
    out = aggregate(ups, steps, list(w))
    for k in out:
        np.testing.assert_allclose(out[k], tau_eff * d_sum[k], rtol=1e-5, atol=1e-6)


def test_bad_inputs() -> None:
    rng = np.random.default_rng(2)
    a, b = _u(rng), _u(rng)
    b["a"] = b["a"][:2]
    with pytest.raises(UpdateSchemaError):
        aggregate([a, b], [1, 1])
    with pytest.raises(ValueError):
        aggregate([a], [1, 2])
    assert np.all(normalise(a, 0)["a"] == 0)
