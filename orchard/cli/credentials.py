"""``orchard certs init`` and ``orchard tokens issue``: TLS certificates and enrollment
tokens, made on the root's machine without a running server."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from orchard.cli.common import fail, out
from orchard.errors import OrchardError

certs_app = typer.Typer(no_args_is_help=True, help="TLS certificates.")
tokens_app = typer.Typer(no_args_is_help=True, help="Enrollment tokens.")


@certs_app.command("init")
def certs_init(out_dir: Annotated[Path, typer.Option("--out")],
               host: Annotated[list[str] | None, typer.Option("--host", help="Server names/IPs (repeatable).")] = None) -> None:
    """Make a CA and a server certificate (for the root and aggregators)."""
    from orchard.server.tls import init_certs

    p = init_certs(out_dir, host)
    out.print(f"CA {p.ca_cert}; server certificate {p.server_cert} (key {p.server_key}, mode 0600)")


@tokens_app.command("issue")
def tokens_issue(data_dir: Annotated[Path, typer.Option("--data-dir")],
                 role: Annotated[str, typer.Option("--role", help="client or aggregator")] = "client",
                 count: Annotated[int, typer.Option("--count")] = 1,
                 label: Annotated[str, typer.Option("--label")] = "") -> None:
    """Issue enrollment tokens (stored hashed in the root's store; printed once)."""
    from orchard.server.store import SQLiteStore

    if role not in ("client", "aggregator"):
        fail(OrchardError(f"--role must be client or aggregator, got {role!r}"))
    data_dir.mkdir(parents=True, exist_ok=True)
    st = SQLiteStore(data_dir / "orchard.db")
    try:
        for _ in range(count):
            out.print(st.issue_token(role, label), highlight=False)
    finally:
        st.close()
