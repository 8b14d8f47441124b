"""``orchard certs init``: a private CA and a server certificate, made with ``cryptography``.

The CA signs one server certificate whose subject alternative names cover the given
hosts (``localhost`` and ``127.0.0.1`` by default). Clients and aggregators trust the CA
file. Every file is written owner-only (``orchard.files``): the keys are secrets, and the
certificates, public as they are, sit in a data dir that is owner-only as a whole (copy
``ca.pem`` to where clients run).
"""

from __future__ import annotations

import datetime as dt
import ipaddress
import logging
import ssl
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from orchard import tlsversion
from orchard.errors import ConfigError
from orchard.files import atomic_write

log = logging.getLogger("orchard.server.tls")


@dataclass(frozen=True)
class TlsPaths:
    ca_cert: Path
    ca_key: Path
    server_cert: Path
    server_key: Path

    @classmethod
    def in_dir(cls, d: str | Path) -> TlsPaths:
        d = Path(d)
        return cls(d / "ca.pem", d / "ca.key", d / "server.pem", d / "server.key")

    def exists(self) -> bool:
        return self.server_cert.is_file() and self.server_key.is_file() and self.ca_cert.is_file()


def init_certs(out: str | Path, hosts: list[str] | None = None, days: int = 825) -> TlsPaths:
    hosts = hosts or ["localhost", "127.0.0.1", "::1"]
    paths = TlsPaths.in_dir(out)
    now = dt.datetime.now(dt.UTC)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "Orchard CA")])
    ca = (x509.CertificateBuilder().subject_name(ca_name).issuer_name(ca_name)
          .public_key(ca_key.public_key()).serial_number(x509.random_serial_number())
          .not_valid_before(now - dt.timedelta(minutes=5)).not_valid_after(now + dt.timedelta(days=days))
          .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
          .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                       content_commitment=False, key_encipherment=False, data_encipherment=False,
                                       key_agreement=False, encipher_only=False, decipher_only=False), critical=True)
          .sign(ca_key, hashes.SHA256()))
    key = ec.generate_private_key(ec.SECP256R1())
    sans: list[x509.GeneralName] = []
    for h in hosts:
        try:
            sans.append(x509.IPAddress(ipaddress.ip_address(h)))
        except ValueError:
            sans.append(x509.DNSName(h))
    cert = (x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, hosts[0])]))
            .issuer_name(ca_name).public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - dt.timedelta(minutes=5)).not_valid_after(now + dt.timedelta(days=days))
            .add_extension(x509.SubjectAlternativeName(sans), critical=False)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
            .sign(ca_key, hashes.SHA256()))
    pem = serialization.Encoding.PEM
    nopw = serialization.NoEncryption()
    pkcs8 = serialization.PrivateFormat.PKCS8
    atomic_write(paths.ca_cert, ca.public_bytes(pem))
    atomic_write(paths.ca_key, ca_key.private_bytes(pem, pkcs8, nopw))
    atomic_write(paths.server_cert, cert.public_bytes(pem))
    atomic_write(paths.server_key, key.private_bytes(pem, pkcs8, nopw))
    return paths


def _check(paths: TlsPaths) -> None:
    if not paths.exists():
        raise ConfigError(f"TLS files missing in {paths.server_cert.parent}: run `orchard certs init --out DIR`")


def server_credentials(paths: TlsPaths):
    """gRPC server credentials: TLS 1.3 only where ``orchard.tlsversion`` holds (it warns here
    when it does not)."""
    import grpc

    _check(paths)
    if not tlsversion.held():
        log.warning("this gRPC server also accepts TLS 1.2: %s (Orchard makes gRPC refuse TLS 1.2 through %s, "
                    "which gRPC reads when it is imported; import orchard first and leave %s unset)",
                    tlsversion.why_not(), tlsversion.ENV, tlsversion.ENV)
    return grpc.ssl_server_credentials([(paths.server_key.read_bytes(), paths.server_cert.read_bytes())])


def https_context(paths: TlsPaths) -> ssl.SSLContext:
    """The server side of an HTTPS listener (the dashboard): TLS 1.3 only."""
    _check(paths)
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_3
    ctx.load_cert_chain(str(paths.server_cert), str(paths.server_key))
    return ctx
