"""Device state providers against a fake sysfs tree, psutil-shaped data, and the
simulated device's thermal and battery physics."""

from __future__ import annotations

import math
from collections import namedtuple
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from orchard.edge_runtime.clock import ClockError, VirtualClock
from orchard.edge_runtime.device import (
    DeviceColumns,
    DeviceStateUnavailable,
    PsutilProvider,
    SimulatedDevice,
    SimulatedDeviceParams,
    StaticProvider,
    SysfsProvider,
    ThermalParams,
    default_provider,
    integrate_many,
    max_temperature,
    thermal_step,
)
from orchard.errors import ConfigError
from orchard.typing import DeviceState


def _write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text + "\n")


def _battery(root: Path, name: str, capacity: int, status: str, **extra: int) -> None:
    d = root / "class" / "power_supply" / name
    _write(d / "type", "Battery")
    _write(d / "capacity", str(capacity))
    _write(d / "status", status)
    for k, v in extra.items():
        _write(d / k, str(v))


def _mains(root: Path, online: bool) -> None:
    d = root / "class" / "power_supply" / "AC"
    _write(d / "type", "Mains")
    _write(d / "online", "1" if online else "0")


def _zone(root: Path, i: int, kind: str, millideg: str) -> None:
    d = root / "class" / "thermal" / f"thermal_zone{i}"
    _write(d / "type", kind)
    _write(d / "temp", millideg)


@pytest.mark.parametrize(
    ("status", "mains", "expected"),
    [
        ("Charging", False, True),
        ("Full", False, True),
        ("Discharging", False, False),
        ("Not charging", True, True),  # plugged in, held at a charge threshold
        ("Not charging", False, False),
    ],
)
def test_sysfs_battery_status(tmp_path: Path, status: str, mains: bool, expected: bool) -> None:
    _battery(tmp_path, "BAT0", 57, status)
    _mains(tmp_path, mains)
    s = SysfsProvider(root=tmp_path).read()
    assert s.battery_percent == 57.0
    assert s.charging is expected


def test_sysfs_temperature_is_max_over_zones_in_celsius(tmp_path: Path) -> None:
    _zone(tmp_path, 0, "acpitz", "41000")
    _zone(tmp_path, 1, "x86_pkg_temp", "63500")
    _zone(tmp_path, 2, "iwlwifi_1", "-273000")  # unconnected sensor: ignored
    _zone(tmp_path, 3, "broken", "not a number")
    assert SysfsProvider(root=tmp_path).read().temperature_c == 63.5
    only_acpi = SysfsProvider(root=tmp_path, thermal_types=frozenset({"acpitz"}))
    assert only_acpi.read().temperature_c == 41.0


def test_sysfs_two_batteries_weighted_by_energy(tmp_path: Path) -> None:
    # 10 of 20 Wh and 40 of 40 Wh: 50 / 60 = 83.3 %, not the mean 75 %.
    _battery(tmp_path, "BAT0", 50, "Discharging", energy_now=10_000_000, energy_full=20_000_000)
    _battery(tmp_path, "BAT1", 100, "Discharging", energy_now=40_000_000, energy_full=40_000_000)
    s = SysfsProvider(root=tmp_path).read()
    assert s.battery_percent == pytest.approx(100 * 50 / 60)
    assert s.charging is False


def test_sysfs_mains_only_box_and_empty_tree(tmp_path: Path) -> None:
    _mains(tmp_path, True)
    s = SysfsProvider(root=tmp_path, unmetered_network=True).read()
    assert s == DeviceState(battery_percent=None, charging=True, unmetered_network=True)
    empty = tmp_path / "empty"
    empty.mkdir()
    assert SysfsProvider(root=empty).read() == DeviceState()
    with pytest.raises(DeviceStateUnavailable):
        SysfsProvider(root=tmp_path / "missing").read()


