"""``orchard server start``: the root."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer

from orchard.cli.common import (
    Insecure,
    ServerCfgOpt,
    Verbose,
    console,
    serve_tier,
)

app = typer.Typer(no_args_is_help=True, help="The root server.")


@app.command("start")
def server_start(
    data_dir: Annotated[Path, typer.Option("--data-dir", help="Store, checkpoints, TLS and admin token live here.")],
    port: Annotated[int, typer.Option("--port", help="0 picks a free port (written to DATA_DIR/server.json).")] = 7070,
    host: Annotated[str, typer.Option("--host")] = "127.0.0.1",
    config: ServerCfgOpt = None,
    insecure: Insecure = False,
    tls_dir: Annotated[Path | None, typer.Option("--tls-dir", help="server.pem/server.key/ca.pem (default DATA_DIR/tls, created if absent).")] = None,
    metrics_port: Annotated[int | None, typer.Option("--metrics-port", help="Serve Prometheus metrics on this port.")] = None,
    dashboard_port: Annotated[int | None, typer.Option(
        "--dashboard-port", help="Serve the live read-only web dashboard on this port (HTTPS under TLS; needs the "
                                 "admin token; 0 picks a free port). Off by default.")] = None,
    base_model: Annotated[Path | None, typer.Option(
        "--base-model", help="Base model dir from `orchard pretrain`: runs of a LoRA task adapt it unless they name "
                             "their own.")] = None,
    verbose: Verbose = True,
) -> None:
    """Start the root server."""
    from orchard.server.app import start_root

    def announce(h: Any) -> None:
        console.print(f"[green]root listening on {h.address}[/] ({'INSECURE' if insecure else 'TLS'}); "
                      f"data in {data_dir}")
        if not insecure:
            # Never the token itself: this output often lands in a log file that others can read.
            console.print(f"admin token: in {data_dir / 'admin.token'} (owner-only; "
                          f"{'created now' if h.admin_token else 'made at the first start'})", soft_wrap=True)
        if h.ca_cert:
            console.print(f"clients trust the CA at {h.ca_cert}")
        if h.dashboard is not None:
            console.print(f"dashboard: {h.dashboard.scheme}://{host}:{h.dashboard.port}/?token=ADMIN_TOKEN "
                          f"(the admin token; {'the CA above signs its certificate' if h.ca_cert else 'loopback only'})",
                          soft_wrap=True)

    serve_tier(config, verbose, lambda scfg: start_root(
        data_dir, host=host, port=port, insecure=insecure, server_cfg=scfg, tls_dir=tls_dir,
        metrics_port=metrics_port, base_model=base_model, dashboard_port=dashboard_port), announce)
