"""``orchard aggregator start``: a middle tier."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Annotated

import typer

from orchard.cli.common import (
    CaCert,
    Insecure,
    ServerCfgOpt,
    Token,
    Verbose,
    console,
    serve_until_signal,
    server_config,
    setup_logging,
)
from orchard.files import restrict_umask

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
    restrict_umask()  # whatever it writes is owner-only (orchard.files)
    from orchard.server.app import start_aggregator
    from orchard.server.corelog import HandshakeLog
    from orchard.server.process import tune_server_process

    scfg = server_config(config)  # a refused config is said on the terminal's stderr, before the log moves
    handshakes = HandshakeLog().install()  # failed TLS handshakes: one line a minute, not one each
    setup_logging(verbose)

    async def main() -> None:
        h = await start_aggregator(upstream, host=host, port=port, insecure=insecure, token=token, ca_cert=ca_cert,
                                   tls_dir=tls_dir, node_id=node_id, metrics_port=metrics_port, server_cfg=scfg,
                                   data_dir=data_dir)
        tune_server_process()
        if port_file is not None:
            port_file.write_text(str(h.port))
        console.print(f"[green]aggregator {h.coordinator.name} listening on {h.address}[/], upstream {upstream}")
        await serve_until_signal(h)

    try:
        asyncio.run(main())
    finally:
        handshakes.close()
