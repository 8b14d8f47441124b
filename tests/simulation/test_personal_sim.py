"""Personal adapters in the simulator's report and in a root's status."""

from __future__ import annotations

import math

from orchard import personal_metrics
from orchard.config import RunConfig
from orchard.server.observe import personalization
from orchard.simulation import SimulationConfig, run_simulation

ALWAYS_ON = {"gflops": 20.0, "battery": False, "availability": [1.0] * 24, "dropout": 0.0}


def _sim(kind: str) -> SimulationConfig:
    run = RunConfig.model_validate({
        "task": "digits", "task_params": {"alpha": 0.1}, "rounds": 2,
        "train": {"epochs": 1, "batch_size": 8, "learning_rate": 0.1},
        "cohort": {"over_selection": 1.0, "min_fraction": 1.0, "deadline_s": 3600.0},
        "personalization": {"kind": kind, "steps": 10, "lam": 0.1}})
    return SimulationConfig(clients=30, clients_per_round=10, rounds=2, progress=False, governor=False,
                            profiles={"box": ALWAYS_ON}, devices={"box": 1.0}, run=run)


def test_the_report_holds_each_devices_global_and_personal_accuracy() -> None:
    report = run_simulation(_sim("ditto"))
    pz = report.personalization
    assert pz is not None and pz["kind"] == "ditto"
    for model in ("global", "personal"):
        assert 20 <= pz[model]["devices"] <= 30  # a device with no held-out example is not counted
        assert 0.0 <= pz[model]["p10"] <= pz[model]["mean"] <= 1.0
    # Devices on few classes gain from their own adapter.
    assert pz["personal"]["mean"] > pz["global"]["mean"]
    assert "personalization" in report.to_dict()
    assert run_simulation(_sim("none")).personalization is None


def test_status_reads_the_latest_round_that_carries_device_evaluations() -> None:
    m = {k: v for k, v in personal_metrics.encode(0.5, 0.9).items()}
    rounds = [{"round": 1, "metrics": m}, {"round": 2, "metrics": {"train_loss": 1.0}}]
    got = personalization(rounds)
    assert got["round"] == 1
    assert math.isclose(got["personal"]["mean"], 0.9) and math.isclose(got["global"]["mean"], 0.5)
    assert personalization([{"round": 1, "metrics": {"train_loss": 1.0}}]) == {}
