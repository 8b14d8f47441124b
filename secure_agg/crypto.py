"""Key agreement, key derivation and the authenticated share channel.

Each client holds two X25519 key pairs (Bonawitz et al., 2017, §4, round 0,
"AdvertiseKeys"): (c_pk, c_sk) for the channel that carries encrypted shares and
(s_pk, s_sk) for pairwise mask agreement. Diffie-Hellman outputs are never used directly:
HKDF-SHA256 binds each derived key to its purpose, the session id, the round and the
ordered pair of nodes, so a key from one session or one direction is useless in another.

Shares travel encrypted with AES-256-GCM (§4, round 1, "ShareKeys": AE.enc). The
associated data binds sender, recipient, session id and round; a ciphertext replayed into
another session or readdressed to another node fails authentication. Each channel key is
derived per direction and per session and encrypts exactly one message, so a constant
nonce never repeats under one key.
"""

from __future__ import annotations

import functools
import hmac
from dataclasses import dataclass

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.serialization import (
    Encoding,
    NoEncryption,
    PrivateFormat,
    PublicFormat,
)

from orchard.secure_agg.errors import MalformedMessage, TamperedCiphertext
from orchard.secure_agg.prg import SEED_BYTES

KEY_BYTES = 32
_LABEL = b"orchard-secagg/v1"
_NONCE = bytes(12)
_HASH_BYTES = 32  # SHA-256
_NO_SALT = bytes(_HASH_BYTES)  # RFC 5869 §2.2: a missing salt is HashLen zero bytes

__all__ = [
    "KEY_BYTES",
    "PairwiseSeed",
    "agree",
    "channel_key",
    "decrypt_share",
    "encrypt_share",
    "hkdf",
    "load_private",
    "load_private_cached",
    "load_public",
    "pairwise_seed",
    "private_bytes",
    "public_bytes",
    "share_associated_data",
]


