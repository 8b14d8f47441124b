"""The governor over many simulated devices at once, as columns.

A simulator runs thousands of governed devices a round, each a few steps of
:class:`~orchard.edge_runtime.governor.Governor` on a
:class:`~orchard.edge_runtime.device.SimulatedDevice`: as objects, a device costs tens
of Python calls a step (readings, samples, estimates, decisions). :func:`govern_many`
takes the same decisions for a batch of devices with one numpy operation per rule over
all of them: each pass is one ``before_step`` (the duty-cycle pause, then decide, cool
and decide again until each device runs or stops) and one step of every device that
runs. A device's arithmetic is the scalar code's, operation for operation (float64
adds, multiplies and divides round as Python's do, and the thermal model's exponential
is ``math.exp``, as :func:`~orchard.edge_runtime.device.thermal_step` takes it), so a
device comes out bit for bit as a :class:`Governor` with :func:`run_governed` leaves it:
a property test holds the two to each other over random devices and policies.

It answers what a simulator asks of a governed run (the seconds it took and the steps
it did) and moves each device's state on; a trainer on a real device, which needs the
report and the stop reason, uses :class:`Governor`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from .device import SimulatedDevice
from .policy import DevicePolicy

_RUN, _COOL, _STOP = 0, 1, 2


def _exp(x: np.ndarray) -> np.ndarray:
    return np.fromiter(map(math.exp, x.tolist()), np.float64, x.size)


class _Policies:
    """Each device's policy as columns (devices share a few policy objects)."""

    def __init__(self, policies: Sequence[DevicePolicy]) -> None:
        rows: dict[int, int] = {}
        table: list[tuple[float, ...]] = []
        self.window: list[object] = []
        index = np.empty(len(policies), np.intp)
        for i, p in enumerate(policies):
            j = rows.get(id(p))
            if j is None:
                j = rows[id(p)] = len(table)
                pc, b, e = p.pacing, p.budget, p.eligibility
                inf = math.inf
                table.append((
                    p.hard_ceiling_c, pc.throttle_band_c, pc.min_duty, pc.cooldown_quantum_s, pc.max_cooldown_s,
                    pc.prior_rise_c, pc.prior_drop_percent, pc.safety_factor, float(pc.history),
                    math.nan if pc.joules_per_unit is None else pc.joules_per_unit,
                    inf if b.max_steps is None else float(b.max_steps), inf if b.time_s is None else b.time_s,
                    inf if b.energy_j is None else b.energy_j, e.min_battery_percent,
                    float(e.allow_on_battery), float(e.require_unmetered), float(e.require_idle)))
                self.window.append(p.window)
            index[i] = j
        cols = np.array(table, np.float64)[index].T
        (self.hard, self.band, self.min_duty, self.quantum, self.max_cool, self.prior_rise, self.prior_drop,
         self.k, history, self.jpu, self.max_steps, self.time_s, self.energy_j, self.floor, allow_battery,
         need_unmetered, need_idle) = cols
        self.history = history.astype(np.intp)
        self.index = index
        self.allow_battery, self.need_unmetered, self.need_idle = allow_battery > 0, need_unmetered > 0, need_idle > 0


class _Samples:
    """The last ``history`` samples (steps, or rests) of each device: a ring of columns."""

    def __init__(self, n: int, history: np.ndarray, cap: int) -> None:
        self.cap = max(int(min(history.max(initial=1), cap)), 1)
        self.history = history
        self.count = np.zeros(n, np.intp)
        shape = (n, self.cap)
        self.units, self.seconds, self.rise, self.drop, self.energy = (np.zeros(shape) for _ in range(5))

    def push(self, i: np.ndarray, units: np.ndarray | float, seconds: np.ndarray, rise: np.ndarray,
             drop: np.ndarray, energy: np.ndarray) -> None:
        slot = self.count[i] % np.minimum(self.history[i], self.cap)
        self.units[i, slot] = units
        self.seconds[i, slot] = seconds
        self.rise[i, slot] = rise
        self.drop[i, slot] = drop
        self.energy[i, slot] = energy
        self.count[i] += 1

    def valid(self, i: np.ndarray) -> np.ndarray:
        held = np.minimum(self.count[i], np.minimum(self.history[i], self.cap))
        return np.arange(self.cap)[None, :] < held[:, None]


