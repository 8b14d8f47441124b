"""Summing payloads: in the compressed domain where the algebra allows, else decoded.

:class:`PayloadSum` follows the accumulate / merge / finalize shape of the aggregation
package, and like the float64 accumulator it keeps a weighted sum: each payload is
added with its weight ``w`` (1 unless the caller says otherwise). A field-linear
codec's payloads add coordinate-wise (:meth:`Codec.coordinates`): float32 values,
randk's kept values, fixed-scale qsgd's integer codes (alone or inside randk). Float
coordinates are added as ``w * coords`` into a float64 sum (each product in float64,
as the accumulator forms it), so the sum is the exact weighted sum up to float64
rounding and does not depend on the order the payloads came in; integer codes are
added exactly, in uint32, and only unweighted (``w = 1``): they carry an offset per
summand that decoding removes by counting summands (:attr:`Algebra.weighted_sums`).
Either sum is decoded once, from the payload of the sum (:meth:`PayloadSum.encoded`).
Every other payload is decoded and added, times ``w``, to a dense float64 sum: that
includes PowerSGD, whose factors add only by concatenation (a sum that grows by
``(n + m) r`` floats per summand), so each is decoded on arrival and memory stays one
dense tensor.

A payload is checked whole before it joins a sum (:meth:`PayloadSum.check`: parsed as
decode would, and every value it stands for finite), and a sum refuses a payload that
could take it past float32's range once weighted (``w * bound``), or integer codes past
uint32, so a bad payload never changes a sum.

:class:`UpdateSum` is the same for a whole update (one :class:`PayloadSum` per tensor,
each with its tensor's shared seed): what a tier keeps for its direct clients when the
run aggregates in the compressed domain (:func:`sums_compressed`).
"""

from __future__ import annotations

import math
import threading
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field

import numpy as np

from orchard.compression.base import BaseCodec, Codec, check_seed, check_shape
from orchard.compression.casts import CastCodec
from orchard.compression.errors import NonFiniteError
from orchard.compression.update import check_names, tensor_seed
from orchard.compression.wire import EncodedTensor, framed_values
from orchard.config import RunConfig
from orchard.errors import CodecError
from orchard.updates import split, squared_norm

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


_FLAT_MAX = 1 << 16  # elements: an update this small is checked and added as one vector


class CheckedUpdate(Mapping[str, CheckedPayload]):
    """A whole update that passed :meth:`UpdateSum.check` on the flat path: every tensor's
    coordinates as one float32 vector, in the sum's tensor order, and each tensor's
    ``max |x|``. Reads as the mapping of :class:`CheckedPayload` the per-tensor path
    returns (each built from its slice when asked for)."""

    __slots__ = ("coords", "bounds", "_layout")

    def __init__(self, coords: np.ndarray, bounds: list[float], layout: _FlatLayout) -> None:
        self.coords = coords
        self.bounds = bounds
        self._layout = layout

    def part(self, i: int) -> np.ndarray:
        lo, hi = self._layout.spans[i]
        return self.coords[lo:hi]

    def __getitem__(self, name: str) -> CheckedPayload:
        i = self._layout.index[name]
        coords = self.part(i)
        enc = self._layout.codec.from_coordinates(self._layout.shapes[i], coords)
        return CheckedPayload(enc, self.bounds[i], coords)

    def __iter__(self) -> Iterator[str]:
        return iter(self._layout.index)

    def __len__(self) -> int:
        return len(self._layout.index)


