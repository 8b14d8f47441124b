"""Privacy accounting: what a round of Orchard's DP costs, and what rounds compose to.

Pure: numbers in, numbers out; the accounting itself is ``dp_accounting``'s RDP
accountant, called with the events built here. A round is a Gaussian mechanism on the
round's clipped sum; its sensitivity follows the declared adjacency (``SENSITIVITY``);
no amplification by sampling is claimed (:func:`_round_event` says why).

Adaptive clipping (Andrew et al., 2021) releases a second value, the noised count of
clients within the norm; :func:`update_noise_multiplier` splits one round's budget
between it and the updates.
"""

from __future__ import annotations

import math

from orchard.errors import ConfigError

# How far one device's contribution can move a round's clipped sum, in clip norms, under
# each adjacency: adding or removing a device moves it by at most C; replacing one
# device's data by another's, by at most 2C (the difference of two vectors of norm <= C).
SENSITIVITY = {"add_remove": 1.0, "replace_one": 2.0}


def sensitivity_factor(adjacency: str) -> float:
    """The L2 sensitivity of a round's clipped sum in units of the clip norm."""
    try:
        return SENSITIVITY[adjacency]
    except KeyError:
        raise ConfigError(f"unknown adjacency {adjacency!r}: use one of {sorted(SENSITIVITY)}") from None


def _round_event(noise_multiplier: float, adjacency: str):  # -> dp_accounting.DpEvent
    """One round as the accountant sees it: a Gaussian mechanism on the round's sum, with
    noise multiplier ``z / sensitivity`` (``z`` is the noise's stddev over the clip norm).

    No amplification by sampling: Orchard's selection is not Poisson sampling (the root
    takes a fixed number among the devices that are live and eligible when the round
    opens, late joiners first come, first served; the simulator among the devices online
    at the simulated hour), so the accountant assumes a device may be in every round.
    A device that takes part in fewer rounds spends less than this."""
    import dp_accounting

    return dp_accounting.GaussianDpEvent(noise_multiplier / sensitivity_factor(adjacency))


def epsilon_spent(noise_multiplier: float, rounds: int, delta: float, adjacency: str = "replace_one") -> float:
    """ε after ``rounds`` Gaussian rounds at noise multiplier ``noise_multiplier`` (stddev
    over clip norm) under ``adjacency`` (dp_accounting, RDP)."""
    return epsilon_of([(noise_multiplier, rounds)], delta, adjacency)


def epsilon_of(rounds: list[tuple[float, int]], delta: float, adjacency: str = "replace_one") -> float:
    """ε of a composition of rounds given as ``(noise multiplier, count)`` pairs
    (several runs on the same devices compose this way: the population ledger)."""
    events = [(z, n) for z, n in rounds if n > 0 and math.isfinite(z)]  # z = inf: a charge that adds nothing
    if not events:
        return 0.0
    import dp_accounting
    from dp_accounting.rdp import RdpAccountant

    acc = RdpAccountant()
    for z, n in events:
        acc.compose(dp_accounting.SelfComposedDpEvent(_round_event(z, adjacency), n))
    return float(acc.get_epsilon(delta))


def noise_multiplier_for(epsilon: float, delta: float, rounds: int, adjacency: str = "replace_one") -> float:
    """The smallest noise multiplier whose ``rounds`` rounds spend at most ``epsilon``
    (dp_accounting's calibration over its RDP accountant)."""
    problems = []
    if not epsilon > 0:
        problems.append(f"target epsilon must be > 0, got {epsilon}")
    if not 0 < delta < 1:
        problems.append(f"delta must be in (0, 1), got {delta}")
    if rounds < 1:
        problems.append(f"rounds must be >= 1, got {rounds}")
    if problems:
        raise ConfigError(problems)
    import dp_accounting
    from dp_accounting.rdp import RdpAccountant

    return float(dp_accounting.calibrate_dp_mechanism(
        RdpAccountant, lambda z: dp_accounting.SelfComposedDpEvent(_round_event(z, adjacency), rounds),
        epsilon, delta))


def count_sensitivity(adjacency: str) -> float:
    """How far one device moves adaptive clipping's count of clients within the norm.
    The count is of centred bits ``b_i - 1/2`` (Andrew et al., 2021, Alg. 1; TF Privacy):
    adding or removing a device moves it by 1/2, replacing one device's data by at most 1."""
    return 0.5 if adjacency == "add_remove" else 1.0


def update_noise_multiplier(z: float, count_stddev: float, adjacency: str = "replace_one") -> float:
    """``z_update`` such that the updates' sum with noise ``z_update C`` and the count with
    noise ``count_stddev``, released together, spend what one Gaussian mechanism with
    noise multiplier ``z`` spends under ``adjacency`` (Andrew et al., Thm 1).

    The pair is one Gaussian mechanism whose sensitivity in noise units is
    ``sqrt((k C / (z_update C))^2 + (s_b / count_stddev)^2)`` with ``k`` the sum's
    sensitivity in clip norms and ``s_b`` the count's (:func:`count_sensitivity`); it
    must equal ``k / z``, the sensitivity the accountant charges. So
    ``z_update = (z^-2 - (s_b / (k count_stddev))^2)^(-1/2)``: Andrew et al.'s
    ``(z^-2 - (2 sigma_b)^-2)^(-1/2)`` under both adjacencies (``s_b / k`` is 1/2 in
    each), which holds only because the count is centred: an uncentred count under
    add/remove (``s_b = 1``, ``k = 1``) would spend four times as much on it."""
    ratio = count_sensitivity(adjacency) / (sensitivity_factor(adjacency) * count_stddev)
    rest = z ** -2 - ratio ** 2
    if rest <= 0:
        raise ConfigError(f"the clipped-count noise (stddev {count_stddev}) leaves no budget for the updates at "
                          f"noise multiplier {z}: raise privacy.adaptive.count_stddev above {z * ratio * count_stddev:.3g}")
    return rest ** -0.5
