"""One tensor's running weighted sum of payloads: :class:`PayloadSum`.

How payloads add (coordinate-wise in the compressed domain where the codec is linear,
else decoded into a dense float64 sum) and why the sums are guarded: see
:mod:`orchard.compression.aggregate`. :func:`add_weighted` is the one weighted add every
sum here goes through, so the compressed and the decode path form the same products.
"""

from __future__ import annotations

import math
import threading
from dataclasses import dataclass, field

import numpy as np

from orchard.compression.base import BaseCodec, Codec, check_seed, check_shape
from orchard.compression.errors import NonFiniteError
from orchard.compression.wire import EncodedTensor
from orchard.errors import CodecError

FLOAT32_MAX = float(np.finfo(np.float32).max)
UINT32_MAX = int(np.iinfo(np.uint32).max)

_BLOCK = 1 << 15  # elements per step of a weighted add: a 256 KiB float64 scratch per thread
_SMALL = 1 << 12  # elements: a weighted add this small takes a float64 copy (32 KiB at most)
_scratch = threading.local()


def add_weighted(acc: np.ndarray, x: np.ndarray, weight: float) -> None:
    """``acc += weight * x`` into a contiguous float64 ``acc`` (``x`` of any real float
    dtype, as many elements): each product formed in float64, as the accumulator of the
    decode path forms it, without a float64 temporary the size of a large ``x`` -- the
    products go through one small scratch buffer per thread, a block at a time. (Up to
    ``_SMALL`` elements, where a tier's per-upload cost is the calls, not the work, ``x``
    is copied to float64 and multiplied in place: the same products, fewer steps.)"""
    if not acc.flags.c_contiguous:  # reshape would copy, and the sum would be lost
        raise ValueError("add_weighted needs a contiguous accumulator")
    a = acc if acc.ndim == 1 else acc.reshape(-1)
    v = x if x.ndim == 1 else x.reshape(-1)
    if weight == 1.0:
        np.add(a, v, a)
        return
    if a.size <= _SMALL:
        t = v.astype(np.float64)
        np.multiply(t, weight, t)
        np.add(a, t, a)
        return
    buf = getattr(_scratch, "buf", None)
    if buf is None:
        buf = _scratch.buf = np.empty(_BLOCK, np.float64)
    # (Outputs passed by position: a ufunc parses an out= keyword at about a microsecond a
    # call, as much as the work on a small update.)
    if a.size <= _BLOCK:  # one block: the loop's slicing costs more than the work here
        t = buf[: a.size]
        np.multiply(v, weight, t, dtype=np.float64)
        np.add(a, t, a)
        return
    for i in range(0, a.size, _BLOCK):
        j = min(i + _BLOCK, a.size)
        t = buf[: j - i]
        np.multiply(v[i:j], weight, t, dtype=np.float64)
        np.add(a[i:j], t, a[i:j])


def check_weight(weight: float) -> float:
    """A summand's weight as a float; CodecError unless it is positive and finite."""
    w = float(weight)
    if not (math.isfinite(w) and w > 0):
        raise CodecError(f"a summand's weight must be positive and finite, got {weight!r}")
    return w


@dataclass(frozen=True)
class CheckedPayload:
    """A parsed payload that passed :meth:`PayloadSum.check`: a bound on its values, and
    its coordinates -- or, for a codec without them, what it decodes to. ``codes`` is
    derived from the coordinates, once: the most its integer coordinates can add to a
    sum (0 for float coordinates)."""

    enc: EncodedTensor
    bound: float
    coords: np.ndarray | None = None
    decoded: np.ndarray | None = None
    codes: int = field(init=False, repr=False, compare=False)

    def __init__(
        self,
        enc: EncodedTensor,
        bound: float,
        coords: np.ndarray | None = None,
        decoded: np.ndarray | None = None,
    ) -> None:
        # One per tensor per upload: the instance dict written directly, as Field's.
        d = self.__dict__
        d["enc"] = enc
        d["bound"] = bound
        d["coords"] = coords
        d["decoded"] = decoded
        d["codes"] = 0 if coords is None or coords.dtype.kind == "f" else _code_bound(coords, 1)


