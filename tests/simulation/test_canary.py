"""Canary devices (``[simulation.attack] kind = "canary"``): each folded canary sends
exactly its norm times its seeded direction, whichever way the simulator builds uploads,
and the report counts the folds an auditor needs."""

from __future__ import annotations

import numpy as np
import pytest

from orchard.simulation import SimulationConfig, canary, run_simulation
from orchard.tasks import get_task


@pytest.mark.parametrize("vectorize", [True, False])
def test_the_model_moves_by_the_mean_of_the_canaries_directions(vectorize: bool) -> None:
    cfg = SimulationConfig.model_validate(dict(
        clients=30, clients_per_round=6, rounds=1, aggregators=0, seed=3, evaluate_every=0, progress=False,
        vectorize=vectorize, attack={"fraction": 1.0, "kind": "canary", "multiplier": 0.5},
        run={"task": "digits", "task_params": {"with_replacement": True},
             "cohort": {"weighting": "uniform", "over_selection": 1.0},
             "server_optimizer": {"name": "fedavg", "lr": 1.0}}))
    rep = run_simulation(cfg)
    folds = rep.canary_folds or {}
    assert sum(folds.values()) == rep.rounds[0]["participants"] >= 3
    initial = get_task("digits", with_replacement=True).initial_arrays(cfg.run_config().seed)
    shapes = {k: v.shape for k, v in initial.items()}
    expect = {k: np.zeros(s) for k, s in shapes.items()}
    for p, n in folds.items():
        for k, v in canary.update(shapes, 3, int(p), 0.5).items():
            expect[k] += n * v.astype(np.float64) / sum(folds.values())
    for k, v in initial.items():
        np.testing.assert_allclose(rep.final_arrays[k] - v, expect[k], atol=1e-6)


def test_unseen_directions_are_unit_and_independent_of_the_canaries() -> None:
    shapes = {"a": (30, 20), "b": (7,)}
    d, u = canary.direction(shapes, 0, 5), canary.unseen_direction(shapes, 0, 5)
    for x in (d, u):
        assert sum(float((v ** 2).sum()) for v in x.values()) == pytest.approx(1.0)
    assert abs(sum(float((d[k] * u[k]).sum()) for k in shapes)) < 0.2
