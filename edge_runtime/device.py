"""Device state providers: where a client learns its battery, charging, temperature,
network and idleness (ARCHITECTURE section 4).

Every provider has one method, ``read() -> DeviceState``, and nothing else: the
budget policy and the governor (``policy.py``, ``governor.py``) take the state as a
value and never touch sysfs, psutil or a simulator themselves.

- :class:`SysfsProvider` reads Linux ``/sys/class/power_supply`` and
  ``/sys/class/thermal`` (the root is configurable, so tests point it at a fake tree).
- :class:`PsutilProvider` uses ``psutil.sensors_battery`` / ``sensors_temperatures``
  where the platform has them.
- :class:`StaticProvider` returns a fixed state from configuration (mains-powered
  boxes without sensors, or tests).
- :class:`SimulatedDevice` integrates a battery and a first-order thermal model on an
  explicit :class:`~orchard.edge_runtime.clock.VirtualClock`.

A reading that is unknown is ``None``, never a guess: the policy decides what an
unknown means.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import numpy as np

from orchard.errors import ConfigError, OrchardError
from orchard.typing import DeviceState

from .clock import VirtualClock


class DeviceStateUnavailable(OrchardError):
    """A provider cannot read the device at all (missing sysfs root, no psutil sensors)."""


@runtime_checkable
class DeviceStateProvider(Protocol):
    def read(self) -> DeviceState: ...


# --------------------------------------------------------------------------- sysfs

# Status strings the kernel's power_supply class reports
# (Documentation/ABI/testing/sysfs-class-power).
_ON_EXTERNAL_POWER = {"Charging", "Full"}
_ON_BATTERY = {"Discharging"}
# "Not charging": plugged in but the charger holds the battery (e.g. at a charge
# threshold). It is on external power only if a mains/USB supply says it is online.
_AMBIGUOUS = {"Not charging"}

# Zones that report nonsense are common (-273 °C, 0, or > 150 °C from unconnected
# sensors); readings outside this band are ignored rather than trusted.
_PLAUSIBLE_C = (-40.0, 150.0)


def _read_text(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except OSError:  # EIO/ENODEV from a sensor that is present but unreadable
        return None


def _read_float(path: Path) -> float | None:
    text = _read_text(path)
    if text is None:
        return None
    try:
        return float(text)
    except ValueError:
        return None


@dataclass(frozen=True)
class SysfsProvider:
    """Battery and temperature from Linux sysfs.

    ``root`` is the sysfs mount point (``/sys`` on a device; a temporary folder laid out
    the same way in tests). ``thermal_types`` keeps only zones whose ``type`` file is in
    the set (e.g. ``{"x86_pkg_temp", "cpu-thermal"}``); None keeps every zone. The
    temperature is the maximum over kept zones: the hottest part is what throttles.

    sysfs says nothing about metered networks or user activity, so ``unmetered_network``
    is passed in (from configuration); ``idle`` comes from the 1-minute load average in
    ``proc_root/loadavg`` when ``idle_max_load`` is set, else from ``idle``.
    """

    root: Path = Path("/sys")
    thermal_types: frozenset[str] | None = None
    unmetered_network: bool | None = None
    idle: bool | None = None
    idle_max_load: float | None = None
    proc_root: Path = Path("/proc")

    def read(self) -> DeviceState:
        root = Path(self.root)
        if not root.is_dir():
            raise DeviceStateUnavailable(
                f"sysfs root {root} does not exist: mount sysfs or pass the right root"
            )
        battery, charging = self._power(root / "class" / "power_supply")
        return DeviceState(
            battery_percent=battery,
            charging=charging,
            temperature_c=self._temperature(root / "class" / "thermal"),
            unmetered_network=self.unmetered_network,
            idle=self._idle(),
            extra=self._energy(root / "class" / "powercap"),
        )

    def _power(self, base: Path) -> tuple[float | None, bool | None]:
        if not base.is_dir():
            return None, None
        capacities: list[float] = []
        energy_now = energy_full = 0.0
        energy_complete = True
        statuses: list[str] = []
        mains_online: bool | None = None
        for supply in sorted(base.iterdir()):
            kind = _read_text(supply / "type")
            if kind == "Battery":
                cap = _read_float(supply / "capacity")
                if cap is None:
                    continue
                capacities.append(min(max(cap, 0.0), 100.0))
                status = _read_text(supply / "status")
                if status:
                    statuses.append(status)
                now, full = _read_float(supply / "energy_now"), _read_float(supply / "energy_full")
                if now is None or not full:
                    energy_complete = False
                else:
                    energy_now += now
                    energy_full += full
            elif kind in {"Mains", "USB", "USB_C", "USB_PD", "Wireless"}:
                online = _read_float(supply / "online")
                if online is not None:
                    mains_online = bool(mains_online) or online >= 1
        if not capacities:
            # No battery: a mains-powered box if a supply says so, else unknown.
            return None, (True if mains_online else None)
        # Several batteries (some laptops): weight by their energy when every one says
        # how much it holds, otherwise average the percentages.
        if energy_complete and energy_full > 0:
            battery = 100.0 * energy_now / energy_full
        else:
            battery = sum(capacities) / len(capacities)
        charging: bool | None
        if any(s in _ON_EXTERNAL_POWER for s in statuses):
            charging = True
        elif any(s in _AMBIGUOUS for s in statuses):
            charging = bool(mains_online)
        elif any(s in _ON_BATTERY for s in statuses):
            charging = False
        else:
            charging = mains_online
        return battery, charging

    def _temperature(self, base: Path) -> float | None:
        if not base.is_dir():
            return None
        best: float | None = None
        for zone in sorted(base.glob("thermal_zone*")):
            if (
                self.thermal_types is not None
                and _read_text(zone / "type") not in self.thermal_types
            ):
                continue
            milli = _read_float(zone / "temp")  # millidegrees Celsius
            if milli is None:
                continue
            celsius = milli / 1000.0
            if not _PLAUSIBLE_C[0] <= celsius <= _PLAUSIBLE_C[1]:
                continue
            best = celsius if best is None else max(best, celsius)
        return best

    def _idle(self) -> bool | None:
        if self.idle_max_load is None:
            return self.idle
        text = _read_text(Path(self.proc_root) / "loadavg")
        if not text:
            return self.idle
        try:
            return float(text.split()[0]) <= self.idle_max_load
        except ValueError:
            return self.idle

    @staticmethod
    def _energy(base: Path) -> dict[str, float]:
        # RAPL package counters (microjoules, wrapping at max_energy_range_uj). Exposed
        # as a raw counter; the governor only uses differences over one step.
        total = 0.0
        found = False
        for dom in sorted(base.glob("intel-rapl:[0-9]")) if base.is_dir() else []:
            uj = _read_float(dom / "energy_uj")
            if uj is not None:
                total += uj
                found = True
        return {"energy_j": total / 1e6} if found else {}


# -------------------------------------------------------------------------- psutil


@dataclass(frozen=True)
class PsutilProvider:
    """Battery and temperature from psutil (Linux, Windows, macOS, BSD, partially).

    psutil lacks ``sensors_temperatures`` on some platforms and returns None from
    ``sensors_battery`` without a battery; both become ``None`` readings.
    """

    unmetered_network: bool | None = None
    idle: bool | None = None
    sensor_names: frozenset[str] | None = None  # keep only these sensors_temperatures keys

    def read(self) -> DeviceState:
        try:
            import psutil
        except ImportError as err:  # pragma: no cover - psutil is a dependency
            raise DeviceStateUnavailable("psutil is not installed: pip install psutil") from err
        battery = charging = None
        sensors_battery = getattr(psutil, "sensors_battery", None)
        if sensors_battery is not None:
            b = sensors_battery()
            if b is not None:
                battery = float(b.percent)
                charging = None if b.power_plugged is None else bool(b.power_plugged)
        temperature = None
        sensors_temperatures = getattr(psutil, "sensors_temperatures", None)
        if sensors_temperatures is not None:
            temperature = max_temperature(sensors_temperatures(), self.sensor_names)
        return DeviceState(
            battery_percent=battery,
            charging=charging,
            temperature_c=temperature,
            unmetered_network=self.unmetered_network,
            idle=self.idle,
        )


def max_temperature(
    sensors: dict[str, Iterable[Any]], names: frozenset[str] | None = None
) -> float | None:
    """Hottest plausible reading of ``psutil.sensors_temperatures()``-shaped data."""
    best: float | None = None
    for name, entries in sensors.items():
        if names is not None and name not in names:
            continue
        for entry in entries:
            c = getattr(entry, "current", None)
            if c is None or not _PLAUSIBLE_C[0] <= float(c) <= _PLAUSIBLE_C[1]:
                continue
            best = float(c) if best is None else max(best, float(c))
    return best


# -------------------------------------------------------------------------- static


@dataclass(frozen=True)
class StaticProvider:
    """A fixed state, e.g. from a client config for a mains-powered edge box."""

    state: DeviceState = field(default_factory=DeviceState)

    def read(self) -> DeviceState:
        return self.state

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> StaticProvider:
        known = {"battery_percent", "charging", "temperature_c", "unmetered_network", "idle"}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ConfigError(
                f"unknown device state fields {unknown}; expected a subset of {sorted(known)}"
            )
        return cls(DeviceState(**data))


# ----------------------------------------------------------------------- simulated


@dataclass(frozen=True)
class ThermalParams:
    ambient_c: float = 25.0
    r_th_c_per_w: float = 4.0  # °C of steady-state rise per watt dissipated
    tau_s: float = 60.0  # thermal time constant of the device body


def thermal_step(temp_c: float, power_w: float, dt_s: float, params: ThermalParams) -> float:
    """Advance the first-order (lumped RC) thermal model by ``dt_s`` at constant power.

    The model is ``dT/dt = (P * R_th - (T - T_amb)) / tau``: the die heats towards the
    steady state ``T_ss = T_amb + P * R_th`` (R_th in °C/W) with time constant ``tau``
    (s). For constant P the exact solution is
    ``T(t + dt) = T_ss + (T(t) - T_ss) * exp(-dt / tau)``, used here instead of an
    Euler step so a long sleep or a long step cannot overshoot ``T_ss``.
    """
    t_ss = params.ambient_c + power_w * params.r_th_c_per_w
    return t_ss + (temp_c - t_ss) * math.exp(-dt_s / params.tau_s)


@dataclass(frozen=True)
class SimulatedDeviceParams:
    """One simulated device.

    Work is counted in abstract *units* (a training step is typically one unit per
    example or per batch; the trainer decides). A unit takes ``seconds_per_unit`` at
    ``active_power_w``, so costs ``active_power_w * seconds_per_unit`` joules; at rest
    the device draws ``idle_power_w``. Plugged in, the charger adds ``charge_power_w``
    to the battery (minus whatever the device draws, so a heavy load can still drain a
    plugged phone).
    """

    capacity_wh: float = 15.0
    battery_percent: float = 80.0
    plugged: bool = False
    charge_power_w: float = 10.0
    idle_power_w: float = 0.5
    active_power_w: float = 6.0
    seconds_per_unit: float = 0.05
    thermal: ThermalParams = field(default_factory=ThermalParams)
    temperature_c: float | None = None  # initial; None means ambient
    unmetered_network: bool = True
    idle: bool = True

    def __post_init__(self) -> None:
        problems = []
        for name in ("capacity_wh", "seconds_per_unit"):
            if getattr(self, name) <= 0:
                problems.append(f"{name} must be > 0, got {getattr(self, name)}")
        for name in ("charge_power_w", "idle_power_w", "active_power_w"):
            if getattr(self, name) < 0:
                problems.append(f"{name} must be >= 0, got {getattr(self, name)}")
        if not 0.0 <= self.battery_percent <= 100.0:
            problems.append(f"battery_percent must be in [0, 100], got {self.battery_percent}")
        if self.thermal.tau_s <= 0 or self.thermal.r_th_c_per_w < 0:
            problems.append("thermal.tau_s must be > 0 and thermal.r_th_c_per_w >= 0")
        if problems:
            raise ConfigError(problems)

    def with_state(
        self, battery_percent: float, plugged: bool, temperature_c: float | None
    ) -> SimulatedDeviceParams:
        """These parameters (a device kind's, checked when they were made) for one device
        in a given state: a simulator makes one per device and round, so only the field
        that differs per device and has a range, the battery, is checked again."""
        if not 0.0 <= battery_percent <= 100.0:
            raise ConfigError(f"battery_percent must be in [0, 100], got {battery_percent}")
        p = object.__new__(SimulatedDeviceParams)
        d = p.__dict__
        d.update(self.__dict__)
        d["battery_percent"] = battery_percent
        d["plugged"] = plugged
        d["temperature_c"] = temperature_c
        return p


class SimulatedDevice:
    """A battery and a thermal mass driven by an explicit virtual clock.

    State is integrated lazily: whenever it is read or work is done, the interval since
    the last update is first integrated at idle power (the device rested while the
    clock moved, e.g. during a governor's sleep). ``work(units)`` then runs the units at
    active power and advances the clock by their duration.

    ``extra["energy_j"]`` is the cumulative energy the device has drawn (idle and
    active), which the governor uses for the per-round energy budget (the sysfs
    provider reports the RAPL counter under the same key).

    A reading taken when nothing has changed since the last one (the clock has not
    moved, no work was done, the charger is as it was) is the last reading itself, as
    :class:`StaticProvider` returns one state: readings are values, not to be mutated.
    A simulator reads each device at check-in and again, at the same instant, when its
    governor starts.
    """

    def __init__(self, params: SimulatedDeviceParams, clock: VirtualClock) -> None:
        self.params = params
        self.clock = clock
        # Joules at 100 %. The params are frozen, so this is a constant of the device;
        # it is read at every integration step (a simulator reads many devices often).
        self._capacity_j = params.capacity_wh * 3600.0
        self._battery_j = params.battery_percent / 100.0 * self._capacity_j
        self._temp = (
            params.thermal.ambient_c if params.temperature_c is None else params.temperature_c
        )
        self._energy_j = 0.0
        self._t = clock.monotonic()
        self.plugged = params.plugged
        self.max_temperature_c = self._temp  # highest temperature ever reached
        self.min_battery_percent = params.battery_percent  # lowest charge ever reached
        self.work_done = 0.0
        self._reading: DeviceState | None = None  # the last read(), while it still holds

    def _integrate(self, dt: float, power_w: float) -> None:
        if dt <= 0:
            return
        self._reading = None
        p = self.params
        # Temperature is monotone between its start and T_ss over a constant-power
        # interval, so the extremes are at the endpoints. The clamps and extremes are
        # written out as max()/min() compute them (the first argument wins a tie or a
        # NaN), without their call: a simulator integrates at every reading.
        temp = self._temp = thermal_step(self._temp, power_w, dt, p.thermal)
        if temp > self.max_temperature_c:
            self.max_temperature_c = temp
        net_w = (p.charge_power_w if self.plugged else 0.0) - power_w
        battery = self._battery_j + net_w * dt
        if battery < 0.0:
            battery = 0.0
        if self._capacity_j < battery:
            battery = self._capacity_j
        self._battery_j = battery
        percent = 100.0 * battery / self._capacity_j
        if percent < self.min_battery_percent:
            self.min_battery_percent = percent
        self._energy_j += power_w * dt

    def _catch_up(self) -> None:
        now = self.clock.monotonic()
        dt = now - self._t
        if dt != 0:  # no time passed (e.g. a read right after work): nothing to integrate
            self._integrate(dt, self.params.idle_power_w)
        self._t = now

    @property
    def battery_percent(self) -> float:
        return 100.0 * self._battery_j / self._capacity_j

    def levels(self) -> tuple[float, float]:
        """(battery percent, temperature) now: what :meth:`read` would report for them,
        without building the whole reading (a simulator puts thousands of devices away
        a round this way)."""
        self._catch_up()
        return self.battery_percent, self._temp

    def work(self, units: float) -> float:
        """Run ``units`` of work at active power; advances the clock. Returns seconds taken."""
        if units < 0:
            raise ValueError(f"work units must be >= 0, got {units}")
        self._catch_up()
        p = self.params
        dt = units * p.seconds_per_unit
        self._integrate(dt, p.active_power_w)
        clock = self.clock
        clock.advance(dt)
        self._t = clock.monotonic()
        self.work_done += units
        return dt

    def set_plugged(self, plugged: bool) -> None:
        self._catch_up()
        self.plugged = plugged

    def snapshot(self) -> tuple[Any, ...]:
        """Everything about this device that changes, and its clock, as plain values: with
        the parameters it was made with (or any that differ only in the initial battery,
        charger and temperature, which only start a device), :meth:`restore` makes a device
        that behaves exactly as this one from here on. A simulator moves devices between
        processes this way (a few numbers, not the parameters' objects)."""
        return (self._battery_j, self._temp, self._energy_j, self._t, self.plugged, self.max_temperature_c,
                self.min_battery_percent, self.work_done, self.clock.snapshot())

    @classmethod
    def from_snapshot(cls, params: SimulatedDeviceParams, snap: tuple[Any, ...]) -> SimulatedDevice:
        """``SimulatedDevice(params, VirtualClock())`` that has taken ``snap`` (:meth:`restore`):
        the device a snapshot describes, on a clock of its own, without first setting up the
        state the snapshot replaces (a simulator makes thousands a round). ``params``: the
        ones the snapshot's device was made with, or any that differ only in the initial
        battery, charger and temperature."""
        dev = object.__new__(cls)
        dev.params = params
        dev.clock = VirtualClock()
        dev._capacity_j = params.capacity_wh * 3600.0
        dev.restore(snap)
        return dev

    def restore(self, snap: tuple[Any, ...]) -> None:
        """Take the state a :meth:`snapshot` holds (this device's clock included)."""
        (self._battery_j, self._temp, self._energy_j, self._t, self.plugged, self.max_temperature_c,
         self.min_battery_percent, self.work_done, clock) = snap
        self.clock.restore(clock)
        self._reading = None  # a cached reading of the state before: read afresh

    def read(self) -> DeviceState:
        self._catch_up()
        reading = self._reading
        if reading is not None and reading.charging is self.plugged:
            return reading
        p = self.params
        battery, cap = self._battery_j, self._capacity_j
        reading = self._reading = DeviceState(
            battery_percent=100.0 * battery / cap,
            charging=self.plugged,  # "Full" on a charger counts as external power, as in sysfs
            temperature_c=self._temp,
            unmetered_network=p.unmetered_network,
            idle=p.idle,
            extra={"energy_j": self._energy_j, "full": 1.0 if battery >= cap else 0.0},
        )
        return reading


@dataclass
class DeviceColumns:
    """Many simulated devices' changing state as columns (one row a device): what
    :meth:`SimulatedDevice.snapshot` holds, less the work done and the clock's wall
    origin and sleep (a device at rest has none). ``t`` is each device's own time."""

    battery_j: np.ndarray  # float64
    temperature_c: np.ndarray  # float64
    energy_j: np.ndarray  # float64
    t: np.ndarray  # float64
    plugged: np.ndarray  # bool
    max_temperature_c: np.ndarray  # float64
    min_battery_percent: np.ndarray  # float64

    def snapshot(self, j: int) -> tuple[Any, ...]:
        """Row ``j`` as :meth:`SimulatedDevice.snapshot` writes it (for :meth:`SimulatedDevice.restore`)."""
        t = float(self.t[j])
        return (float(self.battery_j[j]), float(self.temperature_c[j]), float(self.energy_j[j]), t,
                bool(self.plugged[j]), float(self.max_temperature_c[j]), float(self.min_battery_percent[j]),
                0.0, (t, 0.0, 0.0))


def integrate_many(cols: DeviceColumns, rows: np.ndarray, dt: np.ndarray, power_w: np.ndarray, *,
                   capacity_j: np.ndarray, charge_power_w: np.ndarray, ambient_c: np.ndarray,
                   r_th_c_per_w: np.ndarray, tau_s: np.ndarray) -> None:
    """:meth:`SimulatedDevice._integrate` for the devices ``rows`` of ``cols`` at once, in
    place: ``dt`` seconds at ``power_w`` each. Every other argument is one value a row:
    the device's ``capacity_wh * 3600``, its charger and its :class:`ThermalParams`.

    The same operations in the same order on the same float64 values, with each
    exponential taken by ``math.exp`` as :func:`thermal_step` takes it, so a row comes out
    bit for bit as a :class:`SimulatedDevice` integrated alone would (a property test
    holds the two together). A simulator brings thousands of idle devices up to the
    present a round this way, before any of them becomes an object. Rows with ``dt <= 0``
    are left as they are, as ``_integrate`` returns at once for them."""
    go = dt > 0
    if not go.all():
        rows, dt, power_w, capacity_j, charge_power_w, ambient_c, r_th_c_per_w, tau_s = (
            a[go] for a in (rows, dt, power_w, capacity_j, charge_power_w, ambient_c, r_th_c_per_w, tau_s))
    if rows.size == 0:
        return
    # thermal_step: T_ss + (T - T_ss) * exp(-dt / tau), with T_ss = T_amb + P * R_th
    t_ss = ambient_c + power_w * r_th_c_per_w
    decay = np.fromiter(map(math.exp, (-dt / tau_s).tolist()), np.float64, rows.size)
    temp = t_ss + (cols.temperature_c[rows] - t_ss) * decay
    cols.temperature_c[rows] = temp
    hot = cols.max_temperature_c[rows]
    cols.max_temperature_c[rows] = np.where(temp > hot, temp, hot)
    net_w = np.where(cols.plugged[rows], charge_power_w, 0.0) - power_w
    battery = cols.battery_j[rows] + net_w * dt
    battery = np.where(battery < 0.0, 0.0, battery)
    battery = np.where(capacity_j < battery, capacity_j, battery)
    cols.battery_j[rows] = battery
    percent = 100.0 * battery / capacity_j
    low = cols.min_battery_percent[rows]
    cols.min_battery_percent[rows] = np.where(percent < low, percent, low)
    cols.energy_j[rows] = cols.energy_j[rows] + power_w * dt


def default_provider(sysfs_root: str | os.PathLike[str] = "/sys") -> DeviceStateProvider:
    """The best real provider on this host: sysfs when it has power or thermal data,
    else psutil."""
    root = Path(sysfs_root)
    if (root / "class" / "power_supply").is_dir() or (root / "class" / "thermal").is_dir():
        return SysfsProvider(root=root)
    return PsutilProvider()
