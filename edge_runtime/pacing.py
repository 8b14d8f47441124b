"""The governor's decisions and arithmetic, as pure functions: the duty cycle, the
estimate of the next step's cost, whether a step may start (:func:`decide`) and whether
a pause is affordable (:func:`check_rest`).

Everything they need is an argument (the device state, the policy, the history of
steps), so the guarantee of :mod:`orchard.edge_runtime.governor` can be tested on them
alone; the :class:`~orchard.edge_runtime.governor.Governor` only reads the provider,
sleeps on the clock and keeps the history.
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right
from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum
from functools import lru_cache
from typing import NamedTuple

from orchard.typing import DeviceState

from .policy import DevicePolicy, PacingConfig, evaluate


class StopReason(StrEnum):
    COMPLETED = "completed"  # budget.max_steps reached
    TIME_BUDGET = "time_budget"
    ENERGY_BUDGET = "energy_budget"
    THERMAL_CEILING = "thermal_ceiling"
    BATTERY_FLOOR = "battery_floor"
    INELIGIBLE = "ineligible"  # unplugged, network or idleness changed, window closed


def duty_cycle(
    temperature_c: float | None, hard_ceiling_c: float, band_c: float, min_duty: float
) -> float:
    """Fraction of wall time spent working: 1 below the band, linear down to ``min_duty``
    at the hard ceiling."""
    if temperature_c is None:
        return 1.0
    soft = hard_ceiling_c - band_c
    if temperature_c <= soft:
        return 1.0
    frac = min((temperature_c - soft) / band_c, 1.0)
    return 1.0 - (1.0 - min_duty) * frac


def pause_for_duty(step_s: float, duty: float) -> float:
    """Pause after a ``step_s``-second step so that step / (step + pause) = duty."""
    return step_s * (1.0 - duty) / duty


class StepSample(NamedTuple):
    """What one step (``units`` > 0) or one rest (``units`` == 0: a throttling or
    cooling pause) cost, measured around it. None where the device did not say.

    A named tuple, as is :class:`StepEstimate`: both are immutable records built at
    every step, and a named tuple costs a fraction of a frozen dataclass, whose
    ``__init__`` calls ``object.__setattr__`` once per field.
    """

    units: float
    seconds: float
    rise_c: float | None
    drop_percent: float | None
    energy_j: float | None


class StepEstimate(NamedTuple):
    """Predicted cost of the next step (upper bounds, safety factor applied)."""

    rise_c: float
    drop_percent: float
    energy_j: float
    seconds: float
    # Battery and energy drawn per second of wall time, steps or rests, whichever is
    # higher: what a pause of a given length will cost before the next step.
    drain_percent_per_s: float = 0.0
    energy_j_per_s: float = 0.0


# The maxima below are written out (``if m is None or r > m: m = r``) rather than
# through max() or a helper: the governor asks before every step, so they are on a
# device's hot path, and a call costs more than the comparison. ``r > m`` keeps the
# first of equal values, as max() does.


def _per_unit_maxima(
    samples: Sequence[StepSample],
) -> tuple[float | None, float | None, float | None, float | None]:
    """The largest rise, drop, energy and seconds per unit over ``samples``, in one pass."""
    rise = drop = energy = seconds = None
    for s in samples:
        u = s.units
        if u <= 0:
            continue
        r = s.seconds / u
        if seconds is None or r > seconds:
            seconds = r
        if s.rise_c is not None:
            r = s.rise_c / u
            if rise is None or r > rise:
                rise = r
        if s.drop_percent is not None:
            r = s.drop_percent / u
            if drop is None or r > drop:
                drop = r
        if s.energy_j is not None:
            r = s.energy_j / u
            if energy is None or r > energy:
                energy = r
    return rise, drop, energy, seconds


def _per_second_maxima(*groups: Sequence[StepSample]) -> tuple[float | None, float | None]:
    """The largest battery drop and energy per second over every sample of ``groups``."""
    drain = power = None
    for samples in groups:
        for s in samples:
            t = s.seconds
            if t <= 0:
                continue
            if s.drop_percent is not None:
                r = s.drop_percent / t
                if drain is None or r > drain:
                    drain = r
            if s.energy_j is not None:
                r = s.energy_j / t
                if power is None or r > power:
                    power = r
    return drain, power


def estimate_next_step(
    history: Sequence[StepSample],
    next_units: float,
    pacing: PacingConfig,
    charging: bool | None,
    rests: Sequence[StepSample] = (),
) -> StepEstimate:
    """Upper-bound the next step's cost from recent steps (see the module docstring).

    Before any step is seen, the rise and drop are the configured priors (no drop
    assumed on a charger), and energy and duration are 0: the first step is the one
    a budget cannot see coming. Per-second drains cover rests as well as steps; before
    a rest has been seen, a rest is assumed to draw no more than a step does (true of
    any device whose idle power is below its training power).
    """
    k = pacing.safety_factor
    n = pacing.history
    recent = history if len(history) <= n else list(history)[-n:]
    recent_rests = rests if len(rests) <= n else list(rests)[-n:]
    rise = drop = energy = seconds = drain = power = None
    if recent or recent_rests:  # not before the first step
        rise, drop, energy, seconds = _per_unit_maxima(recent)
        drain, power = _per_second_maxima(recent, recent_rests)
    if energy is None and pacing.joules_per_unit is not None:
        energy = pacing.joules_per_unit
    prior_drop = 0.0 if charging else pacing.prior_drop_percent
    if drain is None:
        # Nothing measured yet: the first-step prior spread over one cooling pause.
        drain = prior_drop / pacing.cooldown_quantum_s
    # A negative rate (cooling, charging) counts as 0. Written out as max(x, 0.0) would
    # compute it: ``x < 0.0`` is False for -0.0 and NaN, which max() passes through too.
    if rise is not None and rise < 0.0:
        rise = 0.0
    if drop is not None and drop < 0.0:
        drop = 0.0
    if energy is not None and energy < 0.0:
        energy = 0.0
    if drain < 0.0:
        drain = 0.0
    if not power or power < 0.0:  # None, ±0.0 or negative: max(power or 0.0, 0.0) is 0.0
        power = 0.0
    return StepEstimate(
        rise_c=pacing.prior_rise_c if rise is None else k * rise * next_units,
        drop_percent=prior_drop if drop is None else k * drop * next_units,
        energy_j=0.0 if energy is None else k * energy * next_units,
        seconds=0.0 if seconds is None else k * seconds * next_units,
        drain_percent_per_s=k * drain,
        energy_j_per_s=k * power,
    )


class Action(StrEnum):
    RUN = "run"
    COOL = "cool"  # rest, then decide again
    STOP = "stop"


@dataclass(frozen=True)
class Decision:
    action: Action
    reason: StopReason | None = None
    detail: str = ""
    reasons: tuple[str, ...] = ()


# Decisions are frozen, so equal ones can be shared: the go-ahead before every step,
# and the stop after the last one (a simulator runs thousands of governors a round).
_RUN = Decision(Action.RUN)


@lru_cache(maxsize=64, typed=True)
def _completed(max_steps: int) -> Decision:
    return Decision(Action.STOP, StopReason.COMPLETED, f"max_steps={max_steps} done")


def decide(
    state: DeviceState,
    policy: DevicePolicy,
    estimate: StepEstimate,
    *,
    wall_s: float,
    elapsed_s: float,
    energy_used_j: float,
    steps_done: int,
) -> Decision:
    """May the next step start now? Pure: everything it needs is an argument."""
    # Each policy value is read once, and only where it is needed: the policy is a
    # pydantic model, whose attributes cost several times a plain object's.
    budget = policy.budget
    max_steps = budget.max_steps
    if max_steps is not None and steps_done >= max_steps:
        return _completed(max_steps)

    # Rules other than battery and temperature (those two get predictive handling
    # below): losing external power when it is required, the network turning metered,
    # the user picking the device up, the window closing.
    elig = evaluate(state, policy, wall_s)
    if not elig.eligible:
        others = [r for r in elig.reasons if r.code not in ("battery", "thermal")]
        if others:
            return Decision(Action.STOP, StopReason.INELIGIBLE, "; ".join(others), tuple(others))

    b = state.battery_percent
    drop = estimate.drop_percent
    # On a charger, a battery below the floor is fine (charging beats the floor, as in
    # eligibility) as long as it is not falling.
    charging_up = bool(state.charging) and drop <= 0.0
    if b is not None and not charging_up:
        floor = policy.battery_floor_percent
        if b - drop < floor:
            return Decision(
                Action.STOP,
                StopReason.BATTERY_FLOOR,
                f"battery {b:.2f}% minus the next step's predicted {drop:.2f}% "
                f"would pass the floor {floor:.1f}%",
            )

    time_s = budget.time_s
    if time_s is not None and elapsed_s + estimate.seconds > time_s:
        return Decision(
            Action.STOP,
            StopReason.TIME_BUDGET,
            f"{elapsed_s:.1f} s used, next step ~{estimate.seconds:.2f} s, budget {time_s:.1f} s",
        )
    energy_j = budget.energy_j
    if energy_j is not None and energy_used_j + estimate.energy_j > energy_j:
        return Decision(
            Action.STOP,
            StopReason.ENERGY_BUDGET,
            f"{energy_used_j:.1f} J used, next step ~{estimate.energy_j:.2f} J, budget {energy_j:.1f} J",
        )

    t = state.temperature_c
    if t is not None:
        hard = policy.hard_ceiling_c
        if t >= hard:
            return Decision(
                Action.STOP,
                StopReason.THERMAL_CEILING,
                f"temperature {t:.2f} °C reached the ceiling {hard:.1f} °C",
            )
        if t + estimate.rise_c > hard:
            return Decision(
                Action.COOL,
                detail=f"{t:.2f} °C + predicted rise {estimate.rise_c:.2f} °C would pass {hard:.1f} °C",
            )
    return _RUN


def check_rest(
    state: DeviceState,
    policy: DevicePolicy,
    estimate: StepEstimate,
    rest_s: float,
    *,
    elapsed_s: float,
    energy_used_j: float,
) -> Decision:
    """May the device pause ``rest_s`` seconds and still afford a step afterwards?

    A pause is not free: the device keeps drawing idle power. Checking only before
    steps would let a long cooling pause take the battery below its floor.
    """
    floor = policy.battery_floor_percent
    b = state.battery_percent
    drain = estimate.drain_percent_per_s * rest_s + estimate.drop_percent
    charging_up = bool(state.charging) and drain <= 0.0
    if b is not None and not charging_up and b - drain < floor:
        return Decision(
            Action.STOP,
            StopReason.BATTERY_FLOOR,
            f"battery {b:.2f}% cannot afford a {rest_s:.1f} s pause and a step "
            f"(~{drain:.2f}%) above the floor {floor:.1f}%",
        )
    e_budget = policy.budget.energy_j
    e_next = energy_used_j + estimate.energy_j_per_s * rest_s + estimate.energy_j
    if e_budget is not None and e_next > e_budget:
        return Decision(
            Action.STOP,
            StopReason.ENERGY_BUDGET,
            f"{energy_used_j:.1f} J used; a {rest_s:.1f} s pause and a step would pass {e_budget:.1f} J",
        )
    t_budget = policy.budget.time_s
    if t_budget is not None and elapsed_s + rest_s + estimate.seconds > t_budget:
        return Decision(
            Action.STOP,
            StopReason.TIME_BUDGET,
            f"{elapsed_s:.1f} s used; a {rest_s:.1f} s pause and a step would pass {t_budget:.1f} s",
        )
    return _RUN


# ----------------------------------------------------------------------- the object



class SensorLog:
    """The times the governor's steps ran and the temperatures it read, kept for
    ``horizon_s``: what :func:`sensor_margin` needs from the past. Steps are kept with
    their cumulative work, so the work inside any window is two binary searches."""

    __slots__ = ("horizon_s", "read_t", "read_c", "step_start", "step_end", "step_cum", "_cum")

    def __init__(self, horizon_s: float) -> None:
        self.horizon_s = horizon_s
        self.read_t: list[float] = []
        self.read_c: list[float] = []
        self.step_start: list[float] = []
        self.step_end: list[float] = []
        self.step_cum: list[float] = []  # work up to each step's end, since the log began
        self._cum = 0.0

    def reading(self, t: float, temperature_c: float) -> None:
        self.read_t.append(t)
        self.read_c.append(temperature_c)
        if self.read_t[0] < t - 2 * self.horizon_s:
            k = bisect_left(self.read_t, t - self.horizon_s)
            del self.read_t[:k], self.read_c[:k]

    def step(self, start: float, end: float) -> None:
        self._cum += end - start
        self.step_start.append(start)
        self.step_end.append(end)
        self.step_cum.append(self._cum)
        if self.step_end[0] < end - 2 * self.horizon_s:
            k = bisect_left(self.step_end, end - self.horizon_s)
            del self.step_start[:k], self.step_end[:k], self.step_cum[:k]

    def _work_until(self, t: float) -> float:
        i = bisect_right(self.step_end, t)  # steps 0..i-1 ended by t
        done = self.step_cum[i - 1] if i else (self.step_cum[0] - (self.step_end[0] - self.step_start[0])
                                               if self.step_cum else 0.0)
        if i < len(self.step_start) and self.step_start[i] < t:
            done += t - self.step_start[i]
        return done

    def work_between(self, start: float, end: float) -> float:
        """Seconds of work inside ``[start, end]``."""
        return max(0.0, self._work_until(end) - self._work_until(start)) if self.step_cum else 0.0

    def steps_after(self, t: float) -> int:
        """Steps that ended after ``t``."""
        return len(self.step_end) - bisect_right(self.step_end, t)

    def heating_rate(self, lag_s: float, noise_c: float, span_s: float) -> float | None:
        """How fast the hot spot heated per second of work, from the last reading and
        the newest one at least ``span_s`` before it; None before there is such a pair,
        or when no work lies in the window the pair saw.

        Readings at ``t_a`` and ``t_b`` show the hot spot at ``t_a - lag`` and
        ``t_b - lag``, each within ``noise_c``: the rise between them is at most
        ``T_b - T_a + 2 noise``, caused by the work that ran in ``[t_a - lag, t_b -
        lag]``. Pauses in that window cooled it, so this understates the rate of work
        alone; the governor keeps the highest value of the round (its first windows,
        worked flat out from cold, come closest, and a device heats slower as it gets
        hotter)."""
        if len(self.read_t) < 2:
            return None
        t_b = self.read_t[-1]
        k = bisect_right(self.read_t, t_b - span_s)
        if k == 0:
            return None
        t_a = self.read_t[k - 1]
        work = self.work_between(t_a - lag_s, t_b - lag_s)
        if work <= 0.0:
            return None
        return max(0.0, (self.read_c[-1] - self.read_c[k - 1] + 2.0 * noise_c) / work)


def sensor_margin(
    rate_c_per_s: float | None,
    unseen_work_s: float,
    unseen_steps: int,
    next_step_s: float,
    pacing: PacingConfig,
) -> float:
    """How far above its reading the hot spot may be by the end of the next step: the
    noise bound, plus what the work the sensor has not yet seen (the last
    ``sensor_lag_s``) and the next step add at ``rate_c_per_s``, times the safety
    factor. Before a rate is known, each unseen step and the next one count as
    ``prior_rise_c``: the governor then works blind only as far as the prior allows and
    waits for the sensor to catch up."""
    if pacing.sensor_lag_s <= 0.0:
        return pacing.sensor_noise_c
    if rate_c_per_s is None:
        ahead = pacing.prior_rise_c * (unseen_steps + 1)
    else:
        ahead = rate_c_per_s * (unseen_work_s + next_step_s)
    return pacing.sensor_noise_c + pacing.safety_factor * ahead
