"""What a session against an active adversary adds to the keys (Bonawitz et al., 2017,
§6): identities, signatures, commitments, and the floors a client holds a server to.

Each device holds a long-term Ed25519 identity key, certified by the root for its node
id at enrollment (:mod:`orchard.identity`). In an active session a client signs

    ADVERTISE_DOMAIN || H(session config) || node id || c_pk || s_pk || H(b_u)

and sends the signature with its root certificate; every neighbour checks both before it
uses the keys, so neither the server nor a relay can substitute a key: a peer whose
signature or certificate fails is treated as absent (no shares to it, no mask with it).
``H(b_u)`` commits the client to its self-mask seed, so the server can check the seed it
reconstructs. Signatures carry a domain tag of their own and the config's hash (which
covers session id and round): one made for another purpose or session binds nothing here.

A client with no root key to check against (``ClientPolicy.root_public_key`` None: an
``--insecure`` development federation, where nothing is enrolled) takes the key a peer's
credential names on its word: the protocol still runs, but against a server that
substitutes keys it is only as strong as the semi-honest one.
"""

from __future__ import annotations

import hashlib
import math
import struct
from dataclasses import dataclass

from orchard.identity import CertificateError, SigningKey, verify_certificate, verify_signature
from orchard.secure_agg._framing import encoded_id
from orchard.secure_agg.crypto import hkdf
from orchard.secure_agg.errors import SecAggConfigError
from orchard.secure_agg.messages import SessionConfig
from orchard.secure_agg.roster import RosterCache, is_roster_credential

__all__ = ["ClientPolicy", "SessionIdentity", "advertise_message", "identity_key", "is_low_order",
           "seed_commitment"]

ADVERTISE_DOMAIN = b"orchard-secagg/advertise/v2\x00"
SEED_DOMAIN = b"orchard-secagg/self-mask/v2\x00"

# X25519 public keys of small order (and their non-canonical encodings), as libsodium
# lists them: an agreement with one gives a value the attacker knows. Compared with the
# top bit cleared, since X25519 ignores it (RFC 7748, §5).
_LOW_ORDER = frozenset(bytes.fromhex(h) for h in (
    "0000000000000000000000000000000000000000000000000000000000000000",
    "0100000000000000000000000000000000000000000000000000000000000000",
    "e0eb7a7c3b41b8ae1656e3faf19fc46ada098deb9c32b1fd866205165f49b800",
    "5f9c95bca3508c24b1d0b1559c83ef5b04445cc4581c8e86d8224eddd09f1157",
    "ecffffffffffffffffffffffffffffffffffffffffffffffffffffffffffff7f",
    "edffffffffffffffffffffffffffffffffffffffffffffffffffffffffffff7f",
    "eeffffffffffffffffffffffffffffffffffffffffffffffffffffffffffff7f",
))


def is_low_order(public_key: bytes) -> bool:
    """Whether an X25519 public key is one of small order (refused: see _LOW_ORDER)."""
    return len(public_key) == 32 and public_key[:31] + bytes((public_key[31] & 0x7F,)) in _LOW_ORDER


def advertise_message(cfg: SessionConfig, node: str, channel_pk: bytes, mask_pk: bytes,
                      commitment: bytes) -> bytes:
    return ADVERTISE_DOMAIN + cfg.digest + encoded_id(node) + channel_pk + mask_pk + commitment


def seed_commitment(cfg: SessionConfig, node: str, seed: bytes) -> bytes:
    """H(b_u): binds the self-mask seed to its owner and session (b_u is 128 random bits:
    the hash hides it)."""
    return hashlib.sha256(SEED_DOMAIN + cfg.digest + encoded_id(node) + seed).digest()


def identity_key(credential: bytes, node: str, root_public_key: bytes | None,
                 rosters: RosterCache | None = None, min_roster_epoch: int = 0) -> bytes:
    """The Ed25519 key ``credential`` binds to ``node``: checked against the root's key
    when there is one (a certificate, :func:`orchard.identity.verify_certificate`, or a
    roster credential, :mod:`~orchard.secure_agg.roster`, whose roster ``rosters``
    remembers once checked), else taken on its word (a raw 32-byte key, or the key a
    certificate or roster credential names).
    Raises :class:`~orchard.identity.CertificateError`."""
    if is_roster_credential(credential):
        return (rosters or RosterCache()).identity_key(credential, node, root_public_key, min_roster_epoch)
    if root_public_key is not None:
        return verify_certificate(credential, root_public_key, node).public_key
    if len(credential) == 32:
        return credential
    if len(credential) < 3:
        raise CertificateError("a credential is a 32-byte key or a device certificate")
    (n,) = struct.unpack(">H", credential[1:3])
    if credential[3:3 + n] != node.encode() or len(credential) != 3 + n + 32 + 8 + 64:
        raise CertificateError(f"the certificate is not {node!r}'s")
    return credential[3 + n:3 + n + 32]


def verify(identity_public_key: bytes, message: bytes, signature: bytes) -> bool:
    try:
        verify_signature(identity_public_key, message, signature)
    except CertificateError:
        return False
    return True


@dataclass(frozen=True)
class SessionIdentity:
    """A client's long-term signing key and the root's certificate of it (empty: the
    credential is the raw public key, unauthenticated)."""

    key: SigningKey
    certificate: bytes = b""

    @property
    def credential(self) -> bytes:
        return self.certificate or self.key.public_key

    @classmethod
    def ephemeral(cls, entropy: bytes) -> SessionIdentity:
        """An uncertified key derived from ``entropy`` (tests, simulations, --insecure)."""
        return cls(SigningKey.from_bytes(hkdf(entropy, b"identity", 32)))


@dataclass(frozen=True)
class ClientPolicy:
    """What a client holds any session to, from its own configuration, never the server's.

    ``root_public_key``: the root's certificate key (from enrollment); with it, every
    peer's keys must carry a certificate from that root, and semi-honest sessions are
    refused; ``min_roster_epoch``: the newest roster epoch this client holds (its own
    enrolment's), below which a peer's roster credential is refused. Floors: at least ``min_participants`` clients and ``min_neighbours``
    neighbours, and a threshold with a margin over a majority: 2t - k >= max(1,
    ceil(corrupt_fraction * k)), so that the two kinds of shares of one client can be
    collected only with more colluding neighbours than that (Bell et al., 2020, §3.3).
    """

    root_public_key: bytes | None = None
    min_roster_epoch: int = 0
    min_participants: int = 3
    min_neighbours: int = 2
    corrupt_fraction: float = 0.05
    require_active: bool | None = None  # None: exactly when root_public_key is set

    def check(self, cfg: SessionConfig) -> None:
        n, k, t = len(cfg.participants), cfg.neighbours, cfg.threshold
        problems = []
        if n < self.min_participants:
            problems.append(f"{n} participants, this client takes part only with >= {self.min_participants}")
        if k < self.min_neighbours:
            problems.append(f"{k} neighbours, this client needs >= {self.min_neighbours}")
        margin = max(1, math.ceil(self.corrupt_fraction * k))
        if 2 * t - k < margin:
            problems.append(f"threshold t={t} of k={k}: 2t - k = {2 * t - k} < {margin}, too few shares "
                            f"would expose a client (this client needs t >= {(k + margin + 1) // 2})")
        active_needed = self.require_active if self.require_active is not None else self.root_public_key is not None
        if active_needed and not cfg.active:
            problems.append("a semi-honest session: this client takes part only in sessions with "
                            "signed keys and the consistency round")
        if problems:
            raise SecAggConfigError([f"session refused: {p}" for p in problems])
