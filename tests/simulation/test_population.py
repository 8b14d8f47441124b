"""The population's catch-up of many devices at once against each device brought up alone."""

from __future__ import annotations

import math

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from orchard.edge_runtime.clock import VirtualClock
from orchard.edge_runtime.device import SimulatedDevice
from orchard.simulation import SimulationConfig
from orchard.simulation.population import LiveDevice, Population

_DAY = 86400.0


def _alone(pop: Population, i: int, t: float) -> SimulatedDevice:
    """Device ``i`` built from its row and brought up to ``t`` one plug change at a time,
    written plainly: the reference for Population.catch_up."""
    k = int(pop.kind[i])
    prof = pop.profiles[k]

    def plugged(at: float) -> bool:
        if not prof.battery:
            return True
        hour = ((at + pop.day_offset_s) % _DAY) / 3600.0
        start, end = prof.charging_start_hour, prof.charging_end_hour
        if start == end:
            return True
        return start <= hour < end if start < end else (hour >= start or hour < end)

    def next_change(at: float) -> float:
        if not prof.battery or prof.charging_start_hour == prof.charging_end_hour:
            return math.inf
        day_t = (at + pop.day_offset_s) % _DAY
        best = math.inf
        for h in (prof.charging_start_hour, prof.charging_end_hour):
            d = h * 3600.0 - day_t
            best = min(best, d + _DAY if d <= 0 else d)
        return at + best

    t0 = float(pop.updated[i])
    battery = min(max(float(pop.battery[i]), 0.0), 100.0) if prof.battery else 100.0
    params = pop.kind_params()[pop.kinds[k]].with_state(battery, plugged(t0), float(pop.temperature[i]))
    clock = VirtualClock(start=t0)
    dev = SimulatedDevice(params, clock)
    now = t0
    while now < t:
        clock.advance(min(next_change(now), t) - now)
        now = clock.monotonic()
        dev.set_plugged(plugged(now))
    return dev


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2**31), start_hour=st.floats(0.0, 23.99),
       moves=st.lists(st.tuples(st.floats(0.0, 4 * _DAY), st.floats(0.0, 4.0)), min_size=1, max_size=4))
def test_catch_up_is_each_device_brought_up_alone(seed: int, start_hour: float,
                                                 moves: list[tuple[float, float]]) -> None:
    """Rows left alone for up to days (across many plug changes), some of them written
    back part way (as devices that took part in a round are), come out of catch_up bit for
    bit as each device built and brought up alone, and a device made from its row reads
    as that device does."""
    cfg = SimulationConfig(clients=40, seed=seed, start_hour=start_hour)
    pop = Population(40, cfg.all_profiles(), cfg.devices, seed, flops_per_example=1e6,
                     day_offset_s=start_hour * 3600.0)
    rng = np.random.default_rng(seed)
    t = 0.0
    for gap, drain in moves:
        t += gap
        # Some devices took part in a round at t: they come back warmer and emptier.
        for i in rng.choice(40, size=10, replace=False).tolist():
            dev = _alone(pop, i, t)
            dev.work(drain * 600.0)
            pop.store(_as_live(pop, i, dev))
        ids = rng.permutation(40)[:25]
        cols = pop.catch_up(ids, t + 1.0)
        for j, i in enumerate(ids.tolist()):
            ref = _alone(pop, i, t + 1.0)
            live = pop.device(i, cols, j)
            assert live.device.snapshot() == ref.snapshot()
            assert Population.state_of(live) == Population.state_of(_as_live(pop, i, ref))


def _as_live(pop: Population, i: int, dev: SimulatedDevice) -> LiveDevice:
    k = int(pop.kind[i])
    return LiveDevice(i, pop.kinds[k], pop.profiles[k], dev, dev.clock, 1.0)  # type: ignore[arg-type]


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2**31), work=st.lists(st.floats(0.0, 3000.0), min_size=12, max_size=12),
       rest=st.floats(0.0, 2 * _DAY))
def test_store_many_writes_what_each_device_would(seed: int, work: list[float], rest: float) -> None:
    """Devices that trained (some past the end time already) put back together leave the
    rows store() leaves, one device at a time, bit for bit."""
    cfg = SimulationConfig(clients=30, seed=seed)
    a, b = (Population(30, cfg.all_profiles(), cfg.devices, seed, flops_per_example=1e6, day_offset_s=7200.0)
            for _ in range(2))
    ids = np.arange(0, 24, 2)
    devs = {}
    for pop in (a, b):
        cols = pop.catch_up(ids, 50.0)
        devs[id(pop)] = [pop.device(int(i), cols, j) for j, i in enumerate(ids.tolist())]
        for live, w in zip(devs[id(pop)], work, strict=True):
            live.device.work(w)
    end = 50.0 + rest
    a.store_many(devs[id(a)], end)
    for live in devs[id(b)]:
        live.clock.advance(max(0.0, end - live.clock.monotonic()))
        b.store(live)
    for name in ("battery", "temperature", "updated"):
        assert np.array_equal(getattr(a, name), getattr(b, name), equal_nan=True), name


def _candidates_plainly(pop: Population, rnd: int, attempt: int, batch: int) -> list[list[int]]:
    """Population.candidates written with a set and a loop: the reference."""
    rng = np.random.default_rng([pop.seed, rnd, attempt, 0xC4EC])
    seen: set[int] = set()
    out = []
    while len(seen) < pop.size // 2:
        ids = [int(i) for i in rng.integers(0, pop.size, size=batch) if int(i) not in seen]
        ids = list(dict.fromkeys(ids))  # in order, without repeats within the batch
        seen.update(ids)
        out.append(ids)
    rest = np.setdiff1d(np.arange(pop.size, dtype=np.int64), np.fromiter(seen, np.int64, len(seen)))
    rng.shuffle(rest)
    out.extend(r.tolist() for r in np.array_split(rest, max(1, len(rest) // max(batch, 1))))
    return out


@settings(max_examples=60, deadline=None)
@given(st.integers(2, 300), st.integers(0, 2**31), st.integers(0, 5), st.integers(0, 3), st.integers(1, 200))
def test_candidates_are_the_plain_draw(size: int, seed: int, rnd: int, attempt: int, batch: int) -> None:
    # Every device offered once, in the seeded order the plain loop gives, batch by batch.
    cfg = SimulationConfig(clients=size, clients_per_round=1, progress=False)
    pop = Population(size, cfg.all_profiles(), cfg.devices, seed, flops_per_example=1e6, day_offset_s=0.0)
    got = [c.tolist() for c in pop.candidates(rnd, attempt, batch)]
    assert all(c.dtype == np.int64 for c in pop.candidates(rnd, attempt, batch))
    assert got == _candidates_plainly(pop, rnd, attempt, batch)
    assert sorted(i for c in got for i in c) == list(range(size))
