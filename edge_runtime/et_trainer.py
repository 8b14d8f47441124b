"""Training through a bundle's ExecuTorch training program, without torch.

The program (:mod:`orchard.edge_runtime.et_program`) computes the loss and the
gradients of the trained tensors (a LoRA adapter's, or the parameters of a task that
trains its model); this trainer does everything else on plain numpy arrays, as a phone
app would around the native runtime: batches, the split of a batch into the program's
fixed-size micro-batches (gradients add up exactly: each row weighs
``1 / (K * batch rows)``, ``K`` the row's loss terms: its ``T`` tokens for a next-token
program, 1 for a class label, the values of a regression target), FedProx's term and
the SGD step. Every kind of program trains through this one loop.

Same contract as the reference torch trainer (:class:`orchard.tasks.torch_trainer.TorchTrainer`):
a :class:`~orchard.trainer.Trainer` that takes and returns the trained tensors by name,
asks a :class:`~orchard.trainer.StepGate` (the governor) before every step and reports
partial work the same way (``weight = n * done / planned``). The SGD step is torch's
``torch.optim.SGD`` (dampening 0, no Nesterov)::

    g = grad + mu (w - w_global)          # FedProx (Li et al., 2020, eq. 2), mu > 0
    g = g + weight_decay * w
    buf = g (first step) | momentum * buf + g
    w = w - lr * (buf if momentum else g)

Batches: an epoch visits the client's rows in a permutation drawn from a numpy
generator seeded like the torch trainer's (trainer seed, ``TrainConfig.seed``). When a
client's data fit one batch (every Shakespeare client at the default batch size of
32) there is no permutation and both trainers see the same batches; otherwise the
orders differ (numpy's permutation is not torch's).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from orchard.errors import ConfigError, UpdateSchemaError
from orchard.seeds import derive_seed
from orchard.text import CharTokenizer
from orchard.trainer import EvalResult, StepGate, TrainConfig, TrainResult
from orchard.typing import NDArrays

from .bundle import BundleError, read_bundle
from .bundle_task import read_tokenizer
from .et_program import NEXT_TOKEN, REGRESSION, TrainingProgram, load_training_program

RUNTIMES = ("torch", "executorch")


@dataclass(frozen=True)
class DeviceData:
    """A device's examples: ``x`` (N, ...) inputs and ``y`` (N, ...) targets: (N, T)
    int64 token windows for a next-token program, rows of features and their labels for
    a classification or regression program."""

    x: np.ndarray
    y: np.ndarray

    def __len__(self) -> int:
        return int(self.x.shape[0])

    @staticmethod
    def empty(seq_len: int) -> DeviceData:
        return DeviceData(np.empty((0, seq_len), np.int64), np.empty((0, seq_len), np.int64))

    @staticmethod
    def empty_for(shapes: RowShapes) -> DeviceData:
        (xs, xd), (ys, yd) = shapes
        return DeviceData(np.empty((0, *xs), xd), np.empty((0, *ys), yd))


# ((one input row's shape, dtype), (one target row's shape, dtype)): what a program takes.
RowShapes = tuple[tuple[tuple[int, ...], str], tuple[tuple[int, ...], str]]


def text_windows(ids: np.ndarray, seq_len: int) -> DeviceData:
    """Non-overlapping windows ``x[t] = ids[t]``, ``y[t] = ids[t + 1]`` (as the reference
    text task cuts a client's text)."""
    n = (len(ids) - 1) // seq_len
    if n <= 0:
        return DeviceData.empty(seq_len)
    x = ids[: n * seq_len].reshape(n, seq_len)
    y = ids[1 : n * seq_len + 1].reshape(n, seq_len)
    return DeviceData(x.astype(np.int64), y.astype(np.int64))


def load_device_data(
    path: str | os.PathLike[str], *, seq_len: int | None = None, shapes: RowShapes | None = None,
    tokenizer: CharTokenizer | None = None, test_fraction: float = 0.2,
) -> tuple[DeviceData, DeviceData]:
    """(train, test) examples of a device from a file, for a program that takes rows of
    ``shapes`` (``seq_len``: token windows of that length, int64).

    ``.npz``: arrays ``x`` and ``y`` of those row shapes, and optionally ``test_x`` and
    ``test_y``. Any other file is the device's own text (UTF-8), encoded with the
    bundle's ``tokenizer``: its first ``1 - test_fraction`` trains, the rest tests.
    """
    if shapes is None:
        if seq_len is None:
            raise ConfigError("load_device_data needs the program's row shapes (or seq_len for token windows)")
        shapes = (((seq_len,), "int64"), ((seq_len,), "int64"))
    (xs, xd), (ys, yd) = shapes
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"device data {p} does not exist")
    if p.suffix == ".npz":
        want = f"x of shape (N, {', '.join(map(str, xs))}) {xd} and y of shape (N{''.join(f', {d}' for d in ys)}) {yd}"
        with np.load(p) as z:
            missing = [k for k in ("x", "y") if k not in z.files]
            if missing:
                raise ConfigError(f"{p} lacks arrays {missing}: expected {want}")
            train = DeviceData(np.asarray(z["x"], xd), np.asarray(z["y"], yd))
            test = (DeviceData(np.asarray(z["test_x"], xd), np.asarray(z["test_y"], yd))
                    if "test_x" in z.files and "test_y" in z.files else DeviceData.empty_for(shapes))
        for name, d in (("x/y", train), ("test_x/test_y", test)):
            if d.x.shape[1:] != xs or d.y.shape[1:] != ys or len(d.x) != len(d.y):
                raise ConfigError(f"{p}: {name} have shapes {d.x.shape} and {d.y.shape}, expected {want}")
        return train, test
    if seq_len is None:
        if xs != ys or len(xs) != 1 or xd != "int64":
            raise ConfigError(f"{p} is not an .npz: this program trains on rows, pass an .npz of {xs} {xd} "
                              f"inputs x and {ys} {yd} targets y")
        seq_len = xs[0]
    if tokenizer is None:
        raise ConfigError(f"{p} is text, and the bundle has no tokenizer to encode it: pass an .npz of token ids")
    ids = np.asarray(tokenizer.encode_array(p.read_text(encoding="utf-8")), np.int64)
    cut = int(round(len(ids) * (1.0 - test_fraction)))
    return text_windows(ids[:cut], seq_len), text_windows(ids[cut:], seq_len)


