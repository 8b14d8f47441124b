"""The governor on a simulated device: it throttles near the ceiling, never overshoots
it by more than 1 °C, never takes the battery below its floor, and says why it stopped."""

from __future__ import annotations

import math
from datetime import UTC, datetime

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from orchard.config import EligibilityConfig
from orchard.edge_runtime.clock import VirtualClock
from orchard.edge_runtime.device import (
    SimulatedDevice,
    SimulatedDeviceParams,
    StaticProvider,
    ThermalParams,
)
from orchard.edge_runtime.governor import (
    Governor,
    GovernorStopped,
    GovernorUsageError,
    StepEstimate,
    StepSample,
    StopReason,
    duty_cycle,
    estimate_next_step,
    pause_for_duty,
    run_governed,
    wait_until_eligible,
)
from orchard.edge_runtime.policy import DailyWindow, DevicePolicy, PacingConfig, RoundBudget
from orchard.errors import BudgetExceeded, ConfigError
from orchard.typing import DeviceState


def _policy(
    floor: float = 20.0, ceiling: float = 45.0, *, budget: RoundBudget | None = None, **kw: object
) -> DevicePolicy:
    return DevicePolicy(
        eligibility=EligibilityConfig(min_battery_percent=floor, max_temperature_c=ceiling),
        budget=budget or RoundBudget(),
        **kw,  # type: ignore[arg-type]
    )


def _hot_device(clock: VirtualClock, **kw: object) -> SimulatedDevice:
    # Full load would settle at 25 + 8 W * 4 °C/W = 57 °C, well past a 45 °C ceiling.
    params = dict(
        capacity_wh=20.0,
        battery_percent=90.0,
        active_power_w=8.0,
        idle_power_w=0.3,
        seconds_per_unit=0.2,
        thermal=ThermalParams(ambient_c=25.0, r_th_c_per_w=4.0, tau_s=30.0),
    )
    params.update(kw)
    return SimulatedDevice(SimulatedDeviceParams(**params), clock)  # type: ignore[arg-type]


def _train(dev: SimulatedDevice, gov: Governor, units: float = 1.0):
    return run_governed(gov, lambda: dev.work(units) and units)


def test_duty_cycle_is_linear_across_the_band() -> None:
    assert duty_cycle(30.0, 45.0, 5.0, 0.1) == 1.0
    assert duty_cycle(40.0, 45.0, 5.0, 0.1) == 1.0
    assert duty_cycle(42.5, 45.0, 5.0, 0.1) == pytest.approx(0.55)
    assert duty_cycle(45.0, 45.0, 5.0, 0.1) == pytest.approx(0.1)
    assert duty_cycle(None, 45.0, 5.0, 0.1) == 1.0
    # work / (work + pause) is the duty asked for.
    assert 2.0 / (2.0 + pause_for_duty(2.0, 0.25)) == pytest.approx(0.25)


def test_without_a_governor_the_device_overheats() -> None:
    """The oracle for the next test: the workload really is too hot to run flat out."""
    clock = VirtualClock()
    dev = _hot_device(clock)
    for _ in range(2000):
        dev.work(1.0)
    assert dev.max_temperature_c > 50.0


def test_governor_throttles_and_finishes_under_the_ceiling() -> None:
    clock = VirtualClock()
    dev = _hot_device(clock)
    gov = Governor(dev, _policy(budget=RoundBudget(max_steps=2000)), clock)
    report = _train(dev, gov)
    assert report.stop_reason is StopReason.COMPLETED
    assert report.steps_done == 2000 and report.remaining_steps == 0
    assert dev.max_temperature_c <= 45.0 + 1.0
    assert dev.max_temperature_c > 40.0  # it did run into the throttling band
    assert report.paused_s > 0 and report.duty < 1.0
    # Throttling cost time: 2000 steps flat out take 400 s.
    assert report.elapsed_s > 400.0
    assert report.energy_j == pytest.approx(dev.read().extra["energy_j"], rel=1e-9)
    m = report.to_metrics()
    assert m["governor_steps"] == 2000.0 and m["governor_stopped_early"] == 0.0



def test_no_pause_after_the_last_step() -> None:
    """In the throttling band the governor pauses before a step, never after the last one."""
    clock = VirtualClock()
    dev = _hot_device(clock, temperature_c=43.0)  # inside the 40-45 °C band: duty < 1
    gov = Governor(dev, _policy(budget=RoundBudget(max_steps=3)), clock)
    step_ends: list[float] = []

    def step() -> float:
        dev.work(1.0)
        step_ends.append(clock.monotonic())
        return 1.0

    report = run_governed(gov, step)
    assert report.stop_reason is StopReason.COMPLETED and report.steps_done == 3
    assert report.paused_s > 0  # it did throttle between steps
    assert clock.monotonic() == step_ends[-1]  # and the round ended with its last step

