"""What every codec declares (its algebra) and the framing they share.

A codec is an encode/decode pair over one tensor. :class:`BaseCodec` does the part
that is the same for all of them -- input checks, the payload header, refusing a
payload made by another codec or for another shape -- and leaves two methods to each
codec: ``_encode`` (float32 array -> fields) and ``decode_parsed`` (fields -> array).
"""

from __future__ import annotations

import functools
import math
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import numpy as np

from orchard.compression.errors import CodecMismatchError, MalformedPayloadError
from orchard.compression.wire import MAX_COUNT, EncodedTensor, Field, parse_payload
from orchard.errors import CodecError

State = dict[str, np.ndarray]
"""A stateful codec's per-tensor state: plain float32 arrays the device can persist."""


@dataclass(frozen=True)
class Algebra:
    """What a codec promises about sums of its payloads.

    ``linear``: payloads of one tensor (same shape, same ``shared_seed``) can be summed
    without decoding (:meth:`BaseCodec.add`), and ``decode(sum, num_summands=n)`` equals
    the sum of the ``n`` decodes to float tolerance, for *any* inputs.

    ``field_linear``: linear, and the sum is an element-wise sum of one fixed-length
    vector whose layout does not depend on the data (no data-dependent scale, no
    data-dependent coordinates), so it survives being embedded in an integer field and
    summed there under masks: this is what secure aggregation needs.

    ``stateful``: ``encode`` reads and returns a per-tensor :data:`State`.

    ``unbiased``: ``E[decode(encode(x))] = x`` over the encoder's randomness.

    ``needs_num_summands``: ``decode`` of a sum must be told how many payloads it sums.
    """

    linear: bool
    field_linear: bool
    stateful: bool
    unbiased: bool
    needs_num_summands: bool

    @property
    def weighted_sums(self) -> bool:
        """Payloads of one tensor add with real weights ``w_i`` in the compressed domain:
        the codec is linear and decoding a sum does not depend on how many payloads it
        sums. A codec whose decode needs ``num_summands`` (qsgd with a fixed scale, alone
        or inside randk) carries an offset per summand in integer codes: its payloads add
        exactly only unweighted, and a weighted sum has no summand count to decode with."""
        return self.linear and not self.needs_num_summands


@runtime_checkable
class Codec(Protocol):
    """The public face of every codec (see the package docstring for the contract)."""

    name: str
    algebra: Algebra

    def encode(
        self,
        x: np.ndarray,
        rng: np.random.Generator,
        state: State | None = None,
        shared_seed: int = 0,
    ) -> tuple[bytes, State | None]: ...

    def decode(
        self,
        payload: bytes,
        shape: tuple[int, ...],
        num_summands: int = 1,
        shared_seed: int = 0,
        state: State | None = None,
    ) -> np.ndarray: ...

    def parse(self, payload: bytes, shape: tuple[int, ...]) -> EncodedTensor: ...

    def decode_parsed(
        self, enc: EncodedTensor, num_summands: int = 1, shared_seed: int = 0
    ) -> np.ndarray: ...

    def add(self, a: EncodedTensor, b: EncodedTensor) -> EncodedTensor | None: ...

    def coordinates(self, enc: EncodedTensor, shared_seed: int = 0) -> np.ndarray | None: ...

    def from_coordinates(
        self, shape: tuple[int, ...], coords: np.ndarray, shared_seed: int = 0
    ) -> EncodedTensor: ...

    def coordinate_scale(self, shape: tuple[int, ...]) -> float | None: ...

    def bound(
        self, enc: EncodedTensor, num_summands: int = 1, shared_seed: int = 0
    ) -> float: ...


def peak(x: np.ndarray) -> float:
    """max |x|; NaN when x holds a NaN, 0 when empty. A large array takes two reductions
    and no |x| temporary; a small float one (at most ``_SMALL`` elements) takes |x| and
    its argmax, which is cheaper there. Both give max |x| exactly."""
    n = x.size
    if not n:
        return 0.0
    if n <= _SMALL and x.dtype.kind == "f":  # (|x| of a signed int minimum would wrap)
        # A tier checks thousands of small tensors: a reduction's setup costs more than
        # the work there, argmax's does not. argmax finds the first NaN when there is one.
        a = np.abs(x)
        return float(a.item(a.argmax()))
    # The ufuncs' reduce directly (ndarray.max adds a Python wrapper). Both reductions
    # propagate NaN, so max() of the two floats never drops one.
    return max(float(_max(x, axis=None)), -float(_min(x, axis=None)))


