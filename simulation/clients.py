"""The client side of a simulated round: train, take the delta, encode, build the upload.

A job is what a real client holds after it has polled: its task assignment (and the
global model it pulled). :func:`run_jobs` does what ``ClientRuntime._do_task`` does for
each, with the same functions (``train_seed``, ``delta_of``, ``build_upload``), so a
simulated client sends the bytes a real one would. Clients are built from their
partition index when the job runs and dropped when it returns: memory follows the size
of a job, not of the population.

Small models train many clients at once (:mod:`orchard.simulation.vectorized`) when the
trainer allows it; the uploads are built one by one either way.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from orchard.client.update import build_upload, delta_of, train_seed
from orchard.compression import Codec
from orchard.config import RunConfig
from orchard.errors import OrchardError
from orchard.messages import TaskAssignment, UploadHeader
from orchard.simulation import vectorized
from orchard.tasks import Task
from orchard.trainer import TrainConfig, TrainResult
from orchard.typing import NDArrays


@dataclass
class ClientJob:
    partition: int
    node_id: str
    assignment: TaskAssignment
    steps: int | None = None  # set when the device's governor stopped training early
    codec_state: dict[str, Any] | None = None


@dataclass
class ClientOutput:
    partition: int
    node_id: str
    header: UploadHeader | None
    payload: bytes = b""
    codec_state: dict[str, Any] | None = None
    error: str = ""
    metrics: dict[str, float] = field(default_factory=dict)


def _train_config(cfg: RunConfig, job: ClientJob) -> tuple[int, TrainConfig]:
    seed = train_seed(cfg.seed, job.assignment.round, job.partition)
    tc = dataclasses.replace(cfg.train, seed=seed)
    if job.steps is not None:
        tc = dataclasses.replace(tc, steps=job.steps)
    return seed, tc


def run_jobs(task: Task, population: int, cfg: RunConfig, codec: Codec, global_arrays: NDArrays,
             jobs: list[ClientJob], vectorize: bool) -> list[ClientOutput]:
    """Train and encode every job; a client whose training fails sends nothing (as on a device)."""
    trainers = [task.client_trainer(j.partition, population, cfg.seed) for j in jobs]
    seeds_cfgs = [_train_config(cfg, j) for j in jobs]
    results: list[TrainResult | None | str]
    if vectorize and jobs and vectorized.supports(trainers[0], seeds_cfgs[0][1]):
        results = list(vectorized.train_many(trainers, global_arrays, [c for _, c in seeds_cfgs]))
    else:
        results = []
        for tr, (_, tc) in zip(trainers, seeds_cfgs, strict=True):
            try:
                results.append(tr.train(global_arrays, tc))
            except (OrchardError, ValueError, RuntimeError) as err:
                results.append(f"{type(err).__name__}: {err}")
    del trainers
    out = []
    for job, (seed, _), res in zip(jobs, seeds_cfgs, results, strict=True):
        if not isinstance(res, TrainResult):
            out.append(ClientOutput(job.partition, job.node_id, None, error=str(res)))
            continue
        if res.num_examples == 0:
            out.append(ClientOutput(job.partition, job.node_id, None, error="no training data"))
            continue
        try:
            delta = delta_of(job.assignment, global_arrays, res)
            header, payload, states = build_upload(job.assignment, cfg, codec, job.node_id, delta, res, seed,
                                                   job.codec_state)
        except OrchardError as err:
            out.append(ClientOutput(job.partition, job.node_id, None, error=f"{type(err).__name__}: {err}"))
            continue
        out.append(ClientOutput(job.partition, job.node_id, header, payload, states or None,
                                metrics=dict(res.metrics)))
    return out
