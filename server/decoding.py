"""Turn a client's encoded payload into a float32 delta, checked before it is folded."""

from __future__ import annotations

import threading

import numpy as np

from orchard.aggregation.fedavg import check_update
from orchard.compression import Codec, build_codec, decode_update
from orchard.errors import CodecError, UpdateSchemaError
from orchard.messages import UploadHeader
from orchard.typing import NDArrays
from orchard.updates import split


class ClientUpdateDecoder:
    """Callable used by the coordinator (``ClientDecoder``).

    Everything that is the same for every update of a round (the codec, the schema's
    shapes) is built once per round task, not once per upload: a tier decodes thousands
    of uploads per round."""

    def __init__(self) -> None:
        # id(task) -> (task, codec, shapes). The task is kept so its id cannot be reused.
        self._rounds: dict[int, tuple[object, Codec, dict[str, tuple[int, ...]]]] = {}
        self._lock = threading.Lock()  # decode runs in a small thread pool

    def _for(self, task) -> tuple[Codec, dict[str, tuple[int, ...]]]:
        with self._lock:
            hit = self._rounds.get(id(task))
            if hit is None:
                if len(self._rounds) >= 4:  # a tier works on one round at a time
                    self._rounds.clear()
                shapes = {s.name: tuple(s.shape) for s in task.schema}
                hit = self._rounds[id(task)] = (task, build_codec(task.config.codec), shapes)
            return hit[1], hit[2]

    def __call__(self, h: UploadHeader, payload: bytes | bytearray | memoryview, task) -> NDArrays:  # task: RoundTask
        codec, shapes = self._for(task)
        try:
            payloads = dict(zip(shapes, split(payload, h.payload_sizes), strict=True))
            arrays = decode_update(codec, payloads, shapes, num_summands=1, shared_seed=task.shared_seed)
        except CodecError:
            raise
        except (ValueError, IndexError, TypeError) as err:  # a codec bug must not crash the tier
            raise CodecError(f"payload could not be decoded with codec {codec.name!r}: {err}") from None
        for k, v in arrays.items():
            if v.dtype != np.float32:
                arrays[k] = v.astype(np.float32)
        check_update(shapes, arrays)
        return arrays


__all__ = ["ClientUpdateDecoder", "UpdateSchemaError"]
