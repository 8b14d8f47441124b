"""Domain messages of the Fleet protocol (what the protos carry, as typed values).

Servicers and the client runtime convert protos to these with :mod:`orchard.wire`;
round logic only ever sees these.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import IntEnum

from orchard.typing import TensorSpec


class UploadKind(IntEnum):
    CLIENT_UPDATE = 0  # one client's encoded model delta
    PARTIAL_SUM = 1  # a lower tier's float64 weighted sum of its cohort


PARTIAL_CODEC = "float64"


@dataclass(frozen=True)
class TaskAssignment:
    run_id: str
    round: int
    attempt: int
    task_id: str
    model_hash: str
    model_bytes: int
    config_json: str
    schema: tuple[TensorSpec, ...]
    deadline_unix: float
    cohort_target: int
    shared_seed: int


@dataclass(frozen=True)
class Idle:
    retry_after_s: float
    reason: str


@dataclass(frozen=True)
class DroppedUpload:
    """An upload a tier acknowledged that will be in no aggregate: its ids as the client
    sent them (its header's run, round, attempt, node and task) and why it is dropped."""

    run_id: str
    round: int
    attempt: int
    node_id: str
    task_id: str
    reason: str = ""


@dataclass(frozen=True)
class UploadHeader:
    node_id: str
    run_id: str
    round: int
    attempt: int
    task_id: str
    kind: UploadKind
    schema: tuple[TensorSpec, ...]
    payload_sizes: tuple[int, ...]
    codec: str
    payload_sha256: str
    weight: float
    count: int
    num_examples: int = 0
    num_steps: int = 0
    metric_sums: dict[str, float] = field(default_factory=dict)
    metric_weights: dict[str, float] = field(default_factory=dict)
    bytes_up: int = 0
    bytes_down: int = 0
    tier_participants: dict[str, int] = field(default_factory=dict)
    # Asynchronous mode, partials only: the client updates inside, by the staleness they
    # were folded with below (the tier above adds the partial's own staleness).
    staleness: dict[int, int] = field(default_factory=dict)
    # Partials only: nodes selected below this tier (at every tier down) that were dropped
    # (silent past their timeout, or gone), so that the root's record counts them.
    dropped: int = 0

    @property
    def total_bytes(self) -> int:
        return sum(self.payload_sizes)