class PayloadSum:
    """Running weighted sum of one tensor's payloads (all made with the same ``shared_seed``)."""

    def __init__(self, codec: Codec, shape: tuple[int, ...], shared_seed: int = 0) -> None:
        self.codec = codec
        self.shape = check_shape(shape)
        self.shared_seed = check_seed(shared_seed)
        # A codec outside BaseCodec (error feedback wraps one) is asked three times.
        self._parse = codec.parse_for_sum if isinstance(codec, BaseCodec) else self._parse_for_sum
        self._reset()

    def _reset(self) -> None:
        self.coords: np.ndarray | None = None  # the compressed sum: its coordinates
        self.compressed_count = 0
        self.code_bound = 0  # integer coordinates: an upper bound on the summed codes
        self.dense: np.ndarray | None = None  # float64: payloads without coordinates
        self.count = 0
        self.weight = 0.0  # the sum of the summands' weights
        self.bound = 0.0  # an upper bound on |element| of the sum so far

    def check(self, payload: bytes | bytearray | memoryview) -> CheckedPayload:
        """Parse and check one payload as decode would, without decoding it where the codec
        can: CodecError if it is malformed, :class:`NonFiniteError` if it carries NaN or Inf."""
        enc, bound, coords = self._parse(payload, self.shape, self.shared_seed)
        if not math.isfinite(bound):
            raise self.non_finite()
        if coords is not None:
            return CheckedPayload(enc, bound, coords)
        # No coordinates: decode here, where checks run (beside each other), not in add.
        return CheckedPayload(enc, bound, decoded=self.codec.decode_parsed(enc, 1, self.shared_seed))

    def _parse_for_sum(
        self, payload: bytes | bytearray | memoryview, shape: tuple[int, ...], shared_seed: int
    ) -> tuple[EncodedTensor, float, np.ndarray | None]:
        enc = self.codec.parse(payload, shape)  # type: ignore[arg-type]
        return enc, self.codec.bound(enc, 1, shared_seed), self.codec.coordinates(enc, shared_seed)

    def accumulate(self, payload: bytes | bytearray | memoryview, weight: float = 1.0) -> None:
        """Check one payload and fold it in with ``weight``; a bad one raises CodecError and
        changes nothing."""
        self.add(self.check(payload), weight)

    def non_finite(self) -> NonFiniteError:
        """The refusal of a payload of this sum's tensor that holds NaN or Inf."""
        return NonFiniteError(f"{self.codec.name} payload for shape {self.shape} holds NaN or Inf values")

    def past_range(self, bound: float, so_far: float) -> CodecError:
        """The refusal of a summand up to ``bound`` (weighted) that could take a sum up to
        ``so_far`` of this tensor past float32's range."""
        return CodecError(f"a summand of magnitude up to {bound:.3g} could take the sum of shape "
                          f"{self.shape} (up to {so_far:.3g} so far) past float32's range")

    def guard(self, bound: float, codes: int = 0) -> None:
        """Refuse (CodecError) a summand that could take the sum past float32's range, or
        its integer codes past uint32. ``bound`` is the summand's, weighted."""
        if self.bound + bound > FLOAT32_MAX:
            raise self.past_range(bound, self.bound)
        if self.code_bound + codes > UINT32_MAX:
            raise CodecError(
                f"{self.codec.name}: {self.compressed_count} summands' codes of shape "
                f"{self.shape} would pass 2**32; split the cohort"
            )

    def admit(self, checked: CheckedPayload, weight: float = 1.0) -> float:
        """Every refusal :meth:`add` could make, without changing anything: the weight
        (positive, finite; exactly 1 for integer codes) and the overflow guards. Returns
        the weight as a float."""
        w = check_weight(weight)
        self._admit(checked, w)
        return w

    def _admit(self, checked: CheckedPayload, w: float) -> None:
        """:meth:`admit` for a weight that passed :func:`check_weight`."""
        codes = checked.codes
        if w != 1.0 and codes:
            raise CodecError(
                f"{self.codec.name}: integer codes add exactly only unweighted, got weight "
                f"{w:g}; decode such payloads to weight them"
            )
        bound = w * checked.bound
        if self.bound + bound > FLOAT32_MAX or self.code_bound + codes > UINT32_MAX:
            self.guard(bound, codes)  # says which

    def add(self, checked: CheckedPayload, weight: float = 1.0) -> None:
        """Fold in ``weight`` times a payload that passed :meth:`check` (this sum's or
        another's of this shape)."""
        self._add_admitted(checked, self.admit(checked, weight))

    def _add_admitted(self, checked: CheckedPayload, w: float, counted: float | None = None) -> None:
        """:meth:`add`, for a summand and float weight that :meth:`admit` just let through
        (nothing changed between the two): it refuses nothing. ``counted``: what the
        summand adds to :attr:`weight` when that is not ``w`` (a clipped update: scaled
        down, counted at its full weight)."""
        coords = checked.coords
        if coords is not None:
            if self.coords is not None and coords.dtype.kind == "f":  # the usual case, flat
                add_weighted(self.coords, coords, w)
                self.compressed_count += 1
            else:
                self._add_coords(coords, w, 1, checked.codes)
        else:
            decoded = checked.decoded
            if decoded is None:
                decoded = self.codec.decode_parsed(checked.enc, 1, self.shared_seed)
            self._add_dense(decoded, w)
        self.count += 1
        self.weight += w if counted is None else counted
        self.bound += w * checked.bound

    def merge(self, other: PayloadSum) -> None:
        """Fold in another sum of this tensor (its summands keep the weights they had)."""
        if other.shape != self.shape or other.shared_seed != self.shared_seed:
            raise CodecError(
                f"cannot merge sums of shape {other.shape} (seed {other.shared_seed}) into "
                f"shape {self.shape} (seed {self.shared_seed})"
            )
        self.guard(other.bound, other.code_bound)
        if other.coords is not None:
            self._add_coords(other.coords, 1.0, other.compressed_count, other.code_bound)
        if other.dense is not None:
            self._add_dense(other.dense, 1.0)
        self.count += other.count
        self.weight += other.weight
        self.bound += other.bound

    def result(self, dtype: type[np.floating] = np.float32) -> np.ndarray:
        """The weighted sum of every payload folded in (zeros when none was)."""
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

    def _add_coords(self, coords: np.ndarray, weight: float, n: int, codes: int) -> None:
        if coords.dtype.kind == "f":
            if self.coords is None:  # a new float64 array: never a view of a caller's buffer
                self.coords = _weighted_copy(coords, weight)
            else:
                add_weighted(self.coords, coords, weight)
        elif self.coords is None:  # integer codes (weight 1: see admit)
            self.coords = np.array(coords, dtype=np.uint32)
        else:
            np.add(self.coords, coords, out=self.coords, casting="unsafe")
        self.compressed_count += n
        self.code_bound += codes

    def _add_dense(self, x: np.ndarray, weight: float) -> None:
        if self.dense is None:
            self.dense = _weighted_copy(x, weight)
        else:
            add_weighted(self.dense, x, weight)


def _weighted_copy(x: np.ndarray, weight: float) -> np.ndarray:
    """``weight * x`` as a new float64 array of x's shape (a 0-d one included)."""
    out = np.empty(x.shape, np.float64)
    np.multiply(x, weight, out=out, dtype=np.float64)
    return out


def _code_bound(coords: np.ndarray | None, n: int) -> int:
    """The most ``n`` payloads' integer coordinates can sum to (0 for float coordinates)."""
    if coords is None or coords.dtype.kind not in "iu":
        return 0
    return n * int(np.iinfo(coords.dtype).max)

