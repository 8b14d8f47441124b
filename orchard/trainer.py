"""The client programming model: a trainer takes named arrays and a config and returns
named arrays, a weight and metrics (ARCHITECTURE section 3).

Everything that trains on a client implements :class:`Trainer`: the reference tasks'
torch trainer, the LoRA trainer, and the Flower ``ClientApp`` adapter. The client
runtime and the simulator call only this protocol.

A trainer may also accept a :class:`StepGate` (the edge runtime's governor) as the
keyword-only argument ``gate`` of ``train``: it then asks the gate before every local
step and stops cleanly when the gate says no. The gate is an optional keyword rather
than part of :class:`Trainer` so that trainers which cannot be paced step by step (a
Flower app runs its whole loop in one call) stay valid trainers; :func:`train_gated`
runs those as one indivisible step.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field, replace
from typing import Any, Protocol, runtime_checkable

from orchard.typing import Metrics, NDArrays


@dataclass(frozen=True)
class TrainConfig:
    """Per-round client training settings, carried in the task spec.

    ``epochs`` or ``steps`` bounds local work (``steps`` wins when both are set).
    ``proximal_mu`` > 0 turns on FedProx's proximal term (Li et al., 2020, eq. 2).
    """

    epochs: int = 1
    steps: int | None = None
    batch_size: int = 32
    learning_rate: float = 0.05
    optimizer: str = "sgd"  # "sgd" | "adam" | "adamw"
    momentum: float = 0.0
    weight_decay: float = 0.0
    proximal_mu: float = 0.0
    seed: int = 0
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass
class TrainResult:
    """What local training returns.

    ``arrays`` are the *new local values* of the trained tensors (the client runtime
    turns them into a delta against the global model). ``weight`` is what the server
    weights the update by: the number of examples by default. When a :class:`StepGate`
    stopped training early, ``num_steps`` is the steps actually done, ``num_examples``
    the distinct examples those steps drew, and ``weight`` the examples scaled by the
    fraction of the planned steps that ran (``n * done / planned``), so a partial update
    counts for the work in it, in the same unit as everyone else's weight; and
    ``planned_weight`` the weight a complete run would have had (FedNova weighs by
    data, not by work: it normalises by the steps itself).
    """

    arrays: NDArrays
    weight: float
    num_examples: int
    num_steps: int
    metrics: Metrics = field(default_factory=dict)
    planned_weight: float | None = None  # set only when a gate stopped training early

    @property
    def stopped_early(self) -> bool:
        return self.planned_weight is not None


@dataclass
class EvalResult:
    num_examples: int
    metrics: Metrics = field(default_factory=dict)


@runtime_checkable
class Trainer(Protocol):
    def train(self, arrays: NDArrays, config: TrainConfig) -> TrainResult: ...

    def evaluate(self, arrays: NDArrays, config: TrainConfig) -> EvalResult: ...


@runtime_checkable
class StepGate(Protocol):
    """Asked between local steps (the edge runtime's ``Governor`` is one).

    ``before_step`` may block (a throttling pause) and returns False when training must
    stop; ``after_step(work_units)`` records a finished step (examples in its batch).
    Every ``before_step`` that returned True is followed by exactly one ``after_step``.
    """

    def before_step(self) -> bool: ...

    def after_step(self, work_units: float = 1.0) -> None: ...


def accepts_gate(trainer: Trainer) -> bool:
    """Does ``trainer.train`` take a keyword-only ``gate`` (step-by-step pacing)?"""
    try:
        params = inspect.signature(trainer.train).parameters
    except (TypeError, ValueError):  # builtins and some C callables have no signature
        return False
    p = params.get("gate")
    return p is not None and p.kind is inspect.Parameter.KEYWORD_ONLY


def round_config(trainer: object, config: TrainConfig, round_number: int) -> TrainConfig:
    """``config`` as ``trainer`` takes it in round ``round_number``. A trainer that reads the
    round (``reads_round``: a Flower ClientApp, which finds it in its config record where a
    Flower strategy puts it) gets it as ``extra["server-round"]``; any other trainer gets
    ``config`` itself. A live client and the simulator both ask here."""
    if not getattr(trainer, "reads_round", False):
        return config
    return replace(config, extra={**config.extra, "server-round": round_number})


def train_gated(
    trainer: Trainer, arrays: NDArrays, config: TrainConfig, gate: StepGate | None
) -> TrainResult:
    """``trainer.train`` under ``gate``.

    A trainer that accepts a gate is paced step by step. Any other trainer (a Flower
    app) runs as one step: the gate decides whether it may start at all, and is told
    afterwards what it cost. A gate that refuses the first step gives a result with
    zero steps and the arrays unchanged, which the client does not upload.
    """
    if gate is None:
        return trainer.train(arrays, config)
    if accepts_gate(trainer):
        return trainer.train(arrays, config, gate=gate)  # type: ignore[call-arg]
    if not gate.before_step():
        return TrainResult(
            arrays=dict(arrays), weight=0.0, num_examples=0, num_steps=0, planned_weight=0.0
        )
    result = trainer.train(arrays, config)
    gate.after_step(float(max(result.num_examples, 1)))
    return result
