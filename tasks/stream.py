"""Streams of device data: a task's streaming form, and a device's file of appended samples.

Class-incremental arrival (``[run.continual] periods``): period p brings the classes
``periods[p]``. A device's samples of those classes arrive at times drawn uniformly in
``[p * period_s, (p + 1) * period_s)`` (from the run seed and the device, so a device's
stream is a pure function of them); a sample of a class in no period never arrives.

- :class:`ArrivalStream`: rows of a task's pool with arrival times; ``read(cursor)``
  gives those arrived by the stream's clock (``arrive(now_s)``: in the simulator, the
  device's virtual time when it starts training).
- :class:`AppendedSamples`: what a real device reads, a file it appends records to
  (int64 label, then the float32 input, little-endian; a record still being written is
  read next time) or a directory of ``.npz`` files (``x``, ``y``) read in name order.
- :class:`StreamingTask`: a task whose client trainers are
  :class:`~orchard.tasks.continual.ContinualTrainer` over their device's stream, each
  with a replay directory under ``root`` (the simulator's devices).
- :func:`continual_problems`: every problem in ``[run.continual]`` and a device policy's
  replay budget, named, for ``orchard validate``.

Domain-incremental streams (the same classes under a drifting input distribution) are
not built yet: no shipped task has domains to drift between.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np
import torch

from orchard.client.replay import ReplayBudgetError, budget_for, capacity_for
from orchard.config import ContinualConfig, RunConfig
from orchard.errors import ConfigError
from orchard.tasks.continual import ContinualTrainer
from orchard.tasks.partition import Partition
from orchard.tasks.torch_trainer import TensorData, load_arrays
from orchard.trainer import Trainer
from orchard.typing import NDArrays


def class_incremental_arrivals(labels: np.ndarray, periods: list[list[int]], period_s: float,
                               rng: np.random.Generator) -> np.ndarray:
    """Arrival time of each sample (``inf``: never), by its class's period."""
    period_of = {c: p for p, group in enumerate(periods) for c in group}
    base = np.array([period_of.get(int(y), -1) for y in labels], dtype=np.float64)
    offsets = rng.random(labels.shape[0]) * period_s
    return np.where(base >= 0, base * period_s + offsets, np.inf)


class ArrivalStream:
    """Rows of ``pool`` in arrival order, read up to the stream's clock."""

    def __init__(self, pool: TensorData, index: np.ndarray, times: np.ndarray) -> None:
        order = np.argsort(times, kind="stable")
        keep = order[np.isfinite(times[order])]
        self.index = np.asarray(index, dtype=np.int64)[keep]
        self.times = np.asarray(times, dtype=np.float64)[keep]
        self._pool = pool
        self.sample_shape = tuple(int(s) for s in pool.x.shape[1:])
        self.now_s = 0.0

    def __len__(self) -> int:
        return int(self.index.shape[0])

    def arrive(self, now_s: float) -> None:
        self.now_s = float(now_s)

    def arrived(self) -> int:
        return int(np.searchsorted(self.times, self.now_s, side="right"))

    def read(self, cursor: int) -> tuple[np.ndarray, np.ndarray]:
        rows = self.index[cursor:self.arrived()]
        return (self._pool.x.numpy()[rows].astype(np.float32, copy=False),
                self._pool.y.numpy()[rows].astype(np.int64, copy=False))


class AppendedSamples:
    """A device's own samples as they are appended to ``path`` (a file or a directory)."""

    def __init__(self, path: str | Path, sample_shape: tuple[int, ...]) -> None:
        self.path = Path(path)
        self.sample_shape = tuple(int(s) for s in sample_shape)
        self._x_bytes = int(np.prod(self.sample_shape, dtype=np.int64)) * 4

    @staticmethod
    def record(x: np.ndarray, label: int) -> bytes:
        """One sample as the file form stores it (what an app appends)."""
        return np.int64(label).astype("<i8").tobytes() + np.asarray(x, dtype="<f4").tobytes()

    def read(self, cursor: int) -> tuple[np.ndarray, np.ndarray]:
        if self.path.is_dir():
            return self._read_dir(cursor)
        if not self.path.is_file():
            raise ConfigError(f"{self.path}: the device's data file or directory does not exist")
        rec = 8 + self._x_bytes
        with open(self.path, "rb") as f:
            f.seek(cursor * rec)
            raw = f.read()
        n = len(raw) // rec  # a record still being appended waits for the next round
        a = np.frombuffer(raw[:n * rec], dtype=np.uint8).reshape(n, rec)
        y = a[:, :8].copy().view("<i8").reshape(n).astype(np.int64)
        x = a[:, 8:].copy().view("<f4").reshape(n, *self.sample_shape).astype(np.float32)
        return x, y

    def _read_dir(self, cursor: int) -> tuple[np.ndarray, np.ndarray]:
        xs, ys, skip = [], [], cursor
        for f in sorted(self.path.glob("*.npz")):
            with np.load(f) as z:
                y = np.asarray(z["y"], dtype=np.int64)
                if skip >= y.shape[0]:
                    skip -= y.shape[0]
                    continue
                x = np.asarray(z["x"], dtype=np.float32).reshape(-1, *self.sample_shape)
            xs.append(x[skip:])
            ys.append(y[skip:])
            skip = 0
        if not ys:
            return np.zeros((0, *self.sample_shape), np.float32), np.zeros(0, np.int64)
        return np.concatenate(xs), np.concatenate(ys)