class _FlatLayout:
    """Where each tensor of a small float32 update lies in one flat vector, and the frame
    of each tensor's payload (:meth:`CastCodec.framing`)."""

    def __init__(self, codec: Codec, shapes: Mapping[str, tuple[int, ...]], frames: list[tuple[bytes, np.dtype, int]]
                 ) -> None:
        self.codec = codec
        self.names = list(shapes)
        self.index = {n: i for i, n in enumerate(self.names)}
        self.shapes = [tuple(s) for s in shapes.values()]
        self.frames = frames
        self.spans: list[tuple[int, int]] = []
        off = 0
        for _, _, count in frames:
            self.spans.append((off, off + count))
            off += count
        self.starts = np.array([lo for lo, _ in self.spans], dtype=np.intp)
        # A whole update framed as clients frame it: each tensor's payload size, and where
        # each header and each tensor's values start in the joined payload.
        self.sizes = tuple(len(head) + count * dtype.itemsize for head, dtype, count in frames)
        self.total = sum(self.sizes)
        self.places: list[tuple[bytes, int, np.dtype, int, int]] = []  # head, its offset, dtype, count, values' offset
        at = 0
        for (head, dtype, count), size in zip(frames, self.sizes, strict=True):
            self.places.append((head, at, dtype, count, at + len(head)))
            at += size

    @staticmethod
    def of(codec: Codec, shapes: Mapping[str, tuple[int, ...]]) -> _FlatLayout | None:
        """The layout when every tensor's payload is a linear cast's values (float32), none is
        empty and the update is small (at most ``_FLAT_MAX`` elements: there a tier's cost
        is the calls per tensor, not the work); else None."""
        if type(codec) is not CastCodec or not shapes:
            return None
        frames = []
        for shape in shapes.values():
            frame = codec.framing(tuple(shape))
            if frame is None or frame[2] == 0:
                return None
            frames.append(frame)
        if sum(f[2] for f in frames) > _FLAT_MAX:
            return None
        return _FlatLayout(codec, shapes, frames)


