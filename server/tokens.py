"""Enrollment tokens and device credentials as the root's store keeps them: the rows
(never a token or credential itself, only its sha256), a token's public id, and the
root's certificate key file. ``orchard.server.store`` re-exports these names."""

from __future__ import annotations

import os
import secrets
import time
from dataclasses import dataclass
from pathlib import Path

from orchard.files import private_dir
from orchard.identity import SigningKey, hash_secret


def hash_token(token: str) -> str:
    return hash_secret(token)


def new_token() -> str:
    return "orc_" + secrets.token_urlsafe(32)


def token_id(token_hash: str) -> str:
    """A token's public name (listing, revoking): the first 12 hex digits of its hash."""
    return token_hash[:12]


@dataclass(frozen=True)
class TokenRow:
    """An enrollment token, as the store knows it (never the token itself)."""

    hash: str
    role: str
    kind: str  # "shared" | "device"
    label: str
    created: float
    revoked: bool
    node_id: str  # a device token: the node it is bound to ('' until first used)
    spent: bool  # a device token: exchanged for its node's credential

    @property
    def token_id(self) -> str:
        return token_id(self.hash)


@dataclass(frozen=True)
class DeviceRow:
    """An enrolled node: its credential (hashed), its certified key, the token that enrolled it."""

    node_id: str
    role: str
    credential_hash: str
    public_key: bytes
    certificate: bytes
    token_id: str
    issued: float
    revoked: bool


@dataclass(frozen=True)
class Revoked:
    """What one revocation covered: token ids and node ids."""

    tokens: tuple[str, ...] = ()
    nodes: tuple[str, ...] = ()


def load_or_create_key(path: Path) -> SigningKey:
    """The Ed25519 key in ``path`` (32 raw bytes, mode 0600, its folder 0700), made if absent."""
    private_dir(path.parent)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        raw = path.read_bytes()
        if len(raw) != 32:  # another process is writing it this instant, or it is damaged
            time.sleep(0.2)
            raw = path.read_bytes()
        return SigningKey.from_bytes(raw)
    key = SigningKey.generate()
    with os.fdopen(fd, "wb") as f:
        f.write(key.to_bytes())
        f.flush()
        os.fsync(f.fileno())
    return key
