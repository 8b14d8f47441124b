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


def _kept(out, partition: int) -> dict:
    from orchard.client.personal import PersonalStore

    got = PersonalStore(out / "devices" / f"device-{partition}").load("sim-0")
    assert got is not None, f"device {partition} kept no personal adapter"
    return got


def test_a_device_keeps_its_ditto_adapter_across_rounds(tmp_path) -> None:
    import dataclasses

    import numpy as np

    from orchard.client.personal import Ditto
    from orchard.client.update import train_seed
    from orchard.tasks import get_task

    def sim(rounds: int, out):
        cfg = _sim("ditto").model_copy(update={"rounds": rounds, "clients": 10, "clients_per_round": 10,
                                               "out": out})
        return cfg, run_simulation(cfg)

    _, one = sim(1, tmp_path / "one")
    cfg, two = sim(2, tmp_path / "two")
    assert not two.status.startswith("failed"), two.status
    # Every device that took part keeps one adapter file, in its own directory, and no other.
    kept = sorted(p.parent.name for p in (tmp_path / "two" / "devices").glob("device-*/personal-*.bin"))
    assert kept == [f"device-{i}" for i in range(10)]
    after_one, after_two = _kept(tmp_path / "one", 0), _kept(tmp_path / "two", 0)
    # Personalizing once, from the final global adapter (what the simulator did before it
    # kept adapters across rounds): not what a device that took part in both rounds holds.
    run = cfg.run_config()
    task = get_task(run.task, **run.task_params)
    trainer = task.client_trainer(0, 10, run.seed)
    once = Ditto(10, 0.1).personalize(trainer, two.final_arrays, None,
                                      dataclasses.replace(run.train, seed=train_seed(run.seed, 2, 0)))
    assert once is not None and set(once) == set(after_two)
    for name in after_two:
        assert after_two[name].shape == after_one[name].shape
    assert any(not np.allclose(after_two[n], after_one[n]) for n in after_two)
    assert any(not np.allclose(after_two[n], once[n]) for n in after_two)