class UpdateSum:
    """A cohort's running sum of whole updates: one :class:`PayloadSum` per tensor.

    :meth:`check` runs beside other checks (it only reads); :meth:`add` must be
    serialised by the caller, like any accumulator. An update is folded whole or not at
    all.

    A small float32 update (at most ``_FLAT_MAX`` elements) takes the flat path: it is
    checked as one vector (:class:`CheckedUpdate`: every tensor's values, one ``|x|``,
    each tensor's peak from one reduction) and added into one float64 vector that holds
    every tensor's sum, so a tier folds it in a handful of array calls instead of a
    handful per tensor. Each element is the same sum of the same products, in the same
    order, as the per-tensor sums form it, and the per-tensor guards and errors are the
    same; the per-tensor sums are brought up to date from the flat one when they are read
    (:meth:`result`, :meth:`drain`)."""

    def __init__(
        self, codec: Codec, shapes: Mapping[str, tuple[int, ...]], shared_seed: int = 0
    ) -> None:
        self.codec = codec
        self.sums = {
            name: PayloadSum(codec, tuple(shape), tensor_seed(shared_seed, name))
            for name, shape in shapes.items()
        }
        self.count = 0
        self.weight = 0.0  # the sum of the updates' weights
        self._layout = _FlatLayout.of(codec, {n: acc.shape for n, acc in self.sums.items()})
        # The flat path's state: the float64 sum of every tensor, each tensor's bound, and
        # how many updates are in it.
        self._flat: np.ndarray | None = None
        self._bounds = [0.0] * len(self.sums)
        self._flat_count = 0

    def check(
        self, payloads: Mapping[str, bytes | bytearray | memoryview]
    ) -> Mapping[str, CheckedPayload]:
        """Check every tensor's payload; names must match exactly (UpdateMismatchError)."""
        if payloads.keys() != self.sums.keys():  # as sets: the usual case is one comparison
            check_names(payloads, self.sums, "payloads")
        if self._layout is not None:
            return self._check_flat(payloads, self._layout)
        out = {}
        for name, acc in self.sums.items():
            try:
                out[name] = acc.check(payloads[name])
            except CodecError as err:
                raise type(err)(f"tensor {name!r}: {err}") from None
        return out

    def check_packed(self, payload: bytes | bytearray | memoryview, sizes: tuple[int, ...]
                     ) -> Mapping[str, CheckedPayload]:
        """:meth:`check` of an upload's tensors joined in this sum's order, ``sizes`` each
        (:func:`orchard.updates.split`, then check): the same result and errors. An update
        framed exactly as a client frames a small float32 one is read in place, without a
        view per tensor."""
        layout = self._layout
        if (layout is not None and isinstance(payload, bytes) and sizes == layout.sizes
                and len(payload) == layout.total):
            parts = []
            for head, at, dtype, count, values_at in layout.places:
                if payload[at:values_at] != head:
                    break
                parts.append(np.frombuffer(payload, dtype, count, values_at))
            else:
                return self._flat_result(np.concatenate(parts) if len(parts) > 1 else parts[0], layout)
        return self.check(dict(zip(self.sums, split(payload, sizes), strict=True)))

    def _check_flat(self, payloads: Mapping[str, bytes | bytearray | memoryview], layout: _FlatLayout
                    ) -> CheckedUpdate:
        parts = []
        for name, (head, dtype, count) in zip(layout.names, layout.frames, strict=True):
            p = payloads[name]
            v = framed_values(p, head, dtype, count)
            if v is None:  # framed otherwise: the general parser says what is wrong, if anything
                try:
                    v = self.sums[name].check(p).coords
                except CodecError as err:
                    raise type(err)(f"tensor {name!r}: {err}") from None
                assert v is not None  # a linear cast's payload has coordinates
            parts.append(v)
        return self._flat_result(np.concatenate(parts) if len(parts) > 1 else parts[0], layout)

    def _flat_result(self, coords: np.ndarray, layout: _FlatLayout) -> CheckedUpdate:
        """Every tensor's values as one vector, checked: finite, with each tensor's peak."""
        # max |x| of each tensor in one reduction (NaN propagates, as in peak).
        bounds = np.maximum.reduceat(np.abs(coords), layout.starts).tolist()
        if not math.isfinite(sum(bounds)):  # (at most n * float32's max: no overflow)
            name = next(n for n, b in zip(layout.names, bounds, strict=True) if not math.isfinite(b))
            raise NonFiniteError(f"tensor {name!r}: {self.sums[name].non_finite()}")
        return CheckedUpdate(coords, bounds, layout)

    def _flat_of(self, checked: Mapping[str, CheckedPayload], layout: _FlatLayout) -> CheckedUpdate:
        """A mapping of checked payloads (the per-tensor kind) as one flat update."""
        if isinstance(checked, CheckedUpdate) and checked._layout is layout:
            return checked
        parts, bounds = [], []
        for name in layout.names:
            cp = checked[name]
            v = cp.coords if cp.coords is not None else cp.decoded
            if v is None or v.dtype.kind != "f":
                raise CodecError(f"tensor {name!r}: a {self.codec.name} summand must carry float coordinates")
            parts.append(v.reshape(-1))
            bounds.append(cp.bound)
        return CheckedUpdate(np.concatenate(parts).astype(np.float32, copy=False), bounds, layout)

    def add(self, checked: Mapping[str, CheckedPayload], weight: float = 1.0, scale: float = 1.0) -> None:
        """Fold in ``scale * weight`` times a whole checked update, counted at ``weight``
        in :attr:`weight` (``scale`` < 1: the update clipped to a norm bound, its client's
        weight unchanged in the mean's denominator)."""
        flat = type(checked) is CheckedUpdate and checked._layout is self._layout  # names checked with it
        if not flat and checked.keys() != self.sums.keys():
            check_names(checked, self.sums, "checked payloads")
        w = check_weight(weight)
        if not (math.isfinite(scale) and 0 < scale <= 1):
            raise CodecError(f"a summand's scale must be in (0, 1], got {scale!r}")
        m = w * scale
        if self._layout is not None:
            self._add_flat(self._flat_of(checked, self._layout), m)
        else:
            for name, acc in self.sums.items():  # every refusal before any tensor changes
                try:
                    acc._admit(checked[name], m)
                except CodecError as err:
                    raise type(err)(f"tensor {name!r}: {err}") from None
            # Each sum admitted its summand just above, and nothing has changed since (add is
            # serialised by the caller): fold without asking again.
            for name, acc in self.sums.items():
                acc._add_admitted(checked[name], m, w)
        self.count += 1
        self.weight += w

    def _add_flat(self, up: CheckedUpdate, m: float) -> None:
        # Each tensor's weighted bound and the sum's new one, as PayloadSum forms them (in
        # Python floats: a handful of them cost less than an array call).
        bounds = [m * b for b in up.bounds]
        grown = [a + b for a, b in zip(self._bounds, bounds, strict=True)]
        if max(grown) > FLOAT32_MAX:  # refuse before anything changes, as PayloadSum.guard does
            i = next(j for j, g in enumerate(grown) if g > FLOAT32_MAX)
            name = up._layout.names[i]
            raise CodecError(f"tensor {name!r}: {self.sums[name].past_range(bounds[i], self._bounds[i])}")
        if self._flat is None:  # a new float64 array: never a view of a caller's buffer
            self._flat = _weighted_copy(up.coords, m)
        else:
            add_weighted(self._flat, up.coords, m)
        self._bounds = grown
        self._flat_count += 1

    def _settle(self) -> None:
        """Bring the per-tensor sums up to date with the flat one (their sums become views of
        it): they then read as if every flat summand had been added to each."""
        layout = self._layout
        if layout is None or self._flat_count == 0:
            return
        for i, acc in enumerate(self.sums.values()):
            lo, hi = layout.spans[i]
            assert self._flat is not None
            acc.coords = self._flat[lo:hi]
            acc.compressed_count = acc.count = self._flat_count
            acc.weight = self.weight
            acc.bound = self._bounds[i]

    def norm(self, checked: Mapping[str, CheckedPayload]) -> float:
        """The L2 norm of the whole update a checked upload decodes to: read from its
        coordinates where the codec says how (:meth:`Codec.coordinate_scale`), else from
        what it decodes to. Only reads."""
        total = 0.0
        if isinstance(checked, CheckedUpdate) and checked._layout is self._layout:
            for i, shape in enumerate(checked._layout.shapes):  # float32: the coordinates are the values
                scale = self.codec.coordinate_scale(shape)
                assert scale is not None
                total += scale * scale * squared_norm(checked.part(i))
            return math.sqrt(total)
        for name, acc in self.sums.items():
            cp = checked[name]
            scale = self.codec.coordinate_scale(acc.shape) if cp.coords is not None else None
            if scale is not None and cp.coords is not None and cp.coords.dtype.kind == "f":
                total += scale * scale * squared_norm(cp.coords)
            else:
                x = cp.decoded if cp.decoded is not None else self.codec.decode_parsed(cp.enc, 1, acc.shared_seed)
                total += squared_norm(x)
        return math.sqrt(total)

    def result(self) -> dict[str, np.ndarray]:
        """The float32 weighted sum of every update, per tensor, in the order of ``shapes``."""
        self._settle()
        return {name: acc.result() for name, acc in self.sums.items()}

    def drain(self) -> Iterator[tuple[str, np.ndarray]]:
        """Like :meth:`result` (in float64, arrays the caller may keep and change), one
        tensor at a time, each tensor's running sum released as its result comes out
        (:meth:`PayloadSum.take`). The sum is empty afterwards; ``count`` and ``weight``
        stay."""
        self._settle()
        # The per-tensor sums now hold views of the flat sum, which goes with the last of them.
        self._flat, self._flat_count = None, 0
        self._bounds = [0.0] * len(self.sums)
        for name, acc in self.sums.items():
            yield name, acc.take()