def test_sysfs_idle_from_loadavg_and_rapl_energy(tmp_path: Path) -> None:
    proc = tmp_path / "proc"
    _write(proc / "loadavg", "0.20 0.30 0.40 1/200 1234")
    _write(tmp_path / "class" / "powercap" / "intel-rapl:0" / "energy_uj", "2500000")
    s = SysfsProvider(root=tmp_path, idle_max_load=0.5, proc_root=proc).read()
    assert s.idle is True
    assert s.extra == {"energy_j": 2.5}
    _write(proc / "loadavg", "1.70 0.30 0.40 1/200 1234")
    assert SysfsProvider(root=tmp_path, idle_max_load=0.5, proc_root=proc).read().idle is False


def test_default_provider_prefers_sysfs(tmp_path: Path) -> None:
    _zone(tmp_path, 0, "cpu", "40000")
    assert isinstance(default_provider(tmp_path), SysfsProvider)


def test_psutil_shaped_temperatures() -> None:
    shw = namedtuple("shw", "label current high critical")
    data = {
        "coretemp": [shw("a", 50.0, 80, 90), shw("b", 71.0, 80, 90)],
        "nvme": [shw("", 38.0, 0, 0)],
    }
    assert max_temperature(data) == 71.0
    assert max_temperature(data, frozenset({"nvme"})) == 38.0
    assert max_temperature({}) is None


def test_psutil_provider_reads_this_host() -> None:
    # No mock: whatever this host has (a CI box usually has no battery) comes back
    # as readings or as None, never as an exception.
    s = PsutilProvider(unmetered_network=True).read()
    assert s.battery_percent is None or 0.0 <= s.battery_percent <= 100.0
    assert s.temperature_c is None or -40.0 <= s.temperature_c <= 150.0
    assert s.unmetered_network is True


def test_static_provider_from_dict() -> None:
    p = StaticProvider.from_dict({"battery_percent": 90.0, "charging": True})
    assert p.read().battery_percent == 90.0
    with pytest.raises(ConfigError, match="battery"):
        StaticProvider.from_dict({"batery": 1})


def test_thermal_step_solves_the_ode() -> None:
    """The closed form agrees with a fine Euler integration of
    dT/dt = (P R_th - (T - T_amb)) / tau, heats under load and cools at rest."""
    th = ThermalParams(ambient_c=20.0, r_th_c_per_w=5.0, tau_s=30.0)
    t_exact = thermal_step(30.0, 4.0, 12.0, th)
    t, h = 30.0, 1e-3
    for _ in range(12_000):
        t += h * (4.0 * 5.0 - (t - 20.0)) / 30.0
    assert t_exact == pytest.approx(t, abs=1e-3)
    assert thermal_step(30.0, 4.0, 1e6, th) == pytest.approx(40.0)  # T_ss = T_amb + P R_th
    assert thermal_step(50.0, 0.0, 10.0, th) < 50.0


def test_simulated_device_heats_under_load_and_cools_at_rest() -> None:
    clock = VirtualClock()
    p = SimulatedDeviceParams(
        capacity_wh=1.0,
        battery_percent=50.0,
        active_power_w=10.0,
        idle_power_w=0.0,
        seconds_per_unit=1.0,
        thermal=ThermalParams(25.0, 3.0, 20.0),
    )
    dev = SimulatedDevice(p, clock)
    assert dev.work(36) == 36.0
    assert clock.monotonic() == 36.0
    s = dev.read()
    # 10 W for 36 s = 360 J = 0.1 Wh = 10 % of 1 Wh.
    assert s.battery_percent == pytest.approx(40.0)
    assert s.extra["energy_j"] == pytest.approx(360.0)
    assert s.temperature_c == pytest.approx(25.0 + 30.0 * (1 - math.exp(-36 / 20)))
    hot = s.temperature_c
    clock.sleep(60.0)
    assert dev.read().temperature_c < hot
    assert dev.read().battery_percent == pytest.approx(40.0)  # no idle draw configured
    assert dev.max_temperature_c == pytest.approx(hot)


def test_simulated_device_charges_when_plugged() -> None:
    clock = VirtualClock()
    p = SimulatedDeviceParams(
        capacity_wh=1.0, battery_percent=99.0, plugged=True, charge_power_w=36.0, idle_power_w=0.0
    )
    dev = SimulatedDevice(p, clock)
    clock.sleep(50.0)  # 36 W * 50 s = 0.5 Wh, but the battery stops at full
    s = dev.read()
    assert s.battery_percent == 100.0 and s.charging is True
    with pytest.raises(ConfigError):
        SimulatedDeviceParams(capacity_wh=0.0)


