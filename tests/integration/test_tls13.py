"""TLS 1.3 only: a client that offers TLS 1.2 at most is refused by the gRPC port and the
dashboard, and Orchard's own channels do not offer TLS 1.2."""

from __future__ import annotations

import asyncio
import socket
import ssl
import subprocess
import sys
import threading
from pathlib import Path

import grpc
import pytest

from orchard import tlsversion
from orchard.server.app import start_root
from orchard.server.tls import init_certs


def handshake(port: int, ca: Path, version: ssl.TLSVersion) -> str:
    """The TLS version a client offering ``version`` at most gets from ``port``."""
    ctx = ssl.create_default_context(cafile=str(ca))
    ctx.maximum_version = version
    ctx.set_alpn_protocols(["h2", "http/1.1"])
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s, \
            ctx.wrap_socket(s, server_hostname="localhost") as t:
        return str(t.version())


def test_servers_refuse_a_client_that_offers_tls_1_2(tmp_path: Path) -> None:
    assert tlsversion.held(), tlsversion.why_not()

    async def main() -> None:
        root = await start_root(tmp_path / "root", dashboard_port=0)
        ca = Path(root.ca_cert)  # type: ignore[arg-type]
        try:
            for port in (root.port, root.dashboard.port):
                with pytest.raises(ssl.SSLError):
                    await asyncio.to_thread(handshake, port, ca, ssl.TLSVersion.TLSv1_2)
                assert await asyncio.to_thread(handshake, port, ca, ssl.TLSVersion.TLSv1_3) == "TLSv1.3"
        finally:
            await root.stop(0)

    asyncio.run(main())


def test_our_channels_do_not_offer_tls_1_2(tmp_path: Path) -> None:
    """A server that speaks TLS 1.2 at most: an Orchard process's gRPC channel cannot
    complete a handshake with it."""
    paths = init_certs(tmp_path / "tls")
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ctx.maximum_version = ssl.TLSVersion.TLSv1_2
    ctx.set_alpn_protocols(["h2"])
    ctx.load_cert_chain(str(paths.server_cert), str(paths.server_key))
    errors: list[str] = []
    with socket.create_server(("127.0.0.1", 0)) as srv:
        srv.settimeout(10)

        def serve_one() -> None:
            try:
                conn, _ = srv.accept()
            except OSError as err:
                errors.append(f"accept: {err}")
                return
            with conn:
                try:
                    ctx.wrap_socket(conn, server_side=True).close()
                    errors.append("handshake completed")
                except ssl.SSLError as err:
                    errors.append(str(err))

        t = threading.Thread(target=serve_one, daemon=True)
        t.start()
        port = srv.getsockname()[1]
        ch = grpc.secure_channel(f"localhost:{port}", grpc.ssl_channel_credentials(paths.ca_cert.read_bytes()))
        try:
            with pytest.raises(grpc.FutureTimeoutError):
                grpc.channel_ready_future(ch).result(timeout=3)
        finally:
            ch.close()
        t.join(10)
    assert errors and "handshake completed" not in errors[0], errors


def test_it_holds_only_when_orchard_comes_before_grpc() -> None:
    def held(code: str, env: dict[str, str] | None = None) -> str:
        import os

        e = {k: v for k, v in os.environ.items() if k != tlsversion.ENV}
        e.update(env or {})
        return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=e, timeout=60,
                              check=True).stdout.strip()

    probe = "from orchard import tlsversion as t; print(t.held(), t.why_not() if not t.held() else '')"
    assert held(probe) == "True"
    assert held("import grpc\n" + probe) == "False grpc was imported before orchard"
    assert held(probe, {tlsversion.ENV: "ECDHE-ECDSA-AES128-GCM-SHA256"}).startswith(
        f"False {tlsversion.ENV} is set to 'ECDHE-ECDSA-AES128-GCM-SHA256'")