def device_budget(cfg: ContinualConfig, stream_len: int, sample_shape: tuple[int, ...]) -> int:
    """A simulated device's buffer budget in bytes: the configured bytes, or the smallest
    budget keeping ``simulated_budget_fraction`` of its whole stream (at least one sample).
    With a fraction the buffer is also held to that share of the samples seen so far
    (:func:`device_share`), so this is the most it ever holds."""
    if cfg.simulated_budget_bytes is not None:
        return cfg.simulated_budget_bytes
    fraction = 0.1 if cfg.simulated_budget_fraction is None else cfg.simulated_budget_fraction
    return budget_for(max(1, math.floor(fraction * stream_len)), cfg.hot_samples, sample_shape)


def device_share(cfg: ContinualConfig) -> float | None:
    """The share of the samples it has seen that a simulated device's buffer may keep
    (``simulated_budget_fraction``; 0.1 unless a byte budget is set), or None (bytes only)."""
    if cfg.simulated_budget_bytes is not None:
        return None
    return 0.1 if cfg.simulated_budget_fraction is None else cfg.simulated_budget_fraction


class StreamingTask:
    """``task`` with its clients' data as class-incremental streams and replay buffers
    under ``root`` (``root/device-<partition>``). Everything but ``client_trainer``
    is the task's own."""

    def __init__(self, task: Any, cfg: ContinualConfig, root: str | Path) -> None:
        if task.train_labels is None:
            raise ConfigError(f"task {task.name!r} has no labels: class-incremental streams need them")
        self.task = task
        self.name = task.name
        self.cfg = cfg
        self.root = Path(root)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.task, name)

    def initial_arrays(self, seed: int) -> NDArrays:
        return self.task.initial_arrays(seed)

    def partition(self, num_partitions: int, seed: int) -> Partition:
        return self.task.partition(num_partitions, seed)

    def evaluate(self, arrays: NDArrays, split: str = "test") -> dict[str, float]:
        """The task's central evaluation, and on the test pool the accuracy on each
        period's classes (``accuracy_period_<p>``: what forgetting is measured on)."""
        got = dict(self.task.evaluate(arrays, split))
        data = getattr(self.task, "test_data", None)
        labels = getattr(self.task, "test_labels", None)
        if split != "test" or data is None or labels is None:
            return got
        model = self.task.build_model()
        load_arrays(model, arrays, self.task.trainable)
        model.eval()
        with torch.no_grad():  # one pass: each test example's hit, grouped by period below
            hits = torch.cat([model(data.x[i:i + 1000]).argmax(-1) == data.y[i:i + 1000]
                              for i in range(0, len(data), 1000)]).numpy()
        labels = np.asarray(labels)
        for p, group in enumerate(self.cfg.periods):
            mine = np.isin(labels, group)
            got[f"accuracy_period_{p}"] = float(hits[mine].mean()) if mine.any() else float("nan")
        return got

    def stream(self, partition_id: int, num_partitions: int, seed: int) -> ArrivalStream:
        idx = self.task.partition(num_partitions, seed).indices[partition_id]
        rng = np.random.default_rng([seed, partition_id, 0x57])
        times = class_incremental_arrivals(self.task.train_labels[idx], self.cfg.periods, self.cfg.period_s, rng)
        return ArrivalStream(self.task.train_data, idx, times)

    def client_trainer(self, partition_id: int, num_partitions: int, seed: int) -> Trainer:
        stream = self.stream(partition_id, num_partitions, seed)
        task, c = self.task, self.cfg
        part = task.partition(num_partitions, seed)
        return ContinualTrainer(
            lambda: task.build_model(), stream, self.root / f"device-{partition_id}",
            device_budget(c, len(stream), stream.sample_shape), replay_ratio=c.replay_ratio,
            sampling=c.sampling, hot_samples=c.hot_samples,
            test_data=lambda: task.test_data.subset(part.test_indices[partition_id]),
            trainable=task.trainable, seed=seed * 1_000_003 + partition_id, share=device_share(c))


