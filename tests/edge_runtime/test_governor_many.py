"""``govern_many`` (the governor over many simulated devices, as columns) is the
governor: on random devices and policies it gives every device the seconds, steps and
state that one ``Governor`` a device gives it under ``run_governed``, bit for bit."""

from __future__ import annotations

import math

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from orchard.config import EligibilityConfig
from orchard.edge_runtime.clock import VirtualClock
from orchard.edge_runtime.device import SimulatedDevice, SimulatedDeviceParams, ThermalParams
from orchard.edge_runtime.governor import Governor, run_governed
from orchard.edge_runtime.governor_many import govern_many
from orchard.edge_runtime.policy import DailyWindow, DevicePolicy, PacingConfig, RoundBudget

_T0 = 1_750_000_000.0  # a wall-clock origin (2025-06-15 15:06:40 UTC)


def _device(draw: st.DrawFn) -> SimulatedDevice:
    f = st.floats
    params = SimulatedDeviceParams(
        capacity_wh=draw(f(0.05, 20.0)), battery_percent=draw(f(0.0, 100.0)), plugged=draw(st.booleans()),
        charge_power_w=draw(f(0.0, 10.0)), idle_power_w=draw(f(0.0, 2.0)), active_power_w=draw(f(0.0, 12.0)),
        seconds_per_unit=draw(f(0.001, 2.0)),
        thermal=ThermalParams(ambient_c=draw(f(10.0, 40.0)), r_th_c_per_w=draw(f(0.0, 8.0)), tau_s=draw(f(1.0, 120.0))),
        temperature_c=draw(st.none() | f(15.0, 60.0)), unmetered_network=draw(st.booleans() | st.none()),
        idle=draw(st.booleans() | st.none()))
    clock = VirtualClock(start=draw(f(0.0, 1e4)), wall_origin=_T0 + draw(f(0.0, 86_400.0)))
    dev = SimulatedDevice(params, clock)
    clock.advance(draw(f(0.0, 600.0)))  # at rest since it was last read: caught up at its first reading
    return dev


def _mostly(value: bool) -> st.SearchStrategy[bool]:
    return st.sampled_from([value, value, value, not value])


def _policy(draw: st.DrawFn) -> DevicePolicy:
    f, opt = st.floats, st.none
    window = draw(opt() | opt() | st.sampled_from([DailyWindow(start="01:00", end="06:00", tz="UTC"),
                                           DailyWindow(start="22:00", end="21:00", tz="UTC")]))
    return DevicePolicy(
        eligibility=EligibilityConfig(min_battery_percent=draw(f(0.0, 40.0)), allow_on_battery=draw(_mostly(True)),
                                      max_temperature_c=draw(f(30.0, 60.0)), require_unmetered=draw(_mostly(False)),
                                      require_idle=draw(_mostly(False))),
        window=window,
        budget=RoundBudget(max_steps=draw(st.integers(1, 12)), time_s=draw(opt() | f(0.5, 600.0)),
                           energy_j=draw(opt() | f(0.5, 500.0))),
        pacing=PacingConfig(hard_ceiling_c=draw(opt() | f(30.0, 60.0)), throttle_band_c=draw(f(0.5, 30.0)),
                            min_duty=draw(f(0.05, 1.0)), cooldown_quantum_s=draw(f(0.5, 30.0)),
                            max_cooldown_s=draw(f(0.0, 120.0)), prior_rise_c=draw(f(0.0, 3.0)),
                            prior_drop_percent=draw(f(0.0, 3.0)), safety_factor=draw(f(1.0, 2.0)),
                            history=draw(st.integers(1, 4)), joules_per_unit=draw(opt() | f(0.01, 5.0))))


@st.composite
def _runs(draw: st.DrawFn) -> list[tuple[SimulatedDevice, DevicePolicy, int, float]]:
    shared = _policy(draw)  # devices of a kind share a policy object, as in the simulator
    out = []
    for _ in range(draw(st.integers(1, 6))):
        policy = shared if draw(st.booleans()) else _policy(draw)
        per_step = draw(st.integers(0, 32))
        out.append((_device(draw), policy, per_step, draw(st.floats(0.0, 0.5))))
    return out


def _one(device: SimulatedDevice, policy: DevicePolicy, per_step: int, seconds_per_example: float
         ) -> tuple[float, int]:
    gov = Governor(device, policy, device.clock)

    def step() -> float:
        device.work(per_step * seconds_per_example)
        return float(per_step)

    report = run_governed(gov, step)
    return report.elapsed_s, report.steps_done


def _copy(dev: SimulatedDevice) -> SimulatedDevice:
    return SimulatedDevice.from_snapshot(dev.params, dev.snapshot())


def _same(a: float, b: float) -> bool:
    return a == b or (math.isnan(a) and math.isnan(b))


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_runs())
def test_batch_equals_one_governor_a_device(runs: list[tuple[SimulatedDevice, DevicePolicy, int, float]]) -> None:
    alone = [_copy(d) for d, *_ in runs]
    expected = [_one(d, policy, per_step, spe) for d, (_, policy, per_step, spe) in zip(alone, runs, strict=True)]
    batch = [d for d, *_ in runs]
    secs, steps = govern_many(batch, [r[1] for r in runs], [float(r[2]) for r in runs], [r[2] * r[3] for r in runs])
    assert list(zip(secs, steps, strict=True)) == expected
    for d, ref in zip(batch, alone, strict=True):
        got, want = d.snapshot(), ref.snapshot()
        assert all(_same(x, y) for x, y in zip(got[:-1], want[:-1], strict=True)), (got, want)
        assert got[-1] == want[-1]


def test_the_batch_checks_its_inputs() -> None:
    dev = SimulatedDevice(SimulatedDeviceParams(), VirtualClock())
    with pytest.raises(ValueError, match="one policy"):
        govern_many([dev], [], [1.0], [1.0])
    with pytest.raises(ValueError, match=">= 0"):
        govern_many([dev], [DevicePolicy(budget=RoundBudget(max_steps=1))], [1.0], [-1.0])
    assert govern_many([], [], [], []) == ([], [])
