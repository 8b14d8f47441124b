"""The device model: how long a simulated device trains, under the edge runtime's governor.

A selected device's local training is the edge runtime's :class:`SimulatedDevice`
(battery and thermal model) under its governor (``run_governed``): it may pace itself
or stop early, and then trains only the steps it did. :func:`device_training` is one
device; :class:`DeviceRuns` runs a dispatch's devices, here or, a batch at a time, on
an idle worker (``run_devices``).
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

from orchard.edge_runtime.clock import VirtualClock
from orchard.edge_runtime.device import SimulatedDevice, SimulatedDeviceParams
from orchard.edge_runtime.governor import Governor, run_governed
from orchard.edge_runtime.policy import DevicePolicy
from orchard.simulation.population import LiveDevice

_DEVICE_BATCH = 256  # device models per batch sent to a worker (see DeviceRuns)


class DeviceRuns:
    """The device models of one dispatch: (seconds, steps done) of local training on each
    device added, each device's state moved on by its training.

    Under the governor a device's model is thousands of small steps of Python a round.
    With a backend that runs devices elsewhere (``run_devices``: a worker process, idle
    while devices are handed their tasks) full batches go to the worker as soon as they
    are added, while the rest of the cohort is handed out, as long as the worker has at
    most one batch waiting behind the one it runs. :meth:`results` then runs the rest
    here from the front while the worker takes batches from the back, until they meet. A
    device's result is a pure function of its state, policy and plan, so where and when
    it ran changes nothing; a device run elsewhere comes back as a snapshot of its new
    state. Without such a backend (or without the governor) every device runs here."""

    def __init__(self, run_devices: Callable[..., Future[list[tuple[float, int, tuple[Any, ...]]]]] | None,
                 kind_params: dict[str, SimulatedDeviceParams]) -> None:
        self._run_devices = run_devices
        self._kind_params = kind_params  # what rebuilds a device from its snapshot on the worker
        self.plans: list[tuple[LiveDevice, DevicePolicy | None, int, int]] = []
        self._away: list[tuple[int, int, Future[list[tuple[float, int, tuple[Any, ...]]]]]] = []
        self._sent = 0  # plans[:_sent] were sent while devices were added (front to back)

    def add(self, plan: tuple[LiveDevice, DevicePolicy | None, int, int]) -> None:
        """A device's plan (``Dispatch.device_plan``), its state as it starts."""
        self.plans.append(plan)
        if (self._run_devices is not None and len(self.plans) - self._sent >= _DEVICE_BATCH
                and self._worker_has_room()):
            self._send(self._sent, self._sent + _DEVICE_BATCH)
            self._sent += _DEVICE_BATCH

    def _worker_has_room(self) -> bool:
        # A worker runs its batches in order: if the last-but-one is done, so is every
        # earlier one.
        return sum(not f.done() for _, _, f in self._away[-2:]) < 2

    def _send(self, lo: int, hi: int) -> None:
        assert self._run_devices is not None  # only sent to a backend that runs devices
        batch = [(dev.kind, dev.device.snapshot(), policy, planned, per_step, dev.seconds_per_example)
                 for dev, policy, planned, per_step in self.plans[lo:hi]]
        self._away.append((lo, hi, self._run_devices(self._kind_params, batch)))

    def _here(self, lo: int, hi: int, out: list[tuple[float, int] | None]) -> None:
        for i in range(lo, hi):
            dev, policy, planned, per_step = self.plans[i]
            out[i] = device_training(dev.device, dev.clock, policy, planned, per_step, dev.seconds_per_example)

    def results(self) -> list[tuple[float, int]]:
        """(seconds, steps done) of every device added, in the order they were added."""
        plans = self.plans
        out: list[tuple[float, int] | None] = [None] * len(plans)
        front, back = self._sent, len(plans)
        if self._run_devices is None or back - front < 2 * _DEVICE_BATCH:
            self._here(front, back, out)
            front = back
        while front < back:
            if self._worker_has_room() and back - front > _DEVICE_BATCH:
                lo = max(front, back - _DEVICE_BATCH)
                self._send(lo, back)  # the worker keeps one batch running and one waiting
                back = lo
                continue
            hi = min(front + _DEVICE_BATCH // 4, back)
            self._here(front, hi, out)
            front = hi
        for lo, hi, fut in self._away:
            for i, (secs, steps, snap) in zip(range(lo, hi), fut.result(), strict=True):
                plans[i][0].device.restore(snap)
                out[i] = (secs, steps)
        done = [r for r in out if r is not None]
        assert len(done) == len(plans)  # every device ran, here or on the worker
        return done


def device_training(device: SimulatedDevice, clock: VirtualClock, policy: DevicePolicy | None, planned: int,
                    per_step: int, seconds_per_example: float) -> tuple[float, int]:
    """(seconds, steps done) of ``planned`` local steps of ``per_step`` examples on a
    simulated device: under the edge runtime's governor with ``policy`` (it may pace the
    device or stop early), or without one (None) every step at once."""
    if policy is None:
        return device.work(planned * per_step * seconds_per_example), planned
    gov = Governor(device, policy, clock)

    def step() -> float:
        device.work(per_step * seconds_per_example)
        return float(per_step)

    report = run_governed(gov, step)
    return report.elapsed_s, report.steps_done


def run_devices(params: dict[str, SimulatedDeviceParams],
                batch: list[tuple[str, tuple[Any, ...], DevicePolicy | None, int, int, float]]
                ) -> list[tuple[float, int, tuple[Any, ...]]]:
    """:func:`device_training` for devices sent as (kind, snapshot, policy, planned steps,
    examples per step, seconds per example), each rebuilt from its kind's parameters
    (``params``): (seconds, steps, the device's new snapshot) for each."""
    out = []
    for kind, snap, policy, planned, per_step, spe in batch:
        device = SimulatedDevice.from_snapshot(params[kind], snap)
        secs, steps = device_training(device, device.clock, policy, planned, per_step, spe)
        out.append((secs, steps, device.snapshot()))
    return out
