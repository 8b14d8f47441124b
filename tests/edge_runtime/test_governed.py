"""Training under the governor: a real trainer on a simulated device stops at the
battery floor or the thermal ceiling, reports the steps it did, and weighs its update
by the work in it; without a gate nothing changes, bit for bit."""

from __future__ import annotations

import numpy as np
import pytest

from orchard.config import EligibilityConfig
from orchard.edge_runtime.clock import VirtualClock
from orchard.edge_runtime.device import SimulatedDevice, SimulatedDeviceParams, ThermalParams
from orchard.edge_runtime.governed import SerializedDevice, SimulatedLoad, governed_train
from orchard.edge_runtime.governor import Governor, StopReason
from orchard.edge_runtime.policy import DevicePolicy, PacingConfig, RoundBudget
from orchard.tasks import get_task
from orchard.tasks.torch_trainer import TorchTrainer
from orchard.trainer import EvalResult, TrainConfig, TrainResult, accepts_gate, train_gated
from orchard.typing import NDArrays

PLANNED = TrainConfig(steps=20, batch_size=8, learning_rate=0.1, seed=3)


@pytest.fixture(scope="module")
def digits():
    return get_task("digits")


def _trainer(task) -> TorchTrainer:
    tr = task.client_trainer(2, 10, 0)
    assert isinstance(tr, TorchTrainer)
    return tr


def _policy(floor: float = 20.0, ceiling: float = 45.0, **pacing: float) -> DevicePolicy:
    return DevicePolicy(
        eligibility=EligibilityConfig(min_battery_percent=floor, max_temperature_c=ceiling),
        pacing=PacingConfig(**pacing),  # type: ignore[arg-type]
    )


class CountingGate:
    """Always yes; counts what it is told."""

    def __init__(self) -> None:
        self.before = 0
        self.units: list[float] = []

    def before_step(self) -> bool:
        self.before += 1
        return True

    def after_step(self, work_units: float = 1.0) -> None:
        self.units.append(work_units)


def _same(a: TrainResult, b: TrainResult) -> None:
    assert list(a.arrays) == list(b.arrays)
    for k in a.arrays:
        np.testing.assert_array_equal(a.arrays[k], b.arrays[k])
    assert (a.weight, a.num_examples, a.num_steps, a.metrics, a.stopped_early) == (
        b.weight,
        b.num_examples,
        b.num_steps,
        b.metrics,
        b.stopped_early,
    )


def test_a_gate_that_never_stops_changes_nothing(digits) -> None:
    init = digits.initial_arrays(0)
    plain = _trainer(digits).train(init, PLANNED)
    gate = CountingGate()
    gated = _trainer(digits).train(init, PLANNED, gate=gate)
    _same(plain, gated)
    assert not plain.stopped_early
    assert gate.before == PLANNED.steps and gate.units == [8.0] * PLANNED.steps


def test_battery_floor_stops_training_with_fewer_steps(digits) -> None:
    clock = VirtualClock()
    # 36 J of battery; a step of 8 examples costs 8 * 0.05 s * 6 W = 2.4 J (6.7 %), so
    # from 40 % the floor at 20 % allows about three steps of the twenty planned.
    device = SimulatedDevice(
        SimulatedDeviceParams(capacity_wh=0.01, battery_percent=40.0, seconds_per_unit=0.05),
        clock,
    )
    gov = Governor(device, _policy(floor=20.0, prior_drop_percent=8.0), clock)
    trainer = _trainer(digits)
    n = len(trainer.train_data)
    out = governed_train(trainer, digits.initial_arrays(0), PLANNED, gov, load=device)
    r, rep = out.result, out.report
    assert rep.stop_reason is StopReason.BATTERY_FLOOR
    assert 1 <= r.num_steps < PLANNED.steps
    assert r.num_steps == rep.steps_done
    assert r.stopped_early
    assert r.num_examples == min(n, 8 * r.num_steps)
    assert r.weight == pytest.approx(n * r.num_steps / PLANNED.steps)
    assert r.planned_weight == n
    assert device.min_battery_percent >= 20.0
    assert r.metrics["governor_steps"] == r.num_steps
    assert r.metrics["governor_stopped_early"] == 1.0
    # The partial model is what those steps trained: re-running that many steps
    # without a gate gives the same arrays.
    again = _trainer(digits).train(
        digits.initial_arrays(0), TrainConfig(**{**PLANNED.__dict__, "steps": r.num_steps})
    )
    for k in r.arrays:
        np.testing.assert_array_equal(r.arrays[k], again.arrays[k])


