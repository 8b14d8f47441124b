"""Personal adapters: what a device trains for itself beside the global adapter
(``[run.personalization]``, docs/personalization.md).

One interface, :class:`Personalizer`, with one sibling per strategy:

- :class:`NoPersonalization` ("none"): the device uses the global adapter.
- :class:`FineTune` ("finetune"): ``steps`` local steps from the global adapter.
- :class:`Ditto` ("ditto"; Li et al., 2021, Alg. 1): the device keeps its own adapter
  ``v`` and, each time it takes part, trains it ``steps`` steps on
  ``F_k(v) + lam / 2 ||v - w||^2``, ``w`` the round's global adapter (the proximal
  gradient ``lam (v - w)`` is the trainer's ``proximal_mu`` term with ``anchor = w``).

The client runtime and the simulator both call :func:`personalize_and_evaluate`: the
personal adapter from the strategy, then the device's own evaluation of the global and
the personal adapter on its held-out data, as upload metrics
(:mod:`orchard.personal_metrics`).

The personal adapter never leaves the device: it is not part of any upload (the upload
is built from the global update alone) and :class:`PersonalStore` keeps it owner-only in
the device's data dir (``personal-<run>.bin``, the wire blob format), so it survives a
restart and is what the device infers with.
"""

from __future__ import annotations

import dataclasses
import inspect
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from orchard import personal_metrics, wire
from orchard.config import PersonalizationConfig
from orchard.errors import OrchardError
from orchard.files import atomic_write
from orchard.trainer import TrainConfig, Trainer
from orchard.typing import NDArrays


class PersonalizationError(OrchardError):
    """A personal adapter cannot be trained, kept or read here."""


class Personalizer(Protocol):
    kind: str

    def personalize(self, trainer: Trainer, global_arrays: NDArrays, personal: NDArrays | None,
                    config: TrainConfig) -> NDArrays | None:
        """The device's personal adapter after a round with global adapter
        ``global_arrays``; ``personal`` is the one it kept (None: none yet). None: the
        device has no personal adapter (it uses the global one)."""
        ...


def _steps_config(config: TrainConfig, steps: int, learning_rate: float | None, mu: float) -> TrainConfig:
    return dataclasses.replace(config, steps=steps, proximal_mu=mu,
                               learning_rate=config.learning_rate if learning_rate is None else learning_rate)


@dataclass(frozen=True)
class NoPersonalization:
    kind: str = "none"

    def personalize(self, trainer: Trainer, global_arrays: NDArrays, personal: NDArrays | None,
                    config: TrainConfig) -> NDArrays | None:
        return None


@dataclass(frozen=True)
class FineTune:
    """``steps`` plain local steps from the global adapter (no proximal term)."""

    steps: int
    learning_rate: float | None = None
    kind: str = "finetune"

    def personalize(self, trainer: Trainer, global_arrays: NDArrays, personal: NDArrays | None,
                    config: TrainConfig) -> NDArrays | None:
        return trainer.train(global_arrays, _steps_config(config, self.steps, self.learning_rate, 0.0)).arrays


def accepts_anchor(trainer: Trainer) -> bool:
    """Does ``trainer.train`` take a keyword-only ``anchor`` (a proximal pull towards
    other arrays than those it starts from)?"""
    try:
        p = inspect.signature(trainer.train).parameters.get("anchor")
    except (TypeError, ValueError):
        return False
    return p is not None and p.kind is inspect.Parameter.KEYWORD_ONLY


@dataclass(frozen=True)
class Ditto:
    """The device's own adapter, pulled towards the global one with strength ``lam``."""

    steps: int
    lam: float
    learning_rate: float | None = None
    kind: str = "ditto"

    def personalize(self, trainer: Trainer, global_arrays: NDArrays, personal: NDArrays | None,
                    config: TrainConfig) -> NDArrays | None:
        if not accepts_anchor(trainer):
            raise PersonalizationError(
                f"personalization 'ditto' needs a trainer whose train() takes anchor= (the proximal pull towards "
                f"the global adapter); {type(trainer).__name__} does not: use kind 'finetune' with this task")
        start = global_arrays if personal is None or set(personal) != set(global_arrays) else personal
        cfg = _steps_config(config, self.steps, self.learning_rate, self.lam)
        # lam = 0 is local training from the kept adapter (the trainer then anchors nothing).
        return trainer.train(start, cfg, anchor=global_arrays).arrays  # type: ignore[call-arg]


