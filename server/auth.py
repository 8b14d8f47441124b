"""Credentials: enrollment tokens and device credentials for nodes, an admin token for
operators (docs/operating.md, "Device credentials").

Tokens travel as ``authorization: Bearer <token>`` metadata and are stored only as
sha256 hashes. A node enrolls once: its first Join presents an enrollment token with
its new Ed25519 public key and a proof that it holds the private key; the root
certifies the key for the node id and answers with the node's own credential, which
the node presents from then on. A credential authenticates one node id only.

The root (:class:`StoreAuthenticator`) decides everything against its store, on every
call, so a revocation written into the store holds at the root's next call. An
aggregator (:class:`UpstreamAuthenticator`) forwards every Join to the root and asks
it about credentials (``Fleet.VerifyToken``), keeping an answer for ``ttl_s`` (5 s):
a revoked credential is refused below an aggregator at most that long after the root
learned of it. While the root cannot be reached, the last positive answer is kept for
up to ``stale_s`` (300 s), so a root restart does not cut off every client.
"""

from __future__ import annotations

import hmac
import time
import uuid
from collections.abc import Awaitable, Callable, Sequence
from typing import Protocol

from orchard.errors import AuthError
from orchard.identity import (
    PUBLIC_KEY_BYTES,
    CertificateError,
    Enrollment,
    UpstreamUnavailable,
    certify,
    enrollment_message,
    verify_signature,
)
from orchard.server.rosterbook import RosterBook
from orchard.server.store import Store, hash_token, new_token
from orchard.typing import Role


def bearer_token(metadata: Sequence[tuple[str, str | bytes]] | None) -> str | None:
    for k, v in metadata or ():
        if k.lower() == "authorization":
            s = v.decode() if isinstance(v, bytes) else v
            if s.startswith("Bearer "):
                return s[len("Bearer "):].strip()
    return None


class Authenticator(Protocol):
    """Checks a node's token or credential; returns the hash that identifies it."""

    async def verify(self, token: str | None, role: Role, node_id: str = "") -> str: ...

    async def enroll(self, token: str | None, role: Role, node_id: str, public_key: bytes = b"",
                     key_proof: bytes = b"") -> Enrollment: ...

    def certificate(self, node_id: str) -> bytes | None:
        """The node's certificate, if it is enrolled and not revoked (as far as this tier knows)."""
        ...

    async def roster_credential(self, token: str | None, node_id: str) -> bytes:
        """The client's credential in the root's current signed roster
        (:mod:`orchard.server.rosterbook`), the root's bytes; b"" if it has none. ``token``:
        the credential the client authenticated this call with (a tier below the root asks
        the root with it)."""
        ...

    def admin_ok(self, token: str | None) -> bool: ...


class OpenEnrollment(Authenticator):
    """``--insecure`` loopback development: anyone may join, no admin token, no credentials."""

    async def verify(self, token: str | None, role: Role, node_id: str = "") -> str:
        return hash_token(token or "open-enrollment")

    async def enroll(self, token: str | None, role: Role, node_id: str, public_key: bytes = b"",
                     key_proof: bytes = b"") -> Enrollment:
        return Enrollment(node_id, hash_token(token or "open-enrollment"))

    def certificate(self, node_id: str) -> bytes | None:
        return None

    async def roster_credential(self, token: str | None, node_id: str) -> bytes:
        return b""

    def admin_ok(self, token: str | None) -> bool:
        return True


def _a(role: str) -> str:
    """``role`` with its article: "a client", "an aggregator"."""
    return f"{'an' if role[:1] in 'aeiou' else 'a'} {role}"


REVOKED = "revoked: ask the operator for a new enrollment token (`orchard tokens issue --count 1`)"