def device_trainer(task: Any, cfg: ContinualConfig, data: str | Path, state_dir: str | Path | None,
                   policy: Any, seed: int) -> ContinualTrainer:
    """A real device's continual trainer: its samples read from ``data`` as they are
    appended, its replay buffer in ``state_dir/replay`` under its policy's budget."""
    if state_dir is None:
        raise ConfigError("a continual run keeps the device's replay buffer in its data directory: "
                          "pass --state-dir DIR")
    replay = getattr(policy, "replay", None)
    if replay is None:
        raise ConfigError("a continual run needs the device policy's replay budget: set replay.budget_bytes "
                          "in client.json's policy (or --policy)")
    data_shape = tuple(int(s) for s in task.train_data.x.shape[1:])
    return ContinualTrainer(lambda: task.build_model(), AppendedSamples(data, data_shape), Path(state_dir) / "replay",
                            replay.budget_bytes, replay_ratio=cfg.replay_ratio, sampling=cfg.sampling,
                            hot_samples=replay.hot_samples, trainable=task.trainable, seed=seed)


def continual_problems(run: RunConfig, policy: dict[str, Any] | None = None) -> list[str]:
    """Every problem of ``run.continual`` (and of a device policy's ``replay`` table,
    checked against the run's task's sample size when the run has a task)."""
    c = run.continual
    problems: list[str] = []
    replay = (policy or {}).get("replay")
    if c is None and replay is None:
        return problems
    if c is not None:
        if not 0.0 <= c.replay_ratio <= 1.0:
            problems.append(f"continual.replay_ratio must be in [0, 1] (the share of each local batch replayed), "
                            f"got {c.replay_ratio}")
        if not c.periods or any(not g for g in c.periods):
            problems.append("continual.periods must list at least one period, each with at least one class, "
                            "e.g. [[0, 1], [2, 3]]")
        flat = [x for g in c.periods for x in g]
        if len(flat) != len(set(flat)):
            problems.append("continual.periods names a class in more than one period")
        if not c.period_s > 0:
            problems.append(f"continual.period_s must be > 0 seconds, got {c.period_s}")
        if c.hot_samples < 1:
            problems.append(f"continual.hot_samples must be >= 1, got {c.hot_samples}")
        f = c.simulated_budget_fraction
        if f is not None and not 0.0 < f <= 1.0:
            problems.append(f"continual.simulated_budget_fraction must be in (0, 1], got {f}")
        if c.simulated_budget_fraction is not None and c.simulated_budget_bytes is not None:
            problems.append("continual: set simulated_budget_fraction or simulated_budget_bytes, not both")
    budgets = []
    if c is not None and c.simulated_budget_bytes is not None:
        budgets.append(("continual.simulated_budget_bytes", c.simulated_budget_bytes, max(c.hot_samples, 1)))
    if isinstance(replay, dict) and "budget_bytes" in replay:
        budgets.append(("policy.replay.budget_bytes", replay["budget_bytes"], replay.get("hot_samples", 4)))
    if budgets:
        shape = _sample_shape(run, problems)
        for key, value, hot in budgets:
            if not isinstance(value, int) or value <= 0:
                problems.append(f"{key} must be a positive number of bytes, got {value!r}")
                continue
            if shape is None:
                continue
            try:
                capacity_for(value, max(int(hot), 1), shape)
            except ReplayBudgetError as err:
                problems.append(f"{key}: {err}")
    return problems


def _sample_shape(run: RunConfig, problems: list[str]) -> tuple[int, ...] | None:
    from orchard.tasks.registry import get_task

    try:
        task = get_task(run.task, **run.task_params)
    except Exception as err:  # the task's own problems are reported by task_problems
        problems.append(f"continual: cannot build task {run.task!r} to size its samples: {err}")
        return None
    data = getattr(task, "train_data", None)
    if data is None:
        problems.append(f"continual: task {run.task!r} has no training pool to size its samples by")
        return None
    return tuple(int(s) for s in data.x.shape[1:])