def hkdf(ikm: bytes, info: bytes, length: int) -> bytes:
    """HKDF-SHA256 (RFC 5869) with no salt and info ``_LABEL + info``.

    Written on :func:`hmac.digest` (one C call per block) rather than the ``cryptography``
    HKDF object, whose construction costs several times the hashing for a 16- or 32-byte
    output; a server derives one seed per (dropped node, surviving neighbour) pair and a
    client two keys per neighbour. The output is the RFC's, byte for byte (tested against
    ``cryptography``'s HKDF).
    """
    if not 0 < length <= 255 * _HASH_BYTES:
        raise ValueError(f"HKDF-SHA256 output must be 1..{255 * _HASH_BYTES} bytes, got {length}")
    prk = hmac.digest(_NO_SALT, ikm, "sha256")
    info = _LABEL + info
    block, out = b"", []
    for i in range(1, -(-length // _HASH_BYTES) + 1):
        block = hmac.digest(prk, block + info + bytes((i,)), "sha256")
        out.append(block)
    return b"".join(out)[:length]


def _field(b: bytes) -> bytes:
    return len(b).to_bytes(2, "big") + b


def _context(kind: bytes, session_id: bytes, round_number: int, a: str, b: str) -> bytes:
    return (_field(kind) + _field(session_id) + round_number.to_bytes(8, "big")
            + _field(a.encode()) + _field(b.encode()))


def load_private(raw: bytes) -> X25519PrivateKey:
    if len(raw) != KEY_BYTES:
        raise MalformedMessage(f"an X25519 private key is {KEY_BYTES} bytes, got {len(raw)}")
    return X25519PrivateKey.from_private_bytes(raw)


def load_public(raw: bytes) -> X25519PublicKey:
    if len(raw) != KEY_BYTES:
        raise MalformedMessage(f"an X25519 public key is {KEY_BYTES} bytes, got {len(raw)}")
    return X25519PublicKey.from_public_bytes(raw)


def private_bytes(key: X25519PrivateKey) -> bytes:
    return key.private_bytes(Encoding.Raw, PrivateFormat.Raw, NoEncryption())


def public_bytes(key: X25519PrivateKey) -> bytes:
    return key.public_key().public_bytes(Encoding.Raw, PublicFormat.Raw)


def _exchange(sk: X25519PrivateKey, pk: bytes | X25519PublicKey) -> bytes:
    try:
        # Raw bytes are loaded here. The check is on the concrete bytes types: isinstance
        # against the abstract X25519PublicKey costs as much as the hashing that follows.
        return sk.exchange(load_public(bytes(pk)) if isinstance(pk, bytes | bytearray | memoryview)
                           else pk)
    except ValueError as err:  # all-zero shared secret: a low-order public key
        raise MalformedMessage(f"public key rejected by X25519: {err}") from None


def pairwise_seed(s_sk: X25519PrivateKey, peer_s_pk: bytes | X25519PublicKey,
                  session_id: bytes, round_number: int, a: str, b: str) -> bytes:
    """s_{a,b} = HKDF(DH(s_sk, peer_s_pk)) for the unordered pair {a, b} (§4, round 2).

    Both ends (and the server, once it has reconstructed a dropped node's s_sk) derive the
    same seed; ``a``/``b`` are put in sorted order so the derivation is symmetric. The
    peer's key may come loaded (a server derives k seeds per dropped node and loads each
    survivor's key once).
    """
    lo, hi = sorted((a, b))
    return hkdf(_exchange(s_sk, peer_s_pk), _context(b"mask", session_id, round_number, lo, hi),
                SEED_BYTES)


# A loaded private key computes its public key (one X25519 multiplication, ~20 us): a
# server derives about k seeds per dropped node, so it loads each node's key once. The
# keys cached are those of dropped nodes, which the server has reconstructed anyway.
load_private_cached = functools.lru_cache(maxsize=8)(load_private)


@dataclass(frozen=True, slots=True)
class PairwiseSeed:
    """:func:`pairwise_seed` deferred: a seed source for :class:`~orchard.secure_agg.prg.MaskFolder`
    that a mask thread or a mask worker process derives just before it expands the mask.

    It holds raw keys (32 bytes each), so it pickles; calling it gives the seed that
    ``pairwise_seed(load_private(s_sk), peer_s_pk, ...)`` gives.
    """

    s_sk: bytes  # a dropped node's reconstructed mask key, raw
    peer_s_pk: bytes  # a surviving neighbour's advertised mask public key, raw
    session_id: bytes
    round_number: int
    a: str
    b: str

    def __call__(self) -> bytes:
        return pairwise_seed(load_private_cached(self.s_sk), self.peer_s_pk, self.session_id,
                             self.round_number, self.a, self.b)


def agree(sk: X25519PrivateKey, peer_pk: bytes) -> bytes:
    """The raw X25519 shared secret (feed it to :func:`channel_key`, never use it as a key)."""
    return _exchange(sk, peer_pk)


def channel_key(shared: bytes, session_id: bytes, round_number: int, sender: str,
                recipient: str) -> bytes:
    """The AES-256-GCM key for the one message ``sender`` -> ``recipient`` (directional),
    from the channel agreement ``shared = agree(c_sk, peer_c_pk)``."""
    return hkdf(shared, _context(b"channel", session_id, round_number, sender, recipient), 32)


def share_associated_data(session_id: bytes, round_number: int, sender: str,
                          recipient: str) -> bytes:
    return _context(b"shares", session_id, round_number, sender, recipient)


def encrypt_share(key: bytes, plaintext: bytes, associated_data: bytes) -> bytes:
    return AESGCM(key).encrypt(_NONCE, plaintext, associated_data)


def decrypt_share(key: bytes, ciphertext: bytes, associated_data: bytes, sender: str) -> bytes:
    try:
        return AESGCM(key).decrypt(_NONCE, ciphertext, associated_data)
    except InvalidTag:
        raise TamperedCiphertext(
            f"the encrypted shares from {sender!r} failed authentication: the ciphertext was "
            f"modified, addressed to another node, or replayed from another session/round"
        ) from None
