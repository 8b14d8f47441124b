"""Edge clients in a real federation (root over gRPC on loopback, in-process): two
simulated devices train the Shakespeare LoRA task under their governors. One starts
too hot and joins the round once it has cooled; the other runs low on battery and
stops after a few steps. The partial update arrives with the steps actually done and
is weighted as the run's config says: by the work in it ("examples"), or by FedNova."""

from __future__ import annotations

import asyncio
import dataclasses
from pathlib import Path

import numpy as np
import pytest
from fed_harness import FAST, Federation, start_run, wait_status

from orchard import wire
from orchard.client.edge import EdgeGovernance
from orchard.client.runtime import ClientRuntime
from orchard.client.update import train_seed
from orchard.config import CohortConfig, EligibilityConfig, RunConfig
from orchard.edge_runtime import fednova
from orchard.edge_runtime.clock import VirtualClock
from orchard.edge_runtime.device import SimulatedDevice, SimulatedDeviceParams
from orchard.edge_runtime.governor import StopReason
from orchard.edge_runtime.policy import DevicePolicy
from orchard.link import FleetLink, LinkConfig
from orchard.ops import ControlClient
from orchard.server.app import start_root
from orchard.tasks import get_task
from orchard.trainer import TrainConfig
from orchard.typing import Role

NUM_PARTITIONS = 200
PLANNED = TrainConfig(steps=10, batch_size=4, learning_rate=0.05, optimizer="sgd")
ELIGIBILITY = EligibilityConfig(min_battery_percent=20.0, max_temperature_c=45.0)


@pytest.fixture(scope="module")
def task():
    return get_task("shakespeare")


def _devices() -> dict[int, SimulatedDevice]:
    return {
        # Plugged in but 50 °C: ineligible until it cools below the 45 °C ceiling.
        0: SimulatedDevice(SimulatedDeviceParams(temperature_c=50.0, plugged=True), VirtualClock()),
        # 36 J of battery at 40 %: a step of 4 examples costs 4 * 0.1 s * 6 W = 2.4 J
        # (6.7 %), so the 20 % floor stops it after about two of its ten steps.
        1: SimulatedDevice(
            SimulatedDeviceParams(capacity_wh=0.01, battery_percent=40.0, seconds_per_unit=0.1),
            VirtualClock(),
        ),
    }


async def _federation(tmp: Path, task, devices: dict[int, SimulatedDevice]) -> Federation:
    root = await start_root(tmp / "root", insecure=True, server_cfg=FAST, start_grace_s=0.5)
    fed = Federation(root)
    for k, dev in devices.items():
        link = FleetLink(LinkConfig(target=root.address, role=Role.CLIENT, insecure=True, node_id=f"edge-{k}"))
        edge = EdgeGovernance(dev, DevicePolicy(eligibility=ELIGIBILITY), dev.clock, simulated=True,
                              poll_s=10.0, wait_slice_s=3600.0)
        rt = ClientRuntime(link, (lambda p: lambda cfg: task.client_trainer(p, NUM_PARTITIONS, cfg.seed))(k),
                           partition_id=k, edge=edge)
        fed.clients.append(rt)
        fed.client_tasks.append(asyncio.create_task(rt.run()))
    return fed


def _global(address: str) -> dict[str, np.ndarray]:
    ctl = ControlClient(address, insecure=True)
    try:
        return wire.blob_to_arrays(ctl.pull_global())
    finally:
        ctl.close()


async def _one_round(tmp: Path, task, weighting: str):
    devices = _devices()
    fed = await _federation(tmp, task, devices)
    try:
        cfg = RunConfig(task="shakespeare", rounds=1, seed=5, train=PLANNED, eligibility=ELIGIBILITY,
                        cohort=CohortConfig(target=2, over_selection=1.0, min_fraction=1.0, deadline_s=60,
                                            weighting=weighting))  # type: ignore[arg-type]
        assert fed.root is not None
        await start_run(fed.root, cfg)
        st = await wait_status(fed.root, lambda s: s.get("status") in ("completed", "failed"), 90)
        arrays = await asyncio.to_thread(_global, fed.root.address)
        reports = {k: rt.reports[0] for k, rt in enumerate(fed.clients)}
        return cfg, st, arrays, reports, devices
    finally:
        await fed.stop()


def _delta(task, cfg: RunConfig, partition: int, steps: int) -> tuple[dict[str, np.ndarray], int]:
    """What ``partition`` trains in ``steps`` steps of round 1, and its data size: a gate
    that stops after k steps leaves exactly what k ungoverned steps give."""
    init = task.initial_arrays(cfg.seed)
    trainer = task.client_trainer(partition, NUM_PARTITIONS, cfg.seed)
    tc = dataclasses.replace(cfg.train, seed=train_seed(cfg.seed, 1, partition), steps=steps)
    res = trainer.train(init, tc)
    return {k: res.arrays[k] - init[k] for k in init}, len(trainer.inner.train_data)


@pytest.mark.parametrize("weighting", ["examples", "fednova"])
def test_partial_work_is_reported_and_weighted(tmp_path: Path, task, weighting: str) -> None:
    cfg, st, got, reports, devices = asyncio.run(_one_round(tmp_path, task, weighting))
    assert st["status"] == "completed", st
    hot, low = reports[0], reports[1]
    assert hot.accepted and low.accepted, (hot, low)

    # The hot device waited on its clock until it had cooled, then did the full round.
    assert hot.governor is not None and hot.governor.stop_reason is None
    assert hot.num_steps == PLANNED.steps
    assert devices[0].clock.monotonic() > 0 and devices[0].max_temperature_c == 50.0
    assert hot.governor.max_temperature_c is not None and hot.governor.max_temperature_c < 45.0

    # The low-battery device stopped at its floor and sent what it had.
    assert low.governor is not None and low.governor.stop_reason is StopReason.BATTERY_FLOOR
    k = low.num_steps
    assert 1 <= k < PLANNED.steps
    assert devices[1].min_battery_percent >= ELIGIBILITY.min_battery_percent
    assert low.metrics["governor_stopped_early"] == 1.0

    d_hot, n_hot = _delta(task, cfg, 0, PLANNED.steps)
    d_low, n_low = _delta(task, cfg, 1, k)
    init = task.initial_arrays(cfg.seed)
    (rnd,) = st["rounds"]
    if weighting == "examples":
        # Weight = examples x fraction of the planned steps done.
        assert hot.weight == n_hot
        assert low.weight == pytest.approx(n_low * k / PLANNED.steps)
        w = np.array([hot.weight, low.weight])
        want = {n: init[n] + (w[0] * d_hot[n] + w[1] * d_low[n]) / w.sum() for n in init}
    else:
        # FedNova weighs by data and normalises by steps instead.
        assert (hot.weight, low.weight) == (n_hot, n_low)
        assert rnd["metrics"]["fednova_tau"] == pytest.approx((n_hot * PLANNED.steps + n_low * k) / (n_hot + n_low))
        agg = fednova.aggregate([d_hot, d_low], [PLANNED.steps, k], [n_hot, n_low])
        want = {n: init[n] + agg[n] for n in init}
    assert rnd["participants"] == 2 and rnd["weight"] == pytest.approx(hot.weight + low.weight)
    for n in init:
        scale = np.abs(want[n] - init[n]).max()
        assert scale > 0
        assert np.abs(got[n] - want[n]).max() <= 1e-5 * scale + 1e-7, n
