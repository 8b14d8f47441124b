"""Credentials: enrollment tokens for nodes, an admin token for operators.

Tokens travel as ``authorization: Bearer <token>`` metadata and are stored only as
sha256 hashes. A root checks them against its store; an aggregator asks its upstream
(``Fleet.VerifyToken``) and caches the answer, so tokens are issued in one place.
"""

from __future__ import annotations

import hmac
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Protocol

from orchard.errors import AuthError
from orchard.server.store import Store, hash_token
from orchard.typing import Role


def bearer_token(metadata: Sequence[tuple[str, str | bytes]] | None) -> str | None:
    for k, v in metadata or ():
        if k.lower() == "authorization":
            s = v.decode() if isinstance(v, bytes) else v
            if s.startswith("Bearer "):
                return s[len("Bearer "):].strip()
    return None


class Authenticator(Protocol):
    """Checks a node's enrollment token; returns the token hash that identifies it."""

    async def verify(self, token: str | None, role: Role) -> str: ...

    def admin_ok(self, token: str | None) -> bool: ...


class OpenEnrollment(Authenticator):
    """``--insecure`` loopback development: anyone may join, no admin token."""

    async def verify(self, token: str | None, role: Role) -> str:
        return hash_token(token or "open-enrollment")

    def admin_ok(self, token: str | None) -> bool:
        return True


class StoreAuthenticator(Authenticator):
    """The root: tokens issued with ``orchard tokens issue`` into the same data dir."""

    def __init__(self, store: Store, admin_token_hash: str) -> None:
        self.store = store
        self.admin_hash = admin_token_hash

    async def verify(self, token: str | None, role: Role) -> str:
        if not token:
            raise AuthError("no enrollment token: pass --token (issue one with `orchard tokens issue`)")
        h = hash_token(token)
        got = self.store.token_role(h)
        if got is None:
            raise AuthError("unknown or revoked enrollment token")
        if got != role.value:
            raise AuthError(f"this token enrolls a {got}, not a {role.value}")
        return h

    def admin_ok(self, token: str | None) -> bool:
        return bool(token) and hmac.compare_digest(hash_token(token or ""), self.admin_hash)


class UpstreamAuthenticator(Authenticator):
    """An aggregator: asks its upstream whether a token is valid and caches the answer."""

    def __init__(self, ask: Callable[[str, Role], Awaitable[bool]], ttl_s: float = 300.0) -> None:
        self._ask = ask
        self._ttl = ttl_s
        self._cache: dict[tuple[str, Role], tuple[bool, float]] = {}

    async def verify(self, token: str | None, role: Role) -> str:
        if not token:
            raise AuthError("no enrollment token: pass --token (issue one at the root with `orchard tokens issue`)")
        h = hash_token(token)
        hit = self._cache.get((h, role))
        now = time.monotonic()
        if hit is None or now - hit[1] > self._ttl:
            ok = await self._ask(token, role)
            self._cache[(h, role)] = (ok, now)
            if len(self._cache) > 100_000:  # bounded: drop the oldest half
                for k in sorted(self._cache, key=lambda k: self._cache[k][1])[:50_000]:
                    del self._cache[k]
        elif not hit[0]:
            raise AuthError("unknown or revoked enrollment token")
        if not self._cache[(h, role)][0]:
            raise AuthError("unknown or revoked enrollment token (checked with the root)")
        return h

    def admin_ok(self, token: str | None) -> bool:
        return False  # operators talk to the root
