"""Deterministic seeds derived from tuples of integers.

A simulated round derives a few seeds per client (its training seed, its torch
generator's seed), so the derivation sits on the hot path of a 10,000-client round.
``np.random.SeedSequence`` mixes well but costs about 10 µs a call; BLAKE2b over the
packed integers mixes as well (neighbouring tuples give unrelated seeds) for a tenth of
that. Pure: no state, no I/O.
"""

from __future__ import annotations

import hashlib
import struct

_MASK64 = (1 << 64) - 1


def derive_seed(*parts: int, bits: int = 63) -> int:
    """A seed in ``[0, 2**bits)`` that depends on every part (each taken modulo 2**64)."""
    if not 1 <= bits <= 64:
        raise ValueError(f"bits must be in [1, 64], got {bits}")
    packed = struct.pack(f"<{len(parts)}Q", *(int(p) & _MASK64 for p in parts))
    digest = hashlib.blake2b(packed, digest_size=8, person=b"orchard-seed").digest()
    return int.from_bytes(digest, "little") >> (64 - bits)