HEAVY = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@HEAVY
@given(
    ambient=st.floats(10.0, 35.0),
    headroom=st.floats(6.0, 25.0),
    r_th=st.floats(0.5, 12.0),
    tau=st.floats(5.0, 400.0),
    active_w=st.floats(1.0, 20.0),
    idle_w=st.floats(0.0, 1.5),
    step_s=st.floats(0.01, 3.0),
    capacity_wh=st.floats(0.5, 30.0),
    floor=st.floats(5.0, 50.0),
    start_above_floor=st.floats(1.5, 60.0),
    plugged=st.booleans(),
    charge_w=st.floats(0.0, 25.0),
    units=st.sampled_from([1.0, 4.0, 32.0]),
)
def test_property_no_thermal_overshoot_no_battery_below_floor(
    ambient: float,
    headroom: float,
    r_th: float,
    tau: float,
    active_w: float,
    idle_w: float,
    step_s: float,
    capacity_wh: float,
    floor: float,
    start_above_floor: float,
    plugged: bool,
    charge_w: float,
    units: float,
) -> None:
    ceiling = ambient + headroom
    per_unit_s = step_s / units
    # Physical premises of the guarantee: the device can cool at rest (idle steady
    # state under the ceiling), and one step fits in the margins (from cold it heats
    # at most 5 °C, less than the headroom, and drains at most 1 %, the prior): a
    # governor decides between steps, so it cannot split one.
    assume(ambient + idle_w * r_th <= ceiling - 1.0)
    assume(active_w * r_th * (1.0 - math.exp(-step_s / tau)) <= 5.0)
    assume(active_w * step_s / (capacity_wh * 3600.0) * 100.0 <= 1.0)
    start = min(floor + start_above_floor, 100.0)
    clock = VirtualClock()
    dev = SimulatedDevice(
        SimulatedDeviceParams(
            capacity_wh=capacity_wh,
            battery_percent=start,
            plugged=plugged,
            charge_power_w=charge_w,
            idle_power_w=idle_w,
            active_power_w=active_w,
            seconds_per_unit=per_unit_s,
            thermal=ThermalParams(ambient, r_th, tau),
        ),
        clock,
    )
    gov = Governor(dev, _policy(floor, ceiling, budget=RoundBudget(max_steps=1500)), clock)
    report = _train(dev, gov, units)
    assert dev.max_temperature_c <= ceiling + 1.0, report
    assert dev.min_battery_percent >= floor, report
    assert report.steps_done >= 1  # it did train: the invariant is not won by idling
    assert report.stop_reason in {
        StopReason.COMPLETED,
        StopReason.BATTERY_FLOOR,
        StopReason.THERMAL_CEILING,
    }


def test_battery_floor_stops_before_the_floor() -> None:
    clock = VirtualClock()
    dev = _hot_device(clock, capacity_wh=0.5, battery_percent=30.0, active_power_w=3.0)
    gov = Governor(dev, _policy(floor=25.0), clock)
    report = _train(dev, gov)
    assert report.stop_reason is StopReason.BATTERY_FLOOR
    assert 25.0 <= dev.min_battery_percent < 25.5
    with pytest.raises(GovernorStopped) as err:
        gov.raise_if_stopped()
    assert (
        isinstance(err.value, BudgetExceeded) and err.value.report.steps_done == report.steps_done
    )
    assert not gov.before_step()  # stays stopped


def test_plugged_device_below_floor_trains_while_charging() -> None:
    clock = VirtualClock()
    dev = _hot_device(clock, battery_percent=10.0, plugged=True, charge_power_w=20.0)
    report = _train(
        dev, Governor(dev, _policy(floor=20.0, budget=RoundBudget(max_steps=300)), clock)
    )
    assert report.stop_reason is StopReason.COMPLETED
    assert dev.read().battery_percent > 10.0


