"""Turn a client's encoded payload into a float32 delta, checked before it is folded."""

from __future__ import annotations

import threading

import numpy as np

from orchard.aggregation.fedavg import check_update
from orchard.compression import Codec, build_codec, decode_update
from orchard.config import CodecSpec
from orchard.errors import CodecError, UpdateSchemaError
from orchard.messages import UploadHeader
from orchard.typing import NDArrays
from orchard.updates import split


class ClientUpdateDecoder:
    """Callable used by the coordinator (``ClientDecoder``); caches one codec per spec."""

    def __init__(self) -> None:
        self._codecs: dict[str, Codec] = {}
        self._lock = threading.Lock()  # decode runs in a small thread pool

    def codec(self, spec: CodecSpec) -> Codec:
        key = spec.model_dump_json()
        with self._lock:
            c = self._codecs.get(key)
            if c is None:
                c = self._codecs[key] = build_codec(spec)
            return c

    def __call__(self, h: UploadHeader, payload: bytes | bytearray, task) -> NDArrays:  # task: RoundTask
        codec = self.codec(task.config.codec)
        parts = split(payload, h.payload_sizes)
        payloads = {s.name: p for s, p in zip(task.schema, parts, strict=True)}
        shapes = {s.name: tuple(s.shape) for s in task.schema}
        try:
            arrays = decode_update(codec, payloads, shapes, num_summands=1, shared_seed=task.shared_seed)
        except CodecError:
            raise
        except (ValueError, IndexError, TypeError) as err:  # a codec bug must not crash the tier
            raise CodecError(f"payload could not be decoded with codec {codec.name!r}: {err}") from None
        arrays = {k: np.asarray(v, dtype=np.float32) for k, v in arrays.items()}
        check_update(shapes, arrays)
        return arrays


__all__ = ["ClientUpdateDecoder", "UpdateSchemaError"]
