"""Uniform scalar quantisation: one skeleton, two codecs (``qsgd`` and ``sign``).

The skeleton maps each element of a block with scale ``s`` onto ``L + 1 = 2**bits``
evenly spaced levels of ``[-s, s]``::

    u = (x / s + 1) * L / 2                   in [0, L] when |x| <= s
    j = floor(u + r)                          r ~ U[0, 1): stochastic rounding
    x_hat = s * (2 j / L - 1)

Stochastic rounding is unbiased: ``E[floor(u + r)] = u``, so ``E[x_hat] = x`` whenever
``|x| <= s`` (QSGD, Alistarh et al. 2017, Lemma 3.1; the proof needs only
``|x_i| <= s``). Its variance per element is at most ``(s / L)**2``.

Codes are stored unsigned (the level index ``j``), so the sum of ``n`` payloads that
share their scales decodes as ``s * (2 J / L - n)`` with ``J = sum j``: decode must be
told ``n`` (``needs_num_summands``), and the sum of codes is an integer vector that can
be added modulo a field as long as ``n * L`` fits.

``qsgd``: stochastic rounding, ``bits`` in {1, 2, 4, 8}; the scale is the max-norm of
the tensor or of each ``block`` elements (QSGD's paper uses the L2 norm; the max-norm
keeps unbiasedness and has far smaller variance at these bit widths), or a fixed
``scale`` for every client, which makes the codec field-linear (values beyond the
fixed scale are clipped, the only source of bias). Cost: ``bits`` per element plus a
float32 per block.

``sign``: scaled sign, 1 bit per element, deterministic nearest rounding with
``s = mean |x|`` (EF-SignSGD, Karimireddy et al. 2019, eq. (3): ``C(x) = |x|_1 / d *
sign(x)``). Biased: pair it with error feedback. The level map is float32, so an
element within ``2**-23 * s`` of zero may take either sign.
"""

from __future__ import annotations

import numpy as np

from orchard.compression.base import (
    Algebra,
    BaseCodec,
    State,
    as_float32,
    expect_field,
    expect_fields,
    numel,
    peak,
)
from orchard.compression.errors import CodecMismatchError, MalformedPayloadError
from orchard.compression.wire import CODEC_IDS, MAX_COUNT, EncodedTensor, Field
from orchard.errors import CodecError

QUANT_BITS = (1, 2, 4, 8)
FLUSH_SCALE = np.float32(2.0**-118)  # 255 / 2 / FLUSH_SCALE stays below float32's max


CHUNK = 1 << 16  # elements per pass: scratch stays in L2 and is reused, no page faults


def _segments(size: int, block: int) -> list[tuple[int, int, int, int]]:
    """Cover ``size`` elements with row-major views of at most ~CHUNK elements.

    Each segment is ``(first element, first block, rows, row width)``: either several
    whole blocks, or (for blocks larger than a chunk, and the last partial block) a
    piece of one block. Views, not a zero-padded copy, and small enough that the
    skeleton's temporaries are cache-resident scratch rather than fresh 40 MB arrays.
    """
    full, rem = divmod(size, block)
    if block >= CHUNK:
        return [
            (start, b, 1, min(CHUNK, min(b * block + block, size) - start))
            for b in range(full + (rem > 0))
            for start in range(b * block, min(b * block + block, size), CHUNK)
        ]
    per = CHUNK // block
    segs = [(b * block, b, min(per, full - b), block) for b in range(0, full, per)]
    if rem:
        segs.append((full * block, full, 1, rem))
    return segs


def block_absmax(x: np.ndarray, block: int) -> np.ndarray:
    """Max |x| per block, without an |x| temporary (two reductions instead)."""
    full, rem = divmod(x.size, block)
    parts = []
    if full:
        rows = x[: full * block].reshape(full, block)
        parts.append(np.maximum(rows.max(axis=1), -rows.min(axis=1)))
    if rem:
        tail = x[full * block :]
        parts.append(np.array([max(tail.max(), -tail.min())], dtype=np.float32))
    return np.concatenate(parts).astype(np.float32) if parts else np.zeros(0, np.float32)


