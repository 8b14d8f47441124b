"""Shamir t-of-m secret sharing over GF(p), p = 2^31 - 1 (Shamir, 1979; used as
SS.share / SS.recon in Bonawitz et al., 2017, §3.1 and Bell et al., 2020, §3).

A byte secret is cut into 16-bit limbs; each limb is the constant term of its own random
polynomial of degree t - 1, and all limbs are shared at once with numpy (Horner's rule
on a (holders, limbs) array). Products of two field elements are below 2^62, so uint64
arithmetic never overflows. Any t shares determine the polynomials (Lagrange
interpolation at 0); t - 1 shares are independent of the secret (perfect hiding), which is
why coefficients are drawn exactly uniformly (rejection of the single value 2^31 - 1).
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping, Sequence
from typing import TypeVar

import numpy as np

from orchard.secure_agg.errors import MalformedMessage, NotEnoughShares
from orchard.secure_agg.prg import ByteStream

PRIME = (1 << 31) - 1
LIMB_BITS = 16

__all__ = ["PRIME", "share_bytes", "reconstruct_bytes", "reconstruct_many_bytes", "share_limbs",
           "reconstruct_limbs", "share_size"]

_K = TypeVar("_K", bound=Hashable)
_INCONSISTENT = "shares are inconsistent: they do not interpolate to a byte secret"


def share_size(secret_len: int) -> int:
    """Bytes of one serialised share of a ``secret_len``-byte secret (4 bytes per limb)."""
    return 4 * _num_limbs(secret_len)


def _num_limbs(secret_len: int) -> int:
    return (secret_len + 1) // 2


def _uniform_field(rand: ByteStream, shape: tuple[int, ...]) -> np.ndarray:
    count = int(np.prod(shape))
    out = np.frombuffer(rand.read(4 * count), dtype="<u4").astype(np.uint64) & 0x7FFFFFFF
    # 2^31 - 1 is the only 31-bit value outside the field: redraw it (probability 2^-31).
    bad = np.flatnonzero(out == PRIME)
    while bad.size:
        out[bad] = np.frombuffer(rand.read(4 * bad.size), dtype="<u4").astype(np.uint64) & 0x7FFFFFFF
        bad = bad[out[bad] == PRIME]
    return out.reshape(shape)


def _check_points(xs: Sequence[int]) -> np.ndarray:
    arr = np.asarray(list(xs), dtype=np.int64)
    if arr.ndim != 1 or arr.size == 0:
        raise ValueError("need at least one evaluation point")
    if np.any(arr <= 0) or np.any(arr >= PRIME):
        raise ValueError(f"evaluation points must lie in 1..{PRIME - 1}")
    if np.unique(arr).size != arr.size:
        raise ValueError("evaluation points must be distinct")
    return arr.astype(np.uint64)


def share_limbs(secret: np.ndarray, threshold: int, xs: Sequence[int],
                rand: ByteStream) -> np.ndarray:
    """Shares of a vector of field elements: row i is the share for point ``xs[i]``.

    ``secret`` has shape (L,) with entries < p; the result has shape (len(xs), L).
    """
    xs_arr = _check_points(xs)
    if not 1 <= threshold <= xs_arr.size:
        raise ValueError(f"threshold must be in 1..{xs_arr.size} (holders), got {threshold}")
    secret = np.asarray(secret, dtype=np.uint64)
    if np.any(secret >= PRIME):
        raise ValueError("secret limbs must be field elements (< 2^31 - 1)")
    coeffs = _uniform_field(rand, (threshold - 1, secret.size))
    x = xs_arr[:, None]
    acc = np.zeros((xs_arr.size, secret.size), dtype=np.uint64)
    # Horner: f(x) = s + c1 x + ... + c_{t-1} x^{t-1}.
    for j in range(threshold - 2, -1, -1):
        acc = (acc * x + coeffs[j]) % PRIME
    return (acc * x + secret) % PRIME


def _prod_mod(a: np.ndarray) -> np.ndarray:
    """Product mod p along axis 0, by pairwise halving (log2 rows numpy steps)."""
    while a.shape[0] > 1:
        if a.shape[0] % 2:
            a = np.concatenate([a, np.ones_like(a[:1])])
        a = (a[0::2] * a[1::2]) % PRIME
    return a[0]


def reconstruct_limbs(shares: Mapping[int, np.ndarray], threshold: int) -> np.ndarray:
    """The secret limbs from any ``threshold`` of the shares (point -> share row).

    Raises :class:`NotEnoughShares` with fewer than ``threshold`` shares. With more, the
    ``threshold`` lowest points are used.
    """
    points = _pick(shares, threshold)
    xs = _check_points(points)
    rows = np.stack([np.asarray(shares[p], dtype=np.uint64) for p in points])
    return _interpolate_many(xs[None, :], rows[None, :, :])[0]


def _pick(shares: Mapping[int, object], threshold: int) -> list[int]:
    if threshold < 1:
        raise ValueError(f"threshold must be >= 1, got {threshold}")
    if len(shares) < threshold:
        raise NotEnoughShares(
            f"reconstruction needs {threshold} shares, got {len(shares)}: "
            f"too many holders dropped out"
        )
    return sorted(shares)[:threshold]


def share_bytes(secret: bytes, threshold: int, xs: Sequence[int],
                rand: ByteStream) -> list[bytes]:
    """Shamir shares of a byte string, one serialised share per point in ``xs``."""
    padded = secret + b"\x00" * (len(secret) % 2)
    limbs = np.frombuffer(padded, dtype="<u2").astype(np.uint64)
    rows = share_limbs(limbs, threshold, xs, rand)
    return [row.astype("<u4").tobytes() for row in rows]


def reconstruct_bytes(shares: Mapping[int, bytes], threshold: int, secret_len: int) -> bytes:
    """The ``secret_len``-byte secret from any ``threshold`` serialised shares."""
    points, blob = _gather(shares, threshold, secret_len)
    limbs = _interpolate_many(np.array([points], dtype=np.uint64),
                              _rows(blob, 1, threshold, secret_len))
    return _limbs_to_bytes(limbs[0], secret_len)


def reconstruct_many_bytes(secrets: Mapping[_K, Mapping[int, bytes]], threshold: int,
                           secret_len: int) -> dict[_K, bytes]:
    """:func:`reconstruct_bytes` for many secrets of one length at once (a server
    recovering every survivor's self-mask seed): one numpy pass interpolates all of
    them, each from its own ``threshold`` lowest points. Errors name the secret's key.
    """
    keys = list(secrets)
    if not keys:
        return {}
    points: list[list[int]] = []
    blobs: list[bytes] = []
    for key in keys:
        try:
            pts, blob = _gather(secrets[key], threshold, secret_len)
        except (NotEnoughShares, MalformedMessage) as err:
            raise type(err)(f"secret of {key!r}: {err}") from None
        points.append(pts)
        blobs.append(blob)
    xs = np.array(points, dtype=np.uint64)
    limbs = _interpolate_many(xs, _rows(b"".join(blobs), len(keys), threshold, secret_len))
    bad = np.flatnonzero((limbs >= 1 << LIMB_BITS).any(axis=1))
    if bad.size:
        raise MalformedMessage(f"secret of {keys[bad[0]]!r}: {_INCONSISTENT}")
    raw = limbs.astype("<u2").tobytes()
    width = 2 * limbs.shape[1]
    return {key: raw[i * width:i * width + secret_len] for i, key in enumerate(keys)}


def _gather(shares: Mapping[int, bytes], threshold: int, secret_len: int) -> tuple[list[int], bytes]:
    """The ``threshold`` lowest points and their shares, concatenated, checked."""
    expected = share_size(secret_len)
    for s in shares.values():
        if len(s) != expected:
            raise MalformedMessage(f"a share of a {secret_len}-byte secret is {expected} bytes, "
                                   f"got {len(s)}")
    points = _pick(shares, threshold)
    if points[0] <= 0 or points[-1] >= PRIME:
        raise ValueError(f"evaluation points must lie in 1..{PRIME - 1}")
    return points, b"".join(shares[p] for p in points)


def _rows(blob: bytes, count: int, threshold: int, secret_len: int) -> np.ndarray:
    rows = np.frombuffer(blob, dtype="<u4").astype(np.uint64)
    return rows.reshape(count, threshold, _num_limbs(secret_len))


def _limbs_to_bytes(limbs: np.ndarray, secret_len: int) -> bytes:
    if np.any(limbs >= 1 << LIMB_BITS):
        # Honest shares of a byte secret interpolate to 16-bit limbs; anything else means
        # the shares are of different secrets or were altered.
        raise MalformedMessage(_INCONSISTENT)
    return limbs.astype("<u2").tobytes()[:secret_len]


def _interpolate_many(xs: np.ndarray, rows: np.ndarray) -> np.ndarray:
    """f_i(0) for each secret i, from its distinct points ``xs[i]`` (m, t) and share rows
    ``rows[i]`` (m, t, L), by Lagrange interpolation at zero:

        lambda_ij = prod_{a != j} x_ia / (x_ia - x_ij) = P_i / (x_ij * D_ij),
        P_i = prod_a x_ia,  D_ij = prod_{a != j} (x_ia - x_ij),

    with every x_ij * D_ij inverted at once by Fermat's little theorem. O(m t) memory.
    """
    if np.any(rows >= PRIME):
        raise MalformedMessage("a share holds a value outside the field (>= 2^31 - 1)")
    m, t = xs.shape
    den = np.array(xs, dtype=np.uint64, copy=True)  # accumulates x_ij * D_ij
    for a in range(t):
        d = (xs[:, a:a + 1] + PRIME - xs) % PRIME  # x_ia - x_ij; zero at j = a
        d[:, a] = 1
        den = (den * d) % PRIME
    lam = (_prod_mod(xs.T)[:, None] * _pow_mod(den, PRIME - 2)) % PRIME  # (m, t)
    return ((rows * lam[:, :, None]) % PRIME).sum(axis=1) % PRIME


def _pow_mod(base: np.ndarray, exponent: int) -> np.ndarray:
    """Elementwise base^exponent mod p (square and multiply; products stay < 2^62)."""
    result = np.ones_like(base)
    base = base % PRIME
    while exponent:
        if exponent & 1:
            result = (result * base) % PRIME
        base = (base * base) % PRIME
        exponent >>= 1
    return result