def test_time_and_energy_budgets() -> None:
    clock = VirtualClock()
    cool = ThermalParams(ambient_c=25.0, r_th_c_per_w=1.0, tau_s=30.0)  # never throttles
    dev = _hot_device(clock, thermal=cool)
    report = _train(dev, Governor(dev, _policy(budget=RoundBudget(time_s=30.0)), clock))
    assert report.stop_reason is StopReason.TIME_BUDGET
    assert report.elapsed_s <= 30.0 and report.paused_s == 0.0
    # 0.2 s steps; the 150th would end at 30.0 s, past the budget with the 1.25 safety factor.
    assert report.steps_done == 149

    clock = VirtualClock()
    dev = _hot_device(clock)
    report = _train(dev, Governor(dev, _policy(budget=RoundBudget(energy_j=100.0)), clock))
    assert report.stop_reason is StopReason.ENERGY_BUDGET
    assert report.energy_j is not None and report.energy_j <= 100.0
    assert report.steps_done == 62  # 1.6 J per step; the 63rd would reach 100.8 J


def test_energy_budget_needs_a_measure() -> None:
    clock = VirtualClock()
    prov = StaticProvider(DeviceState(battery_percent=None, temperature_c=30.0))
    with pytest.raises(ConfigError, match="joules_per_unit"):
        Governor(prov, _policy(budget=RoundBudget(energy_j=10.0)), clock).before_step()
    policy = _policy(budget=RoundBudget(energy_j=10.0), pacing=PacingConfig(joules_per_unit=0.5))
    report = run_governed(Governor(prov, policy, clock), lambda: 3.0)
    assert report.stop_reason is StopReason.ENERGY_BUDGET
    assert report.steps_done == 6 and report.energy_j == 9.0


def test_hot_ambient_stops_at_once() -> None:
    clock = VirtualClock()
    dev = _hot_device(clock, thermal=ThermalParams(ambient_c=47.0, r_th_c_per_w=4.0, tau_s=30.0))
    report = _train(dev, Governor(dev, _policy(), clock))
    assert report.steps_done == 0 and report.stop_reason is StopReason.THERMAL_CEILING


def test_cannot_cool_enough_stops_after_max_cooldown() -> None:
    # Idle draw alone settles at 25 + 4.9 * 4 = 44.6 °C: a 1 °C prior rise never fits.
    clock = VirtualClock()
    dev = _hot_device(clock, idle_power_w=4.9, temperature_c=44.5)
    policy = _policy(pacing=PacingConfig(max_cooldown_s=120.0))
    report = _train(dev, Governor(dev, policy, clock))
    assert report.stop_reason is StopReason.THERMAL_CEILING
    assert report.steps_done == 0 and report.paused_s == pytest.approx(120.0)
    assert "cooling" in report.detail


def test_out_of_order_calls_are_refused() -> None:
    clock = VirtualClock()
    gov = Governor(_hot_device(clock), _policy(), clock)
    with pytest.raises(GovernorUsageError):
        gov.after_step(1.0)
    assert gov.before_step()
    with pytest.raises(GovernorUsageError):
        gov.before_step()


def _utc(hour: int) -> float:
    return datetime(2026, 3, 10, hour, tzinfo=UTC).timestamp()


def test_stops_when_the_window_closes_and_resumes_in_the_next_one() -> None:
    clock = VirtualClock(wall_origin=_utc(5) + 3000.0)  # 05:50 UTC; the window ends 06:00
    dev = _hot_device(
        clock, battery_percent=100.0, capacity_wh=200.0, seconds_per_unit=1.0, active_power_w=2.0
    )
    policy = _policy(
        window=DailyWindow(start="01:00", end="06:00", tz="UTC"),
        budget=RoundBudget(max_steps=1000),
    )
    first = _train(dev, Governor(dev, policy, clock))
    assert first.stop_reason is StopReason.INELIGIBLE
    assert [r.split(":")[0] for r in first.reasons] == ["window"]
    assert first.steps_done == 600  # 1 s steps for ten minutes
    assert first.resume_at_wall_s == _utc(1) + 86400

    decision = wait_until_eligible(dev, policy, clock, poll_s=60.0)
    assert decision.eligible and clock.wall() == _utc(1) + 86400

    second = _train(dev, Governor(dev, policy, clock, carry_over=first))
    assert second.stop_reason is StopReason.COMPLETED
    assert second.steps_done == 1000 and second.remaining_steps == 0


