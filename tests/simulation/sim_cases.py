"""The simulation configurations the simulator's tests share: a small digits run, a
device that is always there, and a cohort that is the whole population (deterministic).
A plain module beside the tests (tests/ is not a package), imported by name.
"""

from __future__ import annotations

from orchard.config import CohortConfig, RunConfig
from orchard.simulation import DeviceProfile, SimulationConfig

DIGITS = {"with_replacement": True, "samples_per_client": 20}
ALWAYS_ON = DeviceProfile(gflops=10.0, battery=False, availability=[1.0] * 24, dropout=0.0, latency_s=0.05)


def _run(**kw: object) -> RunConfig:
    base: dict[str, object] = dict(task="digits", task_params=DIGITS,
                                   train={"epochs": 1, "batch_size": 10, "learning_rate": 0.1})
    base.update(kw)
    return RunConfig.model_validate(base)


def _sim(**kw: object) -> SimulationConfig:
    base: dict[str, object] = dict(clients=400, clients_per_round=40, rounds=2, aggregators=2, progress=False,
                                   run=_run())
    base.update(kw)
    return SimulationConfig.model_validate(base)


def _deterministic(n: int, **kw: object) -> SimulationConfig:
    """Every device always on, never dropping, selected every round: the cohort is the population."""
    run = _run(cohort=CohortConfig(target=n, over_selection=1.0, min_fraction=1.0, deadline_s=600.0))
    base: dict[str, object] = dict(clients=n, clients_per_round=n, rounds=2, progress=False,
                                   profiles={"box": ALWAYS_ON}, devices={"box": 1.0}, run=run)
    base.update(kw)
    return SimulationConfig.model_validate(base)