def _largest(values: np.ndarray, ok: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Each row's largest value where ``ok``, and whether it had one (the scalar code's
    ``None``). Only the value matters: equal values (0.0 and -0.0) decide alike."""
    return np.where(ok, values, -np.inf).max(axis=1, initial=-np.inf), ok.any(axis=1)


class _Batch:
    """The devices' and their governors' state, as columns (see :func:`govern_many`)."""

    def __init__(self, devices: Sequence[SimulatedDevice], policies: Sequence[DevicePolicy]) -> None:
        n = len(devices)
        self.p = pol = _Policies(policies)
        # One pass over the devices (attribute reads are most of a small batch's cost).
        rows = np.array([(d._capacity_j, d._battery_j, d._temp, d._energy_j, d._t, d.plugged, d.max_temperature_c,
                          d.min_battery_percent, d.work_done, *d.clock.snapshot(), q.idle_power_w, q.active_power_w,
                          q.charge_power_w, q.seconds_per_unit, q.thermal.ambient_c, q.thermal.r_th_c_per_w,
                          q.thermal.tau_s, q.unmetered_network is True, q.idle is True)
                         for d in devices for q in (d.params,)], np.float64).reshape(n, 21).T.copy()
        (self.cap_j, self.battery, self.temp, self.energy, self.t, plugged, self.max_t, self.min_b, self.work_done,
         self.now, self.wall_origin, self.slept, self.idle_w, self.active_w, self.charge_w, self.s_per_unit,
         self.ambient, self.r_th, self.tau, unmetered_f, idle_f) = rows
        self.plugged = plugged > 0
        unmetered, idle = unmetered_f > 0, idle_f > 0
        # Eligibility rules other than battery and temperature that never change while a
        # simulated device trains (its charger, network and use are fixed): decide()'s
        # "others", except the daily window, which depends on the time.
        self.ineligible = ((~self.plugged & ~pol.allow_battery) | (pol.need_unmetered & ~unmetered)
                           | (pol.need_idle & ~idle))
        # The governors.
        self.steps = np.zeros(n, np.intp)
        self.t0 = np.zeros(n)
        self.started = np.zeros(n, bool)
        self.used_j = np.zeros(n)  # the governor's energy, summed reading by reading
        self.counter = np.zeros(n)  # its last reading of the device's energy counter
        self.last_units = np.ones(n)
        self.last_step_s = np.zeros(n)
        finite = pol.max_steps[np.isfinite(pol.max_steps)]
        self.history = _Samples(n, pol.history, int(finite.max()) if finite.size == n else 1 << 30)
        self.rests: _Samples | None = None  # made at the first rest

    # -- the simulated device (SimulatedDevice._integrate, _catch_up, work)

    def _integrate(self, i: np.ndarray, dt: np.ndarray, power: np.ndarray) -> None:
        on = dt > 0
        if not on.all():
            i, dt, power = i[on], dt[on], power[on]
        t_ss = self.ambient[i] + power * self.r_th[i]
        temp = t_ss + (self.temp[i] - t_ss) * _exp(-dt / self.tau[i])
        self.temp[i] = temp
        self.max_t[i] = np.where(temp > self.max_t[i], temp, self.max_t[i])
        net = np.where(self.plugged[i], self.charge_w[i], 0.0) - power
        battery = self.battery[i] + net * dt
        battery = np.where(battery < 0.0, 0.0, battery)
        cap = self.cap_j[i]
        battery = np.where(cap < battery, cap, battery)
        self.battery[i] = battery
        percent = 100.0 * battery / cap
        self.min_b[i] = np.where(percent < self.min_b[i], percent, self.min_b[i])
        self.energy[i] += power * dt

    def _read(self, i: np.ndarray) -> None:
        """A reading (``Governor._read`` of ``SimulatedDevice.read``): the device caught up
        at idle to its clock, and the governor's energy counted from its counter."""
        dt = self.now[i] - self.t[i]
        moved = dt != 0
        if moved.any():
            self._integrate(i[moved], dt[moved], self.idle_w[i[moved]])
        self.t[i] = self.now[i]
        counter = self.energy[i]
        seen = self.started[i]
        prev = self.counter[i]
        add = seen & (counter >= prev)
        self.used_j[i] = np.where(add, self.used_j[i] + (counter - prev), self.used_j[i])
        self.counter[i] = counter
        self.started[i] = True

    def percent(self, i: np.ndarray) -> np.ndarray:
        return 100.0 * self.battery[i] / self.cap_j[i]

    def elapsed(self, i: np.ndarray) -> np.ndarray:
        return 0.0 + (self.now[i] - self.t0[i])

    # -- the governor's rules (pacing.estimate_next_step, decide, check_rest)

    def estimate(self, i: np.ndarray) -> tuple[np.ndarray, ...]:
        """(rise, drop, energy, seconds, drain per s, energy per s) of the next step."""
        p, h = self.p, self.history
        k = p.k[i]
        valid = h.valid(i)
        units = h.units[i]
        per_unit = valid & (units > 0)
        safe_u = np.where(per_unit, units, 1.0)
        rise, has_rise = _largest(h.rise[i] / safe_u, per_unit)
        drop, has_drop = _largest(h.drop[i] / safe_u, per_unit)
        energy, has_energy = _largest(h.energy[i] / safe_u, per_unit)
        seconds, has_seconds = _largest(h.seconds[i] / safe_u, per_unit)
        secs = h.seconds[i]
        timed = valid & (secs > 0)
        safe_s = np.where(timed, secs, 1.0)
        drain, has_drain = _largest(h.drop[i] / safe_s, timed)
        power, has_power = _largest(h.energy[i] / safe_s, timed)
        if self.rests is not None:
            r = self.rests
            rtimed = r.valid(i) & (r.seconds[i] > 0)
            rsafe = np.where(rtimed, r.seconds[i], 1.0)
            rdrain, has_rdrain = _largest(r.drop[i] / rsafe, rtimed)
            rpower, has_rpower = _largest(r.energy[i] / rsafe, rtimed)
            drain, has_drain = np.maximum(drain, rdrain), has_drain | has_rdrain
            power, has_power = np.maximum(power, rpower), has_power | has_rpower
        jpu = p.jpu[i]
        use_jpu = ~has_energy & ~np.isnan(jpu)
        energy = np.where(use_jpu, jpu, energy)
        has_energy = has_energy | use_jpu
        prior_drop = np.where(self.plugged[i], 0.0, p.prior_drop[i])
        drain = np.where(has_drain, drain, prior_drop / p.quantum[i])
        rise = np.where(rise < 0.0, 0.0, rise)
        drop = np.where(drop < 0.0, 0.0, drop)
        energy = np.where(energy < 0.0, 0.0, energy)
        drain = np.where(drain < 0.0, 0.0, drain)
        power = np.where(has_power & ((power > 0.0) | np.isnan(power)), power, 0.0)
        nu = self.last_units[i]
        return (np.where(has_rise, k * rise * nu, p.prior_rise[i]),
                np.where(has_drop, k * drop * nu, prior_drop),
                np.where(has_energy, k * energy * nu, 0.0),
                np.where(has_seconds, k * seconds * nu, 0.0),
                k * drain, k * power)

    def _outside_window(self, i: np.ndarray) -> np.ndarray:
        windows = self.p.window
        if not any(w is not None for w in windows):
            return np.zeros(i.size, bool)
        wall = (self.wall_origin[i] + self.now[i]).tolist()
        return np.fromiter((w is not None and not w.contains(s)  # type: ignore[attr-defined]
                            for w, s in zip((windows[j] for j in self.p.index[i]), wall, strict=True)), bool, i.size)

    def decide(self, i: np.ndarray, est: tuple[np.ndarray, ...]) -> np.ndarray:
        p = self.p
        rise, drop, energy, seconds = est[:4]
        b, t, hard = self.percent(i), self.temp[i], p.hard[i]
        charging_up = self.plugged[i] & (drop <= 0.0)
        stop = ((self.steps[i] >= p.max_steps[i]) | self.ineligible[i] | self._outside_window(i)
                | (~charging_up & (b - drop < p.floor[i]))
                | (self.elapsed(i) + seconds > p.time_s[i])
                | (self.used_j[i] + energy > p.energy_j[i])
                | (t >= hard))
        return np.where(stop, _STOP, np.where(t + rise > hard, _COOL, _RUN))

    def rest(self, i: np.ndarray, seconds: np.ndarray) -> np.ndarray:
        """``Governor._rest``: the devices that may pause ``seconds`` do (and are read
        after it); the rest stop. Returns which of ``i`` stopped."""
        p = self.p
        rise, drop, energy, secs, drain_ps, power_ps = self.estimate(i)
        drain = drain_ps * seconds + drop
        charging_up = self.plugged[i] & (drain <= 0.0)
        stop = ((~charging_up & (self.percent(i) - drain < p.floor[i]))
                | (self.used_j[i] + power_ps * seconds + energy > p.energy_j[i])
                | (self.elapsed(i) + seconds + secs > p.time_s[i]))
        go, seconds = i[~stop], seconds[~stop]
        if go.size:
            t0, b0, e0 = self.temp[go], self.percent(go), self.used_j[go]
            self.slept[go] += seconds
            self.now[go] += seconds
            self._read(go)
            if self.rests is None:
                self.rests = _Samples(len(self.steps), self.p.history, 1 << 30)
            self.rests.push(go, 0.0, seconds, self.temp[go] - t0, b0 - self.percent(go), self.used_j[go] - e0)
        return stop

    def step(self, i: np.ndarray, units: np.ndarray, work: np.ndarray) -> None:
        """One step of ``work`` device units on each device (``SimulatedDevice.work``),
        recorded as ``units`` (``Governor.after_step``)."""
        t_before, t0, b0, e0 = self.now[i], self.temp[i], self.percent(i), self.used_j[i]
        dt = work * self.s_per_unit[i]
        self._integrate(i, dt, self.active_w[i])
        self.now[i] += dt
        self.t[i] = self.now[i]
        self.work_done[i] += work
        self._read(i)
        seconds = self.now[i] - t_before
        seconds = np.where(seconds < 0.0, 0.0, seconds)
        self.history.push(i, units, seconds, self.temp[i] - t0, b0 - self.percent(i), self.used_j[i] - e0)
        self.last_step_s[i] = seconds
        self.steps[i] += 1
        self.last_units[i] = np.where(units > 0, units, self.last_units[i])

    def put_back(self, devices: Sequence[SimulatedDevice]) -> None:
        cols = (self.battery, self.temp, self.energy, self.t, self.max_t, self.min_b, self.work_done,
                self.now, self.wall_origin, self.slept)
        for d, (battery, temp, energy, t, max_t, min_b, work_done, now, origin, slept) in zip(
                devices, zip(*(c.tolist() for c in cols), strict=True), strict=True):
            d.restore((battery, temp, energy, t, d.plugged, max_t, min_b, work_done, (now, origin, slept)))


