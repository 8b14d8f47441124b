"""A population of simulated devices whose memory is a few numbers per device.

Each device is one row of a handful of numpy arrays (its kind, a speed factor, its
battery charge, temperature and the time they were last brought up to date): about 30
bytes, so a million devices cost ~30 MB and nothing else grows with the population.
A device becomes an object only while it takes part in a round. :meth:`Population.
catch_up` brings a batch of rows up to the present at once, as columns (idle drain,
charging on each kind's daily schedule, cooling: the edge runtime's device model,
``integrate_many``); :meth:`Population.device` makes one row the edge runtime's
:class:`SimulatedDevice`, and :meth:`Population.store_many` writes a round's devices
back together when it is over (:meth:`Population.store` one).

Availability is a per-kind hourly probability of being online (phones mostly at night,
edge boxes always); whether a given device is online for a given round is a
deterministic draw from the run seed, the round and the device id, so the same seed
gives the same population behaviour whatever the executor.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

from orchard.config import EligibilityConfig
from orchard.edge_runtime.clock import VirtualClock
from orchard.edge_runtime.device import (
    DeviceColumns,
    SimulatedDevice,
    SimulatedDeviceParams,
    ThermalParams,
    integrate_many,
)
from orchard.edge_runtime.policy import check_eligibility
from orchard.errors import ConfigError
from orchard.simulation.config import DeviceProfile
from orchard.typing import DeviceState

_DAY_S = 86400.0


@dataclass
class LiveDevice:
    """A device taking part in a round: its simulated hardware on its own virtual clock."""

    index: int
    kind: str
    profile: DeviceProfile
    device: SimulatedDevice
    clock: VirtualClock
    seconds_per_example: float


class Population:
    """``size`` devices drawn from a mix of kinds. Rows are filled deterministically from ``seed``.

    Times are simulated seconds since the start of the simulation; ``day_offset_s`` is
    the time of day at which the simulation starts (seconds after midnight).
    """

    def __init__(self, size: int, profiles: dict[str, DeviceProfile], mix: dict[str, float], seed: int,
                 flops_per_example: float, day_offset_s: float) -> None:
        kinds = [k for k, share in mix.items() if share > 0]
        if not kinds:
            raise ConfigError("the device mix has no kind with a positive share")
        missing = [k for k in kinds if k not in profiles]
        if missing:
            raise ConfigError(f"device kinds {missing} have no profile; known: {sorted(profiles)}")
        self.size = size
        self.kinds = kinds
        self.profiles = [profiles[k] for k in kinds]
        self.flops_per_example = float(flops_per_example)
        self.day_offset_s = float(day_offset_s)
        self.seed = seed
        rng = np.random.default_rng([seed, 0x50505])
        shares = np.array([mix[k] for k in kinds], dtype=np.float64)
        self.kind = rng.choice(len(kinds), size=size, p=shares / shares.sum()).astype(np.uint8)
        sigma = np.array([p.speed_sigma for p in self.profiles])[self.kind]
        # Lognormal with median 1: half the devices of a kind are faster than its nominal speed.
        self.speed = np.exp(rng.normal(0.0, 1.0, size) * sigma).astype(np.float32)
        has_battery = np.array([p.battery for p in self.profiles])[self.kind]
        self.battery = np.where(has_battery, rng.uniform(30.0, 100.0, size), np.nan).astype(np.float32)
        self.temperature = np.array([p.ambient_c for p in self.profiles], dtype=np.float32)[self.kind]
        self.updated = np.zeros(size, dtype=np.float64)
        # Per kind, the device parameters (checked once, here): a device is made from its
        # kind's and its row's state (SimulatedDevice.from_snapshot).
        thermal = [ThermalParams(ambient_c=p.ambient_c, r_th_c_per_w=p.r_th_c_per_w, tau_s=p.tau_s)
                   for p in self.profiles]
        self._params = [SimulatedDeviceParams(
            capacity_wh=p.capacity_wh, charge_power_w=p.charge_power_w, idle_power_w=p.idle_power_w,
            active_power_w=p.active_power_w,
            seconds_per_unit=1.0,  # work is counted in seconds at full speed (see LiveDevice)
            thermal=th, unmetered_network=p.unmetered_network, idle=True)
            for p, th in zip(self.profiles, thermal, strict=True)]
        self._flops_per_s = [p.gflops * 1e9 for p in self.profiles]
        # What catch_up needs of each kind, as columns indexed by a device's kind.
        self._has_battery = np.array([p.battery for p in self.profiles])
        self._charge_start_h = np.array([float(p.charging_start_hour) for p in self.profiles])
        self._charge_end_h = np.array([float(p.charging_end_hour) for p in self.profiles])
        self._capacity_j = np.array([q.capacity_wh * 3600.0 for q in self._params])
        self._idle_w = np.array([q.idle_power_w for q in self._params])
        self._charge_w = np.array([q.charge_power_w for q in self._params])
        self._ambient_c = np.array([q.thermal.ambient_c for q in self._params])
        self._r_th = np.array([q.thermal.r_th_c_per_w for q in self._params])
        self._tau_s = np.array([q.thermal.tau_s for q in self._params])
        self._by_kind = dict(zip(self.kinds, self._params, strict=True))

    # ------------------------------------------------------------------ who is around

    def hour_of(self, t: float | np.ndarray) -> float | np.ndarray:
        return ((t + self.day_offset_s) % _DAY_S) / 3600.0

    def online(self, ids: np.ndarray, t: float, rnd: int, attempt: int) -> np.ndarray:
        """Which of ``ids`` are online at time ``t`` (a deterministic draw per round)."""
        hour = int(self.hour_of(t))
        p = np.array([prof.availability[hour] for prof in self.profiles])[self.kind[ids]]
        u = np.random.default_rng([self.seed, rnd, attempt, 0xA7A1]).random(len(ids))
        return u < p

    def candidates(self, rnd: int, attempt: int, batch: int) -> Iterator[np.ndarray]:
        """Distinct device ids in a seeded random order, ``batch`` at a time, until every
        device was offered once. Draws cost O(batch), not O(population), until most of
        the population has been offered (then the rest come as one shuffled block)."""
        rng = np.random.default_rng([self.seed, rnd, attempt, 0xC4EC])
        seen = np.zeros(self.size, dtype=bool)
        offered = 0
        while offered < self.size // 2:
            draws = rng.integers(0, self.size, size=batch)
            # Each id's first draw in the batch, in draw order, unless offered before.
            first = np.zeros(len(draws), dtype=bool)
            first[np.unique(draws, return_index=True)[1]] = True
            ids = draws[first & ~seen[draws]]
            seen[ids] = True
            offered += len(ids)
            yield ids.astype(np.int64, copy=False)
        rest = np.flatnonzero(~seen).astype(np.int64)
        rng.shuffle(rest)
        yield from np.array_split(rest, max(1, len(rest) // max(batch, 1)))

    # ------------------------------------------------------------------ devices, as rows and objects

    def _plugged(self, k: np.ndarray, t: np.ndarray) -> np.ndarray:
        """Whether devices of kinds ``k`` are on their chargers at times ``t``: a mains box
        always, a phone inside its kind's daily charging window."""
        hour = self.hour_of(t)
        start, end = self._charge_start_h[k], self._charge_end_h[k]
        inside = np.where(start < end, (start <= hour) & (hour < end), (hour >= start) | (hour < end))
        return ~self._has_battery[k] | (start == end) | inside

    def _next_plug_change(self, k: np.ndarray, t: np.ndarray) -> np.ndarray:
        """The first time after ``t`` at which each device's charging state flips (inf for
        one that never flips)."""
        start, end = self._charge_start_h[k], self._charge_end_h[k]
        day_t = (t + self.day_offset_s) % _DAY_S
        best = np.full(len(t), math.inf)
        for h in (start, end):
            d = h * 3600.0 - day_t
            d = np.where(d <= 0, d + _DAY_S, d)
            best = np.where(d < best, d, best)
        return np.where(~self._has_battery[k] | (start == end), math.inf, t + best)

    def kind_params(self) -> dict[str, SimulatedDeviceParams]:
        """Each kind's device parameters: what, with a device's snapshot, rebuilds the
        device (:meth:`SimulatedDevice.from_snapshot`) in another process."""
        return self._by_kind

    def catch_up(self, ids: np.ndarray, t: float) -> DeviceColumns:
        """Devices ``ids`` as their :class:`SimulatedDevice` would be at time ``t``, built
        from their rows, as columns: each one idles on battery or on its charger from its
        row's time to ``t``, in pieces between its plug changes (several a day for a device
        left alone for days). A row is what a device built from it alone and brought up
        to ``t`` the same way would hold, bit for bit (``integrate_many``); :meth:`device`
        makes it an object."""
        k = self.kind[ids].astype(np.intp)
        t0 = self.updated[ids]
        # The charge a device starts from, in [0, 100] as the device's parameters require
        # (written as min(max(b, 0), 100) computes it); a mains box is full.
        b = self.battery[ids].astype(np.float64)
        b = np.where(b < 0.0, 0.0, b)
        b = np.where(b > 100.0, 100.0, b)
        b = np.where(self._has_battery[k], b, 100.0)
        temp = self.temperature[ids].astype(np.float64)
        cols = DeviceColumns(battery_j=b / 100.0 * self._capacity_j[k], temperature_c=temp,
                             energy_j=np.zeros(len(ids)), t=t0, plugged=self._plugged(k, t0),
                             max_temperature_c=temp.copy(), min_battery_percent=b)
        rows = np.flatnonzero(t0 < t)
        while rows.size:
            kr, now = k[rows], cols.t[rows]
            nxt = self._next_plug_change(kr, now)
            nxt = np.where(t < nxt, t, nxt)
            moved = now + (nxt - now)  # the device's clock advanced by the difference
            self._rest(cols, rows, moved - now, kr)
            cols.t[rows] = moved
            cols.plugged[rows] = self._plugged(kr, moved)
            rows = rows[moved < t]
        return cols

    def _rest(self, cols: DeviceColumns, rows: np.ndarray, dt: np.ndarray, k: np.ndarray) -> None:
        """Rows ``rows`` of ``cols``, devices of kinds ``k``, idle ``dt`` seconds each
        (``integrate_many`` at each kind's idle power, with its charger and thermal model)."""
        integrate_many(cols, rows, dt, self._idle_w[k], capacity_j=self._capacity_j[k],
                       charge_power_w=self._charge_w[k], ambient_c=self._ambient_c[k],
                       r_th_c_per_w=self._r_th[k], tau_s=self._tau_s[k])

    def device(self, i: int, cols: DeviceColumns, j: int) -> LiveDevice:
        """Device ``i`` as an object: its edge-runtime :class:`SimulatedDevice` in the state
        of row ``j`` of ``cols`` (from :meth:`catch_up`), on its own virtual clock."""
        k = int(self.kind[i])
        dev = SimulatedDevice.from_snapshot(self._params[k], cols.snapshot(j))
        seconds = self.flops_per_example / (self._flops_per_s[k] * float(self.speed[i]))
        return LiveDevice(i, self.kinds[k], self.profiles[k], dev, dev.clock, seconds)

    def store(self, live: LiveDevice) -> None:
        """Write a device's state back to its row (it leaves the round)."""
        battery, temperature = live.device.levels()
        i = live.index
        if live.profile.battery:
            self.battery[i] = battery
        self.temperature[i] = temperature
        self.updated[i] = live.clock.monotonic()

    def store_many(self, devices: list[LiveDevice], t: float) -> None:
        """:meth:`store` for each of ``devices`` after its clock is moved on to ``t`` (one
        already past ``t`` stays where it is): the rest since its last step is integrated
        for all of them at once (``integrate_many``), bit for bit as each device's own
        ``levels()`` would, and the rows are written together."""
        if not devices:
            return
        rows = []
        for live in devices:
            clock = live.clock
            clock.advance(max(0.0, t - clock.monotonic()))
            battery_j, temp, energy_j, since, plugged, hot, low, _work, _clock = live.device.snapshot()
            rows.append((battery_j, temp, energy_j, since, plugged, hot, low, clock.monotonic(), live.index))
        b, temp, e, since, plugged, hot, low, now, ids = (np.array(c) for c in zip(*rows, strict=True))
        cols = DeviceColumns(battery_j=b, temperature_c=temp, energy_j=e, t=since, plugged=plugged,
                             max_temperature_c=hot, min_battery_percent=low)
        k = self.kind[ids].astype(np.intp)
        self._rest(cols, np.arange(len(ids)), now - since, k)
        has = self._has_battery[k]
        self.battery[ids[has]] = (100.0 * cols.battery_j / self._capacity_j[k])[has]
        self.temperature[ids] = cols.temperature_c
        self.updated[ids] = now

    @staticmethod
    def state_of(live: LiveDevice) -> DeviceState:
        st = live.device.read()
        if not live.profile.battery:
            # A mains box has no battery to report: unknown, never a guess.
            return DeviceState(battery_percent=None, charging=True, temperature_c=st.temperature_c,
                               unmetered_network=st.unmetered_network, idle=st.idle)
        return st  # the device's reading: a value nobody mutates (see SimulatedDevice.read)

    @staticmethod
    def eligible(state: DeviceState, eligibility: EligibilityConfig, wall_s: float) -> bool:
        """The device-side decision (the edge runtime's policy), before it checks in."""
        return check_eligibility(state, eligibility, wall_s).eligible
