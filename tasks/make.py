"""A task from the pieces a practitioner already has: :func:`make_task`.

```python
from orchard.tasks import Csv, Dirichlet, make_task

def build(*, alpha: float = 0.5, hidden: int = 32):
    return make_task(
        name="wine",
        model=lambda: nn.Sequential(nn.Linear(11, hidden), nn.ReLU(), nn.Linear(hidden, 3)),
        data=Csv("wine.csv", label="quality"),
        partitioner=Dirichlet(alpha=alpha),
        params={"alpha": alpha, "hidden": hidden},
    )
```

The result is a :class:`~orchard.tasks.core.SupervisedTask`, the class Orchard's own
tasks are, so every command takes it. Everything is checked before it is returned, and
every problem found is reported at once, each naming the argument and what was expected
(:class:`TaskSpecError`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal, TypeAlias

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from orchard.errors import ConfigError
from orchard.tasks.core import SupervisedTask, seeded_model
from orchard.tasks.data import SOURCES, Arrays, load_data, take
from orchard.tasks.partition import stratified_split
from orchard.tasks.partitioners import IID, PARTITIONERS, ByColumn, Dirichlet, Shards, bind
from orchard.tasks.torch_trainer import (
    LossFn,
    MetricFn,
    Objective,
    ObjectiveTrainer,
    TensorData,
    TorchTrainer,
    evaluate_model,
)
from orchard.trainer import Trainer


class TaskSpecError(ConfigError):
    """What :func:`make_task` was given does not make a task; one line per problem."""


@dataclass(frozen=True)
class LoRA:
    """Train LoRA adapters (peft) on the modules named ``target_modules`` (name
    suffixes, as peft matches them) of a frozen base; ``variant`` "ffa" trains ``B``
    only (exact averaging, half the bytes), "full" trains ``A`` and ``B``. The base and
    ``A`` come from ``seed``, shared by every client."""

    target_modules: tuple[str, ...]
    rank: int = 4
    alpha: int = 8
    variant: str = "ffa"
    seed: int = 0


Trainable: TypeAlias = Literal["all"] | LoRA | Sequence[str]
Loss: TypeAlias = Literal["cross_entropy", "mse"] | LossFn


def _mse(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(out.reshape(y.shape) if out.numel() == y.numel() else out, y)


def _cross_entropy(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1))


def _check_model(model: Any, problems: list[str]) -> nn.Module | None:
    if not callable(model) or isinstance(model, nn.Module):
        what = "a torch.nn.Module instance" if isinstance(model, nn.Module) else type(model).__name__
        problems.append(f"model: expected a function of no arguments that returns a torch.nn.Module "
                        f"(e.g. lambda: MyNet()), got {what}")
        return None
    try:
        built = model()
    except Exception as err:  # a user's factory may raise anything; say which argument
        problems.append(f"model: calling it raised {type(err).__name__}: {err}")
        return None
    if not isinstance(built, nn.Module):
        problems.append(f"model: the factory returned a {type(built).__name__}, expected a torch.nn.Module")
        return None
    return built


def _split(data: Arrays, fraction: float, seed: int, stratify: np.ndarray | None) -> tuple[Arrays, Arrays]:
    if stratify is not None:
        train_idx, test_idx = stratified_split(stratify, fraction, seed)
    else:
        perm = np.random.default_rng(seed).permutation(len(data))
        k = int(round(len(data) * fraction))
        train_idx, test_idx = np.sort(perm[k:]), np.sort(perm[:k])
    return take(data, train_idx), take(data, test_idx)


def make_task(
    *,
    name: str,
    model: Callable[[], nn.Module],
    data: Any,
    test: Any | float = 0.2,
    loss: Loss = "cross_entropy",
    metrics: Mapping[str, MetricFn] | None = None,
    trainable: Trainable = "all",
    partitioner: Any = None,
    params: Mapping[str, Any] | None = None,
    split_seed: int = 0,
    info: Mapping[str, Any] | None = None,
) -> SupervisedTask:
    """A task over ``data`` with ``model``.

    - ``model``: a function of no arguments returning a fresh ``torch.nn.Module``
      (seeded by Orchard: the run seed gives the initial global model).
    - ``data``: see :mod:`orchard.tasks.data` (arrays, tensors, a torch Dataset, or a
      CSV, Parquet, NPZ, image folder or text file).
    - ``test``: a held-out source of the same kind, or the fraction of ``data`` held
      out (stratified by label for classes, by ``ByColumn``'s column for natural
      clients), with ``split_seed``.
    - ``loss``: "cross_entropy" (integer targets, logits out), "mse", or a function
      ``(outputs, targets) -> scalar tensor``.
    - ``metrics``: name -> ``(outputs, targets) -> float`` over a whole evaluation set,
      reported besides ``loss`` (and ``accuracy`` for class targets).
    - ``trainable``: "all", a list of parameter names (the rest frozen), or
      :class:`LoRA`.
    - ``partitioner``: IID(), Dirichlet(...) (default Dirichlet(alpha=0.5) for class
      targets, IID() otherwise), Shards(...) or ByColumn(column).
    - ``params``: the builder's parameters, recorded with runs and bundles.
    """
    problems: list[str] = []
    if not isinstance(name, str) or not name:
        problems.append(f"name: expected a non-empty string, got {name!r}")
    probe = _check_model(model, problems)
    try:
        train = load_data(data, "data")
    except ConfigError as err:
        problems += err.problems
        train = None
    test_data: Arrays | None = None
    if isinstance(test, float):
        if not 0.0 < test < 1.0:
            problems.append(f"test: a held-out fraction must be in (0, 1), got {test}")
    else:
        try:
            test_data = load_data(test, "test")
        except ConfigError as err:
            problems += err.problems
    if not (loss in ("cross_entropy", "mse") or (callable(loss) and not isinstance(loss, str))):
        problems.append(f"loss: expected 'cross_entropy', 'mse' or a function (outputs, targets) -> scalar tensor, "
                        f"got {loss!r}")
    for k, fn in (metrics or {}).items():
        if not isinstance(k, str) or not callable(fn):
            problems.append(f"metrics[{k!r}]: expected a name -> function (outputs, targets) -> float, got {fn!r}")
    if partitioner is not None and not isinstance(partitioner, IID | Dirichlet | Shards | ByColumn):
        problems.append(f"partitioner: expected {PARTITIONERS}; got {type(partitioner).__name__} {partitioner!r}")
    if not (trainable == "all" or isinstance(trainable, LoRA)
            or (isinstance(trainable, Sequence) and not isinstance(trainable, str)
                and all(isinstance(t, str) for t in trainable))):
        problems.append(f"trainable: expected 'all', a list of parameter names or LoRA(target_modules=...), "
                        f"got {trainable!r}")
    if problems or train is None or probe is None:
        raise TaskSpecError(problems or [f"data: expected {SOURCES}"])

    classification = bool(np.issubdtype(train.y.dtype, np.integer))
    if loss == "cross_entropy" and not classification:
        problems.append(f"loss: 'cross_entropy' needs integer class targets, the data's y is {train.y.dtype}; "
                        "use loss='mse' or a function")
    if isinstance(partitioner, ByColumn) and partitioner.column not in train.columns:
        have = ", ".join(sorted(train.columns)) or "none"
        problems.append(f"partitioner: ByColumn({partitioner.column!r}) needs a per-row column {partitioner.column!r} "
                        f"in data; its columns: {have}")
    if problems:
        raise TaskSpecError(problems)

    if test_data is None:
        stratify = None
        if isinstance(partitioner, ByColumn):
            stratify = np.unique(train.columns[partitioner.column].astype(str), return_inverse=True)[1]
        elif classification and train.y.ndim == 1:
            stratify = train.y
        train, test_data = _split(train, float(test), split_seed, stratify)
    if train.y.shape[1:] != test_data.y.shape[1:] or np.shape(train.x)[1:] != np.shape(test_data.x)[1:]:
        raise TaskSpecError(f"test: rows of shape x {np.shape(test_data.x)[1:]}, y {test_data.y.shape[1:]} differ "
                            f"from data's x {np.shape(train.x)[1:]}, y {train.y.shape[1:]}")
    num_classes = int(max(train.y.max(initial=0), test_data.y.max(initial=0))) + 1 if classification else 1
    if train.classes is not None:
        num_classes = max(num_classes, len(train.classes))

    # One forward pass on two rows: a model that does not take the data says so here,
    # not on the first client.
    loss_fn: LossFn = _cross_entropy if loss == "cross_entropy" else _mse if loss == "mse" else loss  # type: ignore[assignment]
    x2 = torch.from_numpy(np.ascontiguousarray(train.x[:2]))
    y2 = torch.from_numpy(np.ascontiguousarray(train.y[:2]))
    try:
        with torch.no_grad():
            out = probe(x2)
        value = loss_fn(out, y2)
    except Exception as err:  # the user's model or loss, on their own data
        raise TaskSpecError(
            f"model: a forward pass and the loss on two rows of data (x {tuple(x2.shape)} {x2.dtype}, "
            f"y {tuple(y2.shape)} {y2.dtype}) raised {type(err).__name__}: {err}"
        ) from None
    if not isinstance(value, torch.Tensor) or value.ndim != 0:
        raise TaskSpecError(f"loss: expected a scalar tensor, got {type(value).__name__} "
                            f"{tuple(value.shape) if isinstance(value, torch.Tensor) else ''}")
    if classification and loss == "cross_entropy" and out.shape[-1] < num_classes:
        raise TaskSpecError(f"model: it outputs {out.shape[-1]} logits per example, the data has {num_classes} classes")

    spec = partitioner if partitioner is not None else (Dirichlet() if classification and train.y.ndim == 1 else IID())
    partition = bind(spec, train.y, test_data.y, num_classes, train.columns, test_data.columns)

    objective = None
    if loss != "cross_entropy" or metrics:
        objective = Objective(loss_fn, classification and loss == "cross_entropy" or
                              (classification and callable(loss) and out.shape[-1] > 1),
                              tuple((metrics or {}).items()))
    evaluator = objective.evaluate if objective is not None else evaluate_model

    def inner(factory: Callable[[], nn.Module], train_rows: Any, test_rows: Any, trainable: Sequence[str] | None,
              seed: int) -> Trainer:
        if objective is None:
            return TorchTrainer(factory, train_rows, test_rows, trainable=trainable, seed=seed)
        return ObjectiveTrainer(factory, train_rows, test_rows, objective=objective, trainable=trainable, seed=seed)

    names: list[str] | None
    extra: dict[str, Any] = {}
    if isinstance(trainable, LoRA):
        from orchard.edge_runtime.lora import LoRASpec, LoRATrainer, apply_lora, trainable_names

        try:
            lora = LoRASpec(target_modules=tuple(trainable.target_modules), rank=trainable.rank,
                            alpha=trainable.alpha, variant=trainable.variant, init_seed=trainable.seed)
        except ConfigError as err:
            raise TaskSpecError([f"trainable: LoRA {p}" for p in err.problems]) from None
        modules = {n for n, _ in probe.named_modules()}
        unmatched = [t for t in lora.target_modules if not any(m == t or m.endswith("." + t) for m in modules)]
        if unmatched:
            raise TaskSpecError(f"trainable: LoRA target modules {unmatched} name no module of the model; "
                                f"its modules: {', '.join(sorted(m for m in modules if m)) or 'none'}")
        base_seed = trainable.seed

        def base() -> nn.Module:
            return seeded_model(model, base_seed)

        def build_model(seed: int) -> nn.Module:
            return apply_lora(base(), lora)

        names = trainable_names(build_model(0), lora)

        def trainer_factory(factory: Any, train_rows: Any, test_rows: Any, trainable: Any, seed: int) -> Trainer:
            return LoRATrainer(base, lora, lambda f, ns: inner(f, train_rows, test_rows, ns, seed), trainable=trainable)

        fixed_seed = base_seed
        extra = {"lora": True, "lora_rank": lora.rank, "lora_variant": lora.variant}
    else:
        def build_model(seed: int) -> nn.Module:
            return seeded_model(model, seed)

        all_params = [n for n, _ in probe.named_parameters()]
        if trainable == "all":
            names = None
        else:
            names = list(trainable)  # type: ignore[arg-type]
            unknown = [n for n in names if n not in all_params]
            if unknown or not names:
                raise TaskSpecError(f"trainable: {unknown or 'an empty list'} — expected parameter names of the model: "
                                    f"{', '.join(all_params)}")

        def trainer_factory(factory: Any, train_rows: Any, test_rows: Any, trainable: Any, seed: int) -> Trainer:
            return inner(factory, train_rows, test_rows, trainable, seed)

        fixed_seed = 0

    task_info = {**extra, **dict(info or {})}
    if train.classes is not None:
        task_info.setdefault("classes", list(train.classes))
    if isinstance(spec, ByColumn):
        task_info.setdefault("clients", sorted(set(train.columns[spec.column].astype(str).tolist())))
    return SupervisedTask(
        name=name,
        train=TensorData.from_numpy(train.x, train.y),
        test=TensorData.from_numpy(test_data.x, test_data.y),
        train_labels=train.y if classification and train.y.ndim == 1 else None,
        test_labels=test_data.y if classification and test_data.y.ndim == 1 else None,
        num_classes=num_classes,
        model=build_model,
        partitioner=partition,
        params=dict(params or {}),
        trainable=names,
        fixed_seed=fixed_seed,
        trainer_factory=trainer_factory,
        info=task_info,
        evaluator=evaluator,
        loss=loss,
    )
