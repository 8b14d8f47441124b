"""Local training on a stream with experience replay: the one continual trainer, used by
a real client and by the simulator alike.

Each round the trainer reads the samples of its stream that arrived since the last
round (``SampleStream.read(cursor)``; the cursor is kept in the replay file, so a
restarted client resumes where it stopped), trains on them mixed with samples replayed
from the device's buffer, then offers them to the buffer.

Mixing. With batch size B and ratio r, a step takes ``k = round(r * B)`` samples drawn
from the buffer and ``B - k`` new ones (an epoch is one pass over the new samples). An
empty buffer replays nothing: the step is all new samples. ``r = 1`` trains on replayed
samples only (as many steps as a pass over the new samples in batches of B); the new
ones still enter the buffer. ``r = 0`` never reads the buffer.

What travels is what :class:`~orchard.tasks.torch_trainer.TorchTrainer` returns: the
trained tensors, a weight (the new samples) and metrics. The buffer stays in the
device's directory and is read by nothing else.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Protocol

import numpy as np
import torch
from torch import nn

from orchard.client.replay import ReplayBuffer
from orchard.errors import ConfigError
from orchard.seeds import derive_seed
from orchard.tasks.torch_trainer import (
    LazyTrainable,
    StepTotals,
    TensorData,
    _loss_and_correct,
    arrays_of,
    evaluate_model,
    load_arrays,
    make_optimizer,
    train_step,
)
from orchard.trainer import EvalResult, StepGate, TrainConfig, TrainResult
from orchard.typing import NDArrays


class SampleStream(Protocol):
    """A device's samples in arrival order. ``read(cursor)``: inputs (float32) and labels
    (int64) of the samples after the first ``cursor`` that have arrived by now."""

    sample_shape: tuple[int, ...]

    def read(self, cursor: int) -> tuple[np.ndarray, np.ndarray]: ...


class ContinualTrainer:
    """A :class:`~orchard.trainer.Trainer` over a :class:`SampleStream` and a replay buffer
    in ``directory`` of at most ``budget_bytes`` (see the module)."""

    def __init__(self, model_factory: Callable[[], nn.Module], stream: SampleStream, directory: str | Path,
                 budget_bytes: int, *, replay_ratio: float, sampling: str = "reservoir", hot_samples: int = 4,
                 test_data: TensorData | Callable[[], TensorData] | None = None,
                 trainable: Sequence[str] | None = None, seed: int = 0, share: float | None = None) -> None:
        if not 0.0 <= replay_ratio <= 1.0:
            raise ConfigError(f"continual.replay_ratio must be in [0, 1], got {replay_ratio}")
        self.stream = stream
        self.directory = Path(directory)
        self.budget_bytes = int(budget_bytes)
        self.replay_ratio = float(replay_ratio)
        self.sampling = sampling
        self.hot_samples = hot_samples
        self._test = test_data
        self.seed = seed
        self._model = LazyTrainable(model_factory, trainable)
        self.share = share
        # The samples the last round read (what a personal step after it trains on).
        self._recent: tuple[np.ndarray, np.ndarray] | None = None

    def arrive(self, now_s: float) -> None:
        """The stream's clock (the simulator's virtual time); a file the device appends to needs none."""
        arrive = getattr(self.stream, "arrive", None)
        if arrive is not None:
            arrive(now_s)

    def buffer(self) -> ReplayBuffer:
        """The device's buffer as the file holds it now (a damaged file is discarded)."""
        return ReplayBuffer(self.directory, self.stream.sample_shape, self.budget_bytes, sampling=self.sampling,
                            hot_samples=self.hot_samples, share=self.share)

    @property
    def trainable(self) -> list[str]:
        return self._model.names

    def train(self, arrays: NDArrays, config: TrainConfig, *, gate: StepGate | None = None,
              anchor: NDArrays | None = None) -> TrainResult:
        """A local round (see the module). With ``anchor`` it is a personal step
        (:mod:`orchard.client.personal`, Ditto): ``proximal_mu`` pulls towards ``anchor``,
        and it trains on the samples the last round read (else those waiting on the
        stream) mixed with replayed ones at the ratio, without consuming or buffering
        anything: the round's own call did that."""
        model, names, tensors = self._model.get()
        load_arrays(tensors, arrays, names)
        if config.batch_size < 1:
            raise ConfigError(f"batch_size must be >= 1, got {config.batch_size}")
        buf = self.buffer()
        personal = anchor is not None
        if personal and self._recent is not None:
            new_x, new_y = self._recent
        else:
            new_x, new_y = self.stream.read(buf.cursor)
        n = int(new_y.shape[0])
        rng = np.random.default_rng(derive_seed(self.seed, config.seed, 0x5E9, bits=63))
        if n == 0:
            return TrainResult(arrays=arrays_of(tensors, names), weight=0.0, num_examples=0, num_steps=0,
                               metrics={"train_loss": float("nan"), "train_accuracy": float("nan")})
        b = config.batch_size
        k = int(round(self.replay_ratio * b)) if len(buf) > 0 else 0
        fresh = b - k
        steps_per_epoch = -(-n // (fresh if fresh > 0 else b))
        total = config.steps if config.steps is not None else config.epochs * steps_per_epoch
        params = [tensors[name] for name in names]
        opt = make_optimizer(params, config)
        mu = config.proximal_mu
        if mu > 0 and anchor is not None:
            anchors = [torch.from_numpy(np.array(anchor[name], dtype=np.float32)).reshape(tensors[name].shape)
                       for name in names]
        else:
            anchors = [p.detach().clone() for p in params] if mu > 0 else []
        gen = torch.Generator().manual_seed(derive_seed(self.seed, config.seed, bits=63))
        x_new, y_new = torch.from_numpy(new_x), torch.from_numpy(new_y)
        totals = StepTotals()
        step, stopped = 0, False
        model.train()
        perm = torch.randperm(n, generator=gen)
        pos = 0
        while step < total:
            if gate is not None and not gate.before_step():
                stopped = True
                break
            parts_x, parts_y = [], []
            if fresh > 0:
                if pos >= n:
                    perm, pos = torch.randperm(n, generator=gen), 0
                idx = perm[pos:pos + fresh]
                pos += fresh
                parts_x.append(x_new[idx])
                parts_y.append(y_new[idx])
            if k > 0:
                rx, ry = buf.draw(k, rng)
                parts_x.append(torch.from_numpy(rx))
                parts_y.append(torch.from_numpy(ry))
            x, y = torch.cat(parts_x), torch.cat(parts_y)
            totals.add(*train_step(model, opt, _loss_and_correct, x, y, params, anchors, mu), y)
            step += 1
            if gate is not None:
                gate.after_step(float(y.shape[0]))
        if not personal:
            # The new samples were seen: they enter the buffer (by its rule) whatever the gate did.
            for i in range(n):
                buf.offer(new_x[i], int(new_y[i]), rng)
            buf.cursor += n
            buf.flush()
            self._recent = (new_x, new_y)
        metrics = totals.metrics()
        if stopped:
            return TrainResult(arrays=arrays_of(tensors, names), weight=float(n) * step / total if total else 0.0,
                               num_examples=min(n, step * max(fresh, 1)), num_steps=step, metrics=metrics,
                               planned_weight=float(n))
        return TrainResult(arrays=arrays_of(tensors, names), weight=float(n), num_examples=n, num_steps=step,
                           metrics=metrics)

    def evaluate(self, arrays: NDArrays, config: TrainConfig) -> EvalResult:
        model, names, tensors = self._model.get()
        load_arrays(tensors, arrays, names)
        if self._test is None:
            return EvalResult(num_examples=0, metrics={})
        if not isinstance(self._test, TensorData):
            self._test = self._test()
        if len(self._test) == 0:
            return EvalResult(num_examples=0, metrics={})
        return EvalResult(num_examples=len(self._test), metrics=evaluate_model(model, self._test))
