"""Device identity: a node's long-term Ed25519 key, the root's certificate binding it to
a node id, and where a node keeps both with its credential.

Every node (client or aggregator) generates its key on first join and never sends the
private half anywhere. At enrollment the root signs

    certificate = 0x01 || u16 len(node_id) || node_id (UTF-8) || public key (32 bytes)
                  || u64 issued (unix seconds) || Ed25519 signature (64 bytes)

the signature being over ``CERT_DOMAIN`` followed by every byte before it (integers
big-endian). :func:`verify_certificate` checks one against the root's public key and
says which node id and device key it binds. The root ships its public key in every
JoinReply of an enrolled node and in client bundles; a peer that holds it can check
another node's certificate without asking anyone. A certificate does not expire and
says nothing of revocation: whoever hands one out (the root, an aggregator) hands out
only those of devices that are not revoked.

A node proves it holds its key when it enrolls, by signing
:func:`enrollment_message`, so a root never certifies a key for someone who merely
copied it from a certificate.

:class:`NodeIdentity` keeps the key and what enrollment returned (node id, credential,
certificate, root key) in a directory of the node's data dir: the directory mode 0700,
each file mode 0600, written whole (temp file, fsync, rename).
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import struct
from dataclasses import dataclass, replace
from pathlib import Path

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from orchard.errors import AuthError
from orchard.files import DIR_MODE, atomic_write

CERT_VERSION = 1
CERT_DOMAIN = b"orchard/device-certificate/v1\x00"
ENROLL_DOMAIN = b"orchard/enroll/v1\x00"
PUBLIC_KEY_BYTES = 32
SIGNATURE_BYTES = 64


class CertificateError(AuthError):
    """A certificate or signature that does not verify, and why."""


class UpstreamUnavailable(AuthError):
    """The root could not be asked (it restarts, the network is gone): try again."""


@dataclass(frozen=True)
class Enrollment:
    """A Join's answer: the node id, the hash it authenticates with from now on (what the
    tier binds the node id to) and, when the node's key was certified, its credential
    (``credential``: only when just issued), certificate and the root's public key."""

    node_id: str
    token_hash: str
    credential: str = ""
    certificate: bytes = b""
    root_public_key: bytes = b""
    roster_credential: bytes = b""  # a client's, in the root's current signed roster (an aggregator's answer)


def hash_secret(secret: str) -> str:
    """sha256 hex of a token or credential: all a server ever stores of one."""
    return hashlib.sha256(secret.encode()).hexdigest()


class SigningKey:
    """An Ed25519 private key: a device's identity key, or the root's certificate key."""

    def __init__(self, key: Ed25519PrivateKey) -> None:
        self._key = key
        self.public_key: bytes = key.public_key().public_bytes(serialization.Encoding.Raw,
                                                               serialization.PublicFormat.Raw)

    @classmethod
    def generate(cls) -> SigningKey:
        return cls(Ed25519PrivateKey.generate())

    @classmethod
    def from_bytes(cls, raw: bytes) -> SigningKey:
        if len(raw) != 32:
            raise CertificateError(f"an Ed25519 private key is 32 bytes, got {len(raw)}")
        return cls(Ed25519PrivateKey.from_private_bytes(raw))

    def to_bytes(self) -> bytes:
        return self._key.private_bytes(serialization.Encoding.Raw, serialization.PrivateFormat.Raw,
                                       serialization.NoEncryption())

    def sign(self, message: bytes) -> bytes:
        """The 64-byte Ed25519 signature of ``message``. Callers put a domain tag of
        their own at the start of what they sign, so a signature made for one purpose
        is never valid for another."""
        return self._key.sign(message)


def verify_signature(public_key: bytes, message: bytes, signature: bytes) -> None:
    """Raise CertificateError unless ``signature`` is ``public_key``'s over ``message``."""
    if len(public_key) != PUBLIC_KEY_BYTES:
        raise CertificateError(f"an Ed25519 public key is {PUBLIC_KEY_BYTES} bytes, got {len(public_key)}")
    try:
        Ed25519PublicKey.from_public_bytes(public_key).verify(signature, message)
    except InvalidSignature:
        raise CertificateError("the signature does not verify under this public key") from None


@dataclass(frozen=True)
class Certificate:
    """What a verified certificate says: this node id holds this device key (since ``issued``)."""

    node_id: str
    public_key: bytes
    issued: int


def _body(node_id: str, public_key: bytes, issued: int) -> bytes:
    node = node_id.encode()
    if not node or len(node) > 0xFFFF:
        raise CertificateError(f"a certificate names a node id of 1 to 65535 bytes, got {len(node)}")
    if len(public_key) != PUBLIC_KEY_BYTES:
        raise CertificateError(f"a device key is {PUBLIC_KEY_BYTES} bytes, got {len(public_key)}")
    return struct.pack(">BH", CERT_VERSION, len(node)) + node + public_key + struct.pack(">Q", issued)


def certify(root: SigningKey, node_id: str, public_key: bytes, issued: int) -> bytes:
    """The root's certificate binding ``public_key`` to ``node_id``."""
    body = _body(node_id, public_key, issued)
    return body + root.sign(CERT_DOMAIN + body)


