"""PowerSGD: rank-r compression by one step of subspace iteration with a warm start.

Vogels, Karimireddy & Jaggi, "PowerSGD: Practical Low-Rank Gradient Compression for
Distributed Optimization", NeurIPS 2019, Algorithm 1. A tensor is viewed as a matrix
``M`` (``shape[0] x rest``, as the paper does for convolution kernels) and, with the
previous round's ``Q`` (``m x r``) as the starting point::

    P     = M Q              (n x r)
    P_hat = orthogonalise(P) (reduced QR; the paper uses Gram-Schmidt, same span)
    Q     = M^T P_hat        (m x r)
    M    ~= P_hat Q^T

The paper all-reduces ``P`` and ``Q`` between the two products; a federated client
sends once, so it sends both factors of its own ``M`` and keeps ``Q`` as its state
for the next round (the warm start of section 3.2, which is what makes rank 1-4 work).

Cost: ``4 (n + m) r`` bytes instead of ``4 n m``. Tensors where that is not smaller
(vectors, ranks at or above ``min(n, m)``) are sent dense, as the paper does for
biases. Biased: pair it with error feedback (the paper always does).

Sum in the compressed domain: ``P_a Q_a^T + P_b Q_b^T = [P_a P_b] [Q_a Q_b]^T``, so
payloads add by concatenating factors along the rank axis -- exact, linear in the
sense of :class:`~orchard.compression.base.Algebra`, but the summed rank grows with
the cohort and the layout is data dependent, so not field-linear.
"""

from __future__ import annotations

import numpy as np

from orchard.compression.base import (
    Algebra,
    BaseCodec,
    State,
    expect_field,
    expect_fields,
    numel,
    peak,
)
from orchard.compression.errors import MalformedPayloadError, StateError
from orchard.compression.wire import CODEC_IDS, EncodedTensor, Field
from orchard.errors import CodecError


def matrix_dims(shape: tuple[int, ...]) -> tuple[int, int]:
    if len(shape) < 2:
        return (numel(shape), 1)
    return shape[0], numel(shape[1:])


class PowerSGDCodec(BaseCodec):
    name = "powersgd"
    codec_id = CODEC_IDS["powersgd"]
    algebra = Algebra(
        linear=True, field_linear=False, stateful=True, unbiased=False, needs_num_summands=False
    )

    def __init__(self, rank: int = 4) -> None:
        self.rank = rank

    def factorised(self, shape: tuple[int, ...]) -> bool:
        """Whether this shape is sent as two factors (else dense float32)."""
        n, m = matrix_dims(shape)
        return len(shape) >= 2 and (n + m) * self.rank < n * m

    def _start_q(self, m: int, rng: np.random.Generator, state: State | None) -> np.ndarray:
        if state is None or "q" not in state:
            # The paper initialises Q i.i.d. standard normal; any full-rank start works.
            return rng.standard_normal((m, self.rank), dtype=np.float32)
        q = np.asarray(state["q"])
        if q.shape != (m, self.rank):
            raise StateError(
                f"powersgd state 'q' must have shape {(m, self.rank)} for this tensor, "
                f"got {q.shape}"
            )
        return q.astype(np.float32, copy=False)

    def encode_parsed(
        self, x: np.ndarray, rng: np.random.Generator, state: State | None, shared_seed: int
    ) -> tuple[EncodedTensor, State | None]:
        if not self.factorised(x.shape):
            return self.header(x.shape, [Field(x.reshape(-1))]), state
        n, m = matrix_dims(x.shape)
        mat = x.reshape(n, m)
        if not np.isfinite(mat).all():
            raise CodecError("powersgd cannot factorise a tensor that holds NaN or inf")
        q = self._start_q(m, rng, state)
        p_hat, _ = np.linalg.qr(mat @ q)
        q_new = (mat.T @ p_hat).astype(np.float32)
        fields = [Field(p_hat.astype(np.float32).reshape(-1)), Field(q_new.reshape(-1))]
        return self.header(x.shape, fields), {"q": q_new}

    def _factors(self, enc: EncodedTensor) -> tuple[np.ndarray, np.ndarray]:
        n, m = matrix_dims(enc.shape)
        fp, fq = expect_fields(enc, 2, "P factor, Q factor")
        p = expect_field(enc, fp, "P", dtype="float32")
        q = expect_field(enc, fq, "Q", dtype="float32")
        r = p.size // n if n else 0
        if p.size != n * r or q.size != m * r or r == 0:
            raise MalformedPayloadError(
                f"powersgd payload for shape {enc.shape}: expected factors of {n} x r and "
                f"{m} x r floats for one r >= 1, got {p.size} and {q.size}"
            )
        return p.reshape(n, r), q.reshape(m, r)

    def decode_parsed(
        self, enc: EncodedTensor, num_summands: int = 1, shared_seed: int = 0
    ) -> np.ndarray:
        if not self.factorised(enc.shape):
            (f,) = expect_fields(enc, 1, "dense values")
            dense = expect_field(enc, f, "dense", count=numel(enc.shape), dtype="float32")
            return dense.astype(np.float32).reshape(enc.shape)
        p, q = self._factors(enc)
        return (p @ q.T).astype(np.float32, copy=False).reshape(enc.shape)

    def bound(self, enc: EncodedTensor, num_summands: int = 1, shared_seed: int = 0) -> float:
        """``r * max |P| * max |Q|`` bounds every element of ``P Q^T`` (dense: its max |x|)."""
        if not self.factorised(enc.shape):
            (f,) = expect_fields(enc, 1, "dense values")
            return peak(expect_field(enc, f, "dense", count=numel(enc.shape), dtype="float32"))
        p, q = self._factors(enc)
        return p.shape[1] * peak(p) * peak(q)

    def add(self, a: EncodedTensor, b: EncodedTensor) -> EncodedTensor | None:
        if not self.factorised(a.shape):
            total = self.decode_parsed(a).reshape(-1) + self.decode_parsed(b).reshape(-1)
            return self.header(a.shape, [Field(total)])
        (pa, qa), (pb, qb) = self._factors(a), self._factors(b)
        p = np.concatenate([pa, pb], axis=1)
        q = np.concatenate([qa, qb], axis=1)
        return self.header(a.shape, [Field(p.reshape(-1)), Field(q.reshape(-1))])