def test_wait_until_eligible_polls_while_charging() -> None:
    clock = VirtualClock()
    dev = _hot_device(
        clock, battery_percent=10.0, capacity_wh=1.0, plugged=True, charge_power_w=5.0
    )
    policy = _policy(floor=20.0)
    # Charging beats the floor: eligible at once.
    assert wait_until_eligible(dev, policy, clock).eligible and clock.monotonic() == 0.0
    dev.set_plugged(False)
    # On battery below the floor and never charging: the wait times out, not eligible.
    d = wait_until_eligible(dev, policy, clock, poll_s=60.0, timeout_s=600.0)
    assert not d.eligible and [r.code for r in d.reasons] == ["battery"]
    assert clock.monotonic() == pytest.approx(600.0)
    dev.set_plugged(True)
    hot = _hot_device(VirtualClock(), temperature_c=44.0)
    d = wait_until_eligible(hot, policy, hot.clock, poll_s=10.0, thermal_margin_c=5.0)
    assert d.eligible and hot.read().temperature_c < 40.0 and hot.clock.monotonic() > 0


def test_decide_is_a_pure_function_of_its_inputs() -> None:
    from orchard.edge_runtime.governor import Action, decide

    policy = _policy(floor=20.0, ceiling=45.0, budget=RoundBudget(max_steps=10))
    est = StepEstimate(rise_c=0.5, drop_percent=0.2, energy_j=1.0, seconds=0.1)
    cool = DeviceState(battery_percent=50.0, charging=False, temperature_c=40.0)
    kw = dict(wall_s=0.0, elapsed_s=0.0, energy_used_j=0.0)

    def act(state: DeviceState, steps: int = 0) -> tuple[Action, StopReason | None]:
        d = decide(state, policy, est, steps_done=steps, **kw)  # type: ignore[arg-type]
        return d.action, d.reason

    assert act(cool) == (Action.RUN, None)
    assert act(cool, steps=10) == (Action.STOP, StopReason.COMPLETED)
    assert act(DeviceState(battery_percent=50.0, temperature_c=44.6)) == (Action.COOL, None)
    assert act(DeviceState(battery_percent=50.0, temperature_c=45.0)) == (
        Action.STOP,
        StopReason.THERMAL_CEILING,
    )
    assert act(DeviceState(battery_percent=20.1, charging=False, temperature_c=30.0)) == (
        Action.STOP,
        StopReason.BATTERY_FLOOR,
    )


def _reference_estimate(history, next_units, pacing, charging, rests):
    """The estimate written plainly: each maximum on its own over a filtered list."""

    def worst(samples, attr, per):
        vals = [getattr(s, attr) / getattr(s, per) for s in samples
                if getattr(s, attr) is not None and getattr(s, per) > 0]
        return max(vals) if vals else None

    k = pacing.safety_factor
    recent, recent_rests = list(history)[-pacing.history:], list(rests)[-pacing.history:]
    rise, drop = worst(recent, "rise_c", "units"), worst(recent, "drop_percent", "units")
    energy, seconds = worst(recent, "energy_j", "units"), worst(recent, "seconds", "units")
    if energy is None and pacing.joules_per_unit is not None:
        energy = pacing.joules_per_unit
    prior_drop = 0.0 if charging else pacing.prior_drop_percent
    drain = worst(recent + recent_rests, "drop_percent", "seconds")
    if drain is None:
        drain = prior_drop / pacing.cooldown_quantum_s
    power = worst(recent + recent_rests, "energy_j", "seconds") or 0.0
    return StepEstimate(
        rise_c=pacing.prior_rise_c if rise is None else k * max(rise, 0.0) * next_units,
        drop_percent=prior_drop if drop is None else k * max(drop, 0.0) * next_units,
        energy_j=0.0 if energy is None else k * max(energy, 0.0) * next_units,
        seconds=0.0 if seconds is None else k * seconds * next_units,
        drain_percent_per_s=k * max(drain, 0.0),
        energy_j_per_s=k * max(power, 0.0),
    )


_maybe = st.one_of(st.none(), st.floats(-5.0, 5.0, allow_nan=False))
_sample = st.builds(StepSample, units=st.sampled_from([0.0, 0.5, 1.0, 10.0]), seconds=st.floats(0.0, 3.0),
                    rise_c=_maybe, drop_percent=_maybe, energy_j=_maybe)


@settings(max_examples=300, deadline=None)
@given(history=st.lists(_sample, max_size=12), rests=st.lists(_sample, max_size=12),
       next_units=st.floats(0.0, 20.0), charging=st.sampled_from([None, False, True]),
       window=st.integers(1, 8), joules=st.sampled_from([None, 2.5]))
def test_property_estimate_matches_plain_reference(history, rests, next_units, charging, window, joules) -> None:
    pacing = PacingConfig(history=window, joules_per_unit=joules)
    got = estimate_next_step(history, next_units, pacing, charging, rests)
    assert got == _reference_estimate(history, next_units, pacing, charging, rests)