_max, _min = np.maximum.reduce, np.minimum.reduce
_SMALL = 1 << 14  # elements: a 64 KiB float32 temporary at most


def as_float32(x: object) -> np.ndarray:
    """The float32 contiguous view (or copy) every codec encodes; refuses non-real dtypes."""
    arr = np.asarray(x)
    if arr.dtype.kind not in "fiu":
        raise CodecError(f"expected a real numeric array, got dtype {arr.dtype}")
    if arr.size > MAX_COUNT:
        raise CodecError(f"a tensor may hold at most {MAX_COUNT} elements, got {arr.size}")
    return np.asarray(arr, dtype=np.float32, order="C")  # ascontiguousarray would make 0-d 1-d


def check_shape(shape: object) -> tuple[int, ...]:
    if type(shape) is tuple:
        # Every update decodes the same few schema shapes: check each one once.
        try:
            return _checked_shape(shape)
        except TypeError:  # unhashable elements: the general path says what is wrong
            pass
    return _check_shape(shape)


@functools.lru_cache(maxsize=1024)
def _checked_shape(shape: tuple) -> tuple[int, ...]:
    return _check_shape(shape)


def _check_shape(shape: object) -> tuple[int, ...]:
    try:
        dims = tuple(int(d) for d in shape)  # type: ignore[attr-defined]
    except (TypeError, ValueError):
        raise CodecError(f"shape must be a tuple of ints, got {shape!r}") from None
    if any(d < 0 for d in dims) or len(dims) > 255 or math.prod(dims) > MAX_COUNT:
        raise CodecError(
            f"shape must have at most 255 non-negative dims and {MAX_COUNT} elements, got {dims}"
        )
    return dims


def check_seed(shared_seed: int) -> int:
    if not isinstance(shared_seed, int | np.integer) or shared_seed < 0:
        raise CodecError(f"shared_seed must be a non-negative int, got {shared_seed!r}")
    return int(shared_seed)


def numel(shape: tuple[int, ...]) -> int:
    return math.prod(shape)


def expect_fields(enc: EncodedTensor, count: int, layout: str) -> tuple[Field, ...]:
    if len(enc.fields) != count:
        got = ", ".join(f.describe() for f in enc.fields) or "none"
        raise MalformedPayloadError(
            f"{enc.codec_name} payload: expected {count} fields ({layout}), "
            f"got {len(enc.fields)} ({got})"
        )
    return enc.fields


def expect_field(
    enc: EncodedTensor,
    field: Field,
    what: str,
    *,
    count: int | None = None,
    dtype: str | None = None,
    bits: int | None = None,
) -> np.ndarray:
    """Check one field's element count and kind; return its data."""
    problems = []
    if count is not None and field.data.size != count:
        problems.append(f"{count} elements, got {field.data.size}")
    if bits is not None and field.bits != bits:
        problems.append(f"{bits}-bit packed, got {field.describe()}")
    if dtype is not None and (field.bits or field.data.dtype != np.dtype(dtype)):
        problems.append(f"dtype {dtype}, got {field.describe()}")
    if problems:
        raise MalformedPayloadError(
            f"{enc.codec_name} payload for shape {enc.shape}, field {what!r}: expected "
            + "; expected ".join(problems)
        )
    return field.data


