"""Summing payloads: in the compressed domain where the algebra allows, else decoded.

:class:`PayloadSum` follows the accumulate / merge / finalize shape of the aggregation
package. Each payload is folded with :meth:`Codec.add` into one compressed running sum
when the codec can (float32, randk, qsgd payloads that share their scales, PowerSGD
factors); any payload that cannot join it is decoded into a dense float32 sum.

Memory is O(one dense tensor) whatever the cohort size: a compressed sum that grows
with its summands (PowerSGD's factors concatenate along the rank axis) is decoded into
the dense sum once it is :data:`GROWTH_LIMIT` times the dense tensor's size, and the
next payload starts a fresh compressed sum.

A payload is checked whole before it joins a sum (:meth:`PayloadSum.check`: parsed as
decode would, and every value it stands for finite), and a sum refuses a payload that
could take it past float32's range, so a bad payload never changes a sum.

:class:`UpdateSum` is the same for a whole update (one :class:`PayloadSum` per tensor,
each with its tensor's shared seed): what a tier keeps for its direct clients when the
run aggregates in the compressed domain (:func:`compressed_weight_scale`).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass

import numpy as np

from orchard.compression.base import Codec, check_seed, check_shape, numel
from orchard.compression.errors import NonFiniteError
from orchard.compression.update import check_names, tensor_seed
from orchard.compression.wire import EncodedTensor, Field
from orchard.config import RunConfig
from orchard.errors import CodecError

# A compressed sum larger than this many dense float32 tensors is decoded into the dense sum.
GROWTH_LIMIT = 2
FLOAT32_MAX = float(np.finfo(np.float32).max)


@dataclass(frozen=True)
class CheckedPayload:
    """A parsed payload that passed :meth:`PayloadSum.check`, and a bound on its values."""

    enc: EncodedTensor
    bound: float


def _owned(enc: EncodedTensor) -> EncodedTensor:
    """A copy whose arrays belong to the sum (never a view of a caller's buffer)."""
    fields = tuple(Field(np.array(f.data), f.bits) for f in enc.fields)
    return EncodedTensor(enc.codec_id, enc.codec_version, enc.shape, fields)


def _nbytes(enc: EncodedTensor) -> int:
    return sum(f.data.nbytes for f in enc.fields)


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
        self.bound = 0.0  # an upper bound on |element| of the sum so far
        self._limit = GROWTH_LIMIT * 4 * max(numel(self.shape), 1)

    def check(self, payload: bytes | bytearray | memoryview) -> CheckedPayload:
        """Parse and check one payload as decode would, without decoding it where the codec
        can: CodecError if it is malformed, :class:`NonFiniteError` if it carries NaN or Inf."""
        enc = self.codec.parse(payload, self.shape)
        bound = self.codec.bound(enc, 1, self.shared_seed)
        if not math.isfinite(bound):
            raise NonFiniteError(
                f"{self.codec.name} payload for shape {self.shape} holds NaN or Inf values"
            )
        return CheckedPayload(enc, bound)

    def accumulate(self, payload: bytes | bytearray | memoryview) -> None:
        """Check one payload and fold it in; a bad one raises CodecError and changes nothing."""
        self.add(self.check(payload))

    def guard(self, bound: float) -> None:
        """Refuse (CodecError) a summand that could take the sum past float32's range."""
        if self.bound + bound > FLOAT32_MAX:
            raise CodecError(
                f"a summand of magnitude up to {bound:.3g} could take the sum of shape "
                f"{self.shape} (up to {self.bound:.3g} so far) past float32's range"
            )

    def add(self, checked: CheckedPayload) -> None:
        """Fold in a payload that passed :meth:`check` (this sum's or another's of this shape)."""
        self.guard(checked.bound)
        self._fold(checked.enc, 1)
        self.bound += checked.bound

    def merge(self, other: PayloadSum) -> None:
        if other.shape != self.shape or other.shared_seed != self.shared_seed:
            raise CodecError(
                f"cannot merge sums of shape {other.shape} (seed {other.shared_seed}) into "
                f"shape {self.shape} (seed {self.shared_seed})"
            )
        self.guard(other.bound)
        if other.compressed is not None:
            self._fold(other.compressed, other.compressed_count)
        if other.dense is not None:
            self._add_dense(other.dense)
        self.count += other.count - other.compressed_count
        self.bound += other.bound

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
            self.compressed, self.compressed_count = _owned(enc), n
        else:
            # The running sum is this object's own (copied or made by add): add in place.
            total = self.codec.iadd(self.compressed, enc)
            if total is None:
                decoded = self._decode(enc, n)  # decode first: a bad payload changes nothing
                self._add_dense(decoded)
            else:
                self.compressed = total
                self.compressed_count += n
                if _nbytes(total) > self._limit:  # PowerSGD: factors grow per summand
                    self._add_dense(self._decode(total, self.compressed_count))
                    self.compressed, self.compressed_count = None, 0
        self.count += n

    def _decode(self, enc: EncodedTensor, n: int) -> np.ndarray:
        return self.codec.decode_parsed(enc, n, self.shared_seed)

    def _add_dense(self, x: np.ndarray) -> None:
        if self.dense is None:
            self.dense = np.array(x, dtype=np.float32)
        else:
            self.dense += x


class UpdateSum:
    """A cohort's running sum of whole updates: one :class:`PayloadSum` per tensor.

    :meth:`check` runs beside other checks (it only reads); :meth:`add` must be
    serialised by the caller, like any accumulator. An update is folded whole or not at
    all."""

    def __init__(
        self, codec: Codec, shapes: Mapping[str, tuple[int, ...]], shared_seed: int = 0
    ) -> None:
        self.codec = codec
        self.sums = {
            name: PayloadSum(codec, tuple(shape), tensor_seed(shared_seed, name))
            for name, shape in shapes.items()
        }
        self.count = 0

    def check(
        self, payloads: Mapping[str, bytes | bytearray | memoryview]
    ) -> dict[str, CheckedPayload]:
        """Check every tensor's payload; names must match exactly (UpdateMismatchError)."""
        check_names(payloads, self.sums, "payloads")
        out = {}
        for name, acc in self.sums.items():
            try:
                out[name] = acc.check(payloads[name])
            except CodecError as err:
                raise type(err)(f"tensor {name!r}: {err}") from None
        return out

    def add(self, checked: Mapping[str, CheckedPayload]) -> None:
        check_names(checked, self.sums, "checked payloads")
        for name, acc in self.sums.items():  # every refusal before any tensor changes
            acc.guard(checked[name].bound)
        for name, acc in self.sums.items():
            acc.add(checked[name])
        self.count += 1

    def result(self) -> dict[str, np.ndarray]:
        """The float32 sum of every update, per tensor, in the order of ``shapes``."""
        return {name: acc.result() for name, acc in self.sums.items()}

    def drain(self) -> Iterator[tuple[str, np.ndarray]]:
        """Like :meth:`result`, one tensor at a time, releasing each tensor's running sum
        once its result is out: the dense results and the sums are never all held at once.
        The sum is empty afterwards."""
        for name in list(self.sums):
            total = self.sums[name].result()
            self.sums[name] = PayloadSum(self.codec, self.sums[name].shape, self.sums[name].shared_seed)
            yield name, total


# Weightings whose tiers fold exactly sum_i w_i x_i with w_i the header's weight. FedNova
# is left out: its root step pairs the mean update with the mean of a metric weighted
# by the same (uncapped) weights, which capping the update's weights would skew.
COMPRESSED_WEIGHTINGS = ("examples", "steps", "uniform")


def compressed_weight_scale(cfg: RunConfig, codec: Codec | None = None) -> float | None:
    """The weight scale ``S`` of a run that aggregates in the compressed domain, or None.

    The one decision that a client (which pre-scales) and its tier (which sums codes)
    must agree on, made from the run's config alone. A run aggregates in the compressed
    domain when ``compressed_aggregation`` is "auto", secure aggregation is off, the
    weighting is a plain weighted sum (:data:`COMPRESSED_WEIGHTINGS`) and the codec is
    linear. Then a client with weight ``w`` encodes ``(min(w, S) / S) * x`` -- secure
    aggregation's pre-scaling and cap, ``S = secure_aggregation.weight_scale`` -- and the
    tier's partial is ``S * sum`` with weight ``sum min(w, S)``. With uniform weighting
    every weight is 1 and ``S = 1``: clients send ``x`` unscaled.
    """
    if cfg.compressed_aggregation == "off" or cfg.secure_aggregation.enabled:
        return None
    if cfg.cohort.weighting not in COMPRESSED_WEIGHTINGS:
        return None
    if codec is None:
        from orchard.compression.registry import build_codec

        codec = build_codec(cfg.codec)
    if not codec.algebra.linear:
        return None
    return 1.0 if cfg.cohort.weighting == "uniform" else cfg.secure_aggregation.weight_scale


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