def quantize(
    x: np.ndarray, scales: np.ndarray, block: int, bits: int, rng: np.random.Generator | None
) -> np.ndarray:
    """Level indices (uint8) of flat float32 ``x``; ``rng=None`` rounds to nearest."""
    half = np.float32(((1 << bits) - 1) / 2)
    with np.errstate(divide="ignore"):
        inv = np.where(scales > 0, half / scales, np.float32(0)).astype(np.float32)
    codes = np.empty(x.size, dtype=np.uint8)
    u_buf = np.empty(min(x.size, CHUNK), dtype=np.float32)
    r_buf = np.empty_like(u_buf)
    shift = half + np.float32(0.5) if rng is None else half
    for start, b0, rows, width in _segments(x.size, block):
        n = rows * width
        u = u_buf[:n].reshape(rows, width)
        np.multiply(x[start : start + n].reshape(rows, width), inv[b0 : b0 + rows, None], out=u)
        u += shift
        if rng is not None:
            r = r_buf[:n]
            rng.random(out=r, dtype=np.float32)
            u += r.reshape(rows, width)
        # Clip: |x| > s (a fixed scale, or sign's mean-|x| scale) and float rounding of u + r.
        np.clip(u, 0, 2 * half, out=u)
        np.copyto(codes[start : start + n].reshape(rows, width), u, casting="unsafe")  # floor
    return codes


def block_absmax_rows(x: np.ndarray, block: int) -> np.ndarray:
    """:func:`block_absmax` of every row of a (rows, size) array at once: (rows, blocks)."""
    count, size = x.shape
    full, rem = divmod(size, block)
    parts = []
    if full:
        rows = x[:, : full * block].reshape(count, full, block)
        parts.append(np.maximum(rows.max(axis=2), -rows.min(axis=2)))
    if rem:
        tail = x[:, full * block :]
        parts.append(np.maximum(tail.max(axis=1), -tail.min(axis=1))[:, None])
    if not parts:
        return np.zeros((count, 0), np.float32)
    return np.concatenate(parts, axis=1).astype(np.float32)


def quantize_rows(
    x: np.ndarray,
    scales: np.ndarray,
    block: int,
    bits: int,
    rngs: list[np.random.Generator] | None,
) -> np.ndarray:
    """:func:`quantize` of every row of a (rows, size) float32 array, row ``i`` with
    ``scales[i]`` and ``rngs[i]``: the same codes, row by row, as ``quantize`` gives (the
    same float32 operations in the same order, and each row's generator drawn in the
    same pieces), with the arithmetic done for all rows at once."""
    count, size = x.shape
    half = np.float32(((1 << bits) - 1) / 2)
    with np.errstate(divide="ignore"):
        inv = np.where(scales > 0, half / scales, np.float32(0)).astype(np.float32)
    u = np.multiply(x, np.repeat(inv, block, axis=1)[:, :size], dtype=np.float32)
    u += half if rngs is not None else half + np.float32(0.5)
    if rngs is not None:
        r = np.empty((count, size), dtype=np.float32)
        pieces = [(start, rows * width) for start, _, rows, width in _segments(size, block)]
        for i, rng in enumerate(rngs):
            for start, n in pieces:
                rng.random(out=r[i, start : start + n], dtype=np.float32)
        u += r
    np.clip(u, 0, 2 * half, out=u)
    return u.astype(np.uint8)  # floor, as quantize's unsafe copy


def dequantize(
    codes: np.ndarray, scales: np.ndarray, block: int, bits: int, num_summands: int
) -> np.ndarray:
    """Inverse map of summed level indices: ``s * (2 J / L - n)`` per element.

    Computed in float64 and rounded to float32 once: ``J * step`` and ``n * s`` are both
    about ``n`` times the result's scale, so subtracting them in float32 loses bits (a
    zero input decoded to 4e-4 instead of 0 at a scale of 27); decoding a sum of
    payloads then also equals the sum of their decodes to float32 rounding."""
    work = np.float64
    step = (scales.astype(work) * work(2 / ((1 << bits) - 1))).astype(work)
    offset = (scales.astype(work) * work(num_summands)).astype(work)
    out = np.empty(codes.size, dtype=work)
    for start, b0, rows, width in _segments(codes.size, block):
        n = rows * width
        view = out[start : start + n].reshape(rows, width)
        np.multiply(
            codes[start : start + n].reshape(rows, width), step[b0 : b0 + rows, None], out=view
        )
        view -= offset[b0 : b0 + rows, None]
    return out.astype(np.float32)


