"""Choosing k (neighbours) and t (Shamir threshold) as Bell et al. (2020) do (§3.2-3.3,
Theorems 3.6-3.8): the smallest even k, of order log n, for which some t meets three
bounds. Node failures are modelled as independent: a node drops out with probability
delta and is corrupt (colludes with the server) with probability gamma.

1. Correctness (fail with probability <= 2^-eta): every node keeps >= t surviving
   neighbours, so its secrets can be reconstructed:
   ``n * P[Binomial(k, delta) > k - t] <= 2^-eta``.
2. Privacy of secrets (<= 2^-sigma): the server gets either the self-mask seed or the
   mask key of an honest node, never both; against a server that lies about who dropped
   out this needs the active protocol's consistency round (orchard.secure_agg.consistency). Honest
   holders reveal one kind of share per node, corrupt ones both, so with c corrupt
   neighbours the server collects t of both kinds only if 2t <= k + c:
   ``n * P[Binomial(k, gamma) >= 2t - k] <= 2^-sigma`` (t > k/2 always).
3. Privacy of the sum (<= 2^-sigma): the honest survivors stay connected, so the server
   learns only their total. In the relabelled Harary graph this fails only if k/2
   consecutive ring positions are lost: ``n * (gamma + delta)^(k/2) <= 2^-sigma``.

Among the t that pass for the smallest k, the smallest is taken (most dropout slack). If
no k < n - 1 passes, the graph is complete (Bonawitz et al., 2017) with
t = floor((k + ceil(gamma * n)) / 2) + 1, and the report gives the bounds achieved.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from orchard.secure_agg.errors import SecAggConfigError

if TYPE_CHECKING:  # the config module pulls in pydantic; the math does not need it
    from orchard.config import SecureAggregationConfig

__all__ = ["SecAggParameters", "choose_parameters", "parameters_from_config"]


@dataclass(frozen=True)
class SecAggParameters:
    """k and t for a cohort, with the bounds they achieve and why they were chosen."""

    num_clients: int
    neighbours: int  # k
    threshold: int  # t
    complete_graph: bool
    dropout_rate: float
    corrupt_fraction: float
    log2_correctness_failure: float  # log2 of the bound in (1)
    log2_secret_leak: float  # log2 of the bound in (2)
    log2_disconnection: float  # log2 of the bound in (3)
    reasoning: tuple[str, ...]

    @property
    def tolerated_dropouts_per_neighbourhood(self) -> int:
        return self.neighbours - self.threshold


def _log_tail(k: int, p: float) -> np.ndarray:
    """tail[m] = ln P[Binomial(k, p) >= m] for m = 0..k+1 (tail[k+1] = -inf)."""
    m = np.arange(k + 1)
    if p <= 0.0:
        pmf = np.where(m == 0, 0.0, -np.inf)
    elif p >= 1.0:
        pmf = np.where(m == k, 0.0, -np.inf)
    else:
        lg = np.array([math.lgamma(k + 1) - math.lgamma(i + 1) - math.lgamma(k - i + 1)
                       for i in range(k + 1)])
        pmf = lg + m * math.log(p) + (k - m) * math.log1p(-p)
    tail = np.logaddexp.accumulate(pmf[::-1])[::-1]
    return np.concatenate([tail, [-np.inf]])


def _log2(x: float) -> float:
    return -math.inf if x == -math.inf else x / math.log(2)


def _bounds(n: int, k: int, t: int, delta: float, gamma: float) -> tuple[float, float, float]:
    ln_n = math.log(n)
    drop = _log_tail(k, delta)
    corrupt = _log_tail(k, gamma)
    correctness = ln_n + drop[k - t + 1]
    leak = ln_n + corrupt[max(2 * t - k, 0)]
    if k >= n - 1 or gamma + delta <= 0:
        disconnect = -math.inf
    else:
        disconnect = ln_n + (k // 2) * math.log(gamma + delta)
    return (float(min(_log2(correctness), 0.0)), float(min(_log2(leak), 0.0)),
            float(min(_log2(disconnect), 0.0)))


def _complete_threshold(n: int, gamma: float) -> int:
    k = n - 1
    return min(k, (k + math.ceil(gamma * n)) // 2 + 1)


def _check_rates(dropout_rate: float, corrupt_fraction: float) -> None:
    problems = []
    if not 0.0 <= dropout_rate < 0.5:
        problems.append(f"dropout_rate must be in [0, 0.5), got {dropout_rate}")
    if not 0.0 <= corrupt_fraction < 0.5:
        problems.append(f"corrupt_fraction must be in [0, 0.5), got {corrupt_fraction}")
    if dropout_rate + corrupt_fraction >= 0.5:
        problems.append("dropout_rate + corrupt_fraction must stay below 0.5: with half the "
                        "cohort lost no threshold is both reachable and secure")
    if problems:
        raise SecAggConfigError(problems)


def choose_parameters(
    num_clients: int,
    dropout_rate: float,
    *,
    corrupt_fraction: float = 0.05,
    neighbours: int | None = None,
    threshold: float | None = None,
    sigma: float = 40.0,
    eta: float = 20.0,
) -> SecAggParameters:
    """k and t for ``num_clients`` clients (see the module docstring for the bounds).

    ``neighbours`` fixes k and ``threshold`` fixes t as a fraction of k (t = ceil(f k));
    the report then states the bounds those choices achieve.
    """
    n = num_clients
    if n < 2:
        raise SecAggConfigError(f"secure aggregation needs at least 2 clients, got {n}")
    _check_rates(dropout_rate, corrupt_fraction)
    delta, gamma = dropout_rate, corrupt_fraction
    why: list[str] = [
        f"n={n} clients, dropout rate delta={delta}, corrupt fraction gamma={gamma}, "
        f"targets: correctness failure <= 2^-{eta:g}, privacy failure <= 2^-{sigma:g}"
    ]
    if neighbours is not None:
        k = neighbours
        if not 1 <= k <= n - 1:
            raise SecAggConfigError(f"neighbours must be in 1..{n - 1} for {n} clients, got {k}")
        if k < n - 1 and k % 2:
            raise SecAggConfigError(f"neighbours={k} is odd: use an even k (Harary graph) "
                                    f"or n - 1 = {n - 1} (complete graph)")
        why.append(f"k={k} fixed by configuration")
    if threshold is not None and not 0.0 < threshold <= 1.0:
        raise SecAggConfigError(f"threshold is a fraction in (0, 1], got {threshold}")

    def t_range(k: int) -> tuple[int, int]:
        """(smallest t meeting bound 2, largest t meeting bound 1)."""
        ln_n = math.log(n)
        drop = _log_tail(k, delta)
        corrupt = _log_tail(k, gamma)
        t_max = 0
        for t in range(k, 0, -1):
            if ln_n + drop[k - t + 1] <= -eta * math.log(2):
                t_max = t
                break
        t_min = k + 1
        for t in range(k // 2 + 1, k + 1):
            if ln_n + corrupt[2 * t - k] <= -sigma * math.log(2):
                t_min = t
                break
        return t_min, t_max

    def connected(k: int) -> bool:
        return k >= n - 1 or math.log(n) + (k // 2) * math.log(gamma + delta or 1e-300) <= -sigma * math.log(2)

    k_chosen: int | None = neighbours
    t_chosen: int | None = None
    if k_chosen is None:
        for k in range(2, n - 1, 2):
            if not connected(k):
                continue
            t_min, t_max = t_range(k)
            if threshold is not None:
                t = math.ceil(threshold * k)
                if t > k // 2 and t_min <= t <= t_max:
                    k_chosen, t_chosen = k, t
                    break
            elif t_min <= t_max:
                k_chosen, t_chosen = k, t_min
                break
        if k_chosen is None:
            k_chosen = n - 1
            why.append(f"no even k < n - 1 = {n - 1} meets all three bounds: complete graph "
                       f"(the original protocol of Bonawitz et al., 2017)")
        else:
            why.append(f"k={k_chosen} is the smallest even k for which the three bounds hold "
                       f"(log2 n = {math.log2(n):.1f}, k/log2 n = {k_chosen / math.log2(n):.1f})")
    k = k_chosen
    if t_chosen is None:
        if threshold is not None:
            t_chosen = math.ceil(threshold * k)
            why.append(f"t=ceil({threshold} * k)={t_chosen} fixed by configuration")
        elif k >= n - 1:
            t_chosen = _complete_threshold(n, gamma)
            why.append(f"t=floor((k + ceil(gamma n)) / 2) + 1 = {t_chosen}: a strict majority of "
                       f"the neighbourhood plus the expected corrupt clients")
        else:
            t_min, t_max = t_range(k)
            t_chosen = min(max(t_min, k // 2 + 1), k)
            why.append(f"t={t_chosen}: the smallest t whose secret-leak bound holds for this k"
                       + ("" if t_min <= t_max else " (the correctness bound does not hold: "
                          "raise k or lower the dropout rate)"))
    else:
        why.append(f"t={t_chosen}: the smallest threshold meeting the privacy bound; "
                   f"correctness holds for every t <= {t_range(k)[1]}")
    t = t_chosen
    if not k // 2 < t <= k:
        raise SecAggConfigError(
            f"threshold t={t} must be in {k // 2 + 1}..{k} for k={k}: with t <= k/2 a server "
            f"that lies about dropouts can collect both the self-mask and the mask-key shares "
            f"of a client and unmask its input (Bell et al., 2020, §3.3); use threshold > 0.5"
        )
    corr, leak, disc = _bounds(n, k, t, delta, gamma)
    why.append(f"achieved: correctness failure <= 2^{corr:.1f}, secret leak <= 2^{leak:.1f}, "
               f"disconnection <= 2^{disc:.1f}; each node tolerates {k - t} dropped neighbours")
    return SecAggParameters(
        num_clients=n, neighbours=k, threshold=t, complete_graph=k >= n - 1,
        dropout_rate=delta, corrupt_fraction=gamma, log2_correctness_failure=corr,
        log2_secret_leak=leak, log2_disconnection=disc, reasoning=tuple(why),
    )


def parameters_from_config(config: SecureAggregationConfig, num_clients: int) -> SecAggParameters:
    """:func:`choose_parameters` from the run's secure-aggregation settings (dropout rate,
    corrupt fraction, and k or t where fixed)."""
    return choose_parameters(
        num_clients, config.dropout_rate, corrupt_fraction=config.corrupt_fraction,
        neighbours=config.neighbours, threshold=config.threshold,
    )