def test_simulated_device_reuses_a_reading_only_while_it_holds() -> None:
    # A simulator reads a device at check-in and again, at the same instant, when its
    # governor starts: the second reading is the first. Time passing, work or a charger
    # change must each make the next reading a fresh one.
    clock = VirtualClock()
    p = SimulatedDeviceParams(
        capacity_wh=1.0, battery_percent=50.0, idle_power_w=3.6, seconds_per_unit=1.0
    )
    dev = SimulatedDevice(p, clock)
    first = dev.read()
    assert dev.read() is first
    dev.set_plugged(True)  # same instant, on the charger now
    assert dev.read().charging is True and dev.read().battery_percent == first.battery_percent
    dev.plugged = False  # set directly, without set_plugged
    assert dev.read().charging is False
    dev.work(0)  # no work and no time: nothing changed
    assert dev.read() == first
    clock.sleep(10.0)  # 3.6 W for 10 s: 36 J, 1 % of 1 Wh
    rested = dev.read()
    assert rested.extra["energy_j"] == pytest.approx(36.0)
    assert rested.battery_percent == pytest.approx(49.0)
    dev.work(1)
    assert dev.read().extra["energy_j"] > rested.extra["energy_j"]


def test_virtual_clock_only_moves_forward() -> None:
    c = VirtualClock(wall_origin=1000.0)
    c.sleep(2.5)
    assert (c.monotonic(), c.wall(), c.slept_s) == (2.5, 1002.5, 2.5)
    with pytest.raises(ClockError):
        c.advance(-1.0)


def test_a_restored_snapshot_behaves_as_the_device_it_was_taken_from() -> None:
    """A device rebuilt elsewhere from its kind's parameters and a snapshot (as the
    simulator's workers do) reads, works, rests and charges exactly as the original, and
    its clock is the original's to the bit."""
    kind = SimulatedDeviceParams(capacity_wh=4.0, battery_percent=90.0, active_power_w=7.5,
                                 thermal=ThermalParams(tau_s=45.0))
    original = SimulatedDevice(kind.with_state(37.25, False, 31.5), VirtualClock(start=12.5, wall_origin=1e9))
    original.work(3.3)
    original.clock.sleep(40.0)
    original.read()
    copy = SimulatedDevice(kind, VirtualClock())  # the kind's own initial state, then the snapshot
    copy.restore(original.snapshot())
    made = SimulatedDevice.from_snapshot(kind, original.snapshot())  # the same in one step
    assert vars(made).keys() == vars(copy).keys()  # every attribute a device has
    assert copy.snapshot() == original.snapshot() == made.snapshot()
    for dev in (original, copy, made):
        dev.work(2.0)
        dev.clock.advance(600.0)
        dev.set_plugged(True)
        dev.clock.advance(1234.5)
    for dev in (copy, made):
        assert dev.read() == original.read()
        assert dev.snapshot() == original.snapshot()
        assert (dev.clock.monotonic(), dev.clock.wall(), dev.clock.slept_s) == (
            original.clock.monotonic(), original.clock.wall(), original.clock.slept_s)


def test_levels_are_what_a_reading_reports() -> None:
    kind = SimulatedDeviceParams(capacity_wh=4.0, battery_percent=90.0, active_power_w=7.5,
                                 thermal=ThermalParams(tau_s=45.0))
    a = SimulatedDevice(kind.with_state(37.25, False, 31.5), VirtualClock(start=12.5))
    b = SimulatedDevice(kind.with_state(37.25, False, 31.5), VirtualClock(start=12.5))
    for dev in (a, b):
        dev.work(3.3)
        dev.clock.advance(77.7)  # idle time the levels catch up, as a reading does
    battery, temperature = a.levels()
    state = b.read()
    assert (battery, temperature) == (state.battery_percent, state.temperature_c)
    assert battery < 37.25 and temperature > kind.thermal.ambient_c
    assert a.snapshot() == b.snapshot()  # both caught up the same way


