"""Downlink: ship model version v+1 as a quantised delta from version v.

The server sends ``new - old`` through a quantising codec when that is smaller than the
full float32 model, and keeps ``reconstructed`` -- what clients hold after applying
the delta -- as the reference for the next version, so quantisation error does not
drift across versions (each delta re-sends what the previous one rounded away).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from orchard.compression.base import as_float32
from orchard.compression.casts import float32_codec
from orchard.compression.errors import UpdateMismatchError
from orchard.compression.registry import build_codec
from orchard.compression.update import check_names, decode_update, encode_update
from orchard.config import DOWNLINK_CODEC, CodecSpec


@dataclass(frozen=True)
class ModelDelta:
    """An encoded delta from ``from_version`` to ``to_version`` and what it costs."""

    from_version: int
    to_version: int
    payloads: dict[str, bytes]
    encoded_bytes: int  # sum of len(payload)
    dense_bytes: int  # the same model as float32 payloads, header included
    reconstructed: dict[str, np.ndarray]  # old + decoded delta: the next reference

    @property
    def smaller(self) -> bool:
        """Whether the delta beats sending the full float32 model."""
        return self.encoded_bytes < self.dense_bytes


def encode_model_delta(
    old: Mapping[str, np.ndarray],
    new: Mapping[str, np.ndarray],
    rng: np.random.Generator,
    *,
    from_version: int,
    spec: CodecSpec = DOWNLINK_CODEC,
) -> ModelDelta:
    """Encode ``new - old`` tensor by tensor (names and shapes must match)."""
    check_names(new, old, "new model tensors")
    bad = {
        k: (np.shape(old[k]), np.shape(new[k])) for k in old if np.shape(old[k]) != np.shape(new[k])
    }
    if bad:
        raise UpdateMismatchError(f"tensor shapes changed between versions (old, new): {bad}")
    codec = build_codec(spec)
    delta = {k: as_float32(new[k]) - as_float32(old[k]) for k in old}
    payloads, _ = encode_update(codec, delta, rng, None, shared_seed=from_version)
    dense, _ = encode_update(float32_codec(), {k: as_float32(v) for k, v in new.items()}, rng)
    reconstructed = apply_model_delta(old, payloads, from_version=from_version, spec=spec)
    return ModelDelta(
        from_version=from_version,
        to_version=from_version + 1,
        payloads=payloads,
        encoded_bytes=sum(len(p) for p in payloads.values()),
        dense_bytes=sum(len(p) for p in dense.values()),
        reconstructed=reconstructed,
    )


def apply_model_delta(
    old: Mapping[str, np.ndarray],
    payloads: Mapping[str, bytes],
    *,
    from_version: int,
    spec: CodecSpec = DOWNLINK_CODEC,
) -> dict[str, np.ndarray]:
    """Version ``from_version + 1`` from version ``from_version`` and its delta payloads."""
    shapes = {k: tuple(np.shape(v)) for k, v in old.items()}
    delta = decode_update(build_codec(spec), payloads, shapes, shared_seed=from_version)
    return {k: as_float32(old[k]) + delta[k] for k in old}
