"""The client half of the edge runtime: FedNova through the ordinary linear sums equals
``fednova.aggregate``; a stopped device waits past its ceiling or floor before it
polls again."""

from __future__ import annotations

import numpy as np
import pytest

from orchard.aggregation import (
    FEDNOVA_TAU,
    Accumulator,
    MetricSums,
    fednova_rescale,
    finalize,
    merge,
)
from orchard.client.edge import EdgeGovernance
from orchard.client.update import fednova_tau, fednova_update, with_fednova_tau
from orchard.config import EligibilityConfig
from orchard.edge_runtime import fednova
from orchard.edge_runtime.clock import VirtualClock
from orchard.edge_runtime.device import SimulatedDevice, SimulatedDeviceParams, StaticProvider
from orchard.edge_runtime.governor import GovernorReport, StopReason
from orchard.edge_runtime.policy import DevicePolicy, PacingConfig
from orchard.errors import ConfigError, UpdateSchemaError
from orchard.messages import UploadHeader, UploadKind
from orchard.trainer import TrainConfig, TrainResult
from orchard.typing import DeviceState, NDArrays, schema_of


def _header(weight: float, metrics: dict[str, float], metric_w: float) -> UploadHeader:
    return UploadHeader(
        node_id="n", run_id="r", round=1, attempt=0, task_id="t", kind=UploadKind.CLIENT_UPDATE,
        schema=(), payload_sizes=(), codec="none", payload_sha256="", weight=weight, count=1,
        metric_sums={k: v * metric_w for k, v in metrics.items()},
        metric_weights=dict.fromkeys(metrics, metric_w),
    )


@pytest.mark.parametrize("momentum", [0.0, 0.9])
def test_fednova_through_tiers_equals_the_reference(momentum: float) -> None:
    rng = np.random.default_rng(7)
    shapes = {"a": (3, 4), "b": (5,)}
    n = 6
    deltas: list[NDArrays] = [
        {k: rng.normal(size=s).astype(np.float32) for k, s in shapes.items()} for _ in range(n)
    ]
    steps = [1, 3, 7, 2, 10, 5]
    data = [40.0, 10.0, 25.0, 60.0, 5.0, 33.0]
    # Half the clients were stopped early by their governors: their work-scaled weight
    # differs from their data weight, and FedNova must use the data weight.
    results = [
        TrainResult({}, weight=w * (0.5 if i % 2 else 1.0), num_examples=int(w), num_steps=s,
                    planned_weight=w if i % 2 else None)
        for i, (w, s) in enumerate(zip(data, steps, strict=True))
    ]
    cfg = TrainConfig(optimizer="sgd", momentum=momentum)

    # Two tiers, three clients each; each tier folds headers exactly as a coordinator does.
    schema = schema_of(deltas[0])
    tiers = [Accumulator(schema), Accumulator(schema)]
    for i, (d, r) in enumerate(zip(deltas, results, strict=True)):
        sent, weighted, tau = fednova_update(d, r, cfg)
        assert tau == pytest.approx(fednova.norm_a(r.num_steps, momentum))
        h = with_fednova_tau(_header(weighted.weight, {"train_loss": 1.0}, r.num_examples), tau)
        acc = tiers[i % 2]
        acc.accumulate(sent, h.weight)
        acc.partial.metrics.merge(MetricSums(dict(h.metric_sums), dict(h.metric_weights)))
    mean, metrics = finalize(merge(tiers[0].partial, tiers[1].partial))
    got = fednova_rescale(mean, metrics)

    want = fednova.aggregate(deltas, steps, data, momentum=momentum)
    for k in shapes:
        np.testing.assert_allclose(got[k], want[k], rtol=1e-5, atol=1e-6)
    # And it is not FedAvg: with unequal steps the two differ.
    fedavg = {k: sum(w * d[k] for w, d in zip(data, deltas, strict=True)) / sum(data) for k in shapes}
    assert not np.allclose(got["a"], fedavg["a"], rtol=1e-3)
    assert metrics[FEDNOVA_TAU] == pytest.approx(
        sum(w * fednova.norm_a(s, momentum) for w, s in zip(data, steps, strict=True)) / sum(data)
    )


def test_fednova_tau_ignores_momentum_outside_sgd() -> None:
    r = TrainResult({}, 1.0, 1, num_steps=4)
    assert fednova_tau(r, TrainConfig(optimizer="adam", momentum=0.9)) == 4.0
    assert fednova_tau(r, TrainConfig(optimizer="sgd", momentum=0.5)) == pytest.approx(
        fednova.norm_a(4, 0.5)
    )


def test_root_refuses_fednova_without_tau() -> None:
    with pytest.raises(UpdateSchemaError, match="fednova_tau"):
        fednova_rescale({"a": np.ones(2, np.float32)}, {"train_loss": 1.0})


def _report(reason: StopReason | None) -> GovernorReport:
    return GovernorReport(3, 3.0, reason, "", (), 1.0, 1.0, 0.0, None, None, None, None, None)


def test_resume_waits_past_the_ceiling_and_the_floor() -> None:
    policy = DevicePolicy(
        eligibility=EligibilityConfig(min_battery_percent=20.0, max_temperature_c=45.0),
        pacing=PacingConfig(throttle_band_c=4.0),
    )
    edge = EdgeGovernance(StaticProvider(DeviceState()), policy, VirtualClock())
    assert edge.resume_policy(None) == policy
    assert edge.resume_policy(_report(StopReason.TIME_BUDGET)) == policy
    assert edge.resume_policy(_report(StopReason.THERMAL_CEILING)).eligibility.max_temperature_c == 41.0
    assert edge.resume_policy(_report(StopReason.BATTERY_FLOOR)).eligibility.min_battery_percent == 25.0


def test_a_hot_device_waits_on_the_clock_until_it_cooled() -> None:
    clock = VirtualClock()
    device = SimulatedDevice(SimulatedDeviceParams(temperature_c=50.0, plugged=True), clock)
    policy = DevicePolicy(eligibility=EligibilityConfig(max_temperature_c=45.0))
    edge = EdgeGovernance(device, policy, clock, simulated=True, poll_s=10.0, wait_slice_s=3600.0)
    decision = edge.wait_until_eligible(_report(StopReason.THERMAL_CEILING))
    assert decision.eligible
    # It waited until 5 °C (the default throttle band) below the ceiling, not just under it.
    assert edge.state().temperature_c < 40.0
    assert 0 < clock.monotonic() <= 3600.0

    # A slice shorter than the cooling returns "not yet" instead of blocking on.
    hot = SimulatedDevice(SimulatedDeviceParams(temperature_c=50.0), VirtualClock())
    edge = EdgeGovernance(hot, policy, hot.clock, poll_s=1.0, wait_slice_s=2.0)
    assert not edge.wait_until_eligible(None).eligible


def test_simulated_needs_a_device_that_takes_work() -> None:
    with pytest.raises(ConfigError, match="takes work"):
        EdgeGovernance(StaticProvider(DeviceState()), simulated=True)
