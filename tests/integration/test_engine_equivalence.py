"""One round engine: the simulator and a real gRPC federation end with the same model, bit for bit.

For each configuration, the same seed and run config go through

- the simulator (virtual clock, in-process transport: ``Coordinator(inline=True)``), and
- a real federation on loopback: a root, 2 aggregators and 6 clients over gRPC,

and after 3 rounds both global models must be equal to the last bit. The two paths share
the coordinator, the upload builder, the secure-aggregation client and server, and the
root step, so any logic that lives on one path only (as FedNova once did in the
simulator) shows up here as a different model.

What the test pins down so that "bit for bit" is a fair demand: float64 sums depend on
the order of their terms, so every client of the gRPC federation uploads only after the
previous one's upload was folded (:class:`Turnstile`), in partition order, which is the
order the simulator folds equal-speed devices in. The root adds two partials to zero,
which commutes, and secure aggregation sums exactly in its field, so neither depends on
arrival order.

FedBuff (asynchronous mode) runs on a flat federation, root and 6 clients, as the
simulator runs it: which buffer an update lands in depends on when it arrives, so the
gRPC clients upload on the simulator's schedule (:class:`VersionTurnstile`), stale ones
only once the root moved on. A continuation buffer that takes an update before the next
version opens hands its sum over whole, into an empty buffer, which is the same float64
sum as folding the updates there one by one.
"""

from __future__ import annotations

import asyncio
import hashlib
import multiprocessing
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from fed_harness import FAST, Federation, add_clients, start_run, wait_joined, wait_status

from orchard import wire
from orchard.config import RunConfig
from orchard.link import FleetLink
from orchard.ops import ControlClient
from orchard.server.app import start_aggregator, start_root
from orchard.simulation import DeviceProfile, SimulationConfig, run_simulation

CLIENTS, AGGREGATORS, ROUNDS = 6, 2, 3
DIGITS = {"with_replacement": True, "samples_per_client": 20}
# Equal devices (no speed spread, always on, never dropping): the simulator's clients
# finish together and fold in partition order.
EQUAL = DeviceProfile(gflops=10.0, speed_sigma=0.0, battery=False, availability=[1.0] * 24, dropout=0.0,
                      latency_s=0.05)
EF_POWERSGD = {"name": "error_feedback", "params": {"codec": {"name": "powersgd", "params": {"rank": 2}}}}

CASES: dict[str, dict[str, Any]] = {
    "fedavg": {},
    "fedadam": {"server_optimizer": {"name": "fedadam", "lr": 0.05}},
    "fednova": {"cohort": {"weighting": "fednova"}, "train": {"momentum": 0.5}},
    "steps": {"cohort": {"weighting": "steps"}},
    "randk": {"codec": {"name": "randk", "params": {"fraction": 0.25}}},
    "powersgd-ef": {"codec": EF_POWERSGD},
    "secure": {"secure_aggregation": {"enabled": True, "bits": 20, "clip": 1.0}},
}


