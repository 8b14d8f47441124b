"""A cohort's running sum of whole updates: :class:`UpdateSum`, one
:class:`~orchard.compression.payload_sum.PayloadSum` per tensor, with a flat path for
small float32 updates (:class:`CheckedUpdate`) where a tier's cost is the calls per
tensor, not the work.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping

import numpy as np

from orchard.compression.base import Codec
from orchard.compression.casts import CastCodec
from orchard.compression.errors import NonFiniteError
from orchard.compression.payload_sum import (
    FLOAT32_MAX,
    CheckedPayload,
    PayloadSum,
    _weighted_copy,
    add_weighted,
    check_weight,
)
from orchard.compression.update import check_names, tensor_seed
from orchard.compression.wire import framed_values
from orchard.errors import CodecError
from orchard.updates import split, squared_norm

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

