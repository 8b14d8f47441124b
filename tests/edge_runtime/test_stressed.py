"""The stressed device (two-node thermal, lagging and noisy sensor, varying step cost,
voltage sag) and the governor's margin for a sensor that lags and is noisy."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from orchard.config import EligibilityConfig
from orchard.edge_runtime.clock import VirtualClock
from orchard.edge_runtime.governor import Governor, run_governed
from orchard.edge_runtime.pacing import SensorLog, sensor_margin
from orchard.edge_runtime.policy import DevicePolicy, PacingConfig, RoundBudget
from orchard.edge_runtime.stressed import StressedDevice, StressParams
from orchard.errors import ConfigError

# Full load: the body heads for 30 + 10 * 8 = 110 °C within seconds, the die 6 °C above it.
HOT = StressParams(ambient_c=30.0, r_body_ambient_c_per_w=8.0, r_die_body_c_per_w=0.6, tau_die_s=2.0,
                   tau_body_s=20.0, active_power_w=10.0, seconds_per_unit=0.1, capacity_wh=10.0,
                   battery_percent=80.0)


def _device(params: StressParams, seed: int = 0) -> tuple[StressedDevice, VirtualClock]:
    clock = VirtualClock()
    return StressedDevice(params, clock, np.random.default_rng(seed)), clock


def test_two_nodes_settle_at_their_steady_state_and_the_die_leads_the_body() -> None:
    dev, clock = _device(HOT)
    dev.work(5.0)  # 0.5 s at full power: the die has moved, the body has not caught up
    die, body = dev._x
    assert die - 30.0 > 2 * (body - 30.0) > 0
    for _ in range(10000):
        dev.work(1.0)  # 1,000 s: the slower mode (a little slower than the body's own 20 s) has settled
    die, body = dev._x
    assert body == pytest.approx(30.0 + 10.0 * 8.0, abs=1e-3)
    assert die == pytest.approx(body + 10.0 * 0.6, abs=1e-3)
    assert dev.max_temperature_c == pytest.approx(die, abs=1e-3)


def test_the_die_peak_inside_an_interval_counts() -> None:
    # Hot die over a cold body, at rest: the die only falls, and the peak is the start.
    # The reverse -- a die heated from below by a hot body -- rises inside the pause.
    dev, clock = _device(HOT)
    dev._x = np.array([40.0, 60.0])
    dev.max_temperature_c = 40.0
    clock.advance(30.0)
    dev.read()
    assert dev.max_temperature_c > 45.0 and dev.max_temperature_c > float(dev._x[0])


def test_the_sensor_reports_the_die_as_it_was_lag_seconds_ago_within_the_noise() -> None:
    lagged, clock = _device(dataclasses.replace(HOT, sensor_lag_s=3.0))
    truth: list[tuple[float, float]] = []
    for _ in range(80):
        lagged.work(1.0)
        truth.append((clock.monotonic(), float(lagged._x[0])))
    reading = lagged.read().temperature_c
    t_then = clock.monotonic() - 3.0
    assert reading == pytest.approx(next(v for t, v in truth if abs(t - t_then) < 1e-9), abs=1e-9)
    assert reading < float(lagged._x[0]) - 4.0
    noisy, _ = _device(dataclasses.replace(HOT, sensor_noise_c=0.5))
    errors = []
    for _ in range(400):
        noisy.work(1.0)
        errors.append(noisy.read().temperature_c - float(noisy._x[0]))  # type: ignore[operator]
    assert max(map(abs, errors)) <= 0.5 and max(errors) > 0.4 and min(errors) < -0.4


def test_step_cost_varies_within_its_range_and_the_battery_sags_under_load() -> None:
    dev, clock = _device(dataclasses.replace(HOT, step_cost_range=(0.5, 3.0)))
    took = [dev.work(1.0) for _ in range(300)]
    assert 0.05 <= min(took) < 0.07 and 0.28 < max(took) <= 0.3
    sag, clock = _device(dataclasses.replace(HOT, sag_percent_per_w=0.4))
    rested = sag.read().battery_percent
    for _ in range(100):
        sag.work(1.0)
    loaded = sag.read().battery_percent
    clock.advance(60.0)
    recovered = sag.read().battery_percent
    assert rested is not None and loaded is not None and recovered is not None
    assert loaded < rested - 3.0 and recovered > loaded + 3.0
    assert sag.min_loaded_battery_percent == pytest.approx(loaded, abs=1e-9)
    with pytest.raises(ConfigError, match="step_cost_range"):
        StressParams(step_cost_range=(3.0, 0.5))


# A device whose body heats fast (25 s) while its governor has throttled: a heating rate
# read off its recent, mostly resting windows understates a step's, which the governor
# once kept only for its last few estimates (benchmarks/edge.py --stress, device 67).
FAST_BODY = StressParams(ambient_c=22.8, r_body_ambient_c_per_w=7.75, r_die_body_c_per_w=0.217, tau_die_s=1.26,
                         tau_body_s=25.0, active_power_w=9.77, seconds_per_unit=0.149, capacity_wh=12.4,
                         battery_percent=84.0)


@pytest.mark.parametrize(("params", "lag", "noise"), [(HOT, 3.0, 0.5), (HOT, 10.0, 0.5), (FAST_BODY, 10.0, 0.0)])
def test_the_governor_keeps_the_die_under_the_ceiling_when_told_the_sensors_lag_and_noise(
        params: StressParams, lag: float, noise: float) -> None:
    """The regression: without the margin (the sensor's lag and noise not stated) the
    governor steps on readings that are ``lag`` seconds old and overshoots; with it, the
    die stays under the ceiling."""
    overshoot = {}
    for aware in (False, True):
        pacing = PacingConfig(sensor_lag_s=lag if aware else 0.0, sensor_noise_c=noise if aware else 0.0)
        policy = DevicePolicy(eligibility=EligibilityConfig(min_battery_percent=20.0, max_temperature_c=45.0),
                              budget=RoundBudget(max_steps=300), pacing=pacing)
        dev, clock = _device(dataclasses.replace(params, sensor_lag_s=lag, sensor_noise_c=noise))
        report = run_governed(Governor(dev, policy, clock), lambda d=dev: d.work(1.0) and 1.0)
        overshoot[aware] = dev.max_temperature_c - 45.0
        if aware:
            assert report.steps_done == 300
    assert overshoot[False] > 1.0 and overshoot[True] <= 0.0, overshoot


def test_sensor_margin_counts_unseen_work_at_the_rate_the_readings_show() -> None:
    log = SensorLog(60.0)
    for i in range(100):  # 0.1 s steps back to back, the reading rising 0.5 °C a step
        log.step(0.1 * i, 0.1 * (i + 1))
        log.reading(0.1 * (i + 1), 30.0 + 0.5 * (i + 1))
    rate = log.heating_rate(lag_s=2.0, noise_c=0.0, span_s=2.0)
    assert rate == pytest.approx(5.0)  # 0.5 °C per 0.1 s of work
    assert log.work_between(8.0, 10.0) == pytest.approx(2.0) and log.steps_after(8.0) == 20
    p = PacingConfig(sensor_lag_s=2.0, sensor_noise_c=0.5, safety_factor=1.25)
    assert sensor_margin(rate, 2.0, 20, 0.1, p) == pytest.approx(0.5 + 1.25 * 5.0 * 2.1)
    assert sensor_margin(None, 2.0, 20, 0.1, p) == pytest.approx(0.5 + 1.25 * p.prior_rise_c * 21)
    assert sensor_margin(rate, 2.0, 20, 0.1, PacingConfig(sensor_noise_c=0.5)) == 0.5  # no lag: the noise alone