class ExecuTorchTrainer:
    """Local training through an ExecuTorch training program (see the module docstring)."""

    def __init__(self, program: TrainingProgram, train_data: DeviceData,
                 test_data: DeviceData | None = None, seed: int = 0) -> None:
        self.program = program
        self.train_data = train_data
        self.test_data = test_data if test_data is not None else DeviceData.empty_for(program.example_shapes)
        self.seed = seed
        self.names = program.names
        self._shapes = {p.name: p.shape for p in program.manifest.parameters}
        (xs, _), (ys, _) = program.example_shapes
        for what, d in (("train", self.train_data), ("test", self.test_data)):
            if len(d) and (d.x.shape[1:] != xs or d.y.shape[1:] != ys):
                raise ConfigError(
                    f"{what} rows have inputs {list(d.x.shape[1:])} and targets {list(d.y.shape[1:])}, the training "
                    f"program {program.path} takes {list(xs)} and {list(ys)}"
                )
        # A regression program counts no hits: no accuracy to report, as the torch trainer.
        self._accuracy = program.manifest.kind != REGRESSION

    @property
    def trainable(self) -> list[str]:
        return list(self.names)

    def _load(self, arrays: NDArrays) -> dict[str, np.ndarray]:
        if set(arrays) != set(self.names):
            missing = sorted(set(self.names) - set(arrays))[:3]
            extra = sorted(set(arrays) - set(self.names))[:3]
            raise UpdateSchemaError(
                f"the run's arrays are not the tensors the training program {self.program.path} trains "
                f"({self.program.manifest.trains}): missing e.g. "
                f"{missing}, unexpected e.g. {extra}; re-create the bundle for this run's task parameters"
            )
        params = self.program.parameters()
        for n in self.names:
            src = np.asarray(arrays[n])
            if src.shape != tuple(self._shapes[n]):
                raise UpdateSchemaError(
                    f"tensor {n!r}: the training program {self.program.path} trains shape "
                    f"{list(self._shapes[n])}, the run sent {list(src.shape)}; re-create the bundle for this run"
                )
            params[n][...] = src
        return params

    def _batch(self, data: DeviceData, rows: np.ndarray | None) -> tuple[float, int, list[np.ndarray] | None, int]:
        """Mean loss per target, hits and summed gradients of one batch (``rows`` None: all)."""
        x = data.x if rows is None else data.x[rows]
        y = data.y if rows is None else data.y[rows]
        nb, t = len(x), self.program.targets_per_row
        m = self.program.micro_batch
        w = np.full(m, 1.0 / (nb * t), np.float32)
        loss, hits = 0.0, 0
        grads: list[np.ndarray] | None = None
        for start in range(0, nb, m):
            stop = min(start + m, nb)
            l_c, h_c, g_c = self.program.step(x[start:stop], y[start:stop], w[: stop - start])
            loss += l_c
            hits += h_c
            if grads is None:
                grads = [g.copy() for g in g_c]
            else:
                for acc, g in zip(grads, g_c, strict=True):
                    acc += g
        return loss, hits, grads, nb * t

    def train(self, arrays: NDArrays, config: TrainConfig, *, gate: StepGate | None = None) -> TrainResult:
        if config.optimizer.lower() != "sgd":
            raise ConfigError(
                f"the ExecuTorch runtime steps SGD outside its program; the run asks for optimizer "
                f"{config.optimizer!r}: use optimizer = 'sgd' for runs with phone-class clients"
            )
        if config.batch_size < 1:
            raise ConfigError(f"batch_size must be >= 1, got {config.batch_size}")
        params = self._load(arrays)
        plist = [params[n] for n in self.names]
        n = len(self.train_data)
        if n == 0:
            return TrainResult(arrays={k: v.copy() for k, v in params.items()}, weight=0.0, num_examples=0,
                               num_steps=0, metrics=self._metrics(float("nan"), float("nan")))
        lr = np.float32(config.learning_rate)
        mu, wd, momentum = np.float32(config.proximal_mu), np.float32(config.weight_decay), config.momentum
        anchors = [p.copy() for p in plist] if mu > 0 else []
        bufs: list[np.ndarray] | None = None
        steps_per_epoch = -(-n // config.batch_size)
        total = config.steps if config.steps is not None else config.epochs * steps_per_epoch
        rng = np.random.default_rng(derive_seed(self.seed, config.seed, bits=63))
        loss_sum, hits_sum, seen, step, visited, stopped = 0.0, 0, 0, 0, 0, False
        while step < total and not stopped:
            perm = rng.permutation(n) if n > config.batch_size else None
            for start in range(0, n, config.batch_size):
                if step >= total:
                    break
                if gate is not None and not gate.before_step():
                    stopped = True
                    break
                rows = None if perm is None else perm[start : start + config.batch_size]
                loss, hits, grads, targets = self._batch(self.train_data, rows)
                assert grads is not None
                for j, (p, g) in enumerate(zip(plist, grads, strict=True)):
                    if mu > 0:
                        g += mu * (p - anchors[j])
                    if wd != 0:
                        g += wd * p
                    if momentum != 0:
                        if bufs is None:
                            bufs = [np.zeros_like(q) for q in plist]
                        bufs[j] = g.copy() if step == 0 else np.float32(momentum) * bufs[j] + g
                        g = bufs[j]
                    p -= lr * g  # in place: the program's own parameter storage
                loss_sum += loss * targets
                hits_sum += hits
                seen += targets
                step += 1
                nb = len(self.train_data) if rows is None else len(rows)
                visited += nb
                if gate is not None:
                    gate.after_step(float(nb))
        out = {k: params[k].copy() for k in self.names}
        metrics = self._metrics(loss_sum / seen if seen else float("nan"), hits_sum / seen if seen else float("nan"))
        if stopped:
            return TrainResult(arrays=out, weight=float(n) * step / total if total > 0 else 0.0,
                               num_examples=min(n, visited), num_steps=step, metrics=metrics,
                               planned_weight=float(n))
        return TrainResult(arrays=out, weight=float(n), num_examples=n, num_steps=step, metrics=metrics)

    def _metrics(self, loss: float, accuracy: float) -> dict[str, float]:
        out = {"train_loss": loss}
        if self._accuracy:
            out["train_accuracy"] = accuracy
        return out

    def gradients(self, arrays: NDArrays, x: np.ndarray, y: np.ndarray) -> tuple[float, NDArrays]:
        """Mean loss per target and its gradients at ``arrays`` on one batch (for checks)."""
        self._load(arrays)
        (_, xd), (_, yd) = self.program.example_shapes
        loss, _, grads, _ = self._batch(DeviceData(np.asarray(x, xd), np.asarray(y, yd)), None)
        assert grads is not None
        return loss, dict(zip(self.names, grads, strict=True))

    def evaluate(self, arrays: NDArrays, config: TrainConfig) -> EvalResult:
        self._load(arrays)
        n = len(self.test_data)
        if n == 0:
            return EvalResult(num_examples=0, metrics={})
        loss, hits, _, targets = self._batch(self.test_data, None)
        return EvalResult(num_examples=n, metrics={"accuracy": hits / targets, "loss": loss} if self._accuracy
                          else {"loss": loss})


def executorch_trainer_factory(
    bundle_dir: str | os.PathLike[str], train: DeviceData | None = None, test: DeviceData | None = None,
    *, data_path: str | os.PathLike[str] | None = None, seed: int = 0,
) -> Callable[[Any], ExecuTorchTrainer]:
    """A client runtime's trainer factory for ``orchard client start --runtime executorch``.

    The bundle's program is loaded and checked now (a bad bundle is refused before the
    client joins): its manifest and digest, its layout, and its trained tensors against
    the bundle's adapter. Data: ``train``/``test`` arrays, or ``data_path`` (see
    :func:`load_device_data`). Each task's run must be for the program's task.
    """
    bundle = read_bundle(bundle_dir)
    program = load_training_program(bundle.path, adapter=bundle.adapter_arrays())
    if train is None:
        if data_path is None:
            raise ConfigError(
                "the ExecuTorch runtime trains on the device's own data: pass --data FILE "
                "(its text, or an .npz of x and y: token windows, or rows of features and labels)"
            )
        tok: CharTokenizer | None = None
        if program.manifest.kind == NEXT_TOKEN:
            try:
                tok = read_tokenizer(bundle.path)
            except BundleError:
                tok = None
        train, test = load_device_data(data_path, shapes=program.example_shapes, tokenizer=tok)
    trainer = ExecuTorchTrainer(program, train, test, seed=seed)

    def factory(cfg: Any) -> ExecuTorchTrainer:
        if cfg.task != program.manifest.task:
            raise ConfigError(
                f"the run trains task {cfg.task!r}, the bundle's training program {program.path} is for "
                f"{program.manifest.task!r}: re-create the bundle for this run"
            )
        return trainer

    return factory
