"""The client programming model: a trainer takes named arrays and a config and returns
named arrays, a weight and metrics (ARCHITECTURE section 3).

Everything that trains on a client implements :class:`Trainer`: the reference tasks'
torch trainer, the LoRA trainer, and the Flower ``ClientApp`` adapter. The client
runtime and the simulator call only this protocol.
"""

from __future__ import annotations

from dataclasses import dataclass, field
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
    weights the update by: the number of examples by default, or the steps actually
    done when a governor stopped training early.
    """

    arrays: NDArrays
    weight: float
    num_examples: int
    num_steps: int
    metrics: Metrics = field(default_factory=dict)


@dataclass
class EvalResult:
    num_examples: int
    metrics: Metrics = field(default_factory=dict)


@runtime_checkable
class Trainer(Protocol):
    def train(self, arrays: NDArrays, config: TrainConfig) -> TrainResult: ...

    def evaluate(self, arrays: NDArrays, config: TrainConfig) -> EvalResult: ...