class StoreAuthenticator(Authenticator):
    """The root: tokens issued with ``orchard tokens issue`` into the same data dir, and the
    credentials and certificates it gave enrolled nodes."""

    def __init__(self, store: Store, admin_token_hash: str, clock: Callable[[], float] = time.time) -> None:
        self.store = store
        self.admin_hash = admin_token_hash
        self._clock = clock
        self.rosters = RosterBook(store, clock)

    @property
    def root_public_key(self) -> bytes:
        return self.store.signing_key().public_key

    async def verify(self, token: str | None, role: Role, node_id: str = "") -> str:
        if not token:
            raise AuthError("no enrollment token: pass --token (issue one with `orchard tokens issue`)")
        h = hash_token(token)
        dev = self.store.device_by_credential(h)
        if dev is not None:
            if dev.revoked:
                raise AuthError(f"node {dev.node_id!r}'s credential is {REVOKED}")
            if dev.role != role.value:
                raise AuthError(f"this credential is node {dev.node_id!r}'s, enrolled as {_a(dev.role)}; it cannot "
                                f"act as {_a(role.value)}")
            if node_id and node_id != dev.node_id:
                raise AuthError(f"this credential is node {dev.node_id!r}'s; it cannot act as {node_id!r}")
            return h
        tok = self.store.token(h)
        if tok is None or tok.revoked:
            raise AuthError("unknown or revoked enrollment token")
        if tok.role != role.value:
            raise AuthError(f"this is {_a(tok.role)}'s enrollment token, not {_a(role.value)}'s: it enrolls "
                            f"{_a(tok.role)} only; {_a(role.value)} needs a token issued with `orchard tokens issue "
                            f"--role {role.value}`")
        if tok.kind == "device":
            if tok.spent:
                raise AuthError(f"this enrollment token was exchanged for node {tok.node_id!r}'s credential; "
                                "that node authenticates with its credential (kept in its data dir)")
            if node_id and tok.node_id and node_id != tok.node_id:
                raise AuthError(f"this enrollment token is bound to node {tok.node_id!r}; it cannot act as "
                                f"{node_id!r}")
        elif node_id:
            dev = self.store.device(node_id)
            if dev is not None and not dev.revoked:
                raise AuthError(f"node {node_id!r} is enrolled and authenticates with its own credential")
        return h

    async def enroll(self, token: str | None, role: Role, node_id: str, public_key: bytes = b"",
                     key_proof: bytes = b"") -> Enrollment:
        if not token:
            raise AuthError("no enrollment token: pass --token (issue one with `orchard tokens issue`)")
        h = hash_token(token)
        dev = self.store.device_by_credential(h)
        if dev is not None:  # an enrolled node joins again with its credential
            await self.verify(token, role, node_id)
            if public_key and public_key != dev.public_key:
                raise AuthError(f"node {dev.node_id!r}'s credential was issued to another device key")
            return Enrollment(dev.node_id, h, "", dev.certificate, self.root_public_key)
        tok = self.store.token(h)
        asked = node_id
        # A spent device token may enroll its own node again if that node proves it holds
        # the key it enrolled (the reply to its first Join was lost): a new credential
        # replaces the one it never received.
        rekey = (tok is not None and tok.kind == "device" and tok.spent and not tok.revoked
                 and tok.role == role.value and bool(public_key) and asked in ("", tok.node_id))
        if not rekey:
            await self.verify(token, role)  # the token itself: known, not revoked, this role, not spent
        assert tok is not None
        if tok.kind == "device" and tok.node_id and asked and asked != tok.node_id:
            raise AuthError(f"this enrollment token is bound to node {tok.node_id!r}; it cannot act as {asked!r}")
        node_id = asked or tok.node_id or f"{role.value}-{uuid.uuid4().hex[:12]}"
        prev = self.store.device(node_id)
        if prev is not None and not prev.revoked and not rekey:
            raise AuthError(f"node id {node_id!r} is enrolled and authenticates with its own credential; pick "
                            f"another id, or revoke it first (`orchard tokens revoke --node {node_id}`)")
        if not public_key:  # an older node: its token authenticates it, bound to this node id
            if tok.kind == "device":
                self.store.bind_token(h, node_id)
            return Enrollment(node_id, h)
        if len(public_key) != PUBLIC_KEY_BYTES:
            raise AuthError(f"a device key is {PUBLIC_KEY_BYTES} bytes (Ed25519), got {len(public_key)}")
        try:
            verify_signature(public_key, enrollment_message(role.value, asked, token), key_proof)
        except CertificateError:
            raise AuthError("the enrollment's key proof does not verify: the node must sign "
                            "orchard.identity.enrollment_message(role, node_id, token) with its key") from None
        if rekey and (prev is None or prev.revoked or prev.public_key != public_key):
            raise AuthError(f"this enrollment token was exchanged for node {tok.node_id!r}'s credential; "
                            "that node authenticates with its credential (kept in its data dir)")
        credential = "orc_dev_" + new_token()[len("orc_"):]
        cert = certify(self.store.signing_key(), node_id, public_key, int(self._clock()))
        self.store.enroll_device(node_id, role.value, hash_token(credential), public_key, cert, tok.token_id)
        if tok.kind == "device":
            self.store.bind_token(h, node_id, spent=True)
        self.rosters.changed()
        return Enrollment(node_id, hash_token(credential), credential, cert, self.root_public_key)

    def certificate(self, node_id: str) -> bytes | None:
        dev = self.store.device(node_id)
        return None if dev is None or dev.revoked else dev.certificate

    async def roster_credential(self, token: str | None, node_id: str) -> bytes:
        return self.rosters.credential(node_id)

    def admin_ok(self, token: str | None) -> bool:
        return bool(token) and hmac.compare_digest(hash_token(token or ""), self.admin_hash)


