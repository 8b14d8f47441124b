"""Error feedback: the residual telescopes, and state survives a trip through bytes."""

from __future__ import annotations

import numpy as np
import pytest
from codec_cases import SPECS, shapes
from hypothesis import given
from hypothesis import strategies as st

from orchard.compression import StateError, build_codec, states_from_bytes, states_to_bytes
from orchard.compression.update import encode_update

EF = ["ef-topk", "ef-sign", "ef-powersgd", "ef-topk+qsgd"]


@pytest.mark.parametrize("name", EF)
@given(shape=shapes, rounds=st.integers(1, 6), seed=st.integers(0, 1000))
def test_sent_plus_final_residual_equals_sum_of_inputs(
    name: str, shape: tuple[int, ...], rounds: int, seed: int
) -> None:
    codec = build_codec(SPECS[name])
    rng = np.random.default_rng(seed)
    state, sent, inputs = None, np.zeros(shape), np.zeros(shape)
    for _ in range(rounds):
        x = rng.standard_normal(shape).astype(np.float32)
        payload, state = codec.encode(x, rng, state)
        sent += codec.decode(payload, shape)
        inputs += x
    assert state is not None
    # Float32 residual arithmetic: error ~ rounds * eps * magnitude.
    np.testing.assert_allclose(sent + state["residual"], inputs, atol=1e-4 * (1 + rounds))


def test_without_feedback_the_same_codec_loses_mass() -> None:
    # The telescoping identity is not a tautology: plain top-k drops what it never sends.
    codec = build_codec(SPECS["topk"])
    rng = np.random.default_rng(0)
    x = rng.standard_normal(100).astype(np.float32)
    assert np.abs(codec.decode(codec.encode(x, rng)[0], x.shape) - x).sum() > 1.0


def test_state_round_trips_through_bytes_and_gives_the_same_payloads() -> None:
    codec = build_codec(SPECS["ef-powersgd"])
    w = np.random.default_rng(3).standard_normal((20, 12)).astype(np.float32)
    arrays = {"w": w, "b/bias": np.arange(5, dtype=np.float32)}
    _, states = encode_update(codec, arrays, np.random.default_rng(0), None, 1)
    restored = states_from_bytes(states_to_bytes(states))
    assert restored.keys() == states.keys()
    for name in states:
        assert restored[name].keys() == states[name].keys()
        for key in states[name]:
            np.testing.assert_array_equal(restored[name][key], states[name][key])
    a, _ = encode_update(codec, arrays, np.random.default_rng(5), states, 2)
    b, _ = encode_update(codec, arrays, np.random.default_rng(5), restored, 2)
    assert a == b
    assert set(states["w"]) == {"residual", "inner.q"}


def test_residual_of_the_wrong_shape_is_refused() -> None:
    codec = build_codec(SPECS["ef-topk"])
    with pytest.raises(StateError, match=r"residual has shape \(3,\), the tensor has \(4,\)"):
        codec.encode(np.ones(4), np.random.default_rng(0), {"residual": np.zeros(3)})


def test_powersgd_state_of_the_wrong_shape_is_refused() -> None:
    codec = build_codec(SPECS["powersgd"])
    with pytest.raises(StateError, match=r"'q' must have shape \(8, 2\).*got \(7, 2\)"):
        codec.encode(np.ones((9, 8)), np.random.default_rng(0), {"q": np.zeros((7, 2))})
