"""Personal adapters in the simulator: every evaluated device personalizes with the run's
strategy and evaluates the global and its personal adapter on its own held-out data.

The strategies are the client's own (:mod:`orchard.client.personal`,
``personalize_and_evaluate``), run on each device's trainer; nothing here trains
differently. What differs from a live device: a simulated device keeps no adapter
between rounds. It personalizes once, from the run's final global adapter, when the run
ends ("ditto": ``steps`` steps from the global adapter under the pull towards it;
"finetune": ``steps`` plain steps). The figures are the exact mean and 10th percentile
across the evaluated devices (:func:`orchard.personal_metrics.exact`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import numpy as np

from orchard.client.personal import Personalizer, personalize_and_evaluate, personalizer
from orchard.client.update import train_seed
from orchard.config import RunConfig
from orchard.personal_metrics import exact
from orchard.typing import NDArrays

# Devices evaluated when the caller names none: the population, or this many of it,
# evenly spread over the partition ids.
DEFAULT_DEVICES = 1000


def devices_to_evaluate(population: int, limit: int = DEFAULT_DEVICES) -> list[int]:
    if population <= limit:
        return list(range(population))
    return sorted({int(i) for i in np.linspace(0, population - 1, limit)})


def evaluate_devices(task: Any, population: int, run: RunConfig, global_arrays: NDArrays,
                     devices: Sequence[int], strategy: Personalizer | None = None,
                     round_number: int = 0) -> dict[str, Any]:
    """Each device's accuracy of ``global_arrays`` and of its personal adapter on its own
    held-out data; ``strategy`` defaults to the run's. Returns the strategy's kind, the
    mean and 10th percentile of each, and the per-device values (``per_device``)."""
    strategy = strategy if strategy is not None else personalizer(run.personalization)
    gs: list[float] = []
    ps: list[float] = []
    for i in devices:
        trainer = task.client_trainer(i, population, run.seed)
        cfg = dataclasses.replace(run.train, seed=train_seed(run.seed, round_number, i))
        _, ev = personalize_and_evaluate(strategy, trainer, global_arrays, None, cfg)
        if ev is None:  # no held-out example on this device
            continue
        gs.append(ev.global_accuracy)
        ps.append(ev.personal_accuracy)
    return {"kind": strategy.kind, "global": exact(gs), "personal": exact(ps),
            "per_device": {"global": gs, "personal": ps}}


def report_entry(task: Any, population: int, run: RunConfig, global_arrays: NDArrays,
                 rounds: int) -> dict[str, Any]:
    """What the simulation report holds under ``personalization`` (without per-device values)."""
    got = evaluate_devices(task, population, run, global_arrays, devices_to_evaluate(population),
                           round_number=rounds + 1)
    got.pop("per_device")
    return got
