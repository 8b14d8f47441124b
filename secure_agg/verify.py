"""Verified Shamir reconstruction: use the redundant shares to detect and drop bad ones.

A server unmasking a session holds up to k shares of each secret and needs t. Shares of
one honestly dealt secret lie on one polynomial of degree t - 1, i.e. they form a
codeword of a Reed-Solomon code of length m and dimension t; a share a holder altered
moves the vector off the code. Two steps:

1. Detection, batched over every secret of one share count m (cheap, numpy): a vector
   s is a codeword iff ``sum_i u_i g(x_i) s_i = 0`` for every polynomial g of degree
   < m - t, where ``u_i = 1 / prod_{j != i} (x_i - x_j)`` (the dual code is a generalised
   Reed-Solomon code). One g with uniformly random coefficients, drawn after the shares
   are in, misses a non-codeword with probability 1/p (p = 2^31 - 1) per secret.
2. Correction, for a secret that fails (rare: only under attack), by Berlekamp-Welch
   on a random combination of its limbs: it finds the polynomial that agrees with all
   but at most e = floor((m - t) / 2) shares, and so the holders whose shares disagree.

Every recovered secret is then checked against what its owner committed to (the mask
public key for a mask key, H(b_u) for a self-mask seed); a secret that fails the check,
or that cannot be decoded, is reported, never returned. So a wrong share can cost its
holder its say, and a wrongly dealt secret can abort the session naming its owner, but
neither can change a recovered secret.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Mapping
from dataclasses import dataclass, field
from typing import Generic, TypeVar

import numpy as np

from orchard.secure_agg.prg import ByteStream
from orchard.secure_agg.shamir import (
    LIMB_BITS,
    PRIME,
    _interpolate_many,
    _num_limbs,
    _pow_mod,
    _uniform_field,
    share_size,
)

_K = TypeVar("_K", bound=Hashable)

__all__ = ["Recovered", "recover_verified"]


@dataclass
class Recovered(Generic[_K]):
    """What :func:`recover_verified` got: each secret it recovered and checked, the
    evaluation points whose shares it discarded, and the secrets it could not recover
    (key -> why)."""

    secrets: dict[_K, bytes] = field(default_factory=dict)
    discarded: dict[_K, tuple[int, ...]] = field(default_factory=dict)
    failed: dict[_K, str] = field(default_factory=dict)


def recover_verified(shares: Mapping[_K, Mapping[int, bytes]], threshold: int, secret_len: int,
                     check: Callable[[_K, bytes], bool], rand: ByteStream) -> Recovered[_K]:
    """Recover every secret in ``shares`` (key -> {point: share}) from all of its shares,
    dropping shares that do not lie on one polynomial of degree ``threshold - 1`` and
    accepting a secret only if ``check(key, secret)``. ``rand``: unpredictable to the
    holders (the detection's random polynomial)."""
    out: Recovered[_K] = Recovered()
    size = share_size(secret_len)
    groups: dict[int, list[_K]] = {}
    for key, held in shares.items():
        bad = [x for x, s in held.items() if len(s) != size]
        if bad:
            out.discarded[key] = tuple(sorted(bad))
        if len(held) - len(bad) < threshold:
            out.failed[key] = (f"{len(held) - len(bad)} well-formed shares, threshold is {threshold}")
            continue
        groups.setdefault(len(held) - len(bad), []).append(key)
    for m, keys in groups.items():
        pts = [sorted(x for x, s in shares[k].items() if len(s) == size) for k in keys]
        xs = np.array(pts, dtype=np.uint64)
        rows = np.frombuffer(b"".join(shares[k][x] for k, p in zip(keys, pts, strict=True) for x in p),
                             dtype="<u4").astype(np.uint64).reshape(len(keys), m, _num_limbs(secret_len))
        in_field = (rows < PRIME).all(axis=(1, 2))
        ok = in_field & (_codewords(xs, rows, threshold, rand) if m > threshold else True)
        limbs = _interpolate_many(xs[:, :threshold], np.where(rows[:, :threshold] < PRIME, rows[:, :threshold], 0))
        for i, key in enumerate(keys):
            secret = _to_bytes(limbs[i], secret_len) if ok[i] else None
            if secret is not None and check(key, secret):
                out.secrets[key] = secret
                continue
            _correct(key, pts[i], rows[i], threshold, secret_len, check, rand, out)
    return out


def _codewords(xs: np.ndarray, rows: np.ndarray, t: int, rand: ByteStream) -> np.ndarray:
    """For each secret i, whether its share rows (m, L) lie on one degree < t polynomial
    (the dual-code test of the module docstring); shape (secrets,)."""
    g_count, m = xs.shape
    den = np.ones_like(xs)
    for a in range(m):
        d = xs + PRIME - xs[:, a:a + 1]  # x_i - x_a (+ p: < 2p, so den * d < 2^63)
        d[:, a] = 1
        den = (den * d) % PRIME
    u = _pow_mod(den, PRIME - 2)
    coeffs = _uniform_field(rand, (g_count, m - t))
    g = np.zeros_like(xs)
    for j in range(m - t - 1, -1, -1):  # Horner
        g = (g * xs + coeffs[:, j:j + 1]) % PRIME
    w = (u * g) % PRIME
    rows = np.where(rows < PRIME, rows, 0)
    acc = ((rows * w[:, :, None]) % PRIME).sum(axis=1) % PRIME
    return (acc == 0).all(axis=1)


def _to_bytes(limbs: np.ndarray, secret_len: int) -> bytes | None:
    if np.any(limbs >= 1 << LIMB_BITS):
        return None  # not shares of a byte string: dealt or altered wrongly
    return limbs.astype("<u2").tobytes()[:secret_len]


def _correct(key: _K, pts: list[int], rows: np.ndarray, t: int, secret_len: int,
             check: Callable[[_K, bytes], bool], rand: ByteStream, out: Recovered[_K]) -> None:
    """Berlekamp-Welch on a random combination of the limbs; then the limbs from the
    shares that agree, checked. A share with a value outside the field is wrong on its
    face: it is dropped before decoding."""
    outside = tuple(x for x, row in zip(pts, rows, strict=True) if (row >= PRIME).any())
    if outside:
        out.discarded[key] = tuple(sorted({*out.discarded.get(key, ()), *outside}))
        keep = [i for i, x in enumerate(pts) if x not in outside]
        pts, rows = [pts[i] for i in keep], rows[keep]
        if len(pts) < t:
            out.failed[key] = f"only {len(pts)} of its shares are field elements, threshold is {t}"
            return
    r = [int(v) for v in _uniform_field(rand, (rows.shape[1],))]
    ys = [sum(ri * int(v) for ri, v in zip(r, row, strict=True)) % PRIME for row in rows.tolist()]
    poly = berlekamp_welch(pts, ys, t)
    if poly is None:
        out.failed[key] = f"its {len(pts)} shares do not decode (more than {(len(pts) - t) // 2} are wrong)"
        return
    bad = tuple(x for x, y in zip(pts, ys, strict=True) if _eval(poly, x) != y)
    good = [i for i, x in enumerate(pts) if x not in bad]
    if len(good) < t:
        out.failed[key] = f"only {len(good)} of its shares agree, threshold is {t}"
        return
    xs = np.array([[pts[i] for i in good[:t]]], dtype=np.uint64)
    limbs = _interpolate_many(xs, rows[None, good[:t], :])
    secret = _to_bytes(limbs[0], secret_len)
    if bad:
        out.discarded[key] = tuple(sorted({*out.discarded.get(key, ()), *bad}))
    if secret is None or not check(key, secret):
        out.failed[key] = "its shares agree on a secret that is not the one its owner committed to"
        return
    out.secrets[key] = secret


def _eval(poly: list[int], x: int) -> int:
    acc = 0
    for c in reversed(poly):
        acc = (acc * x + c) % PRIME
    return acc


def berlekamp_welch(xs: list[int], ys: list[int], t: int) -> list[int] | None:
    """The coefficients (low first) of the polynomial f of degree < t with f(x_i) = y_i for
    all but at most e = floor((m - t) / 2) of the m points, or None if there is none.

    Solves Q(x_i) = y_i E(x_i) for Q of degree < t + e and E monic of degree e (linear in
    their coefficients), then f = Q / E (Berlekamp and Welch, 1986). O(m^3) in Python
    integers: run only on a secret whose shares failed the batched check.
    """
    m = len(xs)
    if m < t:
        return None
    e = (m - t) // 2
    nq = t + e
    rows = []
    for x, y in zip(xs, ys, strict=True):
        powers = [pow(x, j, PRIME) for j in range(nq)]
        rows.append(powers + [(-y * powers[j]) % PRIME for j in range(e)] + [y * pow(x, e, PRIME) % PRIME])
    sol = _solve(rows, nq + e)
    if sol is None:
        return None
    q, err = sol[:nq], [*sol[nq:], 1]
    f, rem = _divide(q, err)
    if any(rem):
        return None
    f = (f + [0] * t)[:t]
    wrong = sum(1 for x, y in zip(xs, ys, strict=True) if _eval(f, x) != y)
    return f if wrong <= e else None


def _solve(rows: list[list[int]], n: int) -> list[int] | None:
    """One solution of the augmented system ``rows`` (n unknowns) mod p, free unknowns 0."""
    a = [r[:] for r in rows]
    pivots: list[int] = []
    r = 0
    for c in range(n):
        piv = next((i for i in range(r, len(a)) if a[i][c]), None)
        if piv is None:
            continue
        a[r], a[piv] = a[piv], a[r]
        inv = pow(a[r][c], PRIME - 2, PRIME)
        a[r] = [v * inv % PRIME for v in a[r]]
        for i in range(len(a)):
            if i != r and a[i][c]:
                f = a[i][c]
                a[i] = [(v - f * w) % PRIME for v, w in zip(a[i], a[r], strict=True)]
        pivots.append(c)
        r += 1
    if any(row[n] for row in a[r:]):
        return None  # inconsistent
    sol = [0] * n
    for i, c in enumerate(pivots):
        sol[c] = a[i][n]
    return sol


def _divide(num: list[int], den: list[int]) -> tuple[list[int], list[int]]:
    """Polynomial division mod p (coefficients low first; ``den`` monic)."""
    num = num[:]
    dd = len(den) - 1
    if len(num) - 1 < dd:
        return [0], num
    quot = [0] * (len(num) - dd)
    for i in range(len(num) - 1, dd - 1, -1):
        c = num[i]
        if c:
            quot[i - dd] = c
            for j in range(dd + 1):
                num[i - dd + j] = (num[i - dd + j] - c * den[j]) % PRIME
    return quot, num[:dd]
