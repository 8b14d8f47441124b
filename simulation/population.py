"""A population of simulated devices whose memory is a few numbers per device.

Each device is one row of a handful of numpy arrays (its kind, a speed factor, its
battery charge, temperature and the time they were last brought up to date): about 30
bytes, so a million devices cost ~30 MB and nothing else grows with the population.
A device becomes an object only while it takes part in a round: :meth:`Population.
materialise` builds the edge runtime's :class:`SimulatedDevice` from its row, brings
it up to the present (idle drain, charging on its daily schedule, cooling), and
:meth:`Population.store` writes the result back when the round is over.

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
from orchard.edge_runtime.device import SimulatedDevice, SimulatedDeviceParams, ThermalParams
from orchard.edge_runtime.policy import check_eligibility
from orchard.errors import ConfigError
from orchard.simulation.config import DeviceProfile
from orchard.typing import DeviceState

_DAY_S = 86400.0


def _in_window(hour: float, start: float, end: float) -> bool:
    if start == end:
        return True
    if start < end:
        return start <= hour < end
    return hour >= start or hour < end


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
        # Per kind, what materialise needs of the profile (the thermal model is shared:
        # it is frozen).
        self._thermal = [ThermalParams(ambient_c=p.ambient_c, r_th_c_per_w=p.r_th_c_per_w, tau_s=p.tau_s)
                         for p in self.profiles]
        # Per kind, the device parameters (checked once, here); materialise sets each
        # device's own battery, charger and temperature on a copy.
        self._params = [SimulatedDeviceParams(
            capacity_wh=p.capacity_wh, charge_power_w=p.charge_power_w, idle_power_w=p.idle_power_w,
            active_power_w=p.active_power_w,
            seconds_per_unit=1.0,  # work is counted in seconds at full speed (see LiveDevice)
            thermal=th, unmetered_network=p.unmetered_network, idle=True)
            for p, th in zip(self.profiles, self._thermal, strict=True)]
        self._flops_per_s = [p.gflops * 1e9 for p in self.profiles]
        self._by_kind = dict(zip(self.kinds, self._params, strict=True))

    # ------------------------------------------------------------------ who is around

    def hour_of(self, t: float) -> float:
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
        seen: set[int] = set()
        while len(seen) < self.size // 2:
            ids = [int(i) for i in rng.integers(0, self.size, size=batch) if int(i) not in seen]
            ids = list(dict.fromkeys(ids))  # in order, without repeats within the batch
            seen.update(ids)
            yield np.asarray(ids, dtype=np.int64)
        rest = np.setdiff1d(np.arange(self.size, dtype=np.int64), np.fromiter(seen, np.int64, len(seen)))
        rng.shuffle(rest)
        yield from np.array_split(rest, max(1, len(rest) // max(batch, 1)))

    # ------------------------------------------------------------------ one device

    def plugged_at(self, i: int, t: float) -> bool:
        p = self.profiles[self.kind[i]]
        if not p.battery:
            return True
        return _in_window(self.hour_of(t), p.charging_start_hour, p.charging_end_hour)

    def _next_plug_change(self, i: int, t: float) -> float:
        """The first time after ``t`` at which the device's charging state flips."""
        p = self.profiles[self.kind[i]]
        if not p.battery or p.charging_start_hour == p.charging_end_hour:
            return math.inf
        day_t = (t + self.day_offset_s) % _DAY_S
        best = math.inf
        for h in (p.charging_start_hour, p.charging_end_hour):
            d = h * 3600.0 - day_t
            if d <= 0:
                d += _DAY_S
            best = min(best, d)
        return t + best

    def kind_params(self) -> dict[str, SimulatedDeviceParams]:
        """Each kind's device parameters: what, with a device's snapshot, rebuilds the
        device (:meth:`SimulatedDevice.restore`) in another process."""
        return self._by_kind

    def materialise(self, i: int, t: float) -> LiveDevice:
        """Device ``i`` as a :class:`SimulatedDevice`, brought up to time ``t``."""
        k = int(self.kind[i])
        prof = self.profiles[k]
        t0 = float(self.updated[i])
        params = self._params[k].with_state(
            battery_percent=min(max(float(self.battery[i]), 0.0), 100.0) if prof.battery else 100.0,
            plugged=self.plugged_at(i, t0),
            temperature_c=float(self.temperature[i]),
        )
        clock = VirtualClock(start=t0)
        dev = SimulatedDevice(params, clock)
        # Catch up piecewise: the device idles on battery or on the charger between its
        # plug changes (several per day for a device left alone for days).
        now = t0
        while now < t:
            nxt = min(self._next_plug_change(i, now), t)
            clock.advance(nxt - now)
            now = clock.monotonic()
            dev.set_plugged(self.plugged_at(i, now))
        seconds = self.flops_per_example / (self._flops_per_s[k] * float(self.speed[i]))
        return LiveDevice(int(i), self.kinds[k], prof, dev, clock, seconds)

    def store(self, live: LiveDevice) -> None:
        """Write a device's state back to its row (it leaves the round)."""
        battery, temperature = live.device.levels()
        i = live.index
        if live.profile.battery:
            self.battery[i] = battery
        self.temperature[i] = temperature
        self.updated[i] = live.clock.monotonic()

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
