"""``orchard aggregator start``: a middle tier."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer

from orchard.cli.common import (
    CaCert,
    Insecure,
    ServerCfgOpt,
    Token,
    Verbose,
    console,
    serve_tier,
)

app = typer.Typer(no_args_is_help=True, help="An aggregator tier.")


@app.command("start")
def aggregator_start(
    upstream: Annotated[str, typer.Option("--upstream", help="HOST:PORT of the root or a higher aggregator.")],
    port: Annotated[int, typer.Option("--port")] = 0,
    host: Annotated[str, typer.Option("--host")] = "127.0.0.1",
    insecure: Insecure = False,
    token: Token = None,
    ca_cert: CaCert = None,
    tls_dir: Annotated[Path | None, typer.Option("--tls-dir", help="This aggregator's server.pem/server.key.")] = None,
    node_id: Annotated[str, typer.Option("--node-id")] = "",
    config: ServerCfgOpt = None,
    metrics_port: Annotated[int | None, typer.Option("--metrics-port")] = None,
    port_file: Annotated[Path | None, typer.Option("--port-file", help="Write the bound port here.")] = None,
    data_dir: Annotated[Path | None, typer.Option(
        "--data-dir", help="Keep this aggregator's identity here (owner-only): a restart resumes the same node.")] = None,
    verbose: Verbose = True,
) -> None:
    """Start an aggregator: serves clients below, dials its upstream."""
    from orchard.server.app import start_aggregator

    def announce(h: Any) -> None:
        if port_file is not None:
            port_file.write_text(str(h.port))
        console.print(f"[green]aggregator {h.coordinator.name} listening on {h.address}[/], upstream {upstream}")

    serve_tier(config, verbose, lambda scfg: start_aggregator(
        upstream, host=host, port=port, insecure=insecure, token=token, ca_cert=ca_cert, tls_dir=tls_dir,
        node_id=node_id, metrics_port=metrics_port, server_cfg=scfg, data_dir=data_dir), announce)
