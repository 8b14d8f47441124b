"""Cohort selection: who is eligible, and how a tier splits its target among children.

Pure functions over plain values; the coordinator calls them with its registry.
"""

from __future__ import annotations

import math

import numpy as np

from orchard.config import EligibilityConfig
from orchard.typing import DeviceState


def device_eligible(d: DeviceState, cfg: EligibilityConfig) -> tuple[bool, list[str]]:
    """Server-side eligibility from reported state. Unknown fields never disqualify:
    devices that cannot report a battery (edge boxes on mains) are eligible."""
    reasons = []
    plugged = bool(d.charging)
    if d.battery_percent is not None and not plugged:
        if not cfg.allow_on_battery:
            reasons.append("on battery and the run requires charging")
        elif d.battery_percent < cfg.min_battery_percent:
            reasons.append(f"battery {d.battery_percent:.0f}% below the {cfg.min_battery_percent:.0f}% floor")
    if d.temperature_c is not None and d.temperature_c >= cfg.max_temperature_c:
        reasons.append(f"temperature {d.temperature_c:.1f} C at or above the {cfg.max_temperature_c:.1f} C ceiling")
    if cfg.require_unmetered and d.unmetered_network is False:
        reasons.append("on a metered network")
    if cfg.require_idle and d.idle is False:
        reasons.append("device in use")
    return (not reasons), reasons


def allocate(target: int, capacities: dict[str, int]) -> dict[str, int]:
    """Split ``target`` updates among children in proportion to their capacity
    (largest remainder), never giving a child more than its capacity.

    When every child has the same capacity (a leaf tier's clients: one update each)
    every share is the same, so each child gets ``target // n`` and the remainder goes
    one each to the first children by name, exactly as the largest-remainder loop
    (whose ties go by name) hands it out, without sorting by a key in Python."""
    caps = set(capacities.values())
    if len(caps) == 1 and (cap := next(iter(caps))) > 0:
        each, extra = divmod(max(0, min(target, cap * len(capacities))), len(capacities))
        alloc = dict.fromkeys(capacities, each)
        for k in sorted(alloc)[:extra]:
            alloc[k] += 1
        return alloc
    return _largest_remainder(target, capacities)


def _largest_remainder(target: int, capacities: dict[str, int]) -> dict[str, int]:
    alloc = {k: 0 for k in capacities}
    remaining = min(target, sum(max(c, 0) for c in capacities.values()))
    while remaining > 0:
        open_ = {k: c - alloc[k] for k, c in capacities.items() if c - alloc[k] > 0}
        total = sum(open_.values())
        shares = {k: remaining * c / total for k, c in open_.items()}
        floors = {k: min(int(math.floor(s)), open_[k]) for k, s in shares.items()}
        given = sum(floors.values())
        for k, f in floors.items():
            alloc[k] += f
        left = remaining - given
        # Hand the rest out by largest fractional part (ties by name, for determinism).
        for k in sorted(open_, key=lambda k: (-(shares[k] - floors[k]), k)):
            if left == 0:
                break
            if alloc[k] < capacities[k]:
                alloc[k] += 1
                left -= 1
        remaining = min(target, sum(max(c, 0) for c in capacities.values())) - sum(alloc.values())
    return alloc


def over_select(candidates: list[str], wanted: int, over_selection: float, rng: np.random.Generator) -> list[str]:
    """Pick ceil(wanted * over_selection) of the candidates uniformly at random."""
    return pick(candidates, math.ceil(wanted * over_selection), rng)


def pick(candidates: list[str], k: int, rng: np.random.Generator) -> list[str]:
    """Pick ``min(k, len(candidates))`` of the candidates uniformly at random, in their order."""
    k = min(len(candidates), k)
    if k <= 0:
        return []
    idx = rng.choice(len(candidates), size=k, replace=False)
    return [candidates[i] for i in sorted(idx)]
