"""`orchard server start` as an outsider meets it: what it prints (never the admin token),
what 200 junk connections to its TLS port write to its log (one line, not 200), which
TLS versions its ports speak, and the modes of every path it creates."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import ssl
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from test_file_modes import modes, open_to_others
from test_tls13 import handshake

JUNK = 200


def junk(port: int, ca: Path, n: int) -> None:
    """``n`` connections that fail their TLS handshake: random bytes, plain HTTP, and a
    client that offers TLS 1.2 at most."""
    for i in range(n):
        kind = i % 3
        if kind == 2:
            with pytest.raises(ssl.SSLError):
                handshake(port, ca, ssl.TLSVersion.TLSv1_2)
            continue
        with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
            s.sendall(os.urandom(64) if kind == 0 else b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
            try:
                while s.recv(4096):
                    pass
            except OSError:
                pass


@pytest.fixture(scope="module")
def outsider(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Start a root by its command, probe it from outside, stop it; what was seen."""
    tmp = tmp_path_factory.mktemp("root-process")
    data = tmp / "root-data"
    out, err = open(tmp / "stdout", "wb"), open(tmp / "stderr", "wb")  # noqa: SIM115 - closed below
    env = {k: v for k, v in os.environ.items() if k not in ("GRPC_SSL_CIPHER_SUITES", "GRPC_VERBOSITY")}
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    proc = subprocess.Popen([sys.executable, "-m", "orchard.cli", "server", "start", "--data-dir", str(data),
                             "--port", "0", "--dashboard-port", "0"], stdout=out, stderr=err, env=env,
                            start_new_session=True)
    seen: dict[str, Any] = {"data": data}
    try:
        end = time.monotonic() + 120
        while not (data / "server.json").is_file():
            assert proc.poll() is None and time.monotonic() < end, (tmp / "stderr").read_text()[-3000:]
            time.sleep(0.1)
        info = json.loads((data / "server.json").read_text())
        ca = Path(info["ca_cert"])
        dash_port = int(info["dashboard"].rsplit(":", 1)[1].strip("/"))
        seen["tls"] = {name: {v.name: _version(port, ca, v) for v in (ssl.TLSVersion.TLSv1_2, ssl.TLSVersion.TLSv1_3)}
                       for name, port in (("grpc", info["port"]), ("dashboard", dash_port))}
        junk(info["port"], ca, JUNK)
        junk(dash_port, ca, 20)
        seen["modes"] = modes(data)  # while the store is open: its -wal and -shm are there
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        out.close()
        err.close()
    seen["rc"] = proc.returncode
    seen["output"] = (tmp / "stdout").read_text() + (tmp / "stderr").read_text()
    seen["token"] = (data / "admin.token").read_text().strip()
    return seen


def _version(port: int, ca: Path, v: ssl.TLSVersion) -> str:
    try:
        return handshake(port, ca, v)
    except ssl.SSLError as e:
        return f"refused ({e.reason})"


def test_the_admin_token_stays_out_of_its_output(outsider: dict[str, Any]) -> None:
    assert outsider["token"].startswith("orc_admin_")
    assert outsider["token"] not in outsider["output"]
    assert f"admin token: in {outsider['data'] / 'admin.token'} (owner-only" in outsider["output"], outsider["output"]


def test_junk_connections_are_counted_not_logged_one_by_one(outsider: dict[str, Any]) -> None:
    out = outsider["output"]
    assert "Handshake failed" not in out, out[-3000:]
    reports = re.findall(r"(\d+) TLS handshakes? failed in the last", out)
    assert 1 <= len(reports) <= 2, out[-3000:]  # one at shutdown, and one a minute before it
    assert sum(map(int, reports)) == JUNK + 1, out[-3000:]  # and the TLS 1.2 probe of its port
    assert "NO_SHARED_CIPHER" in out and "WRONG_VERSION_NUMBER" in out
    assert len(out.splitlines()) < 30, out[-3000:]
    assert outsider["rc"] == 0, out[-3000:]


def test_its_ports_speak_tls_1_3_only(outsider: dict[str, Any]) -> None:
    for port in ("grpc", "dashboard"):
        seen = outsider["tls"][port]
        assert seen["TLSv1_3"] == "TLSv1.3" and seen["TLSv1_2"].startswith("refused"), (port, seen)


def test_everything_it_creates_is_owner_only(outsider: dict[str, Any]) -> None:
    found = outsider["modes"]
    for name in ("orchard.db", "orchard.db-wal", "orchard.db-shm", "admin.token", "server.json", "tls/server.key"):
        assert name in found, sorted(found)
    assert open_to_others(found, outsider["data"]) == {}