class BaseCodec(ABC):
    """Header framing and payload checks shared by every codec; subclasses supply the
    two parsed-form methods."""

    name: str
    algebra: Algebra
    codec_id: int
    version: int = 1

    def encode(
        self,
        x: np.ndarray,
        rng: np.random.Generator,
        state: State | None = None,
        shared_seed: int = 0,
    ) -> tuple[bytes, State | None]:
        x32 = as_float32(x)
        enc, new_state = self.encode_parsed(x32, rng, state, check_seed(shared_seed))
        return enc.to_bytes(), new_state

    def decode(
        self,
        payload: bytes,
        shape: tuple[int, ...],
        num_summands: int = 1,
        shared_seed: int = 0,
        state: State | None = None,
    ) -> np.ndarray:
        """Decode to float32 of ``shape``. ``state`` is accepted for symmetry: no decoder keeps any."""
        if not isinstance(num_summands, int | np.integer) or num_summands < 1:
            raise CodecError(f"num_summands must be an int >= 1, got {num_summands!r}")
        enc = self.parse(payload, shape)
        return self.decode_parsed(enc, int(num_summands), check_seed(shared_seed))

    def parse(self, payload: bytes, shape: tuple[int, ...]) -> EncodedTensor:
        """Parse a payload and refuse it unless this codec made it, for this shape."""
        dims = check_shape(shape)
        enc = parse_payload(payload)
        if enc.codec_id != self.codec_id:
            raise CodecMismatchError(
                f"wrong codec id: this decoder is {self.name!r} (id {self.codec_id}), "
                f"the payload was made by {enc.codec_name!r} (id {enc.codec_id})"
            )
        if enc.codec_version != self.version:
            raise CodecMismatchError(
                f"{self.name} payload version {enc.codec_version}, this decoder reads "
                f"version {self.version}"
            )
        if enc.shape != dims:
            raise MalformedPayloadError(
                f"{self.name} payload is for shape {enc.shape}, decode was asked for {dims}"
            )
        return enc

    def header(self, shape: tuple[int, ...], fields: list[Field]) -> EncodedTensor:
        return EncodedTensor(self.codec_id, self.version, tuple(shape), tuple(fields))

    def add(self, a: EncodedTensor, b: EncodedTensor) -> EncodedTensor | None:
        """The compressed-domain sum of two parsed payloads, or None when it does not exist."""
        return None

    def coordinates(self, enc: EncodedTensor, shared_seed: int = 0) -> np.ndarray | None:
        """The vector by which a field-linear codec's payloads add, or None.

        Payloads of one tensor (same shape, same ``shared_seed``) that passed
        :meth:`bound` share everything but these coordinates (float32 values, or integer
        codes): the rest of the layout follows from the shape, the seed and the codec's
        configuration. The payload of their sum has the coordinates' element-wise sum: a
        caller may keep that sum in a wider dtype (float64; integer codes in uint32)
        and rebuild the payload with :meth:`from_coordinates`. Checks the payload as
        :meth:`bound` does; None for codecs without such a vector."""
        return None

    def from_coordinates(
        self, shape: tuple[int, ...], coords: np.ndarray, shared_seed: int = 0
    ) -> EncodedTensor:
        """The payload for ``shape`` (and ``shared_seed``) whose coordinates are ``coords``."""
        raise CodecError(f"{self.name} payloads do not add coordinate-wise")

    def coordinate_scale(self, shape: tuple[int, ...]) -> float | None:
        """``s`` such that one payload of ``shape`` decodes to ``s`` times its float
        coordinates, each at its own element, zeros elsewhere: then the decoded update's
        L2 norm is ``s * ||coordinates||``, read without decoding (a tier clips updates
        it sums in the compressed domain by it). None when that does not hold (integer
        codes, data-dependent scales, no coordinates)."""
        return None

    def parse_for_sum(
        self, payload: bytes, shape: tuple[int, ...], shared_seed: int = 0
    ) -> tuple[EncodedTensor, float, np.ndarray | None]:
        """What a sum checks of one payload, with the same errors, in this order: the
        parsed payload (:meth:`parse`), the bound on its decode (:meth:`bound`, one
        summand) and its coordinates (:meth:`coordinates`). Codecs whose bound and
        coordinates come from the fields they just parsed override it to read them once."""
        enc = self.parse(payload, shape)
        return enc, self.bound(enc, 1, shared_seed), self.coordinates(enc, shared_seed)

    def bound(self, enc: EncodedTensor, num_summands: int = 1, shared_seed: int = 0) -> float:
        """Check ``enc`` as :meth:`decode_parsed` would and bound what it decodes to.

        Returns an upper bound on the absolute value of every element of
        ``decode_parsed(enc, num_summands, shared_seed)``: NaN or inf when the payload
        carries a non-finite value. A malformed payload raises CodecError, as decode
        does. Codecs override this to check their fields without building the dense
        tensor; the default decodes."""
        return peak(self.decode_parsed(enc, num_summands, shared_seed))

    @abstractmethod
    def encode_parsed(
        self, x: np.ndarray, rng: np.random.Generator, state: State | None, shared_seed: int
    ) -> tuple[EncodedTensor, State | None]:
        """Encode float32 ``x`` to its parsed form (header and fields)."""

    @abstractmethod
    def decode_parsed(
        self, enc: EncodedTensor, num_summands: int = 1, shared_seed: int = 0
    ) -> np.ndarray:
        """Decode a parsed payload (or a sum of ``num_summands`` of them) to float32."""

    def __repr__(self) -> str:
        return f"<codec {self.name}>"
