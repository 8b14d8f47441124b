"""FedNova normalisation (Wang et al., 2020, "Tackling the Objective Inconsistency
Problem in Heterogeneous Federated Optimization", section 4).

When governors stop clients after different numbers of local steps ``tau_i``, plain
FedAvg over-weights the clients that ran longer and converges to a different
objective. FedNova divides each client's update by the L1 norm of its local
aggregation vector ``a_i`` (``||a_i||_1 = tau_i`` for plain SGD), then rescales the
weighted mean of those normalised updates by the effective step count::

    d_i     = Delta_i / ||a_i||_1                         (normalised update)
    tau_eff = sum_i p_i * ||a_i||_1                       (p_i: data weights, sum 1)
    Delta   = tau_eff * sum_i p_i * d_i                   (eq. 6, with the server lr 1)

Both sums are linear, so a tree of aggregators can fold ``p_i * d_i`` and
``p_i * ||a_i||_1`` into ordinary streaming weighted sums and only the root multiplies:
that is why :func:`normalise` and :func:`norm_a` are offered on their own.

Pure: arrays in, arrays out; the root uses this optionally.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from orchard.errors import UpdateSchemaError
from orchard.typing import NDArrays


def norm_a(local_steps: int, momentum: float = 0.0) -> float:
    """``||a_i||_1`` for ``local_steps`` of SGD with heavy-ball ``momentum`` rho.

    Plain SGD: ``tau``. Momentum: ``(tau - rho (1 - rho^tau) / (1 - rho)) / (1 - rho)``
    (the paper's momentum case), which tends to ``tau / (1 - rho)`` for long runs.
    """
    if local_steps < 0:
        raise ValueError(f"local_steps must be >= 0, got {local_steps}")
    if not 0.0 <= momentum < 1.0:
        raise ValueError(f"momentum must be in [0, 1), got {momentum}")
    tau = float(local_steps)
    if momentum == 0.0:
        return tau
    rho = momentum
    return (tau - rho * (1.0 - rho**tau) / (1.0 - rho)) / (1.0 - rho)


def normalise(update: NDArrays, local_steps: int, momentum: float = 0.0) -> NDArrays:
    """``d_i = Delta_i / ||a_i||_1``; a client that did no steps contributes zeros."""
    a = norm_a(local_steps, momentum)
    if a == 0.0:
        return {k: np.zeros_like(v) for k, v in update.items()}
    return {k: np.divide(v, a).astype(v.dtype, copy=False) for k, v in update.items()}


def aggregate(
    updates: Sequence[NDArrays],
    local_steps: Sequence[int],
    data_weights: Sequence[float] | None = None,
    momentum: float = 0.0,
) -> NDArrays:
    """FedNova's aggregate update ``tau_eff * sum_i p_i d_i`` (float64 accumulation).

    ``data_weights`` are each client's number of examples (normalised to ``p_i``
    here); None weighs clients equally. With equal ``local_steps`` this is exactly
    the FedAvg weighted mean.
    """
    n = len(updates)
    if n == 0:
        raise ValueError("aggregate needs at least one update")
    if len(local_steps) != n or (data_weights is not None and len(data_weights) != n):
        raise ValueError(
            f"got {n} updates, {len(local_steps)} step counts and "
            f"{'no' if data_weights is None else len(data_weights)} weights: they must match"
        )
    w = np.ones(n) if data_weights is None else np.asarray(data_weights, dtype=np.float64)
    if np.any(w < 0) or w.sum() <= 0:
        raise ValueError("data_weights must be >= 0 with a positive sum")
    p = w / w.sum()
    names = list(updates[0])
    for i, u in enumerate(updates[1:], start=1):
        if list(u) != names or any(u[k].shape != updates[0][k].shape for k in names):
            raise UpdateSchemaError(
                f"update {i} has tensors {[(k, u[k].shape) for k in u]}, expected "
                f"{[(k, updates[0][k].shape) for k in names]}"
            )
    tau_eff = float(sum(pi * norm_a(t, momentum) for pi, t in zip(p, local_steps, strict=True)))
    out: NDArrays = {}
    for k in names:
        acc = np.zeros(updates[0][k].shape, dtype=np.float64)
        for pi, u, t in zip(p, updates, local_steps, strict=True):
            a = norm_a(t, momentum)
            if a > 0:
                acc += pi * (u[k].astype(np.float64) / a)
        out[k] = (tau_eff * acc).astype(updates[0][k].dtype)
    return out