def sums_compressed(cfg: RunConfig, codec: Codec | None = None) -> bool:
    """Whether a tier sums its direct clients' uploads in the compressed domain.

    Decided by the tier from the run's config alone; clients encode their plain update
    either way. A tier sums in the compressed domain when ``compressed_aggregation`` is
    "auto", secure aggregation is off (it has its own, pre-scaled sums) and the codec is
    linear. The tier then adds each payload times its header's weight ``w_i``
    (:class:`UpdateSum`), which is what the decode path's accumulator folds, for every
    weighting. That includes FedNova: its tiers fold ``sum_i p_i d_i`` with ``p_i`` the
    header's weight and the metric ``fednova_tau`` from the header, as on the decode
    path; only the root rescales.

    Codecs whose payloads add exactly only unweighted -- integer codes, qsgd with a fixed
    ``scale`` alone or inside randk (:attr:`Algebra.weighted_sums` is False) -- take this
    path only under ``weighting = "uniform"``, where every weight is 1; under any other
    weighting their uploads are decoded and then accumulated.

    A run that clips updates (DP's clip norm, ``robust.norm_bound``) sums compressed too,
    for codecs with real weights: the tier reads each update's norm from its payload
    (:meth:`Codec.coordinate_scale`, else what it decodes to) and adds it times
    ``w_i min(1, C / ||x_i||)``, still counted at ``w_i``.
    """
    if cfg.compressed_aggregation == "off" or cfg.secure_aggregation.enabled or cfg.needs_decoded_updates:
        return False  # also when each update must be seen, for a robust statistic
    if codec is None:
        from orchard.compression.registry import build_codec

        codec = build_codec(cfg.codec)
    if not codec.algebra.linear:
        return False
    if cfg.clip_norm is not None:
        # A tier clips each update by scaling its weight (its norm read from the payload),
        # which integer codes cannot take: they add only unweighted.
        return codec.algebra.weighted_sums
    return codec.algebra.weighted_sums or cfg.cohort.weighting == "uniform"


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
