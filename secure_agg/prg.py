"""Mask expansion: a seed becomes a uniform vector in Z_{2^b} (Bonawitz et al., 2017, §4:
"PRG(s)"; Bell et al., 2020, §3).

The PRG is AES-128 in counter mode keyed by a 16-byte seed: the keystream (the encryption of
zero bytes) is read as little-endian machine words. The words are uniform in Z_{2^w}
(w = 32 or 64) and therefore uniform in Z_{2^b} for every b <= w after reduction, because
2^b divides 2^w. Every seed is used for exactly one stream (seeds are derived per session
and per pair, see :mod:`orchard.secure_agg.crypto`), so a fixed counter block is safe.

There is no Python loop over coordinates: OpenSSL writes the keystream straight into a
preallocated buffer and numpy adds it to the accumulator (about 1 ms per 10^6 words).
"""

from __future__ import annotations

import numpy as np
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes

from orchard.secure_agg.errors import SecAggConfigError

SEED_BYTES = 16
_ZERO_IV = bytes(16)
_AES_BLOCK = 16

__all__ = [
    "SEED_BYTES",
    "ByteStream",
    "MaskExpander",
    "expand_mask",
    "modulus_mask",
    "word_dtype",
]


def word_dtype(modulus_bits: int) -> np.dtype:
    """The machine word that holds Z_{2^b}: uint32 for b <= 32, uint64 for b <= 64."""
    if not 1 <= modulus_bits <= 64:
        raise SecAggConfigError(f"modulus_bits must be in 1..64, got {modulus_bits}")
    return np.dtype("<u4") if modulus_bits <= 32 else np.dtype("<u8")


def modulus_mask(modulus_bits: int) -> int:
    """2^b - 1: ``x & modulus_mask(b)`` reduces a word modulo 2^b."""
    return (1 << modulus_bits) - 1


def _check_seed(seed: bytes) -> None:
    if len(seed) != SEED_BYTES:
        raise ValueError(f"a mask seed is {SEED_BYTES} bytes, got {len(seed)}")


class MaskExpander:
    """Expands seeds into masks of ``length`` words and folds them into an accumulator.

    Holds two buffers of ``length`` words (the zero plaintext and the keystream), so a
    stream of expansions allocates nothing. Not thread-safe: one per thread.
    """

    def __init__(self, length: int, modulus_bits: int) -> None:
        if length < 0:
            raise ValueError(f"length must be >= 0, got {length}")
        self.length = length
        self.modulus_bits = modulus_bits
        self.dtype = word_dtype(modulus_bits)
        nbytes = length * self.dtype.itemsize
        self._zeros = bytes(nbytes)
        # update_into wants room for one extra block minus one byte.
        self._out = bytearray(nbytes + _AES_BLOCK - 1)
        self._view = np.frombuffer(self._out, dtype=self.dtype, count=length)
        self.expansions = 0  # measurement: how many seeds were expanded

    def expand(self, seed: bytes) -> np.ndarray:
        """The mask of ``seed`` in full words (not yet reduced mod 2^b).

        The returned array is a view of an internal buffer, valid until the next call.
        """
        _check_seed(seed)
        enc = Cipher(algorithms.AES(seed), modes.CTR(_ZERO_IV)).encryptor()
        enc.update_into(self._zeros, self._out)
        self.expansions += 1
        return self._view

    def add_into(self, acc: np.ndarray, seed: bytes, sign: int = 1) -> None:
        """``acc += sign * PRG(seed)`` modulo the word size (in place)."""
        mask = self.expand(seed)
        if sign >= 0:
            np.add(acc, mask, out=acc)
        else:
            np.subtract(acc, mask, out=acc)


def expand_mask(seed: bytes, length: int, modulus_bits: int = 32) -> np.ndarray:
    """PRG(seed) as ``length`` elements of Z_{2^b} (a fresh array)."""
    exp = MaskExpander(length, modulus_bits)
    out = exp.expand(seed).copy()
    out &= np.asarray(modulus_mask(modulus_bits), dtype=out.dtype)
    return out


class ByteStream:
    """A deterministic stream of pseudorandom bytes (AES-256-CTR keyed by ``key``).

    Clients draw all their secrets (key pairs, self-mask seed, Shamir coefficients) from
    one of these, seeded with 32 bytes of entropy the caller provides, so the protocol is
    reproducible in tests and the package never touches a global RNG.
    """

    def __init__(self, key: bytes) -> None:
        if len(key) != 32:
            raise ValueError(f"ByteStream needs a 32-byte key, got {len(key)}")
        self._enc = Cipher(algorithms.AES(key), modes.CTR(_ZERO_IV)).encryptor()

    def read(self, n: int) -> bytes:
        return self._enc.update(bytes(n))
