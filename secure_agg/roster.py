"""Signed rosters: one root signature over every enrolled device's identity key, so a client
checks its neighbours' keys with one Ed25519 verification and a Merkle path each, instead
of one certificate (one verification) each.

The enrolment authority (the root, holding the certificate key) signs, once per roster
epoch,

    ROSTER_DOMAIN || u64 epoch || u32 size || Merkle root

over the leaves ``H(0x00 || LEAF_DOMAIN || node id || identity key)`` of the enrolled
devices sorted by node id, padded with zero leaves to a power of two; inner nodes are
``H(0x01 || left || right)`` (the prefixes keep a leaf from passing as an inner node,
RFC 6962, §2.1). A device's roster credential is

    0x02 || signed roster (108 bytes) || u32 leaf index || identity key (32 bytes)
         || u8 depth || depth sibling hashes (32 bytes each, leaf level first)

and proves that the root put (node id, identity key) in that epoch's roster: the node id
is not in the credential, it is the one the keys are advertised for, so a path for
another node's key does not verify. A :class:`RosterCache` remembers the rosters whose
signature it checked (all credentials of one epoch carry the same 108 bytes), so a client
verifies one signature per epoch and a path of ceil(log2 size) hashes per neighbour.

Freshness: a roster names its epoch; a client refuses a roster older than the newest
epoch it holds (:attr:`ClientPolicy.min_roster_epoch
<orchard.secure_agg.active.ClientPolicy>`, from its own enrolment), so a device removed
from the roster of that epoch cannot take part with an older roster's path.
"""

from __future__ import annotations

import dataclasses
import hashlib
import struct
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

from orchard.identity import (
    PUBLIC_KEY_BYTES,
    SIGNATURE_BYTES,
    CertificateError,
    SigningKey,
    verify_signature,
)
from orchard.secure_agg._framing import encoded_id

if TYPE_CHECKING:
    from orchard.secure_agg.messages import PeerKeys

__all__ = ["ForgedRoster", "NotInRoster", "RosterCache", "RosterError", "SignedRoster", "StaleRoster",
           "build_roster", "is_roster_credential", "roster_leaf", "with_certificates"]

ROSTER_DOMAIN = b"orchard/device-roster/v1\x00"
LEAF_DOMAIN = b"orchard/device-roster/leaf/v1\x00"
ROSTER_CREDENTIAL = 0x02  # a certificate starts with its version, 0x01
ROSTER_BYTES = 8 + 4 + 32 + SIGNATURE_BYTES
MAX_DEPTH = 32


class RosterError(CertificateError):
    """A roster credential that does not prove what it claims."""


class ForgedRoster(RosterError):
    """The roster's signature is not the root's: forged, altered, or from another root."""


class NotInRoster(RosterError):
    """The Merkle path does not lead from (node id, key) to the signed root: that key is
    not the one the roster holds for that node."""


class StaleRoster(RosterError):
    """The roster is of an epoch older than the newest this client holds."""


@dataclass(frozen=True)
class SignedRoster:
    epoch: int
    size: int
    root: bytes
    signature: bytes

    def body(self) -> bytes:
        return ROSTER_DOMAIN + struct.pack(">QI", self.epoch, self.size) + self.root

    def to_bytes(self) -> bytes:
        return struct.pack(">QI", self.epoch, self.size) + self.root + self.signature

    @classmethod
    def from_bytes(cls, raw: bytes) -> SignedRoster:
        if len(raw) != ROSTER_BYTES:
            raise RosterError(f"a signed roster is {ROSTER_BYTES} bytes, got {len(raw)}")
        epoch, size = struct.unpack(">QI", raw[:12])
        return cls(epoch, size, raw[12:44], raw[44:])

    @property
    def depth(self) -> int:
        return max(0, (self.size - 1).bit_length())


def roster_leaf(node_id: str, public_key: bytes) -> bytes:
    return hashlib.sha256(b"\x00" + LEAF_DOMAIN + encoded_id(node_id) + public_key).digest()


def _inner(left: bytes, right: bytes) -> bytes:
    return hashlib.sha256(b"\x01" + left + right).digest()


def is_roster_credential(credential: bytes) -> bool:
    """Whether ``credential`` is one (a raw key is 32 bytes, a certificate starts with 0x01)."""
    return len(credential) > PUBLIC_KEY_BYTES and credential[0] == ROSTER_CREDENTIAL


def build_roster(root: SigningKey, epoch: int, members: dict[str, bytes]) -> tuple[SignedRoster, dict[str, bytes]]:
    """The root's side: sign the roster of ``members`` (node id -> identity key) for
    ``epoch`` and return it with each member's roster credential."""
    if not members:
        raise RosterError("a roster needs at least one member")
    if any(len(pk) != PUBLIC_KEY_BYTES for pk in members.values()):
        raise RosterError(f"identity keys are {PUBLIC_KEY_BYTES} bytes")
    ids = sorted(members)
    depth = max(0, (len(ids) - 1).bit_length())
    levels = [[roster_leaf(p, members[p]) for p in ids] + [bytes(32)] * ((1 << depth) - len(ids))]
    while len(levels[-1]) > 1:
        below = levels[-1]
        levels.append([_inner(below[i], below[i + 1]) for i in range(0, len(below), 2)])
    body = SignedRoster(epoch, len(ids), levels[-1][0], b"")
    signed = SignedRoster(epoch, len(ids), body.root, root.sign(body.body()))
    head = bytes((ROSTER_CREDENTIAL,)) + signed.to_bytes()
    out = {}
    for i, p in enumerate(ids):
        path = b"".join(levels[level][(i >> level) ^ 1] for level in range(depth))
        out[p] = head + struct.pack(">I", i) + members[p] + bytes((depth,)) + path
    return signed, out