# Asks the upstream about a token or credential (FleetLink.verify_token): the Enrollment
# (the root's answer) or AuthError with the root's reason; UpstreamUnavailable when the
# upstream cannot be reached.
Ask = Callable[..., Awaitable[Enrollment]]


class UpstreamAuthenticator(Authenticator):
    """An aggregator: forwards Joins to its upstream and asks it about credentials,
    keeping each answer for ``ttl_s``; while the upstream cannot be reached, a positive
    answer younger than ``stale_s`` still holds."""

    def __init__(self, ask: Ask, ttl_s: float = 5.0, stale_s: float = 300.0,
                 monotonic: Callable[[], float] = time.monotonic) -> None:
        self._ask = ask
        self.ttl_s = ttl_s
        self.stale_s = stale_s
        self._mono = monotonic
        # (hash, role, node id) -> (refusal or None, when asked)
        self._cache: dict[tuple[str, Role, str], tuple[str | None, float]] = {}
        self._certs: dict[str, bytes] = {}
        self._rosters: dict[str, bytes] = {}  # node id -> the root's roster credential, as it sent it

    def _keep(self, key: tuple[str, Role, str], refusal: str | None, e: Enrollment | None = None) -> None:
        self._cache[key] = (refusal, self._mono())
        if refusal is not None and key[2]:
            self._certs.pop(key[2], None)
            self._rosters.pop(key[2], None)
        if e is not None and e.certificate:
            self._certs[e.node_id] = e.certificate
        if e is not None and e.node_id:
            self._rosters[e.node_id] = e.roster_credential
        if len(self._cache) > 100_000:  # bounded: drop the oldest half
            for k in sorted(self._cache, key=lambda k: self._cache[k][1])[:50_000]:
                del self._cache[k]

    async def verify(self, token: str | None, role: Role, node_id: str = "") -> str:
        if not token:
            raise AuthError("no enrollment token: pass --token (issue one at the root with `orchard tokens issue`)")
        h = hash_token(token)
        key = (h, role, node_id)
        hit = self._cache.get(key)
        now = self._mono()
        if hit is not None and now - hit[1] <= self.ttl_s:
            if hit[0] is not None:
                raise AuthError(hit[0])
            return h
        try:
            e = await self._ask(token, role, node_id=node_id)
        except UpstreamUnavailable:
            if hit is not None and hit[0] is None and now - hit[1] <= self.stale_s:
                return h
            raise
        except AuthError as err:
            self._keep(key, f"{err} (checked with the root)")
            raise AuthError(f"{err} (checked with the root)") from None
        self._keep(key, None, e)
        return h

    async def enroll(self, token: str | None, role: Role, node_id: str, public_key: bytes = b"",
                     key_proof: bytes = b"") -> Enrollment:
        if not token:
            raise AuthError("no enrollment token: pass --token (issue one at the root with `orchard tokens issue`)")
        e = await self._ask(token, role, node_id=node_id, enroll=True, public_key=public_key, key_proof=key_proof)
        self._keep((e.token_hash, role, e.node_id), None, e)
        return e

    def certificate(self, node_id: str) -> bytes | None:
        return self._certs.get(node_id)

    async def roster_credential(self, token: str | None, node_id: str) -> bytes:
        """Asked of the root afresh (uncached: every client of a session then holds the
        root's epoch of that moment, none older than one it held in an earlier session);
        while the root cannot be asked, the last one it sent."""
        if not token:
            return b""
        try:
            e = await self._ask(token, Role.CLIENT, node_id=node_id)
        except UpstreamUnavailable:
            return self._rosters.get(node_id, b"")
        except AuthError:
            return b""
        self._keep((hash_token(token), Role.CLIENT, node_id), None, e)
        return e.roster_credential

    def admin_ok(self, token: str | None) -> bool:
        return False  # operators talk to the root
