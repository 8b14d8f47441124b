"""Summing payloads: in the compressed domain where the algebra allows, else decoded.

:class:`PayloadSum` follows the accumulate / merge / finalize shape of the aggregation
package. Each payload is folded with :meth:`Codec.add` into one compressed running sum
when the codec can (float32, randk, qsgd payloads that share their scales, PowerSGD
factors); any payload that cannot join it is decoded into a dense float32 sum. Memory
is O(one payload + one dense tensor) whatever the cohort size, except PowerSGD, whose
compressed sum grows by ``(n + m) r`` floats per summand until it is finalised.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np

from orchard.compression.base import Codec, check_seed, check_shape
from orchard.compression.wire import EncodedTensor
from orchard.errors import CodecError


class PayloadSum:
    """Running sum of one tensor's payloads (all made with the same ``shared_seed``)."""

    def __init__(self, codec: Codec, shape: tuple[int, ...], shared_seed: int = 0) -> None:
        self.codec = codec
        self.shape = check_shape(shape)
        self.shared_seed = check_seed(shared_seed)
        self.compressed: EncodedTensor | None = None
        self.compressed_count = 0
        self.dense: np.ndarray | None = None
        self.count = 0

    def accumulate(self, payload: bytes) -> None:
        """Fold one payload in; a malformed one raises CodecError and leaves the sum unchanged."""
        self._fold(self.codec.parse(payload, self.shape), 1)

    def merge(self, other: PayloadSum) -> None:
        if other.shape != self.shape or other.shared_seed != self.shared_seed:
            raise CodecError(
                f"cannot merge sums of shape {other.shape} (seed {other.shared_seed}) into "
                f"shape {self.shape} (seed {self.shared_seed})"
            )
        if other.compressed is not None:
            self._fold(other.compressed, other.compressed_count)
        if other.dense is not None:
            self._add_dense(other.dense)
        self.count += other.count - other.compressed_count

    def result(self) -> np.ndarray:
        """The float32 sum of every payload folded in (zeros when none was)."""
        total = np.zeros(self.shape, dtype=np.float32)
        if self.compressed is not None:
            total += self._decode(self.compressed, self.compressed_count)
        if self.dense is not None:
            total += self.dense
        return total

    def encoded(self) -> EncodedTensor | None:
        """The compressed sum, when every payload joined it (e.g. to forward upstream)."""
        return self.compressed if self.dense is None else None

    def _fold(self, enc: EncodedTensor, n: int) -> None:
        if self.compressed is None:
            self.compressed, self.compressed_count = enc, n
        else:
            total = self.codec.add(self.compressed, enc)
            if total is None:
                decoded = self._decode(enc, n)  # decode first: a bad payload changes nothing
                self._add_dense(decoded)
            else:
                self.compressed = total
                self.compressed_count += n
        self.count += n

    def _decode(self, enc: EncodedTensor, n: int) -> np.ndarray:
        return self.codec.decode_parsed(enc, n, self.shared_seed)

    def _add_dense(self, x: np.ndarray) -> None:
        if self.dense is None:
            self.dense = np.array(x, dtype=np.float32)
        else:
            self.dense += x


def sum_payloads(
    codec: Codec, payloads: Iterable[bytes], shape: tuple[int, ...], shared_seed: int = 0
) -> np.ndarray:
    """Decoded float32 sum of ``payloads`` (compressed-domain where the codec allows)."""
    acc = PayloadSum(codec, shape, shared_seed)
    for p in payloads:
        acc.accumulate(p)
    return acc.result()


def sum_encoded(codec: Codec, payloads: Iterable[bytes], shape: tuple[int, ...]) -> bytes:
    """One payload that decodes (with ``num_summands=len(payloads)``) to the sum.

    Only for payloads that add in the compressed domain; otherwise CodecError says which
    one did not.
    """
    total: EncodedTensor | None = None
    for i, p in enumerate(payloads):
        enc = codec.parse(p, shape)
        if total is None:
            total = enc
            continue
        summed = codec.add(total, enc)
        if summed is None:
            raise CodecError(
                f"{codec.name} payload {i} cannot be added to the others without decoding "
                f"(linear={codec.algebra.linear}: data-dependent scales or coordinates); "
                "use sum_payloads"
            )
        total = summed
    if total is None:
        raise CodecError("sum_encoded needs at least one payload")
    return total.to_bytes()