def verify_certificate(cert: bytes, root_public_key: bytes, node_id: str | None = None) -> Certificate:
    """The node id and device key ``cert`` binds, if the root holding ``root_public_key``
    signed it (and, given ``node_id``, if it names that node); else CertificateError."""
    if len(cert) < 3 + PUBLIC_KEY_BYTES + 8 + SIGNATURE_BYTES or cert[0] != CERT_VERSION:
        raise CertificateError("not an Orchard device certificate (version 1)")
    (n,) = struct.unpack(">H", cert[1:3])
    if len(cert) != 3 + n + PUBLIC_KEY_BYTES + 8 + SIGNATURE_BYTES:
        raise CertificateError("a device certificate of the wrong length")
    body, sig = cert[:-SIGNATURE_BYTES], cert[-SIGNATURE_BYTES:]
    try:
        verify_signature(root_public_key, CERT_DOMAIN + body, sig)
    except CertificateError:
        raise CertificateError("the certificate is not signed by this root") from None
    try:
        got = body[3:3 + n].decode()
    except UnicodeDecodeError:
        raise CertificateError("the certificate's node id is not UTF-8") from None
    pk = body[3 + n:3 + n + PUBLIC_KEY_BYTES]
    (issued,) = struct.unpack(">Q", body[3 + n + PUBLIC_KEY_BYTES:])
    if node_id is not None and got != node_id:
        raise CertificateError(f"the certificate is node {got!r}'s, not {node_id!r}'s")
    return Certificate(got, pk, issued)


def enrollment_message(role: str, node_id: str, token: str) -> bytes:
    """What a node signs with its new key when it enrolls: the role and node id it asks
    for and the hash of the token it presents, so the proof is good for that request only."""
    return ENROLL_DOMAIN + role.encode() + b"\x00" + node_id.encode() + b"\x00" + hash_secret(token).encode()


# ---------------------------------------------------------------- the node's side, on disk


@dataclass(frozen=True)
class Enrolled:
    """What enrollment gave a node: its id, its credential, its certificate, the root's key."""

    node_id: str
    credential: str
    certificate: bytes
    root_public_key: bytes


class NodeIdentity:
    """A node's key and enrollment, kept in ``directory`` (None: in memory only, for this
    process; a restarted node then needs a new enrollment token)."""

    KEY_FILE = "device.key"
    ENROLLED_FILE = "credential.json"

    def __init__(self, directory: str | Path | None = None) -> None:
        self.directory = Path(directory) if directory is not None else None
        self.key: SigningKey
        self.enrolled: Enrolled | None = None
        if self.directory is None:
            self.key = SigningKey.generate()
            return
        key_path = self.directory / self.KEY_FILE
        if key_path.is_file():
            self.key = SigningKey.from_bytes(key_path.read_bytes())
        else:
            # The key is on disk before it is ever sent: an enrollment is never made for a
            # key the node could lose by crashing before it saved it.
            self.key = SigningKey.generate()
            self._write(self.KEY_FILE, self.key.to_bytes())
        enrolled = self.directory / self.ENROLLED_FILE
        if enrolled.is_file():
            d = json.loads(enrolled.read_text())
            self.enrolled = Enrolled(d["node_id"], d["credential"], base64.b64decode(d["certificate"]),
                                     base64.b64decode(d["root_public_key"]))

    @property
    def public_key(self) -> bytes:
        return self.key.public_key

    def sign(self, message: bytes) -> bytes:
        """This device's signature of ``message`` (see :meth:`SigningKey.sign`)."""
        return self.key.sign(message)

    def save(self, enrolled: Enrolled) -> None:
        """Keep what enrollment returned (the credential is shown to the node only once)."""
        if enrolled.certificate and enrolled.root_public_key:
            cert = verify_certificate(enrolled.certificate, enrolled.root_public_key, enrolled.node_id)
            if cert.public_key != self.public_key:
                raise CertificateError("the root certified another key than this device's")
        self.enrolled = enrolled
        if self.directory is not None:
            self._write(self.ENROLLED_FILE, json.dumps({
                "node_id": enrolled.node_id, "credential": enrolled.credential,
                "certificate": base64.b64encode(enrolled.certificate).decode(),
                "root_public_key": base64.b64encode(enrolled.root_public_key).decode()}).encode())

    def refresh(self, certificate: bytes, root_public_key: bytes) -> None:
        """A later Join's certificate and root key (the credential is unchanged)."""
        if self.enrolled is not None and certificate and (certificate, root_public_key) != (
                self.enrolled.certificate, self.enrolled.root_public_key):
            self.save(replace(self.enrolled, certificate=certificate, root_public_key=root_public_key))

    def forget(self) -> None:
        """Drop the enrollment (revoked): the key stays, a new token enrolls it again."""
        self.enrolled = None
        if self.directory is not None:
            (self.directory / self.ENROLLED_FILE).unlink(missing_ok=True)

    def _write(self, name: str, data: bytes) -> None:
        assert self.directory is not None
        if self.directory.is_dir():
            os.chmod(self.directory, DIR_MODE)  # it holds the private key: owner-only even if found open
        atomic_write(self.directory / name, data)
