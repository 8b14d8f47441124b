"""Sparsifiers: send k coordinates, with their values encoded by any inner codec.

A sparsified payload is ``[index fields..., values]`` where ``values`` is a complete
nested payload of the inner codec for the 1-D vector of kept values. ``topk`` alone is
``topk`` over ``float32`` values; the pipeline ``topk -> qsgd`` is the same codec with
``qsgd`` inside.

``topk`` (Aji & Heafield 2017; Stich et al. 2018): the k largest |x|. Indices are data
dependent, so they travel: sorted, delta-coded (first index, then gaps >= 1) and
bit-packed at the width of the largest gap, ``~k * log2(d / k)`` bits for spread-out
indices. Biased (it drops the tail): pair it with error feedback. Not linear.

``randk`` (Stich et al. 2018; Konecny & Richtarik 2018): k coordinates drawn uniformly
without replacement from ``shared_seed``, which the whole cohort shares, so no index
travels (a 32-bit check of the seed does, to refuse a decode with the wrong seed).
Selection is a 0/1 matrix that does not depend on the data, so it commutes with sums
modulo any field: linear and field-linear when the inner codec is. With
``unbiased=True`` decode scales by ``d / k`` so that ``E[decode] = x`` over the seed
(variance grows by ``d / k - 1`` times ``|x|^2 / d`` per coordinate).
"""

from __future__ import annotations

import math
import zlib
from typing import Protocol

import numpy as np

from orchard.compression.base import Algebra, BaseCodec, State, expect_field, numel
from orchard.compression.errors import CodecMismatchError, MalformedPayloadError
from orchard.compression.wire import CODEC_IDS, EncodedTensor, Field
from orchard.errors import CodecError


def keep_count(size: int, k: int | None, fraction: float | None) -> int:
    """How many coordinates to keep of ``size``: ``k``, or ``ceil(fraction * size)``, at least 1."""
    if size == 0:
        return 0
    want = k if k is not None else math.ceil((fraction or 0.0) * size)
    return max(1, min(int(want), size))


class Selector(Protocol):
    name: str
    data_independent: bool
    unbiased: bool
    n_index_fields: int

    def select(self, x: np.ndarray, shared_seed: int) -> tuple[np.ndarray, list[Field]]: ...

    def indices(
        self, enc: EncodedTensor, fields: tuple[Field, ...], shared_seed: int
    ) -> np.ndarray: ...

    def kept(self, enc: EncodedTensor, fields: tuple[Field, ...], shared_seed: int) -> int:
        """How many coordinates the payload keeps, checking its index fields as decode
        does, without drawing them where they come from the seed."""
        ...

    def decode_scale(self, size: int, kept: int) -> float: ...


class TopK:
    name = "topk"
    data_independent = False
    unbiased = False
    n_index_fields = 1

    def __init__(self, k: int | None = None, fraction: float | None = None) -> None:
        self.k, self.fraction = k, fraction

    def select(self, x: np.ndarray, shared_seed: int) -> tuple[np.ndarray, list[Field]]:
        kept = keep_count(x.size, self.k, self.fraction)
        if kept == x.size:
            idx = np.arange(x.size, dtype=np.int64)
        else:
            # argpartition is O(d) introselect; a full sort would be O(d log d).
            idx = np.argpartition(np.abs(x), x.size - kept)[x.size - kept :]
            idx.sort()
        gaps = np.diff(idx, prepend=0).astype(np.uint32)
        width = max(1, int(gaps.max()).bit_length()) if gaps.size else 1
        return idx, [Field(gaps, bits=width)]

    def indices(
        self, enc: EncodedTensor, fields: tuple[Field, ...], shared_seed: int
    ) -> np.ndarray:
        (f,) = fields
        if not f.bits:
            raise MalformedPayloadError(
                f"topk payload: expected bit-packed index gaps, got {f.describe()}"
            )
        size = numel(enc.shape)
        gaps = f.data.astype(np.int64)
        if gaps.size > size:
            raise MalformedPayloadError(
                f"topk payload: {gaps.size} indices for a tensor of {size} elements"
            )
        if gaps.size > 1 and int(gaps[1:].min()) == 0:
            raise MalformedPayloadError(
                "topk payload: repeated index (a gap of 0); indices must be strictly increasing"
            )
        idx = np.cumsum(gaps)
        if idx.size and int(idx[-1]) >= size:
            raise MalformedPayloadError(
                f"topk payload: index {int(idx[-1])} out of range for shape {enc.shape} "
                f"({size} elements, valid indices 0..{size - 1})"
            )
        return idx

    def kept(self, enc: EncodedTensor, fields: tuple[Field, ...], shared_seed: int) -> int:
        return int(self.indices(enc, fields, shared_seed).size)

    def decode_scale(self, size: int, kept: int) -> float:
        return 1.0


