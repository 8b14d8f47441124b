"""Summing payloads: in the compressed domain where the algebra allows, else decoded.

:class:`PayloadSum` follows the accumulate / merge / finalize shape of the aggregation
package. A field-linear codec's payloads add coordinate-wise (:meth:`Codec.coordinates`):
float32 values, randk's kept values, fixed-scale qsgd's integer codes (alone or inside
randk). Those are summed without decoding -- integer codes exactly, in uint32; float
values in float64, so that the sum does not depend on the order the payloads came in
(beyond float64 rounding, as with a float64 accumulator) -- and decoded once, from the
payload of the sum (:meth:`PayloadSum.encoded`). Every other payload is decoded and
added to a dense float64 sum: that includes PowerSGD, whose factors add only by
concatenation (a sum that grows by ``(n + m) r`` floats per summand), so each is
decoded on arrival and memory stays one dense tensor.

A payload is checked whole before it joins a sum (:meth:`PayloadSum.check`: parsed as
decode would, and every value it stands for finite), and a sum refuses a payload that
could take it past float32's range (or integer codes past uint32), so a bad payload
never changes a sum.

:class:`UpdateSum` is the same for a whole update (one :class:`PayloadSum` per tensor,
each with its tensor's shared seed): what a tier keeps for its direct clients when the
run aggregates in the compressed domain (:func:`compressed_weight_scale`).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass

import numpy as np

from orchard.compression.base import Codec, check_seed, check_shape
from orchard.compression.errors import NonFiniteError
from orchard.compression.update import check_names, tensor_seed
from orchard.compression.wire import EncodedTensor
from orchard.config import RunConfig
from orchard.errors import CodecError

FLOAT32_MAX = float(np.finfo(np.float32).max)
UINT32_MAX = int(np.iinfo(np.uint32).max)


@dataclass(frozen=True)
class CheckedPayload:
    """A parsed payload that passed :meth:`PayloadSum.check`: a bound on its values, and
    its coordinates -- or, for a codec without them, what it decodes to."""

    enc: EncodedTensor
    bound: float
    coords: np.ndarray | None = None
    decoded: np.ndarray | None = None

    @property
    def codes(self) -> int:
        """The most its integer coordinates can add to a sum (0 for float coordinates)."""
        return _code_bound(self.coords, 1)


class PayloadSum:
    """Running sum of one tensor's payloads (all made with the same ``shared_seed``)."""

    def __init__(self, codec: Codec, shape: tuple[int, ...], shared_seed: int = 0) -> None:
        self.codec = codec
        self.shape = check_shape(shape)
        self.shared_seed = check_seed(shared_seed)
        self._reset()

    def _reset(self) -> None:
        self.coords: np.ndarray | None = None  # the compressed sum: its coordinates
        self.compressed_count = 0
        self.code_bound = 0  # integer coordinates: an upper bound on the summed codes
        self.dense: np.ndarray | None = None  # float64: payloads without coordinates
        self.count = 0
        self.bound = 0.0  # an upper bound on |element| of the sum so far

    def check(self, payload: bytes | bytearray | memoryview) -> CheckedPayload:
        """Parse and check one payload as decode would, without decoding it where the codec
        can: CodecError if it is malformed, :class:`NonFiniteError` if it carries NaN or Inf."""
        enc = self.codec.parse(payload, self.shape)
        bound = self.codec.bound(enc, 1, self.shared_seed)
        if not math.isfinite(bound):
            raise NonFiniteError(
                f"{self.codec.name} payload for shape {self.shape} holds NaN or Inf values"
            )
        coords = self.codec.coordinates(enc, self.shared_seed)
        if coords is not None:
            return CheckedPayload(enc, bound, coords)
        # No coordinates: decode here, where checks run (beside each other), not in add.
        return CheckedPayload(enc, bound, decoded=self.codec.decode_parsed(enc, 1, self.shared_seed))

    def accumulate(self, payload: bytes | bytearray | memoryview) -> None:
        """Check one payload and fold it in; a bad one raises CodecError and changes nothing."""
        self.add(self.check(payload))

    def guard(self, bound: float, codes: int = 0) -> None:
        """Refuse (CodecError) a summand that could take the sum past float32's range, or
        its integer codes past uint32."""
        if self.bound + bound > FLOAT32_MAX:
            raise CodecError(
                f"a summand of magnitude up to {bound:.3g} could take the sum of shape "
                f"{self.shape} (up to {self.bound:.3g} so far) past float32's range"
            )
        if self.code_bound + codes > UINT32_MAX:
            raise CodecError(
                f"{self.codec.name}: {self.compressed_count} summands' codes of shape "
                f"{self.shape} would pass 2**32; split the cohort"
            )

    def add(self, checked: CheckedPayload) -> None:
        """Fold in a payload that passed :meth:`check` (this sum's or another's of this shape)."""
        self.guard(checked.bound, checked.codes)
        if checked.coords is not None:
            self._add_coords(checked.coords, 1, checked.codes)
        else:
            decoded = checked.decoded
            if decoded is None:
                decoded = self.codec.decode_parsed(checked.enc, 1, self.shared_seed)
            self._add_dense(decoded)
        self.count += 1
        self.bound += checked.bound

    def merge(self, other: PayloadSum) -> None:
        if other.shape != self.shape or other.shared_seed != self.shared_seed:
            raise CodecError(
                f"cannot merge sums of shape {other.shape} (seed {other.shared_seed}) into "
                f"shape {self.shape} (seed {self.shared_seed})"
            )
        self.guard(other.bound, other.code_bound)
        if other.coords is not None:
            self._add_coords(other.coords, other.compressed_count, other.code_bound)
        if other.dense is not None:
            self._add_dense(other.dense)
        self.count += other.count
        self.bound += other.bound

    def result(self, dtype: type[np.floating] = np.float32) -> np.ndarray:
        """The sum of every payload folded in (zeros when none was)."""
        total = np.zeros(self.shape, dtype=dtype)
        enc = self.encoded()
        if enc is not None:
            total += self.codec.decode_parsed(enc, self.compressed_count, self.shared_seed)
        if self.dense is not None:
            total += self.dense
        return total

    def take(self) -> np.ndarray:
        """:meth:`result` in float64, emptying this sum as it goes (the compressed sum is
        released before it is decoded, the dense sum becomes the result): for a caller
        that reads the sum once and wants to hold as little as possible meanwhile."""
        enc, n, total = self.encoded(), self.compressed_count, self.dense
        self._reset()
        if total is None:
            total = np.zeros(self.shape, dtype=np.float64)
        if enc is not None:
            total += self.codec.decode_parsed(enc, n, self.shared_seed)
        return total

    def encoded(self) -> EncodedTensor | None:
        """The payload of the compressed sum (decode it with ``compressed_count`` summands),
        or None when no payload had coordinates. Float values are rounded to float32 here,
        once."""
        if self.coords is None:
            return None
        return self.codec.from_coordinates(self.shape, self.coords, self.shared_seed)

    def _add_coords(self, coords: np.ndarray, n: int, codes: int) -> None:
        if self.coords is None:  # a copy in the sum's dtype: never a view of a caller's buffer
            wide = np.float64 if coords.dtype.kind == "f" else np.uint32
            self.coords = np.array(coords, dtype=wide)
        else:
            np.add(self.coords, coords, out=self.coords, casting="unsafe")
        self.compressed_count += n
        self.code_bound += codes

    def _add_dense(self, x: np.ndarray) -> None:
        if self.dense is None:
            self.dense = np.array(x, dtype=np.float64)
        else:
            np.add(self.dense, x, out=self.dense)


def _code_bound(coords: np.ndarray | None, n: int) -> int:
    """The most ``n`` payloads' integer coordinates can sum to (0 for float coordinates)."""
    if coords is None or coords.dtype.kind not in "iu":
        return 0
    return n * int(np.iinfo(coords.dtype).max)


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
            acc.guard(checked[name].bound, checked[name].codes)
        for name, acc in self.sums.items():
            acc.add(checked[name])
        self.count += 1

    def result(self) -> dict[str, np.ndarray]:
        """The float32 sum of every update, per tensor, in the order of ``shapes``."""
        return {name: acc.result() for name, acc in self.sums.items()}

    def drain(self) -> Iterator[tuple[str, np.ndarray]]:
        """Like :meth:`result` (in float64, arrays the caller may keep and change), one
        tensor at a time, each tensor's running sum released as its result comes out
        (:meth:`PayloadSum.take`). The sum is empty afterwards; ``count`` stays."""
        for name, acc in self.sums.items():
            yield name, acc.take()


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
