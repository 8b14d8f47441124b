"""What a reference task is (:class:`Task`) and the one implementation every shipped
task is built from (:class:`SupervisedTask`).

A task bundles a dataset already split into a training pool and a held-out test pool,
a deterministic model factory, a partitioner and the set of tensors that form the
global model. Tasks are plain objects built by a function of keyword parameters
(see :mod:`orchard.tasks.registry`); they hold their loaded data, so building one task
and asking it for 10,000 client trainers reads the files once.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol, runtime_checkable

import numpy as np
import torch
from torch import nn

from orchard.errors import ConfigError
from orchard.tasks.partition import Partition
from orchard.tasks.torch_trainer import (
    TensorData,
    TensorRows,
    TorchTrainer,
    arrays_of,
    evaluate_model,
    load_arrays,
)
from orchard.trainer import Trainer
from orchard.typing import NDArrays

# (num_partitions, seed) -> Partition
Partitioner = Callable[[int, int], Partition]
# seed -> a freshly initialised model
SeededModelFactory = Callable[[int], nn.Module]
# (model_factory, train, test, trainable, seed) -> Trainer; lets a task swap in a
# wrapping trainer (LoRA) without a second training loop.
TrainerFactory = Callable[..., Trainer]
# (model with the arrays loaded, data) -> metrics ("loss", and "accuracy" for classifiers)
Evaluator = Callable[[nn.Module, TensorData], dict[str, float]]


@runtime_checkable
class Task(Protocol):
    """What every Orchard command takes: data with client partitions, a model, a client
    trainer and central evaluation.

    - ``initial_arrays(seed)``: the global model at round 0, the tensors that train and
      travel, float32, in a fixed order.
    - ``partition(num_partitions, seed)``: which training (and local test) examples each
      client holds, a pure function of its arguments.
    - ``client_trainer(partition_id, num_partitions, seed)``: an
      :class:`orchard.trainer.Trainer` over that client's data.
    - ``evaluate(arrays, split)``: central metrics of a global model.

    :func:`orchard.tasks.make_task` builds one from a model factory, a dataset, a loss
    and a partitioner (:class:`SupervisedTask`, as Orchard's own tasks are). Commands
    that export or inspect the model (``client bundle``, ``run pull``, ``baseline``)
    also use ``build_model``, ``trainable``, ``train_data`` and ``pooled_trainer``,
    which a :class:`SupervisedTask` has.
    """

    name: str

    def initial_arrays(self, seed: int) -> NDArrays: ...

    def partition(self, num_partitions: int, seed: int) -> Partition: ...

    def client_trainer(self, partition_id: int, num_partitions: int, seed: int) -> Trainer: ...

    def evaluate(self, arrays: NDArrays, split: str = "test") -> dict[str, float]: ...


def seeded_model(build: Callable[[], nn.Module], seed: int) -> nn.Module:
    """``build()`` with torch's default initialisers drawing from ``seed``.

    torch's ``nn`` initialisers read the global CPU generator; its state is saved and
    restored around the build, so building a model neither depends on nor disturbs the
    caller's RNG. (``torch.manual_seed`` also reseeds every accelerator backend, which
    costs ~30x more than reseeding the CPU generator alone; thousands of simulated
    clients build a model each.)
    """
    saved = torch.get_rng_state()
    try:
        torch.default_generator.manual_seed(seed)
        return build()
    finally:
        torch.set_rng_state(saved)


class SupervisedTask:
    """A task over in-memory (x, y) pools. See :class:`Task` for the contract.

    ``loss`` names what its trainers minimise (see :func:`orchard.tasks.make_task`).
    ``model_seed_for_trainers`` fixes the parts of the model that are *not* global
    state (a frozen base, a LoRA ``A``); clients must agree on them, so they come from a
    task parameter, never from the per-client seed.
    """

    def __init__(
        self,
        name: str,
        train: TensorData,
        test: TensorData,
        num_classes: int,
        model: SeededModelFactory,
        partitioner: Partitioner,
        params: dict[str, Any],
        train_labels: np.ndarray | None = None,
        test_labels: np.ndarray | None = None,
        trainable: Sequence[str] | None = None,
        fixed_seed: int = 0,
        trainer_factory: TrainerFactory = TorchTrainer,
        central_test: TensorData | None = None,
        info: dict[str, Any] | None = None,
        evaluator: Evaluator = evaluate_model,
        loss: str | Callable[..., Any] = "cross_entropy",
    ) -> None:
        self.name = name
        self.train_data = train
        self.test_data = test
        self.train_labels = train_labels
        self.test_labels = test_labels
        self.num_classes = num_classes
        self.params = dict(params)
        # Descriptive facts a caller may report (natural client count, feature names).
        self.info: dict[str, Any] = dict(info or {})
        self._model = model
        self._partitioner = partitioner
        self._fixed_seed = fixed_seed
        self._trainer_factory = trainer_factory
        self._central_test = central_test if central_test is not None else test
        self._evaluator = evaluator
        # What the trainer minimises: "cross_entropy" (the reference trainer's), "mse", or
        # the task's own function. A bundle's training program computes the named ones.
        self.loss = loss
        probe = model(fixed_seed)
        self.trainable: list[str] = (
            list(trainable) if trainable is not None else [n for n, _ in probe.named_parameters()]
        )
        # Partitions are pure functions of (num_partitions, seed); memoised per task
        # instance because client_trainer asks for the same one once per client.
        self._partitions: dict[tuple[int, int], Partition] = {}

    @classmethod
    def from_labelled(cls, name: str, x_train: np.ndarray, y_train: np.ndarray, x_test: np.ndarray,
                      y_test: np.ndarray, num_classes: int, **kw: Any) -> SupervisedTask:
        """A classification task over numpy pools: the labels ``y_*`` are both the targets
        and what the label partitioners read. ``kw``: the other arguments of the class."""
        return cls(name=name, train=TensorData.from_numpy(x_train, y_train),
                   test=TensorData.from_numpy(x_test, y_test), train_labels=y_train,
                   test_labels=y_test, num_classes=num_classes, **kw)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name!r}, {self.params})"

    def build_model(self, seed: int | None = None) -> nn.Module:
        """A fresh model; its non-global parts always come from the task's fixed seed."""
        return self._model(self._fixed_seed if seed is None else seed)

    def initial_arrays(self, seed: int) -> NDArrays:
        """The global model at round 0 (the trainable tensors only), float32, in order."""
        return arrays_of(self._model(seed), self.trainable)

    def partition(self, num_partitions: int, seed: int) -> Partition:
        key = (num_partitions, seed)
        if key not in self._partitions:
            self._partitions[key] = self._partitioner(num_partitions, seed)
        return self._partitions[key]

    def client_data(
        self, partition_id: int, num_partitions: int, seed: int
    ) -> tuple[TensorData, TensorData]:
        if not 0 <= partition_id < num_partitions:
            raise ConfigError(f"partition_id must be in [0, {num_partitions}), got {partition_id}")
        part = self.partition(num_partitions, seed)
        return (
            self.train_data.subset(part.indices[partition_id]),
            self.test_data.subset(part.test_indices[partition_id]),
        )

    def client_trainer(self, partition_id: int, num_partitions: int, seed: int) -> Trainer:
        if not 0 <= partition_id < num_partitions:
            raise ConfigError(f"partition_id must be in [0, {num_partitions}), got {partition_id}")
        part = self.partition(num_partitions, seed)
        # The rows are gathered when first read, or with the rest of a vectorised group's.
        train = TensorRows(self.train_data, part.indices[partition_id])
        fixed = self._fixed_seed
        return self._trainer_factory(
            lambda: self._model(fixed),
            train,
            # The local test split is gathered when the trainer first evaluates.
            lambda: self.test_data.subset(part.test_indices[partition_id]),
            trainable=self.trainable,
            seed=seed * 1_000_003 + partition_id,
        )

    def pooled_trainer(self, seed: int = 0) -> Trainer:
        """A trainer over the whole training pool that evaluates on the central test
        set: the centralised baseline, and the reference for what federation loses."""
        fixed = self._fixed_seed
        return self._trainer_factory(
            lambda: self._model(fixed),
            self.train_data,
            self._central_test,
            trainable=self.trainable,
            seed=seed,
        )

    def evaluate(self, arrays: NDArrays, split: str = "test") -> dict[str, float]:
        """Central evaluation: accuracy and loss of ``arrays`` on the held-out test
        pool (``split="test"``) or on the whole training pool (``"train"``)."""
        if split == "test":
            data = self._central_test
        elif split == "train":
            data = self.train_data
        else:
            raise ConfigError(f"unknown split {split!r}; expected 'test' or 'train'")
        model = self._model(self._fixed_seed)
        load_arrays(model, arrays, self.trainable)
        return self._evaluator(model, data)
