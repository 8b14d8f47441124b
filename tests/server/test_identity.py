"""Device identity keys and the root's certificates (orchard.identity): what verifies,
what does not, and how a node keeps them on disk."""

from __future__ import annotations

import stat
from pathlib import Path

import pytest

from orchard.identity import (
    CertificateError,
    Enrolled,
    NodeIdentity,
    SigningKey,
    certify,
    verify_certificate,
    verify_signature,
)


def test_a_certificate_binds_a_node_id_to_a_device_key() -> None:
    root, device = SigningKey.generate(), SigningKey.generate()
    cert = certify(root, "client-7", device.public_key, 1_700_000_000)
    got = verify_certificate(cert, root.public_key)
    assert (got.node_id, got.public_key, got.issued) == ("client-7", device.public_key, 1_700_000_000)
    assert verify_certificate(cert, root.public_key, "client-7") == got


def test_a_certificate_for_another_node_id_is_refused() -> None:
    root, device = SigningKey.generate(), SigningKey.generate()
    cert = certify(root, "client-7", device.public_key, 1)
    with pytest.raises(CertificateError, match="node 'client-7'"):
        verify_certificate(cert, root.public_key, "client-8")


def test_a_forged_certificate_is_refused() -> None:
    root, mallory, device = SigningKey.generate(), SigningKey.generate(), SigningKey.generate()
    # Signed by a key that is not the root's.
    with pytest.raises(CertificateError, match="not signed by this root"):
        verify_certificate(certify(mallory, "client-7", device.public_key, 1), root.public_key)
    # The root's certificate with another node id (same length) or another key put in.
    cert = certify(root, "client-7", device.public_key, 1)
    renamed = cert.replace(b"client-7", b"client-8")
    rekeyed = cert.replace(device.public_key, mallory.public_key)
    later = cert[:-72] + (2).to_bytes(8, "big") + cert[-64:]
    for bad in (renamed, rekeyed, later):
        with pytest.raises(CertificateError, match="not signed by this root"):
            verify_certificate(bad, root.public_key)
    for junk in (b"", cert[:-1], cert + b"\x00", b"\x02" + cert[1:]):
        with pytest.raises(CertificateError):
            verify_certificate(junk, root.public_key)


def test_a_device_signs_and_its_certified_key_verifies() -> None:
    root, ident = SigningKey.generate(), NodeIdentity()
    cert = verify_certificate(certify(root, "n", ident.public_key, 1), root.public_key)
    sig = ident.sign(b"advertise keys, round 3")
    verify_signature(cert.public_key, b"advertise keys, round 3", sig)
    with pytest.raises(CertificateError):
        verify_signature(cert.public_key, b"advertise keys, round 4", sig)
    with pytest.raises(CertificateError):
        verify_signature(SigningKey.generate().public_key, b"advertise keys, round 3", sig)


def test_a_node_keeps_its_key_and_credential_owner_only(tmp_path: Path) -> None:
    d = tmp_path / "state" / "identity"
    ident = NodeIdentity(d)
    assert ident.enrolled is None
    root = SigningKey.generate()
    cert = certify(root, "client-1", ident.public_key, 5)
    ident.save(Enrolled("client-1", "orc_dev_secret", cert, root.public_key))
    assert stat.S_IMODE(d.stat().st_mode) == 0o700
    for f in d.iterdir():
        assert stat.S_IMODE(f.stat().st_mode) == 0o600, f
    again = NodeIdentity(d)  # a restart resumes the same node
    assert again.public_key == ident.public_key and again.enrolled == ident.enrolled
    assert again.sign(b"m") == ident.sign(b"m")  # Ed25519 is deterministic: the same key
    again.forget()
    assert NodeIdentity(d).enrolled is None and NodeIdentity(d).public_key == ident.public_key


def test_a_node_refuses_a_certificate_of_another_key(tmp_path: Path) -> None:
    ident, other, root = NodeIdentity(tmp_path / "id"), SigningKey.generate(), SigningKey.generate()
    with pytest.raises(CertificateError, match="another key"):
        ident.save(Enrolled("n", "c", certify(root, "n", other.public_key, 1), root.public_key))
    assert ident.enrolled is None and not (tmp_path / "id" / NodeIdentity.ENROLLED_FILE).exists()