def govern_many(devices: Sequence[SimulatedDevice], policies: Sequence[DevicePolicy],
                units: Sequence[float], work: Sequence[float]) -> tuple[list[float], list[int]]:
    """Run each device under its governor (``run_governed(Governor(device, policy,
    device.clock), step)``) with steps of ``work[i]`` units of device work, each counted
    as ``units[i]`` work units: (seconds each governed run took, steps each did), each
    device's state moved on as those runs would leave it."""
    n = len(devices)
    if not n == len(policies) == len(units) == len(work):
        raise ValueError(f"govern_many needs one policy, units and work per device: {n} devices, "
                         f"{len(policies)} policies, {len(units)} units, {len(work)} work")
    if n == 0:
        return [], []
    b = _Batch(devices, policies)
    p = b.p
    u = np.asarray(units, np.float64)
    w = np.asarray(work, np.float64)
    if (w < 0).any() or (u < 0).any():
        raise ValueError("work and work units must be >= 0")
    live = np.arange(n)
    while live.size:
        # before_step: done at max_steps; the first reading; the duty-cycle pause.
        live = live[b.steps[live] < p.max_steps[live]]
        first = live[~b.started[live]]
        if first.size:
            b.t0[first] = b.now[first]
            b._read(first)
        seen = live[b.history.count[live] > 0]
        if seen.size:
            t, hard, band = b.temp[seen], p.hard[seen], p.band[seen]
            soft = hard - band
            frac = np.minimum((t - soft) / band, 1.0)
            duty = np.where(t <= soft, 1.0, 1.0 - (1.0 - p.min_duty[seen]) * frac)
            slow = duty < 1.0
            if slow.any():
                pause_i, d = seen[slow], duty[slow]
                stopped = b.rest(pause_i, b.last_step_s[pause_i] * (1.0 - d) / d)
                live = np.setdiff1d(live, pause_i[stopped], assume_unique=True)
        # Decide, cooling in quanta, until each device runs or stops.
        ready: list[np.ndarray] = []
        pending, cooled = live, np.zeros(live.size)
        while pending.size:
            action = b.decide(pending, b.estimate(pending))
            ready.append(pending[action == _RUN])
            cool = action == _COOL
            pending, cooled = pending[cool], cooled[cool]
            q = p.quantum[pending]
            fits = ~(cooled + q > p.max_cool[pending])
            pending, cooled, q = pending[fits], cooled[fits], q[fits]
            if pending.size:
                stopped = b.rest(pending, q)
                pending, cooled = pending[~stopped], cooled[~stopped] + q[~stopped]
        live = np.sort(np.concatenate(ready)) if ready else live[:0]
        if live.size:
            b.step(live, u[live], w[live])
    b.put_back(devices)
    started = b.started
    elapsed = np.where(started, 0.0 + (b.now - b.t0), 0.0)
    return elapsed.tolist(), b.steps.tolist()
