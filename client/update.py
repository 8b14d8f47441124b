"""From a trainer's result to an upload: delta, weight, codec, header.

Shared by the client runtime and the simulator so that both send exactly the same
bytes for the same inputs; nothing here touches the network. The delta is encoded as
it is: its weight travels in the header and is applied by the tier, whether it decodes
the update or sums payloads in the compressed domain (secure aggregation pre-scales
the values it masks itself: ``orchard.client.secure``).
"""

from __future__ import annotations

from typing import Any, cast

import numpy as np

from orchard import wire
from orchard.compression import Codec, encode_update
from orchard.config import RunConfig
from orchard.errors import UpdateSchemaError
from orchard.messages import TaskAssignment, UploadHeader, UploadKind
from orchard.seeds import derive_seed
from orchard.trainer import TrainResult
from orchard.typing import NDArrays
from orchard.updates import pack


def train_seed(run_seed: int, rnd: int, partition_id: int) -> int:
    """Deterministic per (run seed, round, partition): same seed, same update. In
    ``[0, 2**31 - 1)``."""
    return derive_seed(run_seed, rnd, partition_id, bits=31) % (2**31 - 1)


class _LazyGenerator:
    """Stands in for ``np.random.default_rng(entropy)``, built on first attribute access:
    most codecs draw nothing, and building a Generator costs more than encoding a small
    update. A codec that draws gets the very stream the Generator would give."""

    __slots__ = ("_entropy", "_rng")

    def __init__(self, entropy: list[int]) -> None:
        self._entropy = entropy
        self._rng: np.random.Generator | None = None

    def __getattr__(self, name: str) -> Any:  # only for names the slots do not hold
        if self._rng is None:
            self._rng = np.random.default_rng(self._entropy)
        return getattr(self._rng, name)


def upload_rng(seed: int) -> np.random.Generator:
    """The encoder's randomness for an upload trained with ``seed`` (created lazily)."""
    return cast(np.random.Generator, _LazyGenerator([seed, 0xC0DEC]))


def weight_of(result: TrainResult, weighting: str) -> float:
    if weighting == "steps":
        return float(result.num_steps)
    if weighting == "uniform":
        return 1.0
    return float(result.weight)


def delta_of(t: TaskAssignment, global_arrays: NDArrays, result: TrainResult) -> NDArrays:
    """``local - global`` over exactly the tensors the task's schema names."""
    names = [s.name for s in t.schema]
    missing = [n for n in names if n not in result.arrays]
    if missing:
        raise UpdateSchemaError(f"the trainer returned no value for {missing[:5]}; it must return every "
                                "tensor of the global model")
    out: NDArrays = {}
    for n in names:
        new = np.asarray(result.arrays[n], dtype=np.float32)
        if new.shape != global_arrays[n].shape:
            raise UpdateSchemaError(f"trainer returned {n!r} with shape {new.shape}, "
                                    f"the model has {global_arrays[n].shape}")
        out[n] = np.subtract(new, global_arrays[n], dtype=np.float32)
    return out


def build_upload(t: TaskAssignment, cfg: RunConfig, codec: Codec, node_id: str, delta: NDArrays,
                 result: TrainResult, seed: int,
                 states: dict[str, Any] | None) -> tuple[UploadHeader, bytes, dict[str, Any]]:
    """Encode ``delta`` with the run's codec (unscaled: the header carries the weight);
    returns header, payload and new codec state."""
    w = weight_of(result, cfg.cohort.weighting)
    payloads, new_states = encode_update(codec, delta, upload_rng(seed), states, t.shared_seed)
    payload, sizes = pack([payloads[s.name] for s in t.schema])
    metric_w = float(max(result.num_examples, 1))
    metrics = {k: float(v) for k, v in result.metrics.items() if np.isfinite(v)}
    header = UploadHeader(
        node_id=node_id, run_id=t.run_id, round=t.round, attempt=t.attempt, task_id=t.task_id,
        kind=UploadKind.CLIENT_UPDATE, schema=t.schema, payload_sizes=sizes, codec=cfg.codec.name,
        payload_sha256=wire.sha256_hex(payload), weight=w, count=1, num_examples=result.num_examples,
        num_steps=result.num_steps, metric_sums={k: v * metric_w for k, v in metrics.items()},
        metric_weights={k: metric_w for k in metrics})
    return header, payload, new_states
