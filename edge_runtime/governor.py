"""The governor: paces local training inside the device's thermal, battery, energy and
time budget, and stops it cleanly when a budget runs out (ARCHITECTURE section 4).

The trainer calls it between steps::

    while governor.before_step():      # may pause (duty cycle, cooling); False = stop
        units = train_one_step()
        governor.after_step(units)     # the step's work, e.g. examples in the batch
    report = governor.report()         # steps done, why it stopped, what it cost

Pacing. Below ``ceiling - band`` the duty cycle is 1. Across the band it falls
linearly to ``min_duty``; after a step of ``s`` seconds at duty ``d`` the governor
pauses ``s * (1 - d) / d`` so that work / (work + pause) = d. The device's average power,
and with it the steady-state temperature of a first-order thermal model
(``T_ss = T_amb + P_avg * R_th``), falls with d.

Never overshooting. Before each step the governor predicts what the step will cost
from the steps it has seen (the largest temperature rise, battery drop, energy and
duration per unit of work over the last ``history`` steps, times ``safety_factor``;
a configured prior for the first step). A step that would end above the hard ceiling
is not started: the governor rests the device in ``cooldown_quantum_s`` pauses until
it fits, or stops if that would take longer than ``max_cooldown_s``. A step that
would take the battery below its floor, or a budget past its limit, is not started
either. In a first-order model the rise of a step shrinks as the device heats
(``(T_ss - T) * (1 - exp(-s / tau))``), so a maximum over recent steps is an upper
bound for the next one. Pauses are not free (the device keeps its idle draw), so a
pause is only taken if the battery and the budgets can afford it *and* a step after
it (:func:`check_rest`, from the highest per-second drain seen over steps and pauses).

The guarantee holds under two premises, which the property test states: the device
cools at rest (its idle steady state is below the ceiling), and a single step fits in
the margins (from cold, it heats less than the headroom and drains less than
``prior_drop_percent``). A governor decides between steps; it cannot split one.

The decisions (:func:`decide`, :func:`check_rest`) and the arithmetic
(:func:`duty_cycle`, :func:`estimate_next_step`) are pure functions, in
:mod:`orchard.edge_runtime.pacing` (importable from here too); :class:`Governor` only
reads the provider, sleeps on the clock and keeps history.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, replace

from orchard.errors import BudgetExceeded, ConfigError, OrchardError
from orchard.typing import DeviceState, Metrics

from .clock import Clock
from .device import DeviceStateProvider
from .pacing import (
    Action,
    Decision,
    SensorLog,
    StepEstimate,
    StepSample,
    StopReason,
    _completed,
    check_rest,
    decide,
    duty_cycle,
    estimate_next_step,
    pause_for_duty,
    sensor_margin,
)
from .policy import DevicePolicy, EligibilityDecision, evaluate, next_eligible_time

__all__ = [
    "Action",
    "Decision",
    "Governor",
    "GovernorReport",
    "GovernorStopped",
    "GovernorUsageError",
    "StepEstimate",
    "StepSample",
    "StopReason",
    "check_rest",
    "decide",
    "duty_cycle",
    "estimate_next_step",
    "pause_for_duty",
    "run_governed",
    "wait_until_eligible",
]


class GovernorUsageError(OrchardError):
    """``before_step``/``after_step`` called out of order (a trainer bug)."""


class GovernorStopped(BudgetExceeded):
    """Raised by :meth:`Governor.raise_if_stopped` for callers that prefer exceptions."""

    def __init__(self, report: GovernorReport) -> None:
        self.report = report
        super().__init__(
            f"training stopped after {report.steps_done} steps: {report.stop_reason.value if report.stop_reason else 'running'}"
            f" ({report.detail}); the update carries the steps actually done"
        )


@dataclass(frozen=True)
class GovernorReport:
    """What a governed run did. ``steps_done`` is what the server weights the update by."""

    steps_done: int
    work_units: float
    stop_reason: StopReason | None  # None: the trainer finished on its own
    detail: str
    reasons: tuple[str, ...]
    elapsed_s: float  # wall time from the first before_step, pauses included
    active_s: float  # time inside steps
    paused_s: float  # throttling and cooling pauses
    energy_j: float | None  # None when the device reports no energy and no estimate is set
    max_temperature_c: float | None
    min_battery_percent: float | None
    remaining_steps: int | None  # towards budget.max_steps, for a resumed run
    resume_at_wall_s: float | None  # when it may go on, if the clock alone decides

    @property
    def duty(self) -> float:
        total = self.active_s + self.paused_s
        return self.active_s / total if total > 0 else 1.0

    def to_metrics(self) -> Metrics:
        m: Metrics = {
            "governor_steps": float(self.steps_done),
            "governor_elapsed_s": self.elapsed_s,
            "governor_paused_s": self.paused_s,
            "governor_duty": self.duty,
            "governor_stopped_early": float(
                self.stop_reason is not None and self.stop_reason is not StopReason.COMPLETED
            ),
        }
        if self.energy_j is not None:
            m["governor_energy_j"] = self.energy_j
        if self.max_temperature_c is not None:
            m["governor_max_temperature_c"] = self.max_temperature_c
        return m


class Governor:
    """Paces one round of local training on one device (see the module docstring).

    ``carry_over`` continues a round that an earlier governor stopped (the device
    resumed in its next eligible window): its steps, energy and elapsed time count
    against this round's budget. The policy is fixed for the governor's lifetime.
    """

    def __init__(
        self,
        provider: DeviceStateProvider,
        policy: DevicePolicy,
        clock: Clock,
        *,
        carry_over: GovernorReport | None = None,
    ) -> None:
        self.provider = provider
        self.policy = policy
        self.clock = clock
        # The policy is a frozen pydantic model, whose attributes cost several times a
        # plain object's: what the governor reads around every step is taken out once.
        self._pacing = pacing = policy.pacing
        self._max_steps = policy.budget.max_steps
        self._hard_ceiling_c = policy.hard_ceiling_c
        n = pacing.history
        self._history: deque[StepSample] = deque(maxlen=n)
        self._rests: deque[StepSample] = deque(maxlen=n)
        self._steps = 0
        self._units = self._prior_elapsed = self._active = self._paused = self._energy = 0.0
        self._energy_known = True
        self._max_t: float | None = None
        self._min_b: float | None = None
        if carry_over is not None:
            self._steps = carry_over.steps_done
            self._units = carry_over.work_units
            self._prior_elapsed = carry_over.elapsed_s
            self._active = carry_over.active_s
            self._paused = carry_over.paused_s
            self._energy = carry_over.energy_j or 0.0
            self._energy_known = carry_over.energy_j is not None
            self._max_t = carry_over.max_temperature_c
            self._min_b = carry_over.min_battery_percent
        self._counter: float | None = None  # last extra["energy_j"] reading
        self._t0: float | None = None
        self._stop: Decision | None = None
        self._before: tuple[float, DeviceState] | None = None  # (monotonic, state) at step start
        self._last_units = 1.0
        self._last_state: DeviceState | None = None
        self._last_read_at: float | None = None  # clock.monotonic() of _last_state
        # A lagging or noisy sensor: what the margin for it reads (see _seen).
        lag = pacing.sensor_lag_s
        self._sensor = SensorLog(3.0 * lag + 30.0) if lag > 0 or pacing.sensor_noise_c > 0 else None
        self._rate: float | None = None  # the highest heating rate per second of work seen this round

    # -- I/O helpers

    def _read(self) -> DeviceState:
        s = self.provider.read()
        counter = s.extra.get("energy_j")
        if counter is not None:
            # A cumulative counter (simulator, RAPL). It may wrap: a negative
            # difference is dropped rather than trusted.
            if self._counter is not None and counter >= self._counter:
                self._energy += counter - self._counter
            self._counter = counter
        # The running extremes, as max()/min() would keep them (the first of equals).
        t, b = s.temperature_c, s.battery_percent
        if t is not None and (self._max_t is None or t > self._max_t):
            self._max_t = t
        if b is not None and (self._min_b is None or b < self._min_b):
            self._min_b = b
        self._last_state = s
        self._last_read_at = self.clock.monotonic()
        if self._sensor is not None and t is not None:
            self._sensor.reading(self._last_read_at, t)
        return s

    def _seen(self, state: DeviceState) -> tuple[DeviceState, float]:
        """What the sensor's stated lag and noise leave unseen: the state with its
        temperature raised by the noise bound (the hot spot may be that much above the
        reading now), and how much more it may rise by the end of the next step from
        work the lagging sensor does not show yet
        (:func:`~orchard.edge_runtime.pacing.sensor_margin`, less the noise)."""
        log, t = self._sensor, state.temperature_c
        if log is None or t is None:
            return state, 0.0
        pacing = self._pacing
        lag, noise = pacing.sensor_lag_s, pacing.sensor_noise_c
        ahead = 0.0
        if lag > 0:
            now = self.clock.monotonic()
            rate = log.heating_rate(lag, noise, max(lag, 2.0))
            if rate is not None and (self._rate is None or rate > self._rate):
                # The highest in the round, not a recent one: pauses in a window lower
                # its estimate, and the round's first windows, worked flat out from
                # cold, show the device at its fastest.
                self._rate = rate
            last = self._history[-1].seconds if self._history else 0.0
            ahead = sensor_margin(self._rate, log.work_between(now - lag, now),
                                  log.steps_after(now - lag), pacing.safety_factor * last, pacing) - noise
        return replace(state, temperature_c=t + noise), ahead

    def _current(self) -> DeviceState:
        """The device now: the last reading if the clock has not moved since it was
        taken (a virtual clock between two steps), else a fresh one. A real clock always
        moves, so a real device is always read."""
        if self._last_state is not None and self._last_read_at == self.clock.monotonic():
            return self._last_state
        return self._read()

    def _estimate(self, state: DeviceState) -> StepEstimate:
        return estimate_next_step(
            self._history, self._last_units, self._pacing, state.charging, self._rests
        )

    def _rest(self, state: DeviceState, seconds: float) -> DeviceState | Decision:
        """Pause ``seconds`` if the device can afford it; the new state, or why not."""
        d = check_rest(
            state,
            self.policy,
            self._estimate(state),
            seconds,
            elapsed_s=self._elapsed(),
            energy_used_j=self._energy,
        )
        if d.action is Action.STOP:
            return d
        e0 = self._energy
        self.clock.sleep(seconds)
        self._paused += seconds
        s1 = self._read()
        self._rests.append(
            StepSample(
                units=0.0,
                seconds=seconds,
                rise_c=_diff(s1.temperature_c, state.temperature_c),
                drop_percent=_diff(state.battery_percent, s1.battery_percent),
                energy_j=self._energy - e0 if "energy_j" in s1.extra else None,
            )
        )
        return s1

    def _elapsed(self) -> float:
        return self._prior_elapsed + (
            0.0 if self._t0 is None else self.clock.monotonic() - self._t0
        )

    def _halt(self, decision: Decision) -> bool:
        self._stop = decision
        return False

    # -- the trainer's interface

    @property
    def stopped(self) -> bool:
        return self._stop is not None

    def before_step(self) -> bool:
        """Pause as the duty cycle asks, then say whether the next step may run."""
        if self._stop is not None:
            return False
        if self._before is not None:
            raise GovernorUsageError("before_step called twice without after_step in between")
        max_steps = self._max_steps
        if max_steps is not None and self._steps >= max_steps:
            # Done: no reading, no estimate, and no duty-cycle pause after the last step.
            return self._halt(_completed(max_steps))
        policy, pacing, clock = self.policy, self._pacing, self.clock
        if self._t0 is None:
            self._t0 = clock.monotonic()
            state = self._read()
            if (
                policy.budget.energy_j is not None
                and "energy_j" not in state.extra
                and pacing.joules_per_unit is None
            ):
                raise ConfigError(
                    "an energy budget is set but this device reports no energy counter: "
                    "set pacing.joules_per_unit to estimate energy from work, or drop budget.energy_j"
                )
        else:
            state = self._current()

        if self._history:
            seen, ahead = self._seen(state)
            duty = duty_cycle(
                None if seen.temperature_c is None else seen.temperature_c + ahead,
                self._hard_ceiling_c,
                pacing.throttle_band_c,
                pacing.min_duty,
            )
            if duty < 1.0:
                rested = self._rest(state, pause_for_duty(self._history[-1].seconds, duty))
                if isinstance(rested, Decision):
                    return self._halt(rested)
                state = rested

        cooled = 0.0
        while True:
            est = self._estimate(state)
            seen, ahead = self._seen(state)
            if ahead:
                est = est._replace(rise_c=est.rise_c + ahead)
            d = decide(
                seen,
                policy,
                est,
                wall_s=clock.wall(),
                elapsed_s=self._elapsed(),
                energy_used_j=self._energy,
                steps_done=self._steps,
            )
            if d.action is Action.RUN:
                self._before = (clock.monotonic(), state)
                return True
            if d.action is Action.STOP:
                return self._halt(d)
            q = pacing.cooldown_quantum_s
            if cooled + q > pacing.max_cooldown_s:
                return self._halt(
                    replace(
                        d,
                        action=Action.STOP,
                        reason=StopReason.THERMAL_CEILING,
                        detail=f"{d.detail}; cooling for {cooled:.0f} s did not make room for a step",
                    )
                )
            rested = self._rest(state, q)
            if isinstance(rested, Decision):
                return self._halt(rested)
            cooled += q
            state = rested

    def after_step(self, work_units: float = 1.0) -> None:
        """Record a finished step of ``work_units`` (examples, tokens, batches: any
        unit, as long as the trainer is consistent)."""
        if self._before is None:
            raise GovernorUsageError("after_step called without a before_step that returned True")
        if work_units < 0:
            raise ValueError(f"work_units must be >= 0, got {work_units}")
        t_before, s0 = self._before
        self._before = None
        counter_before = self._energy
        if self._sensor is not None:
            self._sensor.step(t_before, self.clock.monotonic())
        s1 = self._read()
        seconds = self.clock.monotonic() - t_before
        if seconds < 0.0:  # never negative, as max(seconds, 0.0) (which keeps -0.0)
            seconds = 0.0
        energy: float | None = None
        if "energy_j" in s1.extra:
            energy = self._energy - counter_before
        elif self._pacing.joules_per_unit is not None:
            energy = work_units * self._pacing.joules_per_unit
            self._energy += energy
        else:
            self._energy_known = False
        self._history.append(
            StepSample(
                units=work_units,
                seconds=seconds,
                rise_c=_diff(s1.temperature_c, s0.temperature_c),
                drop_percent=_diff(s0.battery_percent, s1.battery_percent),
                energy_j=energy,
            )
        )
        self._steps += 1
        self._units += work_units
        self._active += seconds
        if work_units > 0:
            self._last_units = work_units

    def report(self) -> GovernorReport:
        d = self._stop
        max_steps = self._max_steps
        resume_at = None
        if d is not None and d.reason is StopReason.INELIGIBLE and self._last_state is not None:
            resume_at = next_eligible_time(self._last_state, self.policy, self.clock.wall())
        return GovernorReport(
            steps_done=self._steps,
            work_units=self._units,
            stop_reason=None if d is None else d.reason,
            detail="" if d is None else d.detail,
            reasons=() if d is None else d.reasons,
            elapsed_s=self._elapsed(),
            active_s=self._active,
            paused_s=self._paused,
            energy_j=self._energy if self._energy_known else None,
            max_temperature_c=self._max_t,
            min_battery_percent=self._min_b,
            remaining_steps=None if max_steps is None else max(max_steps - self._steps, 0),
            resume_at_wall_s=resume_at,
        )

    def raise_if_stopped(self) -> None:
        """Raise :class:`GovernorStopped` if a budget stopped training early."""
        if self._stop is not None and self._stop.reason is not StopReason.COMPLETED:
            raise GovernorStopped(self.report())


def _diff(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None else a - b


def run_governed(governor: Governor, step: Callable[[], float]) -> GovernorReport:
    """Run ``step`` (returns its work units) until the governor says stop."""
    while governor.before_step():
        governor.after_step(step())
    return governor.report()


def wait_until_eligible(
    provider: DeviceStateProvider,
    policy: DevicePolicy,
    clock: Clock,
    *,
    poll_s: float = 60.0,
    timeout_s: float | None = None,
    thermal_margin_c: float = 0.0,
) -> EligibilityDecision:
    """Block (on ``clock``) until the device is eligible, or ``timeout_s`` passes.

    This is how a stopped client resumes in its next eligible window: a closed window
    is slept through in one go (its start is known); anything else (charge, cooling,
    the network, the user) is polled every ``poll_s``. ``thermal_margin_c`` makes a
    device that stopped at its ceiling wait until it is that much below it, so it does
    not resume only to stop again at once.
    """
    if poll_s <= 0:
        raise ValueError(f"poll_s must be > 0, got {poll_s}")
    strict = policy
    if thermal_margin_c:
        elig = policy.eligibility.model_copy(
            update={"max_temperature_c": policy.eligibility.max_temperature_c - thermal_margin_c}
        )
        strict = policy.model_copy(update={"eligibility": elig})
    deadline = None if timeout_s is None else clock.monotonic() + timeout_s
    while True:
        state = provider.read()
        now = clock.wall()
        decision = evaluate(state, strict, now)
        if decision.eligible:
            return decision
        at = next_eligible_time(state, strict, now)
        wait = poll_s if at is None else max(at - now, 0.0)
        if deadline is not None:
            left = deadline - clock.monotonic()
            if left <= 0:
                return decision
            wait = min(wait, left)
        clock.sleep(wait)
