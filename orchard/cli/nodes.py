"""``orchard nodes list``: the nodes a root knows."""

from __future__ import annotations

import json
from typing import Annotated

import typer

from orchard.cli.common import AdminToken, CaCert, DataDirOpt, Insecure, control, out

app = typer.Typer(no_args_is_help=True, help="Nodes known to a root.")


@app.command("list")
def nodes_list(server: Annotated[str, typer.Option("--server")], as_json: Annotated[bool, typer.Option("--json")] = False,
               admin_token: AdminToken = None, ca_cert: CaCert = None, insecure: Insecure = False,
               data_dir: DataDirOpt = None) -> None:
    """Nodes joined directly to the root (aggregators report their pools)."""
    with control(server, admin_token, ca_cert, insecure, data_dir) as ctl:
        nodes = ctl.nodes()
    if as_json:
        out.print_json(json.dumps(nodes))
        return
    from rich.table import Table

    t = Table("node", "role", "live", "pool", "eligible")
    for n in nodes:
        t.add_row(n["node_id"], n["role"], str(n["live"]), str(n["pool_size"]), str(n["pool_eligible"]))
    out.print(t)
