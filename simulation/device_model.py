"""The device model: how long a simulated device trains, under the edge runtime's governor.

A selected device's local training is the edge runtime's :class:`SimulatedDevice`
(battery and thermal model) under its governor: it may pace itself or stop early, and
then trains only the steps it did. The devices of a batch are governed together, as
columns (``edge_runtime.governor_many.govern_many``: the governor's rules, held by a
property test to one ``Governor`` a device); :func:`device_training` is a batch of one.
:class:`DeviceRuns` runs a dispatch's devices, here or, a batch at a time, on an idle
worker (``run_devices``).
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

from orchard.edge_runtime.clock import VirtualClock
from orchard.edge_runtime.device import SimulatedDevice, SimulatedDeviceParams
from orchard.edge_runtime.governor_many import govern_many
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
        plans = self.plans[lo:hi]
        out[lo:hi] = devices_training([(dev.device, policy, planned, per_step, dev.seconds_per_example)
                                       for dev, policy, planned, per_step in plans])

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
            hi = min(front + _DEVICE_BATCH, back)  # columns: a device costs less in a larger batch
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
    simulated device (on its own ``clock``): under the edge runtime's governor with
    ``policy`` (it may pace the device or stop early), or without one (None) every step
    at once. One device of :func:`devices_training`."""
    if clock is not device.clock:
        raise ValueError("a simulated device trains on its own clock")
    (result,) = devices_training([(device, policy, planned, per_step, seconds_per_example)])
    return result


def devices_training(runs: list[tuple[SimulatedDevice, DevicePolicy | None, int, int, float]]
                     ) -> list[tuple[float, int]]:
    """:func:`device_training` for each (device, policy, planned steps, examples a step,
    seconds an example): the governed ones together, as columns (``govern_many``, which a
    property test holds to one ``Governor`` a device), each device moved on by its
    training."""
    out: list[tuple[float, int]] = [(0.0, 0)] * len(runs)
    governed = [j for j, r in enumerate(runs) if r[1] is not None]
    for j, (device, policy, planned, per_step, spe) in enumerate(runs):
        if policy is None:
            out[j] = device.work(planned * per_step * spe), planned
    if governed:
        batch = [runs[j] for j in governed]
        secs, steps = govern_many([r[0] for r in batch], [r[1] for r in batch],  # type: ignore[misc]
                                  [float(r[3]) for r in batch], [r[3] * r[4] for r in batch])
        for j, s, k in zip(governed, secs, steps, strict=True):
            out[j] = (s, k)
    return out


def run_devices(params: dict[str, SimulatedDeviceParams],
                batch: list[tuple[str, tuple[Any, ...], DevicePolicy | None, int, int, float]]
                ) -> list[tuple[float, int, tuple[Any, ...]]]:
    """:func:`device_training` for devices sent as (kind, snapshot, policy, planned steps,
    examples per step, seconds per example), each rebuilt from its kind's parameters
    (``params``): (seconds, steps, the device's new snapshot) for each."""
    devices = [SimulatedDevice.from_snapshot(params[kind], snap) for kind, snap, *_ in batch]
    done = devices_training([(device, policy, planned, per_step, spe)
                             for device, (_, _, policy, planned, per_step, spe) in zip(devices, batch, strict=True)])
    return [(secs, steps, device.snapshot()) for (secs, steps), device in zip(done, devices, strict=True)]