_powers = st.floats(0.0, 20.0, allow_nan=False)


@settings(max_examples=60, deadline=None)
@given(devices=st.lists(st.tuples(
    st.floats(0.5, 80.0),  # capacity_wh
    st.floats(0.0, 100.0),  # battery_percent
    _powers, _powers,  # charge_power_w, idle_power_w
    st.floats(-10.0, 60.0), st.floats(0.0, 20.0), st.floats(0.5, 5000.0),  # ambient, r_th, tau
    st.floats(-10.0, 90.0),  # temperature
    st.booleans(),  # plugged
    st.floats(0.0, 3 * 86400.0) | st.just(0.0),  # idle seconds
), min_size=1, max_size=12))
def test_integrate_many_is_each_device_integrated_alone(devices: list[tuple]) -> None:
    """The columns come out bit for bit as each SimulatedDevice brought up alone: the
    simulator's catch-up of thousands of devices at once changes no number."""
    alone, params = [], []
    for cap, b, charge, idle, amb, r_th, tau, temp, plugged, _dt in devices:
        p = SimulatedDeviceParams(capacity_wh=cap, battery_percent=b, plugged=plugged, charge_power_w=charge,
                                  idle_power_w=idle, temperature_c=temp,
                                  thermal=ThermalParams(ambient_c=amb, r_th_c_per_w=r_th, tau_s=tau))
        dev = SimulatedDevice(p, VirtualClock(start=100.0))
        params.append(p)
        alone.append(dev)
    cols = DeviceColumns(
        battery_j=np.array([d.snapshot()[0] for d in alone]), temperature_c=np.array([d.snapshot()[1] for d in alone]),
        energy_j=np.zeros(len(alone)), t=np.full(len(alone), 100.0),
        plugged=np.array([d.plugged for d in alone]),
        max_temperature_c=np.array([d.max_temperature_c for d in alone]),
        min_battery_percent=np.array([d.min_battery_percent for d in alone]))
    for dev, row in zip(alone, devices, strict=True):
        dev.clock.advance(row[-1])
        dev.levels()  # brought up to its clock at idle power
    # What each device integrated over: its clock's difference, as a simulator computes it.
    dts = np.array([dev.clock.monotonic() for dev in alone]) - 100.0
    col = {name: np.array([getattr(p, name) for p in params]) for name in ("charge_power_w", "idle_power_w")}
    integrate_many(cols, np.arange(len(alone)), dts, col["idle_power_w"],
                   capacity_j=np.array([p.capacity_wh * 3600.0 for p in params]),
                   charge_power_w=col["charge_power_w"],
                   ambient_c=np.array([p.thermal.ambient_c for p in params]),
                   r_th_c_per_w=np.array([p.thermal.r_th_c_per_w for p in params]),
                   tau_s=np.array([p.thermal.tau_s for p in params]))
    for j, dev in enumerate(alone):
        battery_j, temp, energy_j, _t, plugged, hot, low, _work, _clock = dev.snapshot()
        got = (cols.battery_j[j], cols.temperature_c[j], cols.energy_j[j], cols.plugged[j],
               cols.max_temperature_c[j], cols.min_battery_percent[j])
        assert [float(v) for v in got] == [battery_j, temp, energy_j, float(plugged), hot, low]


def test_a_device_rebuilt_from_its_columns_is_the_device() -> None:
    kind = SimulatedDeviceParams(capacity_wh=4.0, battery_percent=90.0, active_power_w=7.5)
    dev = SimulatedDevice(kind.with_state(37.25, True, 31.5), VirtualClock(start=12.5))
    battery_j, temp, energy_j, t, plugged, hot, low, _work, _clock = dev.snapshot()
    cols = DeviceColumns(np.array([battery_j]), np.array([temp]), np.array([energy_j]), np.array([t]),
                         np.array([plugged]), np.array([hot]), np.array([low]))
    copy = SimulatedDevice(kind, VirtualClock())
    copy.restore(cols.snapshot(0))
    assert copy.snapshot() == dev.snapshot()
    assert copy.read() == dev.read()