class QuantCodec(BaseCodec):
    """The skeleton as a codec; ``qsgd`` and ``sign`` differ only in scale and rounding.

    ``stochastic``: stochastic (unbiased) or nearest rounding. ``mean_scale``: one scale
    per tensor, ``mean |x|`` (sign's), instead of the max |x| of each block.
    """

    def __init__(
        self,
        name: str,
        bits: int,
        block: int | None = None,
        fixed_scale: float | None = None,
        stochastic: bool = True,
        mean_scale: bool = False,
    ) -> None:
        self.name = name
        self.codec_id = CODEC_IDS["sign" if name == "sign" else "qsgd"]
        self.bits = bits
        self.block = block
        self.fixed_scale = None if fixed_scale is None else np.float32(fixed_scale)
        self.stochastic = stochastic
        self.mean_scale = mean_scale
        fixed = fixed_scale is not None
        self.algebra = Algebra(
            linear=fixed,
            field_linear=fixed,
            stateful=False,
            unbiased=stochastic,
            needs_num_summands=not mean_scale,
        )

    def _block_size(self, size: int) -> int:
        if self.block is None or self.fixed_scale is not None or self.mean_scale:
            return max(size, 1)
        return self.block

    def _scales(self, x: np.ndarray, block: int) -> np.ndarray:
        if self.fixed_scale is not None:
            return np.full(1, self.fixed_scale, dtype=np.float32)
        if x.size == 0:
            return np.zeros(0, dtype=np.float32)
        if self.mean_scale:
            scales = np.array([np.abs(x).mean(dtype=np.float64)], dtype=np.float32)
        else:
            scales = block_absmax(x, block)
        if not np.isfinite(scales).all():
            raise CodecError(f"{self.name} cannot scale a tensor that holds NaN or inf")
        # Flush tiny scales to zero: L / (2 s) would overflow float32, and such a block's
        # values (all below FLUSH_SCALE ~ 3e-36) are sent as exact zeros.
        scales[scales < FLUSH_SCALE] = 0
        return scales

    def encode_many(self, x: np.ndarray, rngs: list[np.random.Generator]) -> list[bytes] | None:
        """The payloads :meth:`encode` gives ``x[i]`` with ``rngs[i]``, for every row of
        ``x`` (one tensor a row, all of one shape) at once: the same bytes (a property
        test holds them together), the scales and the rounding computed for all rows
        together. None where a row would be refused or the codec scales by the mean
        (sign): then encode the rows one by one, each error its own."""
        if self.mean_scale or x.ndim < 1 or x.shape[0] == 0 or len(rngs) != x.shape[0]:
            return None
        try:
            x32 = as_float32(x)
        except CodecError:
            return None
        count, shape = x32.shape[0], tuple(x32.shape[1:])
        flat = x32.reshape(count, -1)
        if flat.shape[1] == 0 or flat.shape[1] > MAX_COUNT:
            return None
        block = self._block_size(flat.shape[1])
        if self.fixed_scale is not None:
            scales = np.full((count, 1), self.fixed_scale, dtype=np.float32)
        else:
            scales = block_absmax_rows(flat, block)
            if not np.isfinite(scales).all():
                return None
            scales[scales < FLUSH_SCALE] = 0
        codes = quantize_rows(flat, scales, block, self.bits, rngs if self.stochastic else None)
        return [self.header(shape, [Field(scales[i]), Field(codes[i], bits=self.bits)]).to_bytes()
                for i in range(count)]

    def encode_parsed(
        self, x: np.ndarray, rng: np.random.Generator, state: State | None, shared_seed: int
    ) -> tuple[EncodedTensor, State | None]:
        flat = x.reshape(-1)
        block = self._block_size(flat.size)
        scales = self._scales(flat, block)
        codes = quantize(flat, scales, block, self.bits, rng if self.stochastic else None)
        return self.header(x.shape, [Field(scales), Field(codes, bits=self.bits)]), None

    def _expected_blocks(self, size: int) -> int:
        if self.fixed_scale is not None:
            return 1
        return -(-size // self._block_size(size)) if size else 0

    def _parts(self, enc: EncodedTensor) -> tuple[np.ndarray, np.ndarray]:
        size = numel(enc.shape)
        f_scale, f_codes = expect_fields(enc, 2, "scales, codes")
        scales = expect_field(
            enc, f_scale, "scales", count=self._expected_blocks(size), dtype="float32"
        )
        if self.fixed_scale is not None and scales[0] != self.fixed_scale:
            raise CodecMismatchError(
                f"{self.name} payload uses scale {scales[0]:g}, this decoder is configured "
                f"for a fixed scale of {self.fixed_scale:g}"
            )
        if f_codes.bits:
            codes = expect_field(enc, f_codes, "codes", count=size, bits=self.bits)
        else:  # a compressed-domain sum: raw uint32 level sums
            codes = expect_field(enc, f_codes, "summed codes", count=size, dtype="uint32")
        return scales, codes

    def _checked_parts(
        self, enc: EncodedTensor, num_summands: int
    ) -> tuple[np.ndarray, np.ndarray, int]:
        """Scales, codes and the summand count, refusing summed codes beyond ``n * L``."""
        scales, codes = self._parts(enc)
        n = num_summands if self.algebra.needs_num_summands else 1
        levels = (1 << self.bits) - 1
        if not enc.fields[1].bits and codes.size and int(codes.max()) > n * levels:
            raise MalformedPayloadError(
                f"{self.name} summed codes reach {int(codes.max())}, but {n} summands of "
                f"{self.bits}-bit codes reach at most {n * levels}: wrong num_summands?"
            )
        return scales, codes, n

    def decode_parsed(
        self, enc: EncodedTensor, num_summands: int = 1, shared_seed: int = 0
    ) -> np.ndarray:
        scales, codes, n = self._checked_parts(enc, num_summands)
        size = numel(enc.shape)
        out = dequantize(codes, scales, self._block_size(size), self.bits, n)
        return out.reshape(enc.shape)

    def bound(self, enc: EncodedTensor, num_summands: int = 1, shared_seed: int = 0) -> float:
        """``n * max |s|``: every decoded element is ``s * (2 J / L - n)`` with ``0 <= J <= n L``."""
        scales, _, n = self._checked_parts(enc, num_summands)
        return peak(scales) * n

    def add(self, a: EncodedTensor, b: EncodedTensor) -> EncodedTensor | None:
        """Sum codes when both payloads share every scale (always, with a fixed scale)."""
        if self.mean_scale:  # sign: per-client mean |x| scales never coincide in practice
            return None
        (sa, ca), (sb, cb) = self._parts(a), self._parts(b)
        if not np.array_equal(sa, sb):
            return None
        total = ca.astype(np.uint32)
        total += cb
        return self.header(a.shape, [Field(sa), Field(total)])

    def coordinates(self, enc: EncodedTensor, shared_seed: int = 0) -> np.ndarray | None:
        """With a fixed scale, the level indices (summed exactly as integers)."""
        if self.fixed_scale is None:
            return None  # per-tensor or per-block scales differ between clients
        return self._parts(enc)[1]

    def from_coordinates(
        self, shape: tuple[int, ...], coords: np.ndarray, shared_seed: int = 0
    ) -> EncodedTensor:
        if self.fixed_scale is None:
            return super().from_coordinates(shape, coords, shared_seed)
        if coords.dtype.kind not in "iu" or (
            coords.size and int(coords.max()) > np.iinfo(np.uint32).max
        ):
            raise CodecError(
                f"{self.name} summed codes must be integers below 2**32, got {coords.dtype}"
            )
        scales = np.full(1, self.fixed_scale, dtype=np.float32)
        codes = Field(np.asarray(coords, np.uint32).reshape(-1))
        return self.header(shape, [Field(scales), codes])


def qsgd_codec(bits: int = 8, block: int | None = None, scale: float | None = None) -> QuantCodec:
    return QuantCodec("qsgd", bits, block=block, fixed_scale=scale, stochastic=True)


def sign_codec() -> QuantCodec:
    return QuantCodec("sign", 1, block=None, stochastic=False, mean_scale=True)


def qsgd_variance_bound(scale: float, bits: int) -> float:
    """Per-element variance bound ``(s / L)**2`` of the stochastic quantiser."""
    return (scale / ((1 << bits) - 1)) ** 2
