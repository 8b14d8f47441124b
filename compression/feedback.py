"""Error feedback: keep what a biased codec dropped and send it next round.

Seide et al. 2014 (1-bit SGD); Stich et al. 2018 (Sparsified SGD with memory);
Karimireddy et al. 2019 (EF-SGD, Algorithm 2). With residual ``e_0 = 0``::

    p_t     = x_t + e_t
    sent_t  = D(C(p_t))
    e_{t+1} = p_t - sent_t

so ``sum_t sent_t + e_T = sum_t x_t`` exactly (telescoping): nothing is lost, only
delayed. The wrapper costs the client one decode per encode. The payload is the inner
codec's, unchanged, so the server decodes and aggregates exactly as for the inner
codec and the wrapper inherits its algebra -- except that it is stateful, and biased
per round.

State: ``{"residual": float32 array of the tensor's shape}`` plus the inner codec's
state under ``"inner.<key>"`` (PowerSGD's ``q``), all plain arrays.
"""

from __future__ import annotations

import numpy as np

from orchard.compression.base import Algebra, BaseCodec, State, as_float32, check_seed
from orchard.compression.errors import StateError
from orchard.compression.wire import EncodedTensor

_INNER = "inner."


class ErrorFeedback:
    """Wrap any codec with a client-side residual (see the module docstring)."""

    def __init__(self, inner: BaseCodec) -> None:
        self.inner = inner
        self.name = f"error_feedback({inner.name})"
        a = inner.algebra
        self.algebra = Algebra(
            linear=a.linear,
            field_linear=a.field_linear,
            stateful=True,
            unbiased=False,
            needs_num_summands=a.needs_num_summands,
        )

    def _residual(self, x: np.ndarray, state: State | None) -> np.ndarray:
        if state is None or "residual" not in state:
            return np.zeros_like(x)
        r = np.asarray(state["residual"])
        if r.shape != x.shape:
            raise StateError(
                f"error-feedback residual has shape {r.shape}, the tensor has {x.shape}"
            )
        return r.astype(np.float32, copy=False)

    def encode(
        self,
        x: np.ndarray,
        rng: np.random.Generator,
        state: State | None = None,
        shared_seed: int = 0,
    ) -> tuple[bytes, State | None]:
        x32 = as_float32(x)
        seed = check_seed(shared_seed)
        corrected = x32 + self._residual(x32, state)
        inner_state = (
            {k[len(_INNER) :]: v for k, v in state.items() if k.startswith(_INNER)}
            if state
            else None
        )
        payload, new_inner = self.inner.encode(corrected, rng, inner_state or None, seed)
        sent = self.inner.decode(payload, x32.shape, 1, seed)
        corrected -= sent
        new_state: State = {"residual": corrected}
        for k, v in (new_inner or {}).items():
            new_state[_INNER + k] = v
        return payload, new_state

    def decode(
        self,
        payload: bytes,
        shape: tuple[int, ...],
        num_summands: int = 1,
        shared_seed: int = 0,
        state: State | None = None,
    ) -> np.ndarray:
        return self.inner.decode(payload, shape, num_summands, shared_seed)

    def parse(self, payload: bytes, shape: tuple[int, ...]) -> EncodedTensor:
        return self.inner.parse(payload, shape)

    def decode_parsed(
        self, enc: EncodedTensor, num_summands: int = 1, shared_seed: int = 0
    ) -> np.ndarray:
        return self.inner.decode_parsed(enc, num_summands, shared_seed)

    def add(self, a: EncodedTensor, b: EncodedTensor) -> EncodedTensor | None:
        return self.inner.add(a, b)

    def coordinates(self, enc: EncodedTensor, shared_seed: int = 0) -> np.ndarray | None:
        return self.inner.coordinates(enc, shared_seed)

    def from_coordinates(
        self, shape: tuple[int, ...], coords: np.ndarray, shared_seed: int = 0
    ) -> EncodedTensor:
        return self.inner.from_coordinates(shape, coords, shared_seed)

    def coordinate_scale(self, shape: tuple[int, ...]) -> float | None:
        return self.inner.coordinate_scale(shape)

    def bound(self, enc: EncodedTensor, num_summands: int = 1, shared_seed: int = 0) -> float:
        return self.inner.bound(enc, num_summands, shared_seed)

    def __repr__(self) -> str:
        return f"<codec {self.name}>"