def _seed_check(shared_seed: int) -> np.ndarray:
    return np.array([zlib.crc32(shared_seed.to_bytes(16, "little", signed=False))], np.uint32)


class RandK:
    name = "randk"
    data_independent = True
    n_index_fields = 1

    def __init__(
        self, k: int | None = None, fraction: float | None = None, unbiased: bool = True
    ) -> None:
        self.k, self.fraction, self.unbiased = k, fraction, unbiased

    def _draw(self, size: int, shared_seed: int) -> np.ndarray:
        kept = keep_count(size, self.k, self.fraction)
        rng = np.random.default_rng(shared_seed)
        idx = rng.choice(size, kept, replace=False, shuffle=False) if size else np.zeros(0)
        return np.sort(idx.astype(np.int64))

    def select(self, x: np.ndarray, shared_seed: int) -> tuple[np.ndarray, list[Field]]:
        return self._draw(x.size, shared_seed), [Field(_seed_check(shared_seed))]

    def indices(
        self, enc: EncodedTensor, fields: tuple[Field, ...], shared_seed: int
    ) -> np.ndarray:
        self.kept(enc, fields, shared_seed)
        return self._draw(numel(enc.shape), shared_seed)

    def kept(self, enc: EncodedTensor, fields: tuple[Field, ...], shared_seed: int) -> int:
        (f,) = fields
        check = expect_field(enc, f, "seed check", count=1, dtype="uint32")
        if check[0] != _seed_check(shared_seed)[0]:
            raise CodecMismatchError(
                f"randk payload was drawn with another shared seed (check {int(check[0]):#x}, "
                f"shared_seed {shared_seed} gives {int(_seed_check(shared_seed)[0]):#x})"
            )
        return keep_count(numel(enc.shape), self.k, self.fraction)

    def decode_scale(self, size: int, kept: int) -> float:
        return size / kept if self.unbiased and kept else 1.0


