"""A simulated device with the physics a real one adds to :class:`SimulatedDevice`: a
two-node thermal model, a temperature sensor that lags and is noisy, steps whose cost
varies, and a battery whose reading sags under load.

The stresses live here, in the device, and the governor sees only what :meth:`read`
returns: the sensor's reading, never the die's temperature. ``max_temperature_c`` and
``min_loaded_battery_percent`` are the truth a benchmark scores against.

Thermal. Power ``P`` enters the die (heat capacity ``C_d``), which leaks through
``R_db`` into the body (``C_b``), which leaks through ``R_ba`` to ambient::

    C_d dT_d/dt = P - (T_d - T_b) / R_db
    C_b dT_b/dt = (T_d - T_b) / R_db - (T_b - T_a) / R_ba

At constant power the state moves exactly as ``x(t) = x_ss + V e^(Lambda t) V^-1 (x0 -
x_ss)`` (the system matrix's eigenvectors ``V``, eigenvalues ``Lambda``, both real and
negative), so a long pause or a long step is integrated in one go. The die's temperature
is a sum of two exponentials in each interval: its maximum is at an end or at the one
point where the derivative vanishes, which is checked too.

Sensor. The reading is the die's temperature ``lag_s`` seconds ago (a transport delay:
the thermistor sits away from the hot spot) plus noise uniform in ``[-noise_c,
noise_c]``, drawn from the device's own generator.

Steps. ``work(units)`` takes ``units * seconds_per_unit * f`` seconds at active power,
``f`` uniform in ``step_cost_range`` for each call (the same batch costs more when the
kernel is descheduled, the cache is cold, the radio is busy).

Battery. The charge falls by the power drawn. Under load the terminal voltage sags, so
the charge a device can still use is lower by ``sag_percent_per_w`` times the power, as
filtered by the battery's own time constant ``sag_tau_s`` (the voltage recovers at
rest). The reading is that loaded level, and so is the floor's truth.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from orchard.errors import ConfigError
from orchard.typing import DeviceState

from .clock import VirtualClock


@dataclass(frozen=True)
class StressParams:
    """One stressed device. Thermal: die and body nodes (see the module docstring)."""

    ambient_c: float = 25.0
    r_die_body_c_per_w: float = 0.5
    r_body_ambient_c_per_w: float = 4.0
    tau_die_s: float = 2.0  # C_d * R_db
    tau_body_s: float = 60.0  # C_b * R_ba
    idle_power_w: float = 0.3
    active_power_w: float = 8.0
    seconds_per_unit: float = 0.2
    capacity_wh: float = 10.0
    battery_percent: float = 80.0
    sensor_lag_s: float = 0.0
    sensor_noise_c: float = 0.0
    step_cost_range: tuple[float, float] = (1.0, 1.0)
    sag_percent_per_w: float = 0.0
    sag_tau_s: float = 5.0

    def __post_init__(self) -> None:
        problems = [f"{k} must be > 0, got {getattr(self, k)}" for k in (
            "r_die_body_c_per_w", "r_body_ambient_c_per_w", "tau_die_s", "tau_body_s", "seconds_per_unit",
            "capacity_wh", "sag_tau_s") if not getattr(self, k) > 0]
        problems += [f"{k} must be >= 0, got {getattr(self, k)}" for k in (
            "idle_power_w", "active_power_w", "sensor_lag_s", "sensor_noise_c", "sag_percent_per_w")
            if not getattr(self, k) >= 0]
        lo, hi = self.step_cost_range
        if not 0 < lo <= hi:
            problems.append(f"step_cost_range must be (low, high) with 0 < low <= high, got {self.step_cost_range}")
        if not 0.0 <= self.battery_percent <= 100.0:
            problems.append(f"battery_percent must be in [0, 100], got {self.battery_percent}")
        if problems:
            raise ConfigError(problems)


class StressedDevice:
    """A :class:`~orchard.edge_runtime.device.DeviceStateProvider` on a virtual clock,
    with the stresses of :class:`StressParams`; ``work`` runs a step, as
    :class:`~orchard.edge_runtime.device.SimulatedDevice`'s does."""

    def __init__(self, params: StressParams, clock: VirtualClock, rng: np.random.Generator) -> None:
        p = self.params = params
        self.clock, self._rng = clock, rng
        c_d = p.tau_die_s / p.r_die_body_c_per_w
        c_b = p.tau_body_s / p.r_body_ambient_c_per_w
        a = np.array([[-1 / (c_d * p.r_die_body_c_per_w), 1 / (c_d * p.r_die_body_c_per_w)],
                      [1 / (c_b * p.r_die_body_c_per_w),
                       -1 / (c_b * p.r_die_body_c_per_w) - 1 / (c_b * p.r_body_ambient_c_per_w)]])
        lam, vec = np.linalg.eig(a)
        self._lam, self._vec, self._inv = lam.real, vec.real, np.linalg.inv(vec.real)
        self._x = np.array([p.ambient_c, p.ambient_c])
        self._t = clock.monotonic()
        # (start, state at start, power, duration) of the intervals the sensor may still
        # report from: the reading at t is the die at t - lag.
        self._segments: list[tuple[float, np.ndarray, float, float]] = []
        self._battery_j = p.battery_percent / 100.0 * p.capacity_wh * 3600.0
        self._p_filtered = p.idle_power_w  # the sag's view of the power drawn
        self.max_temperature_c = float(self._x[0])
        self.min_loaded_battery_percent = self.loaded_battery_percent()

    # -- physics

    def _steady(self, power_w: float) -> np.ndarray:
        p = self.params
        body = p.ambient_c + power_w * p.r_body_ambient_c_per_w
        return np.array([body + power_w * p.r_die_body_c_per_w, body])

    def _at(self, x0: np.ndarray, power_w: float, dt: float) -> np.ndarray:
        ss = self._steady(power_w)
        return ss + self._vec @ (np.exp(self._lam * dt) * (self._inv @ (x0 - ss)))

    def _die_peak(self, x0: np.ndarray, power_w: float, dt: float) -> float:
        """The die's highest temperature over ``[0, dt]`` at constant power."""
        ss = self._steady(power_w)
        a1, a2 = self._vec[0] * (self._inv @ (x0 - ss))
        l1, l2 = self._lam
        ends = max(float(x0[0]), float(self._at(x0, power_w, dt)[0]))
        ratio = -(a2 * l2) / (a1 * l1) if a1 * l1 != 0 else -1.0
        if ratio > 0 and l1 != l2:
            t = math.log(ratio) / (l1 - l2)
            if 0.0 < t < dt:
                ends = max(ends, float(self._at(x0, power_w, t)[0]))
        return ends

    def _integrate(self, dt: float, power_w: float) -> None:
        if dt <= 0:
            return
        p = self.params
        self.max_temperature_c = max(self.max_temperature_c, self._die_peak(self._x, power_w, dt))
        self._segments.append((self._t, self._x.copy(), power_w, dt))
        horizon = self._t + dt - p.sensor_lag_s - 1.0
        while len(self._segments) > 1 and self._segments[1][0] <= horizon:
            self._segments.pop(0)
        self._x = self._at(self._x, power_w, dt)
        # The loaded level is lowest at an end of the interval (the charge falls
        # linearly while the sag moves exponentially towards its new level).
        before = self.loaded_battery_percent()
        self._battery_j = max(0.0, self._battery_j - power_w * dt)
        self._p_filtered = power_w + (self._p_filtered - power_w) * math.exp(-dt / p.sag_tau_s)
        self.min_loaded_battery_percent = min(self.min_loaded_battery_percent, before,
                                              self.loaded_battery_percent())
        self._t += dt

    def _catch_up(self) -> None:
        now = self.clock.monotonic()
        self._integrate(now - self._t, self.params.idle_power_w)
        self._t = now

    def _die_at(self, t: float) -> float:
        """The die's temperature at ``t`` (the past or now)."""
        if t >= self._t or not self._segments:
            return float(self._x[0])
        for start, x0, power_w, dt in reversed(self._segments):
            if start <= t:
                return float(self._at(x0, power_w, min(t - start, dt))[0])
        return float(self._segments[0][1][0])  # before the first interval kept: the device as it started

    def loaded_battery_percent(self) -> float:
        p = self.params
        true = 100.0 * self._battery_j / (p.capacity_wh * 3600.0)
        return true - p.sag_percent_per_w * self._p_filtered

    # -- the device's interface

    def work(self, units: float) -> float:
        """Run ``units`` of work at active power; advances the clock. Returns seconds taken."""
        if units < 0:
            raise ValueError(f"work units must be >= 0, got {units}")
        self._catch_up()
        lo, hi = self.params.step_cost_range
        dt = units * self.params.seconds_per_unit * (lo if lo == hi else float(self._rng.uniform(lo, hi)))
        self._integrate(dt, self.params.active_power_w)
        self.clock.advance(dt)
        self._t = self.clock.monotonic()
        return dt

    def read(self) -> DeviceState:
        """What the device's sensors say: the lagged, noisy temperature and the loaded
        battery level. No energy counter (most phones have none)."""
        self._catch_up()
        p = self.params
        temp = self._die_at(self._t - p.sensor_lag_s)
        if p.sensor_noise_c > 0:
            temp += float(self._rng.uniform(-p.sensor_noise_c, p.sensor_noise_c))
        return DeviceState(battery_percent=self.loaded_battery_percent(), charging=False, temperature_c=temp,
                           unmetered_network=True, idle=True)