def _merge(base: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for k, v in extra.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def _sim_config(case: str, backend: str = "local") -> SimulationConfig:
    run = _merge({"task": "digits", "task_params": DIGITS,
                  "train": {"epochs": 1, "batch_size": 10, "learning_rate": 0.1},
                  "cohort": {"over_selection": 1.0, "min_fraction": 1.0, "deadline_s": 600.0, "max_retries": 0}},
                 CASES[case])
    return SimulationConfig.model_validate(dict(
        clients=CLIENTS, clients_per_round=CLIENTS, rounds=ROUNDS, seed=11, aggregators=AGGREGATORS,
        backend=backend, workers=2 if backend == "ray" else 1, vectorize=False, governor=False, progress=False,
        profiles={"equal": EQUAL}, devices={"equal": 1.0}, run=run))


class Turnstile:
    """Clients upload one at a time, in partition order, each after the previous one's
    upload was folded; round by round."""

    def __init__(self, order: list[int]) -> None:
        self.order = order
        self.done: dict[tuple[int, int], asyncio.Event] = {}

    def _event(self, rnd: int, partition: int) -> asyncio.Event:
        return self.done.setdefault((rnd, partition), asyncio.Event())

    def wrap(self, link: FleetLink, partition: int) -> None:
        push = link.push_update
        i = self.order.index(partition)

        async def in_turn(header: Any, payload: bytes, *a: Any, **kw: Any) -> Any:
            if i > 0:
                await self._event(header.round, self.order[i - 1]).wait()
            try:
                return await push(header, payload, *a, **kw)
            finally:
                self._event(header.round, partition).set()

        link.push_update = in_turn  # type: ignore[method-assign]


async def _federation(tmp: Path, run: RunConfig) -> dict[str, np.ndarray]:
    root = await start_root(tmp / "root", insecure=True, server_cfg=FAST, start_grace_s=0.2, seed=run.seed)
    fed = Federation(root)
    try:
        for _ in range(AGGREGATORS):
            fed.aggregators.append(await start_aggregator(root.address, insecure=True, server_cfg=FAST,
                                                          seed=run.seed))
        # As the simulator places device i: under aggregator i % AGGREGATORS.
        turn = Turnstile(list(range(CLIENTS)))
        for j, agg in enumerate(fed.aggregators):
            parts = list(range(j, CLIENTS, AGGREGATORS))
            for rt, k in zip(await add_clients(fed, agg.address, parts, CLIENTS, task_params=DIGITS), parts,
                             strict=True):
                turn.wrap(rt.link, k)
        for agg in fed.aggregators:
            await wait_joined(agg, CLIENTS // AGGREGATORS)
        await start_run(root, run)
        st = await wait_status(root, lambda s: s.get("status") in ("completed", "failed"), 240)
        assert st["status"] == "completed" and st["completed_rounds"] == ROUNDS, st
        assert all(r["participants"] == CLIENTS for r in st["rounds"]), st["rounds"]
        ctl = ControlClient(root.address, insecure=True)
        try:
            return wire.blob_to_arrays(await asyncio.to_thread(ctl.pull_global))
        finally:
            ctl.close()
    finally:
        await fed.stop()


def _assert_same(sim: dict[str, np.ndarray], grpc_model: dict[str, np.ndarray]) -> None:
    assert sorted(sim) == sorted(grpc_model)
    for k, v in sim.items():
        np.testing.assert_array_equal(grpc_model[k], v, err_msg=f"tensor {k!r} differs")


@pytest.mark.parametrize("case", list(CASES))
def test_simulator_equals_grpc_federation(case: str, tmp_path: Path) -> None:
    cfg = _sim_config(case)
    report = run_simulation(cfg)
    assert report.status == "completed" and len(report.rounds) == ROUNDS
    assert all(r["participants"] == CLIENTS for r in report.rounds)
    grpc_model = asyncio.run(_federation(tmp_path, cfg.run_config()))
    _assert_same(report.final_arrays, grpc_model)


def test_ray_backend_equals_grpc_federation(tmp_path: Path) -> None:
    """The Ray backend is one more engine backend: the same model as the gRPC tree."""
    pytest.importorskip("ray", reason="ray is in the dev extras; install with pip install -e '.[dev]'")
    cfg = _sim_config("fedavg", backend="ray")
    # In a fresh process, as `orchard simulate --backend ray` runs: Ray forks its local
    # cluster's processes, and a test process that already ran gRPC servers has gRPC
    # threads a fork can catch mid-call (the cluster then never comes up).
    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        report = pool.submit(run_simulation, cfg).result()
    grpc_model = asyncio.run(_federation(tmp_path, cfg.run_config()))
    _assert_same(report.final_arrays, grpc_model)


def test_the_check_can_fail(tmp_path: Path) -> None:
    """A one-ulp difference is a failure: the comparison is exact, not a tolerance."""
    a = {"w": np.array([1.0, 2.0], np.float32)}
    b = {"w": np.array([1.0, np.nextafter(np.float32(2.0), np.float32(3.0))], np.float32)}
    with pytest.raises(AssertionError):
        _assert_same(a, b)


# ---------------------------------------------------------------------- FedBuff

# K = 3 of a concurrency of 6 (ceil(3 x 2.0)), at most 2 versions stale, f(s) = (1 + s)^-1/2.
# With equal devices the simulator's buffers are: version 1 folds devices 0, 1, 2 fresh
# while 3, 4, 5 still train on it (carried); version 2 folds 3, 4, 5 at staleness 1 while
# 0, 1, 2 train on it; version 3 folds 0, 1, 2 at staleness 1. The federation is flat
# (the simulator runs asynchronous mode for a root and its clients only).
ASYNC = {"mode": {"kind": "async", "buffer_size": 3, "max_staleness": 2},
         "cohort": {"over_selection": 2.0, "min_fraction": 1.0, "deadline_s": 600.0, "max_retries": 0}}
# The uploads of that schedule, (model version, partition), in fold order.
ASYNC_ORDER = [(1, 0), (1, 1), (1, 2), (1, 3), (1, 4), (1, 5), (2, 0), (2, 1), (2, 2)]


def _async_sim_config(**extra: Any) -> SimulationConfig:
    run = _merge(_merge({"task": "digits", "task_params": DIGITS,
                         "train": {"epochs": 1, "batch_size": 10, "learning_rate": 0.1}}, ASYNC), extra)
    return SimulationConfig.model_validate(dict(
        clients=CLIENTS, clients_per_round=CLIENTS, rounds=ROUNDS, seed=11, aggregators=0, backend="local",
        workers=1, vectorize=False, governor=False, progress=False, profiles={"equal": EQUAL},
        devices={"equal": 1.0}, run=run))


class VersionTurnstile:
    """Uploads in ``ASYNC_ORDER``, each after the one before it was folded; an update of
    version 1 from devices 3, 4, 5 only once version 2 opened (the simulator's devices
    finish after the root moved on, so the root carries them, still training, into the
    next buffer). Any other upload waits for good: it comes after the run's last buffer."""

    def __init__(self, root: Any) -> None:
        self.root = root
        self.done = {k: asyncio.Event() for k in ASYNC_ORDER}

    async def _version_open(self, v: int) -> None:
        while (cr := self.root.coordinator.current) is None or cr.task.round < v:
            await asyncio.sleep(0.01)

    def wrap(self, link: FleetLink, partition: int) -> None:
        push = link.push_update

        async def in_turn(header: Any, payload: bytes, *a: Any, **kw: Any) -> Any:
            key = (header.round, partition)
            if key not in self.done:
                await asyncio.Event().wait()
            i = ASYNC_ORDER.index(key)
            if i > 0:
                await self.done[ASYNC_ORDER[i - 1]].wait()
            if key[0] == 1 and partition >= 3:
                await self._version_open(2)
            try:
                return await push(header, payload, *a, **kw)
            finally:
                self.done[key].set()

        link.push_update = in_turn  # type: ignore[method-assign]


async def _flat_federation(tmp: Path, run: RunConfig, noise_rng: np.random.Generator | None = None
                           ) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    root = await start_root(tmp / "root", insecure=True, server_cfg=FAST, start_grace_s=0.2, seed=run.seed,
                            noise_rng=noise_rng)
    fed = Federation(root)
    try:
        turn = VersionTurnstile(root)
        parts = list(range(CLIENTS))
        for rt, k in zip(await add_clients(fed, root.address, parts, CLIENTS, task_params=DIGITS), parts,
                         strict=True):
            turn.wrap(rt.link, k)
        await wait_joined(root, CLIENTS)
        await start_run(root, run)
        st = await wait_status(root, lambda s: s.get("status") in ("completed", "failed"), 240)
        assert st["status"] == "completed" and st["completed_rounds"] == ROUNDS, st
        ctl = ControlClient(root.address, insecure=True)
        try:
            return wire.blob_to_arrays(await asyncio.to_thread(ctl.pull_global)), st
        finally:
            ctl.close()
    finally:
        await fed.stop()


def test_fedbuff_simulator_equals_grpc_federation(tmp_path: Path) -> None:
    cfg = _async_sim_config()
    report = run_simulation(cfg)
    assert report.status == "completed" and len(report.rounds) == ROUNDS
    want = [{"0": 3}, {"1": 3}, {"1": 3}]
    assert [r["staleness"] for r in report.rounds] == want, [r["staleness"] for r in report.rounds]
    grpc_model, st = asyncio.run(_flat_federation(tmp_path, cfg.run_config()))
    assert [r["staleness"] for r in st["rounds"]] == want, st["rounds"]
    _assert_same(report.final_arrays, grpc_model)


def test_fedbuff_with_central_dp_simulator_equals_grpc_federation(tmp_path: Path) -> None:
    """FedBuff with the root's central DP noise: the same ledger (noise multiplier and
    population stated, so both plan the same noise), the same clip, and the root's noise
    drawn from the generator the simulator seeds its root with: the same models, bit for bit."""
    privacy = {"mode": "central", "noise_multiplier": 1.0, "population": 6, "clip_norm": 0.5}
    cfg = _async_sim_config(privacy=privacy, cohort={"weighting": "uniform"})
    report = run_simulation(cfg)
    assert report.status == "completed" and len(report.rounds) == ROUNDS, report.status
    assert all(r["privacy"]["noise_stddev"] == 0.5 for r in report.rounds), report.rounds
    root_h = int(hashlib.sha256(b"root").hexdigest()[:8], 16)  # as simulation.tree seeds its root's noise
    noise = np.random.default_rng([cfg.seed, 0, root_h, 0xD9])
    grpc_model, st = asyncio.run(_flat_federation(tmp_path, cfg.run_config(), noise))
    assert [r["privacy"]["noise_stddev"] for r in st["rounds"]] == [0.5] * ROUNDS, st["rounds"]
    assert st["privacy"]["epsilon"] == report.privacy["epsilon"]
    _assert_same(report.final_arrays, grpc_model)