class SparsifiedCodec(BaseCodec):
    """A selector followed by a stateless inner codec for the kept values."""

    def __init__(self, selector: TopK | RandK, inner: BaseCodec, name: str) -> None:
        if inner.algebra.stateful:
            raise CodecError(f"{name}: the values codec must be stateless, got {inner.name}")
        self.name = name
        self.codec_id = CODEC_IDS[selector.name]
        self.selector = selector
        self.inner = inner
        a = inner.algebra
        free = selector.data_independent
        self.algebra = Algebra(
            linear=free and a.linear,
            field_linear=free and a.field_linear,
            stateful=False,
            unbiased=selector.unbiased and a.unbiased,
            needs_num_summands=a.needs_num_summands,
        )

    def encode_parsed(
        self, x: np.ndarray, rng: np.random.Generator, state: State | None, shared_seed: int
    ) -> tuple[EncodedTensor, State | None]:
        flat = x.reshape(-1)
        idx, index_fields = self.selector.select(flat, shared_seed)
        values, _ = self.inner.encode(flat[idx], rng, None, shared_seed)
        nested = Field(np.frombuffer(values, dtype=np.uint8))
        return self.header(x.shape, [*index_fields, nested]), None

    def _index_fields(self, enc: EncodedTensor) -> tuple[Field, ...]:
        """The payload's index fields (all but the last, the nested values), refusing a
        payload with another number of fields."""
        want = self.selector.n_index_fields + 1
        if len(enc.fields) != want:
            raise MalformedPayloadError(
                f"{self.name} payload: expected {want} fields (indices, values), "
                f"got {len(enc.fields)}"
            )
        return enc.fields[:-1]

    def _split(self, enc: EncodedTensor, shared_seed: int) -> tuple[np.ndarray, EncodedTensor]:
        idx = self.selector.indices(enc, self._index_fields(enc), shared_seed)
        return idx, self._values(enc, idx.size)

    def _values(self, enc: EncodedTensor, kept: int) -> EncodedTensor:
        nested = expect_field(enc, enc.fields[-1], "values", dtype="uint8")
        try:
            return self.inner.parse(nested.tobytes(), (kept,))
        except CodecError as err:
            raise type(err)(f"values of a {self.name} payload: {err}") from None

    def decode_parsed(
        self, enc: EncodedTensor, num_summands: int = 1, shared_seed: int = 0
    ) -> np.ndarray:
        idx, values_enc = self._split(enc, shared_seed)
        values = self.inner.decode_parsed(values_enc, num_summands, shared_seed).reshape(-1)
        size = numel(enc.shape)
        scale = self.selector.decode_scale(size, idx.size)
        out = np.zeros(size, dtype=np.float32)
        out[idx] = values if scale == 1.0 else values * np.float32(scale)
        return out.reshape(enc.shape)

    def _checked_values(self, enc: EncodedTensor, shared_seed: int) -> tuple[int, EncodedTensor]:
        """How many values are kept and their nested payload, checking the index fields
        (randk: its seed, without drawing the coordinates)."""
        kept = self.selector.kept(enc, self._index_fields(enc), shared_seed)
        return kept, self._values(enc, kept)

    def bound(self, enc: EncodedTensor, num_summands: int = 1, shared_seed: int = 0) -> float:
        """Checks the indices and bounds the values by the inner codec."""
        kept, values = self._checked_values(enc, shared_seed)
        inner = self.inner.bound(values, num_summands, shared_seed)
        return inner * self.selector.decode_scale(numel(enc.shape), kept)

    def coordinates(self, enc: EncodedTensor, shared_seed: int = 0) -> np.ndarray | None:
        """randk: the inner codec's coordinates of the kept values (one cohort, one seed,
        the same coordinates kept by every payload)."""
        if not self.selector.data_independent:
            return None
        _, values = self._checked_values(enc, shared_seed)
        return self.inner.coordinates(values, shared_seed)

    def coordinate_scale(self, shape: tuple[int, ...]) -> float | None:
        """randk: the kept values (distinct elements) times ``d / k`` when unbiased."""
        if not isinstance(self.selector, RandK):
            return None
        size = numel(shape)
        kept = keep_count(size, self.selector.k, self.selector.fraction)
        inner = self.inner.coordinate_scale((kept,))
        return None if inner is None else inner * self.selector.decode_scale(size, kept)

    def from_coordinates(
        self, shape: tuple[int, ...], coords: np.ndarray, shared_seed: int = 0
    ) -> EncodedTensor:
        if not isinstance(self.selector, RandK):
            return super().from_coordinates(shape, coords, shared_seed)
        kept = keep_count(numel(shape), self.selector.k, self.selector.fraction)
        values = self.inner.from_coordinates((kept,), coords, shared_seed)
        nested = Field(np.frombuffer(values.to_bytes(), dtype=np.uint8))
        return self.header(shape, [Field(_seed_check(shared_seed)), nested])

    def add(self, a: EncodedTensor, b: EncodedTensor) -> EncodedTensor | None:
        """Randk payloads with one seed share their coordinates: sum the nested values."""
        if not self.selector.data_independent:
            return None
        if len(a.fields) != 2 or len(b.fields) != 2:
            return None
        if not np.array_equal(a.fields[0].data, b.fields[0].data):
            return None  # drawn from different seeds: different coordinates
        kept = keep_count(numel(a.shape), self.selector.k, self.selector.fraction)
        va, vb = self._values(a, kept), self._values(b, kept)
        total = self.inner.add(va, vb)
        if total is None:
            return None
        nested = Field(np.frombuffer(total.to_bytes(), dtype=np.uint8))
        return self.header(a.shape, [*a.fields[:-1], nested])
