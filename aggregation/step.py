"""The root's step: from a round's partial sum to the next global model.

One function, :func:`server_step`, closes every round wherever it runs: the gRPC root
(``orchard.server.root``) and the simulator (``orchard.simulation.engine``) both call
it, so a weighting or a server optimizer cannot exist on one path and not the other.

    mean, metrics = finalize(partial)              sum_i w_i u_i / sum_i w_i
    FedNova:       mean <- tau_eff * mean          (Wang et al., 2020, eq. 6)
    new global    = optimizer.step(mean)           (Reddi et al., 2021, Algorithm 2)

Pure apart from the optimizer's own state, which the caller owns and checkpoints.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import numpy as np

from orchard.aggregation.fedavg import Partial, finalize
from orchard.config import RunConfig
from orchard.errors import UpdateSchemaError
from orchard.typing import Metrics, NDArrays, Weighting

if TYPE_CHECKING:
    from orchard.aggregation.server_opt import ServerOptimizer

FEDNOVA_TAU = "fednova_tau"  # the metric a FedNova client reports its a_i under


def fednova_rescale(mean: NDArrays, metrics: Metrics) -> NDArrays:
    """FedNova's root step (Wang et al., 2020, eq. 6): clients sent ``d_i = Delta_i / a_i``
    weighted by ``p_i`` and ``a_i`` as the metric ``fednova_tau`` under the same weights,
    so ``mean = sum p_i d_i`` and the metric mean is ``tau_eff``; the update is their
    product. Only the root multiplies: every tier below folds plain weighted sums."""
    tau_eff = metrics.get(FEDNOVA_TAU)
    if tau_eff is None or not math.isfinite(tau_eff) or tau_eff < 0:
        raise UpdateSchemaError(f"weighting 'fednova' needs the metric {FEDNOVA_TAU!r} from every client; "
                                f"the cohort reported {tau_eff!r}")
    return {k: np.multiply(v, tau_eff, dtype=np.float64).astype(np.float32) for k, v in mean.items()}


def server_step(partial: Partial, config: RunConfig, optimizer: ServerOptimizer) -> tuple[NDArrays, Metrics]:
    """The new global model (float32) and the cohort's metric means, from a round's
    ``partial``. Raises UpdateSchemaError for an empty cohort or a FedNova cohort that did
    not report its step counts; the optimizer is stepped only when this returns."""
    mean, metrics = finalize(partial)
    if config.cohort.weighting is Weighting.FEDNOVA:
        mean = fednova_rescale(mean, metrics)
    return optimizer.step(mean), metrics
