"""The native client's connection, through the orchard-device command (which uses only
the C ABI), against a real Orchard root over TLS on port 0: a join with the bundle's CA
and token, and each way it must fail with a status and a message and no crash: a
revoked token, an unknown one, another CA, a server nobody answers at, and a damaged
bundle."""

from __future__ import annotations

import asyncio
import socket
import subprocess
import threading
from collections.abc import Iterator
from pathlib import Path

import device_native
import device_vectors
import pytest

from orchard.config import ServerConfig
from orchard.server.app import TierHandle, start_root
from orchard.server.store import SQLiteStore, hash_token
from orchard.server.tls import init_certs

REASON = device_native.skip_reason()
pytestmark = [pytest.mark.skipif(REASON is not None, reason=REASON or ""), pytest.mark.timeout(1200)]

FAST = ServerConfig(heartbeat_s=1.0, node_timeout_s=5.0, long_poll_s=2.0)
# Status codes of include/orchard_device.h (the command exits with them).
STATUS = {"ORCHARD_OK": 0, "ORCHARD_ERR_BUNDLE": 4, "ORCHARD_ERR_INTEGRITY": 5, "ORCHARD_ERR_AUTH": 8,
          "ORCHARD_ERR_UNAVAILABLE": 11, "ORCHARD_ERR_TLS": 12}


@pytest.fixture(scope="module")
def command() -> Path:
    try:
        return device_native.build("default").path("orchard-device")
    except subprocess.CalledProcessError as err:
        pytest.fail(f"building device/ failed:\n{err.stdout}\n{err.stderr}")


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[TierHandle, Path]]:
    data = tmp_path_factory.mktemp("native-root")
    loop = asyncio.new_event_loop()
    handle = loop.run_until_complete(start_root(data / "root", server_cfg=FAST))
    t = threading.Thread(target=loop.run_forever, daemon=True)
    t.start()
    yield handle, data / "root"
    asyncio.run_coroutine_threadsafe(handle.stop(0.1), loop).result(10)
    loop.call_soon_threadsafe(loop.stop)
    t.join(5)


def _token(data: Path, revoke: bool = False) -> str:
    st = SQLiteStore(data / "orchard.db")
    try:
        tok = st.issue_token("client")
        if revoke:
            assert st.revoke_token(hash_token(tok))
        return tok
    finally:
        st.close()


def _run(command: Path, bundle: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(command), str(bundle), "--attempts", "2", *args], capture_output=True, text=True,
                          timeout=120)


def _bundle(tmp: Path, name: str, address: str, ca: str, token: str) -> Path:
    return device_vectors.connection_bundle(tmp / name, address, ca, token)


def test_join_over_tls_with_the_bundle_token(command: Path, root, tmp_path: Path) -> None:
    handle, data = root
    b = _bundle(tmp_path, "ok", handle.address, Path(handle.ca_cert).read_text(), _token(data))
    res = _run(command, b, "--node-id", "native-7")
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == "joined as native-7"
    assert "native-7" in handle.coordinator.children


@pytest.mark.parametrize("token", ["revoked", "unknown"])
def test_refused_token(command: Path, root, tmp_path: Path, token: str) -> None:
    handle, data = root
    tok = _token(data, revoke=True) if token == "revoked" else "orc_not-a-real-token"
    b = _bundle(tmp_path, token, handle.address, Path(handle.ca_cert).read_text(), tok)
    res = _run(command, b, "--node-id", f"intruder-{token}")
    assert res.returncode == STATUS["ORCHARD_ERR_AUTH"], res.stderr
    assert "ORCHARD_ERR_AUTH" in res.stderr and "token" in res.stderr
    assert f"intruder-{token}" not in handle.coordinator.children


def test_wrong_ca(command: Path, root, tmp_path: Path) -> None:
    handle, data = root
    other_ca = init_certs(tmp_path / "other-tls").ca_cert
    b = _bundle(tmp_path, "wrong-ca", handle.address, Path(other_ca).read_text(), _token(data))
    res = _run(command, b)
    assert res.returncode == STATUS["ORCHARD_ERR_TLS"], res.stderr
    assert "ca.pem" in res.stderr


def test_unreachable_server(command: Path, root, tmp_path: Path) -> None:
    handle, data = root
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    b = _bundle(tmp_path, "unreachable", f"127.0.0.1:{port}", Path(handle.ca_cert).read_text(), _token(data))
    res = _run(command, b)
    assert res.returncode == STATUS["ORCHARD_ERR_UNAVAILABLE"], res.stderr
    assert "unreachable" in res.stderr


def test_damaged_bundle(command: Path, root, tmp_path: Path) -> None:
    handle, data = root
    b = _bundle(tmp_path, "damaged", handle.address, Path(handle.ca_cert).read_text(), _token(data))
    (b / "adapter.safetensors").write_bytes(b"truncated")
    res = _run(command, b)
    assert res.returncode == STATUS["ORCHARD_ERR_INTEGRITY"], res.stderr
    assert "adapter.safetensors has sha256" in res.stderr
