"""``flower``: an unchanged Flower ``ClientApp`` as a task, so the simulator runs it for
every simulated client (``orchard simulate --flower-app module:app``).

The app holds its own data and partitions it by ``partition-id`` and ``num-partitions``
(Flower's ``Context.node_config``), so this task's partitions only say how many
examples a client is taken to hold (``examples_per_client``: what the simulated device
model times its training by); the weight of an update is the ``num-examples`` the app
replies with. The initial global model is a file (``initial_arrays``: safetensors, or
an ``.npz``), as ``orchard run start --initial-arrays`` takes it for a live federation.

Central evaluation asks the app: its ``@app.evaluate`` handler runs on partitions 0..E-1
of E (``eval_clients``) with the global arrays, and the example-weighted means of the
metrics it replies with are the task's; ``accuracy`` and ``loss`` are the first metric
whose name holds "acc" and "loss" (NaN when it reports none, or has no evaluate
handler: ``info["evaluate_error"]`` then says what the app answered).

Every client's trainer is the client runtime's adapter
(:class:`orchard.client.flower_adapter.FlowerTrainer`), imported when the task is built:
the Flower side of Orchard is one adapter, used by a live client and the simulator alike.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from orchard.errors import ConfigError
from orchard.tasks.partition import LabelSkew, Partition, RaggedIndex
from orchard.trainer import TrainConfig, Trainer
from orchard.typing import NDArrays


def read_arrays(path: str | Path) -> NDArrays:
    """Named float arrays from a ``.safetensors`` or ``.npz`` file, in the file's order."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"initial_arrays: no such file {str(p)!r}; write the app's initial model with "
                          "safetensors.numpy.save_file (or numpy.savez)")
    if p.suffix == ".npz":
        with np.load(p, allow_pickle=False) as z:
            return {k: np.ascontiguousarray(z[k]) for k in z.files}
    from safetensors.numpy import load_file

    try:
        return dict(load_file(str(p)))
    except Exception as err:  # safetensors raises its own error types
        raise ConfigError(f"initial_arrays: {str(p)!r} is not a safetensors file: {err}") from None


def _pick(metrics: dict[str, float], word: str) -> float:
    for k, v in metrics.items():
        if word in k.lower():
            return float(v)
    return float("nan")


class FlowerAppTask:
    """A Flower ``ClientApp`` behind the Task protocol (see the module docstring)."""

    def __init__(self, app: str, arrays: NDArrays, params: dict[str, Any], examples_per_client: int,
                 eval_clients: int) -> None:
        from orchard.client.flower_adapter import load_client_app

        self.app_ref = app
        self.app = load_client_app(app)
        self.name = f"flower:{app}"
        self.params = dict(params)
        self.info: dict[str, Any] = {"flower_app": app}
        self._arrays = arrays
        self.trainable = list(arrays)
        self._examples = examples_per_client
        self._eval_clients = eval_clients
        self._partitions: dict[int, Partition] = {}
        self._bytes: Any = None  # the clients' shared ArrayBytes (orchard.client.flower_arrays), once built

    def __repr__(self) -> str:
        return f"FlowerAppTask({self.app_ref!r})"

    def initial_arrays(self, seed: int) -> NDArrays:
        """The file's arrays (the start is the file's, whatever the seed)."""
        return {k: v.copy() for k, v in self._arrays.items()}

    def partition(self, num_partitions: int, seed: int) -> Partition:
        if num_partitions < 1:
            raise ConfigError(f"num_partitions must be >= 1, got {num_partitions}")
        if num_partitions not in self._partitions:
            k = self._examples
            lengths = np.full(num_partitions, k, np.int64)
            empty = np.zeros(num_partitions, np.int64)
            self._partitions[num_partitions] = Partition(
                indices=RaggedIndex.from_lengths(np.zeros(num_partitions * k, np.int32), lengths),
                test_indices=RaggedIndex.from_lengths(np.zeros(0, np.int32), empty),
                label_skew=LabelSkew(np.zeros((num_partitions, 1), np.int32), 0.0, 0.0, 1.0),
                scheme="the Flower app's own (partition-id, num-partitions)",
            )
        return self._partitions[num_partitions]

    def client_trainer(self, partition_id: int, num_partitions: int, seed: int) -> Trainer:
        from orchard.client.flower_adapter import FlowerTrainer
        from orchard.client.flower_arrays import ArrayBytes

        if self._bytes is None:
            self._bytes = ArrayBytes()
        # It reads the round as "server-round" (FlowerTrainer.reads_round), as from a Flower strategy.
        # Every client's message of one global model carries the same .npy bytes (each
        # in its own ArrayRecord: an app cannot reach another client's through it).
        return FlowerTrainer(self.app, partition_id=partition_id, num_partitions=num_partitions,
                             array_bytes=self._bytes)

    def evaluate(self, arrays: NDArrays, split: str = "test") -> dict[str, float]:
        if split != "test":
            raise ConfigError(f"a Flower app evaluates on its own test splits only; got split {split!r}")
        from orchard.client.flower_adapter import FlowerAdapterError, FlowerTrainer

        sums: dict[str, float] = {}
        total = 0
        e = self._eval_clients
        nan = float("nan")
        for pid in range(e):
            try:
                res = FlowerTrainer(self.app, partition_id=pid, num_partitions=e).evaluate(arrays, TrainConfig())
            except FlowerAdapterError as err:
                # An app that only trains (no @app.evaluate) has nothing to report: the
                # run goes on without central metrics, and says why in the task's info.
                self.info["evaluate_error"] = str(err)
                return {"accuracy": nan, "loss": nan}
            total += res.num_examples
            for k, v in res.metrics.items():
                sums[k] = sums.get(k, 0.0) + float(v) * res.num_examples
        means = {k: v / total for k, v in sums.items()} if total else {}
        return {**means, "accuracy": _pick(means, "acc"), "loss": _pick(means, "loss")}


def build(*, app: str, initial_arrays: str, examples_per_client: int = 20, eval_clients: int = 10) -> FlowerAppTask:
    """A Flower ClientApp (module:app) and its initial arrays (a safetensors file)."""
    problems = []
    if examples_per_client < 1:
        problems.append(f"examples_per_client must be >= 1, got {examples_per_client}")
    if eval_clients < 1:
        problems.append(f"eval_clients must be >= 1, got {eval_clients}")
    if problems:
        raise ConfigError(problems)
    arrays = read_arrays(initial_arrays)
    bad = [k for k, v in arrays.items() if not np.issubdtype(v.dtype, np.floating) or not np.isfinite(v).all()]
    if bad or not arrays:
        raise ConfigError(f"initial_arrays: {initial_arrays!r} must hold finite float arrays; "
                          f"{'it holds none' if not arrays else f'these are not: {bad[:5]}'}")
    arrays = {k: v.astype(np.float32) for k, v in arrays.items()}
    return FlowerAppTask(app, arrays, {"app": app, "initial_arrays": str(Path(initial_arrays).resolve()),
                                       "examples_per_client": examples_per_client, "eval_clients": eval_clients},
                         examples_per_client, eval_clients)


__all__ = ["FlowerAppTask", "build", "read_arrays"]
