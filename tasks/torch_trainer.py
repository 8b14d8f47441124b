"""The reference torch trainer: :class:`orchard.trainer.Trainer` for any classifier or
next-token model whose forward maps a batch of inputs to logits.

Which tensors train is a choice of the caller (``trainable``): every parameter by
default, or a subset (a LoRA adapter, a head). The arrays a round hands in are exactly
the trainable tensors and the arrays it hands back are their new values; everything
else in the model is fixed by ``model_factory`` and never leaves the device.

Determinism: batches are drawn from a ``torch.Generator`` seeded from the trainer's
seed and ``TrainConfig.seed``; the model is built once per trainer by a deterministic
factory; nothing reads or advances torch's global RNG. On CPU, the same arrays, config
and seed give bit-identical results.

Pacing: ``train(..., gate=g)`` asks ``g.before_step()`` before each step and stops when
it says no (the edge runtime's governor, when a thermal, battery, energy or time
budget runs out); ``g.after_step(batch size)`` follows each step. The result then
carries the steps done, the distinct examples they drew, and a weight scaled by the
fraction of planned steps that ran. Without a gate nothing changes, bit for bit.

Speed: the digits MLP (64-64-10, ~20 examples per client) is the simulator's benchmark
workload, where Python overhead per step dominates. So the client's data are torch
tensors built once, the model is built once per trainer and reused across rounds,
running loss and accuracy stay tensors until the end of training, and FedProx adds
its gradient term directly (``mu * (w - w_global)``) instead of a loss term that
autograd would have to differentiate.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from orchard.errors import ConfigError, UpdateSchemaError
from orchard.seeds import derive_seed
from orchard.trainer import EvalResult, StepGate, TrainConfig, TrainResult
from orchard.typing import NDArrays

ModelFactory = Callable[[], nn.Module]

_EVAL_BATCH = 1024


@dataclass(frozen=True)
class TensorData:
    """Inputs and integer targets. ``y`` is (N,) for classification, (N, T) for
    next-token prediction (logits then are (N, T, V))."""

    x: torch.Tensor
    y: torch.Tensor

    def __len__(self) -> int:
        return int(self.x.shape[0])

    @staticmethod
    def from_numpy(x: np.ndarray, y: np.ndarray) -> TensorData:
        return TensorData(
            torch.from_numpy(np.ascontiguousarray(x)), torch.from_numpy(np.ascontiguousarray(y))
        )

    def subset(self, idx: np.ndarray) -> TensorData:
        idx = np.asarray(idx, dtype=np.int64)
        if self.x.device.type == "cpu" and self.y.device.type == "cpu" and not self.x.requires_grad:
            # numpy's gather over the shared buffer: a simulated round takes thousands of
            # small client subsets, and torch's advanced indexing costs twice as much.
            return TensorData(torch.from_numpy(self.x.numpy()[idx]), torch.from_numpy(self.y.numpy()[idx]))
        t = torch.from_numpy(idx)
        return TensorData(self.x[t], self.y[t])


class TensorRows:
    """Rows ``index`` of ``pool``, gathered when first read: a client's training data as
    a task hands it out. It reads like a :class:`TensorData` (``x``, ``y``, ``len``,
    ``subset``); the gather happens once, on first use of ``x`` or ``y``.

    Thousands of simulated clients a round each get one, and the vectorised trainer
    reads a group's rows from their common pool with one index (:func:`stack_rows`)
    instead of gathering each client's rows and then stacking the copies."""

    __slots__ = ("pool", "index", "_data")

    def __init__(self, pool: TensorData, index: np.ndarray) -> None:
        self.pool = pool
        self.index = np.asarray(index, dtype=np.int64)
        self._data: TensorData | None = None

    @property
    def data(self) -> TensorData:
        if self._data is None:
            self._data = self.pool.subset(self.index)
        return self._data

    @property
    def x(self) -> torch.Tensor:
        return self.data.x

    @property
    def y(self) -> torch.Tensor:
        return self.data.y

    def __len__(self) -> int:
        return int(self.index.shape[0])

    def subset(self, idx: np.ndarray) -> TensorData:
        return self.data.subset(idx)