def test_thermal_ceiling_stops_training(digits) -> None:
    clock = VirtualClock()
    # Full load settles at 25 + 6 W * 10 °C/W = 85 °C with a 5 s time constant: a
    # 0.4 s step heats a 40 °C device by ~3.5 °C, so the 45 °C ceiling comes fast.
    device = SimulatedDevice(
        SimulatedDeviceParams(
            temperature_c=40.0,
            plugged=True,
            thermal=ThermalParams(ambient_c=25.0, r_th_c_per_w=10.0, tau_s=5.0),
        ),
        clock,
    )
    # No time to cool: the governor must stop rather than wait.
    gov = Governor(device, _policy(ceiling=45.0, max_cooldown_s=0.0), clock)
    out = governed_train(_trainer(digits), digits.initial_arrays(0), PLANNED, gov, load=device)
    assert out.report.stop_reason is StopReason.THERMAL_CEILING
    assert 1 <= out.result.num_steps < PLANNED.steps
    assert device.max_temperature_c <= 45.0


def test_max_steps_budget_and_zero_steps(digits) -> None:
    clock = VirtualClock()
    device = SimulatedDevice(SimulatedDeviceParams(plugged=True), clock)
    budget = DevicePolicy(budget=RoundBudget(max_steps=5))
    out = governed_train(
        _trainer(digits), digits.initial_arrays(0), PLANNED, Governor(device, budget, clock), load=device
    )
    assert out.result.num_steps == 5 and out.report.stop_reason is StopReason.COMPLETED
    assert out.stopped_early  # fewer than the 20 the round asked for

    # Too hot to start at all: no step, arrays untouched, weight 0.
    hot = SimulatedDevice(SimulatedDeviceParams(temperature_c=50.0), clock)
    init = digits.initial_arrays(0)
    out = governed_train(_trainer(digits), init, PLANNED, Governor(hot, _policy(), clock), load=hot)
    assert out.result.num_steps == 0 and out.result.weight == 0.0 and out.result.num_examples == 0
    for k in init:
        np.testing.assert_array_equal(out.result.arrays[k], init[k])


class WholeLoopTrainer:
    """A trainer that cannot be paced step by step (like a Flower app)."""

    def __init__(self) -> None:
        self.calls = 0

    def train(self, arrays: NDArrays, config: TrainConfig) -> TrainResult:
        self.calls += 1
        return TrainResult({k: v + 1 for k, v in arrays.items()}, 7.0, 7, 3)

    def evaluate(self, arrays: NDArrays, config: TrainConfig) -> EvalResult:
        return EvalResult(0)


class NoGate:
    def before_step(self) -> bool:
        return False

    def after_step(self, work_units: float = 1.0) -> None:
        raise AssertionError("after_step without a step")


def test_trainers_without_a_gate_run_as_one_step() -> None:
    t = WholeLoopTrainer()
    assert not accepts_gate(t)
    arrays = {"w": np.zeros(2, np.float32)}
    gate = CountingGate()
    r = train_gated(t, arrays, TrainConfig(), gate)
    assert r.num_steps == 3 and gate.before == 1 and gate.units == [7.0]
    r = train_gated(t, arrays, TrainConfig(), NoGate())
    assert t.calls == 1 and r.num_steps == 0 and r.stopped_early
    np.testing.assert_array_equal(r.arrays["w"], arrays["w"])


def test_lora_trainer_hands_the_gate_to_its_loop() -> None:
    import torch

    from orchard.edge_runtime.lora import LoRASpec, LoRATrainer, get_arrays
    from orchard.tasks.torch_trainer import TensorData

    x = torch.randn(16, 4, generator=torch.Generator().manual_seed(0))
    data = TensorData(x, (x[:, 0] > 0).long())
    spec = LoRASpec(target_modules=("0", "2"), rank=2)
    trainer = LoRATrainer(
        lambda: torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2)),
        spec,
        lambda factory, names: TorchTrainer(factory, data, data, trainable=names),
    )
    assert accepts_gate(trainer)

    class StopAfter(CountingGate):
        def before_step(self) -> bool:
            super().before_step()
            return self.before <= 2

    init = get_arrays(trainer.inner.model, trainer.names)
    r = trainer.train(init, TrainConfig(steps=6, batch_size=4), gate=StopAfter())
    assert r.num_steps == 2 and r.stopped_early and r.weight == pytest.approx(16 * 2 / 6)


def test_serialized_device_reads_and_works() -> None:
    clock = VirtualClock()
    dev = SerializedDevice(SimulatedDevice(SimulatedDeviceParams(), clock))
    before = dev.read().battery_percent
    dev.work(10)
    assert dev.read().battery_percent < before
    assert SimulatedLoad(CountingGate(), dev).before_step()
