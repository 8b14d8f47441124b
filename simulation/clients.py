"""The client side of a simulated round: train, take the delta, encode, build the upload.

A job is what a real client holds after it has polled: its task assignment (and the
global model it pulled). :func:`run_jobs` does what ``ClientRuntime._do_task`` does for
each, with the same functions (``train_seed``, ``delta_of``, ``build_upload``), so a
simulated client sends the bytes a real one would. Clients are built from their
partition index when the job runs and dropped when it returns: memory follows the size
of a job, not of the population.

Small models train many clients at once (:mod:`orchard.simulation.vectorized`) when the
trainer allows it. The uploads of the clients that start from one model are built
together where the run allows it (``deltas_of`` and ``build_uploads``: a cast codec, no
per-client normalisation; the same bytes and headers as ``build_upload``, client by
client), else one by one.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, cast

import numpy as np

from orchard.client.update import build_upload, build_uploads, delta_of, deltas_of, train_seed
from orchard.compression import Codec
from orchard.config import RunConfig
from orchard.errors import OrchardError
from orchard.messages import TaskAssignment, UploadHeader
from orchard.simulation import vectorized
from orchard.tasks import Task
from orchard.trainer import TrainConfig, TrainResult, round_config
from orchard.typing import NDArrays, TensorSpec


@dataclass
class ClientJob:
    partition: int
    node_id: str
    assignment: TaskAssignment
    steps: int | None = None  # set when the device's governor stopped training early
    codec_state: dict[str, Any] | None = None
    # The model the client starts from: "" for the round's global model, else the sha256
    # of its reconstruction from a downlink delta (a key of run_jobs' ``starts``).
    start: str = ""
    # A simulated attacker sends ``attack * delta`` (1.0: an honest client).
    attack: float = 1.0
    # Virtual seconds since the run began when it starts training: a streaming task's
    # trainer reads the samples of its device's stream arrived by then.
    now_s: float = 0.0
    # A canary (orchard.simulation.canary): (seed, norm) of the direction it sends instead.
    canary: tuple[int, float] | None = None
    # The device's own directory when it personalizes: its personal adapter is kept there
    # across rounds (orchard.client.personal.DevicePersonal), as a real device's state dir.
    state_dir: str = ""


@dataclass
class ClientOutput:
    partition: int
    node_id: str
    header: UploadHeader | None
    payload: bytes = b""
    codec_state: dict[str, Any] | None = None
    error: str = ""
    metrics: dict[str, float] = field(default_factory=dict)


class PackedOutputs:
    """A job list's outputs in the form that crosses a process boundary cheaply: every
    payload in one buffer, the rest per client. Pickling a thousand 20 KB ``bytes``
    objects one by one copied each several times over (the pickler's growing buffer,
    then the reader's); one buffer goes through in one piece.

    ``into``: a buffer the reader can see too (a shared-memory segment of the engine's):
    the payloads are written there, if they fit, and only the rest is pickled. Through a
    pipe a job's 10 MB of payloads took some 150 round trips of 64 KB between the two
    processes; through the segment they are one copy. ``in_segment`` says where they went."""

    __slots__ = ("rows", "blob", "in_segment")

    def __init__(self, outputs: list[ClientOutput], into: memoryview | None = None) -> None:
        # A header travels as its fields: a dict pickles in C, where a dataclass instance
        # goes through copyreg's reduce one object at a time (twice the cost both ways).
        self.rows = [(o.partition, o.node_id, None if o.header is None else o.header.__dict__, len(o.payload),
                      o.codec_state, o.error, o.metrics)
                     for o in outputs]
        total = sum(len(o.payload) for o in outputs)
        self.in_segment = into is not None and total <= len(into)
        if self.in_segment:
            assert into is not None
            off = 0
            for o in outputs:
                into[off:off + len(o.payload)] = o.payload
                off += len(o.payload)
            self.blob = b""
        else:
            self.blob = b"".join(o.payload for o in outputs)

    def __getstate__(self) -> tuple[list[tuple[Any, ...]], bytes, bool]:
        return self.rows, self.blob, self.in_segment

    def __setstate__(self, state: tuple[list[tuple[Any, ...]], bytes, bool]) -> None:
        self.rows, self.blob, self.in_segment = state

    def unpack(self, schemas: Sequence[tuple[TensorSpec, ...]] = (),
               segment: memoryview | None = None) -> list[ClientOutput]:
        """The outputs. ``schemas``: the jobs' schemas as the engine holds them; a header
        whose schema equals one of them takes that very object (the worker's copies arrive
        as new objects, which a tier would otherwise compare spec by spec). ``segment``:
        the buffer the payloads were written to, when they were (``in_segment``); they
        are copied out, so it can take the next job's."""
        if not self.in_segment:
            view = memoryview(self.blob)
        elif segment is None:
            raise ValueError("these outputs' payloads are in a shared segment: pass it to unpack")
        else:
            view = segment
        off, out = 0, []
        same: dict[int, tuple[TensorSpec, ...]] = {}  # id of an unpickled schema -> the one to use
        for partition, node_id, fields, size, codec_state, error, metrics in self.rows:
            header = None
            if fields is not None:
                got = fields["schema"]
                schema = same.get(id(got))
                if schema is None:
                    schema = same[id(got)] = next((s for s in schemas if s == got), got)
                fields["schema"] = schema
                header = object.__new__(UploadHeader)  # its fields, as the worker's instance held them
                header.__dict__.update(fields)
            out.append(ClientOutput(partition, node_id, header, bytes(view[off:off + size]), codec_state, error,
                                    metrics))
            off += size
        return out


class MissingStartModel(OrchardError):
    """A job names a start model that was not sent with it (an engine bug, never input)."""


def _start(starts: Mapping[str, NDArrays] | None, key: str) -> NDArrays:
    if starts is None or key not in starts:
        raise MissingStartModel(f"job starts from model {key[:16]}... which the round did not provide")
    return starts[key]


def _train_config(cfg: RunConfig, job: ClientJob) -> tuple[int, TrainConfig]:
    seed = train_seed(cfg.seed, job.assignment.round, job.partition)
    t = cfg.train
    # dataclasses.replace, spelled out: replace() inspects the fields on every call,
    # and a round builds one config per client.
    tc = TrainConfig(epochs=t.epochs, steps=t.steps if job.steps is None else job.steps, batch_size=t.batch_size,
                     learning_rate=t.learning_rate, optimizer=t.optimizer, momentum=t.momentum,
                     weight_decay=t.weight_decay, proximal_mu=t.proximal_mu, seed=seed, extra=t.extra)
    return seed, tc


def run_jobs(task: Task, population: int, cfg: RunConfig, codec: Codec, global_arrays: NDArrays,
             jobs: list[ClientJob], vectorize: bool,
             starts: Mapping[str, NDArrays] | None = None, device: str = "cpu") -> list[ClientOutput]:
    """Train and encode every job; a client whose training fails sends nothing (as on a device).

    A job whose ``start`` is set trains from ``starts[start]`` (the model it rebuilt from
    a downlink delta) and its update is taken against that, as on a device."""
    trainers = [task.client_trainer(j.partition, population, cfg.seed) for j in jobs]
    for trainer, job in zip(trainers, jobs, strict=True):
        arrive = getattr(trainer, "arrive", None)  # a device whose data is a stream (orchard.tasks.stream)
        if arrive is not None:
            arrive(job.now_s)
    seeds_cfgs = [_train_config(cfg, j) for j in jobs]
    for i, (trainer, job) in enumerate(zip(trainers, jobs, strict=True)):
        seed, tc = seeds_cfgs[i]
        seeds_cfgs[i] = (seed, round_config(trainer, tc, job.assignment.round))
    models = [global_arrays if not j.start else _start(starts, j.start) for j in jobs]
    results: list[TrainResult | None | str] = [None] * len(jobs)
    groups: dict[int, list[int]] = {}  # jobs by the model they start from
    for i, m in enumerate(models):
        groups.setdefault(id(m), []).append(i)
    for idx in groups.values():
        start = models[idx[0]]
        if vectorize and vectorized.supports(trainers[idx[0]], seeds_cfgs[idx[0]][1]):
            got = vectorized.train_many([trainers[i] for i in idx], start, [seeds_cfgs[i][1] for i in idx], device)
            for i, r in zip(idx, got, strict=True):
                results[i] = r
            continue
        for i in idx:
            try:
                results[i] = trainers[i].train(start, seeds_cfgs[i][1])
            except (OrchardError, ValueError, RuntimeError) as err:
                results[i] = f"{type(err).__name__}: {err}"
    if cfg.personalization.enabled:
        _personal_rounds(cfg, jobs, trainers, models, seeds_cfgs, results)
    del trainers
    # The uploads of the clients that start from one model, built together where they can
    # be (build_uploads: the same bytes as build_upload, client by client).
    built: dict[int, tuple[UploadHeader, bytes]] = {}
    for idx in groups.values():
        trained = [(i, r) for i in idx if isinstance(r := results[i], TrainResult) and r.num_examples > 0]
        if len(trained) < 2:
            continue
        ok, done = [i for i, _ in trained], [r for _, r in trained]
        deltas = deltas_of(jobs[ok[0]].assignment, models[ok[0]], done)
        if deltas is None:
            continue
        for row, i in enumerate(ok):
            if jobs[i].attack != 1.0:
                for v in deltas.values():
                    v[row] *= np.float32(jobs[i].attack)
            if jobs[i].canary is not None:
                sent = _canary(jobs[i], {k: v.shape[1:] for k, v in deltas.items()})
                for k, v in deltas.items():
                    v[row] = sent[k]
        try:
            got = build_uploads([jobs[i].assignment for i in ok], cfg, codec, [jobs[i].node_id for i in ok], deltas,
                                done, [seeds_cfgs[i][0] for i in ok])
        except OrchardError:  # built one by one below, where each client's error is its own
            got = None
        if got is not None:
            built.update(zip(ok, got, strict=True))
    out = []
    for i, (job, (seed, tc), start, res) in enumerate(zip(jobs, seeds_cfgs, models, results, strict=True)):
        if not isinstance(res, TrainResult):
            out.append(ClientOutput(job.partition, job.node_id, None, error=str(res)))
            continue
        if res.num_examples == 0:
            out.append(ClientOutput(job.partition, job.node_id, None, error="no training data"))
            continue
        if i in built:
            header, payload = built[i]
            out.append(ClientOutput(job.partition, job.node_id, header, payload, None, metrics=dict(res.metrics)))
            continue
        try:
            delta = delta_of(job.assignment, start, res)
            if job.attack != 1.0:
                delta = {k: (v * np.float32(job.attack)).astype(np.float32) for k, v in delta.items()}
            if job.canary is not None:
                delta = _canary(job, {k: np.shape(v) for k, v in delta.items()})
            header, payload, states = build_upload(job.assignment, cfg, tc, codec, job.node_id, delta, res, seed,
                                                   job.codec_state)
        except OrchardError as err:
            out.append(ClientOutput(job.partition, job.node_id, None, error=f"{type(err).__name__}: {err}"))
            continue
        out.append(ClientOutput(job.partition, job.node_id, header, payload, states or None,
                                metrics=dict(res.metrics)))
    return out


def _personal_rounds(cfg: RunConfig, jobs: list[ClientJob], trainers: list[Any], models: list[NDArrays],
                     seeds_cfgs: list[tuple[int, TrainConfig]], results: list[TrainResult | None | str]) -> None:
    """Each trained device's personal step after its round, as the client runtime takes it
    (``DevicePersonal.round``: the adapter it kept, trained and evaluated, kept again in
    its directory); its evaluation joins the update's metrics. One device's adapter is
    read from its file when it trains and dropped after: memory follows the job."""
    from orchard.client.personal import DevicePersonal

    for i, job in enumerate(jobs):
        res = results[i]
        if not job.state_dir or not isinstance(res, TrainResult) or res.num_examples == 0:
            continue
        try:
            extra = DevicePersonal(job.state_dir).round(job.assignment.run_id, cfg.personalization, trainers[i],
                                                        models[i], seeds_cfgs[i][1])
        except (OrchardError, ValueError, RuntimeError) as err:
            results[i] = f"{type(err).__name__}: {err}"
            continue
        results[i] = dataclasses.replace(res, metrics={**res.metrics, **extra})


def _canary(job: ClientJob, shapes: dict[str, tuple[int, ...]]) -> NDArrays:
    from orchard.simulation import canary

    seed, norm = cast(tuple[int, float], job.canary)
    return canary.update(shapes, seed, job.partition, norm)
