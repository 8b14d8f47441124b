"""`orchard client health --bundle DIR`: the container healthcheck of an edge box."""

from __future__ import annotations

import socket
from pathlib import Path

from typer.testing import CliRunner

from orchard.cli import app
from orchard.edge_runtime.bundle import write_bundle


def _bundle(exported_gpt, path: Path, address: str):
    return write_bundle(path, model_path=exported_gpt.onnx_path, adapter=exported_gpt.adapters[0],
                        adapter_version=1, server_address=address)


def test_health_follows_the_server(exported_gpt, tmp_path: Path) -> None:
    with socket.socket() as srv:
        srv.bind(("127.0.0.1", 0))
        srv.listen()
        port = srv.getsockname()[1]
        _bundle(exported_gpt, tmp_path / "b", f"127.0.0.1:{port}")
        res = CliRunner().invoke(app, ["client", "health", "--bundle", str(tmp_path / "b")])
        assert res.exit_code == 0, res.output
        assert "reachable" in res.output
    # The server is gone: unhealthy, on one line.
    res = CliRunner().invoke(app, ["client", "health", "--bundle", str(tmp_path / "b"), "--timeout", "1"])
    assert res.exit_code == 1 and res.output.strip().startswith("unhealthy: cannot reach")
    assert len(res.output.strip().splitlines()) == 1


def test_health_refuses_a_broken_bundle(tmp_path: Path) -> None:
    res = CliRunner().invoke(app, ["client", "health", "--bundle", str(tmp_path / "none")])
    assert res.exit_code == 1 and res.output.startswith("unhealthy:")