def stack_rows(datas: Sequence[TensorData | TensorRows]) -> tuple[torch.Tensor, torch.Tensor]:
    """``(torch.stack([d.x ...]), torch.stack([d.y ...]))`` for datasets of one length.
    Rows of one CPU pool are read with one index over the pool (whether or not a
    dataset gathered its own already: those are the same rows): the same values,
    without a gather and a copy per dataset."""
    first = datas[0]
    if isinstance(first, TensorRows):
        pool = first.pool
        rows = [d for d in datas if isinstance(d, TensorRows) and d.pool is pool]
        if (len(rows) == len(datas) and pool.x.device.type == "cpu" and pool.y.device.type == "cpu"
                and not pool.x.requires_grad):
            idx = np.stack([d.index for d in rows])
            return torch.from_numpy(pool.x.numpy()[idx]), torch.from_numpy(pool.y.numpy()[idx])
    return torch.stack([d.x for d in datas]), torch.stack([d.y for d in datas])


def build_trainable(factory: Callable[[], nn.Module], requested: Sequence[str] | None
                    ) -> tuple[nn.Module, list[str], dict[str, torch.Tensor]]:
    """A fresh model from ``factory`` whose parameters require grad exactly when named in
    ``requested`` (all of them when None); returns (model, trained names, its state dict
    holding the live tensors)."""
    model = factory()
    params = dict(model.named_parameters())
    names = list(requested) if requested is not None else list(params)
    unknown = [n for n in names if n not in params]
    if unknown:
        raise ConfigError(f"trainable tensors {unknown[:5]} are not parameters of the model")
    keep = set(names)
    for n, p in params.items():
        p.requires_grad_(n in keep)
    return model, names, model.state_dict(keep_vars=True)


class LazyTrainable:
    """:func:`build_trainable` on first use, kept after: rounds reuse the module, only the
    arrays change. Shared by the trainers that own one model."""

    def __init__(self, factory: Callable[[], nn.Module], requested: Sequence[str] | None) -> None:
        self._factory = factory
        self._requested = list(requested) if requested is not None else None
        self._state: tuple[nn.Module, list[str], dict[str, torch.Tensor]] | None = None

    def get(self) -> tuple[nn.Module, list[str], dict[str, torch.Tensor]]:
        """(model, trained names, its state dict holding the live tensors)."""
        if self._state is None:
            self._state = build_trainable(self._factory, self._requested)
        return self._state

    @property
    def names(self) -> list[str]:
        return list(self.get()[1])


def train_step(model: nn.Module, opt: torch.optim.Optimizer,
               loss_and_correct: Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]],
               x: torch.Tensor, y: torch.Tensor, params: Sequence[torch.Tensor],
               anchors: Sequence[torch.Tensor], mu: float) -> tuple[torch.Tensor, torch.Tensor]:
    """One optimizer step on ``(x, y)``: the loss and its gradient, FedProx's pull when
    ``mu > 0`` (Li et al., 2020, eq. 2: the gradient of mu/2 ||w - w_global||^2 towards
    ``anchors``), the step. Returns (loss, correct)."""
    opt.zero_grad(set_to_none=True)
    loss, hits = loss_and_correct(model(x), y)
    loss.backward()
    if mu > 0:
        with torch.no_grad():
            for p, a in zip(params, anchors, strict=True):
                if p.grad is not None:
                    p.grad.add_(p - a, alpha=mu)
    opt.step()
    return loss, hits


class StepTotals:
    """A training run's running sums: the loss summed per target, the hits, the targets
    seen. Kept as tensors, read once at the end (no device sync per step)."""

    def __init__(self) -> None:
        self.loss_sum = torch.zeros((), dtype=torch.float64)
        self.correct = torch.zeros((), dtype=torch.int64)
        self.targets = 0

    def add(self, loss: torch.Tensor, hits: torch.Tensor, y: torch.Tensor) -> None:
        """One step's mean ``loss`` and ``hits`` over the targets ``y``."""
        with torch.no_grad():
            self.loss_sum += loss.detach().double() * y.numel()
            self.correct += hits
        self.targets += y.numel()

    def metrics(self, none_seen: float = float("nan")) -> dict[str, float]:
        """``train_loss`` and ``train_accuracy`` per target (``none_seen`` for both when no step ran)."""
        if not self.targets:
            return {"train_loss": none_seen, "train_accuracy": none_seen}
        return {"train_loss": float(self.loss_sum) / self.targets,
                "train_accuracy": float(self.correct) / self.targets}