def personalizer(cfg: PersonalizationConfig) -> Personalizer:
    """The strategy ``cfg`` names."""
    if cfg.kind == "finetune":
        return FineTune(cfg.steps, cfg.learning_rate)
    if cfg.kind == "ditto":
        return Ditto(cfg.steps, cfg.lam, cfg.learning_rate)
    return NoPersonalization()


@dataclass(frozen=True)
class DeviceEvaluation:
    """One device's accuracy of each adapter on its own held-out data."""

    global_accuracy: float
    personal_accuracy: float
    num_examples: int

    def metrics(self) -> dict[str, float]:
        return personal_metrics.encode(self.global_accuracy, self.personal_accuracy)


def _accuracy(trainer: Trainer, arrays: NDArrays, config: TrainConfig) -> tuple[float, int]:
    ev = trainer.evaluate(arrays, config)
    return float(ev.metrics.get("accuracy", float("nan"))), ev.num_examples


def personalize_and_evaluate(strategy: Personalizer, trainer: Trainer, global_arrays: NDArrays,
                             personal: NDArrays | None, config: TrainConfig
                             ) -> tuple[NDArrays | None, DeviceEvaluation | None]:
    """The new personal adapter, and the device's evaluation of both adapters (None when
    it has no held-out data). Without a personal adapter the personal figure is the global
    one: the device uses the global adapter."""
    new = strategy.personalize(trainer, global_arrays, personal, config)
    g, n = _accuracy(trainer, global_arrays, config)
    if n == 0:
        return new, None
    p = g if new is None else _accuracy(trainer, new, config)[0]
    return new, DeviceEvaluation(g, p, n)


_RUN_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")


class PersonalStore:
    """The device's personal adapters, one per run, owner-only under ``state_dir``."""

    def __init__(self, state_dir: str | Path) -> None:
        self.dir = Path(state_dir)

    def path(self, run_id: str) -> Path:
        if not _RUN_ID.fullmatch(run_id):
            raise PersonalizationError(f"run id {run_id[:40]!r} cannot name a file: expected letters, digits, '.', "
                                       "'_' or '-'")
        return self.dir / f"personal-{run_id}.bin"

    def load(self, run_id: str) -> NDArrays | None:
        p = self.path(run_id)
        if not p.is_file():
            return None
        try:
            return wire.blob_to_arrays(p.read_bytes())
        except (ValueError, OrchardError) as err:
            raise PersonalizationError(f"{p} is not a personal adapter ({err}); remove it to start a new one") from None

    def save(self, run_id: str, arrays: NDArrays) -> Path:
        p = self.path(run_id)
        atomic_write(p, wire.arrays_to_blob(arrays))  # 0600 in a 0700 directory (orchard.files)
        return p

    def latest(self) -> Path | None:
        """The most recently written personal adapter, if any (what inference uses)."""
        found = sorted(self.dir.glob("personal-*.bin"), key=lambda q: q.stat().st_mtime) if self.dir.is_dir() else []
        return found[-1] if found else None


class DevicePersonal:
    """A device's personal adapters across rounds: read from its store when it has one (a
    restart picks up where it left), kept in memory otherwise."""

    def __init__(self, state_dir: str | Path | None) -> None:
        self.store = PersonalStore(state_dir) if state_dir is not None else None
        self._held: dict[str, NDArrays] = {}

    def get(self, run_id: str) -> NDArrays | None:
        if run_id not in self._held and self.store is not None:
            got = self.store.load(run_id)
            if got is not None:
                self._held[run_id] = got
        return self._held.get(run_id)

    def round(self, run_id: str, cfg: PersonalizationConfig, trainer: Trainer, global_arrays: NDArrays,
              config: TrainConfig) -> dict[str, float]:
        """This round's personal step and evaluation; returns the metrics to report."""
        new, ev = personalize_and_evaluate(personalizer(cfg), trainer, global_arrays, self.get(run_id), config)
        if new is not None:
            self._held[run_id] = new
            if self.store is not None:
                self.store.save(run_id, new)
        return {} if ev is None else ev.metrics()


def held_out_problems(task: object, task_name: str) -> list[str]:
    """Personalization is judged on each device's own held-out data: a task must give
    every client a local test split (``partition(...).test_indices``)."""
    partition = getattr(task, "partition", None)
    held = False
    if callable(partition):
        try:
            part = partition(2, 0)
            held = any(len(ix) > 0 for ix in getattr(part, "test_indices", ()))
        except (OrchardError, ValueError):
            held = False
    if held:
        return []
    return [f"personalization: task {task_name!r} has no held-out split per device (its partitions carry no "
            "local test examples), so devices could not evaluate their personal adapter: use a task with one "
            "(mnist, digits) or set personalization.kind = 'none'"]
