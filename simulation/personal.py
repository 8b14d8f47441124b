"""Personal adapters in the simulator: every device that takes part in a round keeps its
personal adapter across rounds, and when the run ends every evaluated device evaluates
the global and its personal adapter on its own held-out data.

The strategies are the client's own (:mod:`orchard.client.personal`): each round a
trained device takes its personal step with ``DevicePersonal.round``, as the client
runtime does, from the adapter it kept (:func:`orchard.simulation.clients.run_jobs`);
the adapter is kept in the device's directory (``device-<partition>/personal-<run>.bin``
under the run's device root, the client's ``PersonalStore``), so memory holds one
device's adapter at a time and disk one file per device that took part. When the run
ends each evaluated device personalizes once more from the final global adapter,
starting from the adapter it kept (none: from the global one; "ditto": ``steps`` steps
under the pull towards the global adapter; "finetune": ``steps`` plain steps from the
global adapter). The figures are the exact mean and 10th percentile across the
evaluated devices (:func:`orchard.personal_metrics.exact`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from orchard.client.personal import (
    Personalizer,
    PersonalStore,
    personalize_and_evaluate,
    personalizer,
)
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


def kept(device_root: str | Path | None, partition: int, run_id: str) -> NDArrays | None:
    """The personal adapter a device kept from the rounds it took part in (None: none)."""
    if device_root is None:
        return None
    return PersonalStore(Path(device_root) / f"device-{partition}").load(run_id)


def evaluate_devices(task: Any, population: int, run: RunConfig, global_arrays: NDArrays,
                     devices: Sequence[int], strategy: Personalizer | None = None,
                     round_number: int = 0, device_root: str | Path | None = None,
                     run_id: str = "") -> dict[str, Any]:
    """Each device's accuracy of ``global_arrays`` and of its personal adapter on its own
    held-out data; ``strategy`` defaults to the run's. A device that kept an adapter under
    ``device_root`` for ``run_id`` starts from it. Returns the strategy's kind, the mean
    and 10th percentile of each, and the per-device values (``per_device``)."""
    strategy = strategy if strategy is not None else personalizer(run.personalization)
    gs: list[float] = []
    ps: list[float] = []
    for i in devices:
        trainer = task.client_trainer(i, population, run.seed)
        cfg = dataclasses.replace(run.train, seed=train_seed(run.seed, round_number, i))
        _, ev = personalize_and_evaluate(strategy, trainer, global_arrays, kept(device_root, i, run_id), cfg)
        if ev is None:  # no held-out example on this device
            continue
        gs.append(ev.global_accuracy)
        ps.append(ev.personal_accuracy)
    return {"kind": strategy.kind, "global": exact(gs), "personal": exact(ps),
            "per_device": {"global": gs, "personal": ps}}


def report_entry(task: Any, population: int, run: RunConfig, global_arrays: NDArrays,
                 rounds: int, device_root: str | Path | None = None, run_id: str = "") -> dict[str, Any]:
    """What the simulation report holds under ``personalization`` (without per-device values)."""
    got = evaluate_devices(task, population, run, global_arrays, devices_to_evaluate(population),
                           round_number=rounds + 1, device_root=device_root, run_id=run_id)
    got.pop("per_device")
    return got