def with_certificates(keys: dict[int, PeerKeys], certificates: Mapping[str, bytes]) -> dict[int, PeerKeys]:
    """``keys`` (a server's signed keys by vertex) as shown to a client that advertised a
    certificate or a raw key, not a roster credential: each roster credential replaced by
    the owner's certificate from ``certificates`` where there is one (``keys`` itself when
    nothing changes). Such a client may not read rosters (the native device client treats
    a roster credential as absent). The credential is outside the owner's signature and
    both kinds are the root's word for the same key: the swap changes what the recipient
    checks, not what it trusts; a wrong certificate fails its check like a wrong path."""
    out = keys
    for j, pk in keys.items():
        cert = certificates.get(pk.node) if is_roster_credential(pk.credential) else None
        if cert:
            if out is keys:
                out = dict(keys)
            out[j] = dataclasses.replace(pk, credential=cert)
    return out


class RosterCache:
    """The rosters whose root signature one holder (a client, a server) has checked,
    keyed by their bytes; it keeps the newest ``keep`` epochs' worth."""

    def __init__(self, keep: int = 4) -> None:
        self._checked: dict[tuple[bytes, bytes], SignedRoster] = {}  # (root key, roster bytes)
        # Per checked roster, the tree nodes a verified path went through and their
        # siblings, by (level, position): each leads to the signed root (SHA-256 being
        # collision resistant), so a later path that reaches one of them is proven there
        # (neighbours' paths share their upper levels); one that meets another value
        # there is refused.
        self._proven: dict[tuple[bytes, bytes], dict[tuple[int, int], bytes]] = {}
        self._keep = keep
        self.signatures_checked = 0  # measurement

    def identity_key(self, credential: bytes, node: str, root_public_key: bytes | None,
                     min_epoch: int = 0) -> bytes:
        """The identity key a roster credential proves for ``node``, checked against the
        root key (None: taken on its word, as with an unchecked certificate).
        Raises :class:`ForgedRoster`, :class:`NotInRoster`, :class:`StaleRoster` or
        :class:`RosterError` (malformed)."""
        fixed = 1 + ROSTER_BYTES + 4 + PUBLIC_KEY_BYTES + 1
        if len(credential) < fixed or credential[0] != ROSTER_CREDENTIAL:
            raise RosterError("not a roster credential (version 2)")
        raw = credential[1:1 + ROSTER_BYTES]
        (index,) = struct.unpack(">I", credential[1 + ROSTER_BYTES:5 + ROSTER_BYTES])
        key = credential[5 + ROSTER_BYTES:5 + ROSTER_BYTES + PUBLIC_KEY_BYTES]
        depth = credential[fixed - 1]
        path = credential[fixed:]
        if root_public_key is None:
            return key
        roster = self._checked.get((root_public_key, raw)) or SignedRoster.from_bytes(raw)
        if roster.epoch < min_epoch:
            raise StaleRoster(f"roster epoch {roster.epoch} is older than epoch {min_epoch}, the newest this "
                              "client holds: a device dropped since could use it; the root must issue fresh paths")
        if (root_public_key, raw) not in self._checked:
            try:
                verify_signature(root_public_key, roster.body(), roster.signature)
            except CertificateError:
                raise ForgedRoster(f"the roster of epoch {roster.epoch} is not signed by this root") from None
            self.signatures_checked += 1
            self._remember(root_public_key, raw, roster)
        if depth != roster.depth or depth > MAX_DEPTH or len(path) != 32 * depth or index >= roster.size:
            raise NotInRoster(f"a Merkle path of depth {depth} at leaf {index} does not fit a roster of "
                              f"{roster.size} members")
        proven = self._proven.setdefault((root_public_key, raw), {(depth, 0): roster.root})
        h = roster_leaf(node, key)
        seen = []
        for level in range(depth + 1):
            known = proven.get((level, index >> level))
            if known is not None:
                if known != h:
                    break
                proven.update(seen)  # the path below the known node is proven too
                return key
            if level == depth:
                break
            sibling = path[32 * level:32 * level + 32]
            seen += (((level, index >> level), h), ((level, (index >> level) ^ 1), sibling))
            h = _inner(sibling, h) if (index >> level) & 1 else _inner(h, sibling)
        raise NotInRoster(f"the roster of epoch {roster.epoch} does not hold this identity key for {node!r}")

    def _remember(self, root_public_key: bytes, raw: bytes, roster: SignedRoster) -> None:
        self._checked[(root_public_key, raw)] = roster
        if len(self._checked) > self._keep:
            oldest = min(self._checked, key=lambda k: self._checked[k].epoch)
            del self._checked[oldest]
            self._proven.pop(oldest, None)
