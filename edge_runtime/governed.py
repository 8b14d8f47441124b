"""Training under the governor: the glue between a :class:`~orchard.trainer.Trainer` and
:class:`~orchard.edge_runtime.governor.Governor` (ARCHITECTURE section 4).

The governor is a :class:`~orchard.trainer.StepGate`: a trainer that accepts a gate asks
it before every step and stops when it says no. :func:`governed_train` runs one round
of local training that way and returns the trainer's result together with the
governor's report, whose metrics (steps, pauses, energy, peak temperature) travel with
the update.

Two adapters for devices that are not the host:

- :class:`SimulatedLoad` charges each step's work to a
  :class:`~orchard.edge_runtime.device.SimulatedDevice`, so that a real trainer on a
  laptop drains a simulated battery and heats a simulated body as a phone would.
- :class:`SerializedDevice` makes a provider safe to read from two threads (the client
  runtime reports device state in heartbeats while training runs in an executor);
  the simulated device integrates its state on every read and is not thread-safe.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, replace
from typing import Protocol

from orchard.trainer import StepGate, TrainConfig, Trainer, TrainResult, train_gated
from orchard.typing import DeviceState, NDArrays

from .device import DeviceStateProvider
from .governor import Governor, GovernorReport


class WorkSink(Protocol):
    """A device that is told how much work ran (the simulated device)."""

    def work(self, units: float) -> float: ...


class SerializedDevice:
    """``provider`` behind a lock: ``read`` and ``work`` never interleave.

    ``work`` is offered only when the wrapped provider has it (a simulated device).
    """

    def __init__(self, provider: DeviceStateProvider) -> None:
        self.inner = provider
        self._lock = threading.Lock()

    def read(self) -> DeviceState:
        with self._lock:
            return self.inner.read()

    def work(self, units: float) -> float:
        sink = self.inner
        if not hasattr(sink, "work"):
            raise TypeError(f"{type(sink).__name__} does not take simulated work")
        with self._lock:
            return float(sink.work(units))


class SimulatedLoad:
    """A gate that charges each finished step's work to a simulated device first.

    On a real device the training step itself drains the battery and heats the body;
    on a simulated one nothing happens unless it is told. ``seconds_per_unit`` of the
    device turns a step of ``units`` examples into simulated time, energy and heat,
    which the governor then measures as if the step had caused them.
    """

    def __init__(self, gate: StepGate, device: WorkSink, units_per_example: float = 1.0) -> None:
        self.gate = gate
        self.device = device
        self.units_per_example = units_per_example

    def before_step(self) -> bool:
        return self.gate.before_step()

    def after_step(self, work_units: float = 1.0) -> None:
        self.device.work(work_units * self.units_per_example)
        self.gate.after_step(work_units)


@dataclass(frozen=True)
class GovernedResult:
    result: TrainResult
    report: GovernorReport

    @property
    def stopped_early(self) -> bool:
        return self.result.stopped_early


def governed_train(
    trainer: Trainer,
    arrays: NDArrays,
    config: TrainConfig,
    governor: Governor,
    *,
    load: WorkSink | None = None,
) -> GovernedResult:
    """One round of local training paced by ``governor``.

    ``load``: a simulated device to charge each step's work to (see
    :class:`SimulatedLoad`); None on a real device. The governor's metrics are added
    to the result's, so the server sees how the round went on the device.
    """
    gate: StepGate = governor if load is None else SimulatedLoad(governor, load)
    result = train_gated(trainer, arrays, config, gate)
    report = governor.report()
    metrics = {**result.metrics, **report.to_metrics()}
    return GovernedResult(replace(result, metrics=metrics), report)