def _loss_and_correct(logits: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean cross-entropy over all targets, and the number of argmax hits."""
    flat = logits.reshape(-1, logits.shape[-1])
    target = y.reshape(-1)
    loss = F.cross_entropy(flat, target)
    correct = (flat.argmax(dim=-1) == target).sum()
    return loss, correct


def _tensors(model: nn.Module | dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return model if isinstance(model, dict) else model.state_dict(keep_vars=True)


def arrays_of(model: nn.Module | dict[str, torch.Tensor], names: Sequence[str]) -> NDArrays:
    """The named tensors of ``model`` (or of a ``state_dict(keep_vars=True)``) as float32
    numpy arrays (copies), in ``names`` order."""
    state = _tensors(model)
    return {n: state[n].detach().to(torch.float32).cpu().numpy().copy() for n in names}


def load_arrays(
    model: nn.Module | dict[str, torch.Tensor], arrays: NDArrays, expected: Sequence[str]
) -> None:
    """Copy ``arrays`` into ``model`` in place; names and shapes must match ``expected`` exactly."""
    got, want = list(arrays), list(expected)
    if set(got) != set(want):
        missing = sorted(set(want) - set(got))
        extra = sorted(set(got) - set(want))
        raise UpdateSchemaError(
            f"arrays do not match the model's trained tensors: missing {missing[:5]}"
            f"{'...' if len(missing) > 5 else ''}, unexpected {extra[:5]}{'...' if len(extra) > 5 else ''}"
        )
    state = _tensors(model)
    with torch.no_grad():
        for name in want:
            dst, src = state[name], np.asarray(arrays[name])
            if tuple(dst.shape) != src.shape:
                raise UpdateSchemaError(
                    f"tensor {name!r}: the model has shape {tuple(dst.shape)}, the arrays have {src.shape}"
                )
            dst.copy_(torch.from_numpy(np.ascontiguousarray(src)))


def make_optimizer(params: list[torch.Tensor], config: TrainConfig) -> torch.optim.Optimizer:
    # foreach=False: for a handful of tiny tensors the multi-tensor path costs more
    # than it saves.
    name = config.optimizer.lower()
    lr, wd = config.learning_rate, config.weight_decay
    if name == "sgd":
        return torch.optim.SGD(
            params, lr=lr, momentum=config.momentum, weight_decay=wd, foreach=False
        )
    if name == "adam":
        return torch.optim.Adam(params, lr=lr, weight_decay=wd, foreach=False)
    if name == "adamw":
        return torch.optim.AdamW(params, lr=lr, weight_decay=wd, foreach=False)
    raise ConfigError(f"unknown optimizer {config.optimizer!r}; expected 'sgd', 'adam' or 'adamw'")


@torch.no_grad()
def evaluate_model(
    model: nn.Module, data: TensorData, batch_size: int = _EVAL_BATCH
) -> dict[str, float]:
    """Example-weighted mean loss and accuracy of ``model`` on ``data`` (per target token
    for sequence targets)."""
    was_training = model.training
    model.eval()
    loss_sum = torch.zeros((), dtype=torch.float64)
    correct = torch.zeros((), dtype=torch.int64)
    targets = 0
    for start in range(0, len(data), batch_size):
        x, y = data.x[start : start + batch_size], data.y[start : start + batch_size]
        loss, hits = _loss_and_correct(model(x), y)
        loss_sum += loss.double() * y.numel()
        correct += hits
        targets += y.numel()
    model.train(was_training)
    if targets == 0:
        return {"accuracy": float("nan"), "loss": float("nan")}
    return {"accuracy": float(correct) / targets, "loss": float(loss_sum) / targets}


def _seed_from(*parts: int) -> int:
    # Neighbouring (seed, partition) pairs must give unrelated streams; 63 bits fit
    # torch's manual_seed.
    return derive_seed(*parts, bits=63)


class TorchTrainer:
    """Local training of ``model_factory()`` on one client's data.

    ``trainable`` names the tensors that train and travel (default: every parameter,
    in ``named_parameters`` order). ``seed`` is the trainer's own seed (for example
    derived from the run seed and partition id); ``TrainConfig.seed`` varies it per
    round.
    """

    def __init__(
        self,
        model_factory: ModelFactory,
        train_data: TensorData | TensorRows,
        test_data: TensorData | Callable[[], TensorData],
        trainable: Sequence[str] | None = None,
        seed: int = 0,
    ) -> None:
        self.train_data = train_data
        # A callable is called on first use: a client that only trains (every simulated
        # client in a round) never gathers its local test split.
        self._test: TensorData | Callable[[], TensorData] = test_data
        self.seed = seed
        self._model = LazyTrainable(model_factory, trainable)

    @property
    def test_data(self) -> TensorData:
        if not isinstance(self._test, TensorData):
            self._test = self._test()
        return self._test

    @property
    def trainable(self) -> list[str]:
        return self._model.names

    @property
    def model(self) -> nn.Module:
        """The trainer's model (with whatever arrays were last loaded)."""
        return self._model.get()[0]

    def train(
        self, arrays: NDArrays, config: TrainConfig, *, gate: StepGate | None = None,
        anchor: NDArrays | None = None,
    ) -> TrainResult:
        """Train from ``arrays``. ``anchor``: where ``proximal_mu``'s pull points (default:
        ``arrays``, FedProx); a personal adapter trained towards the global one (Ditto,
        ``orchard.client.personal``) starts elsewhere than its anchor."""
        model, names, tensors = self._model.get()
        load_arrays(tensors, arrays, names)
        n = len(self.train_data)
        if n == 0:
            return TrainResult(
                arrays=arrays_of(tensors, names),
                weight=0.0,
                num_examples=0,
                num_steps=0,
                metrics={"train_loss": float("nan"), "train_accuracy": float("nan")},
            )
        if config.batch_size < 1:
            raise ConfigError(f"batch_size must be >= 1, got {config.batch_size}")
        params = [tensors[name] for name in names]
        opt = make_optimizer(params, config)
        mu = config.proximal_mu
        if mu > 0 and anchor is not None:
            anchors = [torch.from_numpy(np.array(anchor[name], dtype=np.float32)).reshape(tensors[name].shape)
                       for name in names]
        else:
            anchors = [p.detach().clone() for p in params] if mu > 0 else []

        steps_per_epoch = -(-n // config.batch_size)
        total_steps = config.steps if config.steps is not None else config.epochs * steps_per_epoch
        gen = torch.Generator().manual_seed(_seed_from(self.seed, config.seed))
        x_all, y_all = self.train_data.x, self.train_data.y
        totals = StepTotals()
        model.train()
        step = 0
        visited = 0  # examples drawn, with repeats across epochs
        stopped = False
        while step < total_steps and not stopped:
            perm = torch.randperm(n, generator=gen) if n > 1 else torch.zeros(1, dtype=torch.int64)
            for start in range(0, n, config.batch_size):
                if step >= total_steps:
                    break
                if gate is not None and not gate.before_step():
                    stopped = True
                    break
                if n <= config.batch_size:
                    x, y = (
                        x_all,
                        y_all,
                    )  # one batch: skip the gather (order is irrelevant to the mean)
                else:
                    idx = perm[start : start + config.batch_size]
                    x, y = x_all[idx], y_all[idx]
                totals.add(*train_step(model, opt, self._loss_and_correct, x, y, params, anchors, mu), y)
                step += 1
                if gate is not None:
                    visited += int(y.shape[0])
                    gate.after_step(float(y.shape[0]))
        if stopped:
            return self._partial(tensors, names, n, step, total_steps, visited, totals)
        return TrainResult(
            arrays=arrays_of(tensors, names),
            weight=float(n),
            num_examples=n,
            num_steps=step,
            metrics=totals.metrics(none_seen=0.0),
        )

    @staticmethod
    def _partial(
        tensors: dict[str, torch.Tensor],
        names: list[str],
        n: int,
        steps: int,
        planned: int,
        visited: int,
        totals: StepTotals,
    ) -> TrainResult:
        """The result of a run a gate stopped after ``steps`` of ``planned`` steps.

        Every epoch is a permutation, so the distinct examples drawn are the visits,
        capped at the client's ``n``. The weight is ``n * steps / planned``: FedAvg
        weights a client by its data, and a client that did a fraction of its planned
        work contributes that fraction of its data's gradient signal.
        """
        return TrainResult(
            arrays=arrays_of(tensors, names),
            weight=float(n) * steps / planned if planned > 0 else 0.0,
            num_examples=min(n, visited),
            num_steps=steps,
            metrics=totals.metrics(),
            planned_weight=float(n),
        )

    # Cross-entropy over the targets and the argmax hits. A subclass with another
    # objective (:class:`ObjectiveTrainer`) is not this class, so the simulator's
    # vectorised path, which computes cross-entropy itself, never takes it.
    _loss_and_correct = staticmethod(_loss_and_correct)

    def _evaluate(self, model: nn.Module, data: TensorData) -> dict[str, float]:
        return evaluate_model(model, data)

    def evaluate(self, arrays: NDArrays, config: TrainConfig) -> EvalResult:
        model, names, tensors = self._model.get()
        load_arrays(tensors, arrays, names)
        if len(self.test_data) == 0:
            return EvalResult(num_examples=0, metrics={})
        return EvalResult(
            num_examples=len(self.test_data), metrics=self._evaluate(model, self.test_data)
        )


# (outputs, targets) -> a scalar loss tensor, differentiable in outputs.
LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
# (outputs, targets) of a whole evaluation set -> one number.
MetricFn = Callable[[torch.Tensor, torch.Tensor], float]


@dataclass(frozen=True)
class Objective:
    """What a task optimises and reports: a loss of (outputs, targets), whether the
    outputs are class logits (then accuracy is counted, as for cross-entropy), and
    metrics computed over a whole evaluation set's outputs and targets."""

    loss: LossFn
    classification: bool
    metrics: tuple[tuple[str, MetricFn], ...] = ()

    def loss_and_correct(self, out: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        loss = self.loss(out, y)
        if not isinstance(loss, torch.Tensor) or loss.ndim != 0:
            raise ConfigError(
                f"the task's loss must return a scalar tensor, got "
                f"{type(loss).__name__}{'' if not isinstance(loss, torch.Tensor) else f' of shape {tuple(loss.shape)}'}"
            )
        if self.classification:
            hits = (out.reshape(-1, out.shape[-1]).argmax(dim=-1) == y.reshape(-1)).sum()
        else:
            hits = torch.zeros((), dtype=torch.int64)
        return loss, hits

    @torch.no_grad()
    def evaluate(self, model: nn.Module, data: TensorData, batch_size: int = _EVAL_BATCH) -> dict[str, float]:
        """The example-weighted mean loss, accuracy when the outputs are class logits,
        and each metric over the whole set."""
        was_training = model.training
        model.eval()
        loss_sum, correct, count, outs, ys = 0.0, 0, 0, [], []
        for start in range(0, len(data), batch_size):
            x, y = data.x[start : start + batch_size], data.y[start : start + batch_size]
            out = model(x)
            loss, hits = self.loss_and_correct(out, y)
            loss_sum += float(loss) * int(y.shape[0])
            correct += int(hits)
            count += int(y.shape[0])
            if self.metrics:
                outs.append(out)
                ys.append(y)
        model.train(was_training)
        if count == 0:
            return {"loss": float("nan")}
        result = {"loss": loss_sum / count}
        if self.classification:
            result["accuracy"] = correct / max(int(data.y.numel()), 1)
        if self.metrics:
            all_out, all_y = torch.cat(outs), torch.cat(ys)
            for name, fn in self.metrics:
                result[name] = float(fn(all_out, all_y))
        return result


class ObjectiveTrainer(TorchTrainer):
    """:class:`TorchTrainer` with the task's own :class:`Objective` (loss, metrics)."""

    def __init__(self, model_factory: ModelFactory, train_data: TensorData | TensorRows,
                 test_data: TensorData | Callable[[], TensorData], *, objective: Objective,
                 trainable: Sequence[str] | None = None, seed: int = 0) -> None:
        super().__init__(model_factory, train_data, test_data, trainable=trainable, seed=seed)
        self.objective = objective

    def _loss_and_correct(self, out: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # type: ignore[override]
        return self.objective.loss_and_correct(out, y)

    def train(self, arrays: NDArrays, config: TrainConfig, *, gate: StepGate | None = None,
              anchor: NDArrays | None = None) -> TrainResult:
        result = super().train(arrays, config, gate=gate, anchor=anchor)
        if not self.objective.classification:  # no classes, no accuracy to report
            result.metrics.pop("train_accuracy", None)
        return result

    def _evaluate(self, model: nn.Module, data: TensorData) -> dict[str, float]:
        return self.objective.evaluate(model, data)
