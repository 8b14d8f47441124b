"""``orchard certs init`` and ``orchard tokens issue | list | revoke``: TLS certificates,
enrollment tokens and device credentials, on the root's machine, in its data dir (a
running root reads the same store on every call, so a revocation holds at once)."""

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
    from orchard.files import restrict_umask
    from orchard.server.tls import init_certs

    restrict_umask()
    p = init_certs(out_dir, host)
    out.print(f"CA {p.ca_cert}; server certificate {p.server_cert} (key {p.server_key}); all owner-only (0600)")


@tokens_app.command("issue")
def tokens_issue(data_dir: Annotated[Path, typer.Option("--data-dir")],
                 role: Annotated[str, typer.Option("--role", help="client or aggregator")] = "client",
                 count: Annotated[int | None, typer.Option(
                     "--count", min=1, help="Issue N device tokens, one per device: each enrolls one node "
                     "(bound to the first node id that uses it) and is spent once exchanged for the node's own "
                     "credential. Without --count: one shared token, which any number of nodes enroll with.")] = None,
                 label: Annotated[str, typer.Option("--label")] = "") -> None:
    """Issue enrollment tokens (stored hashed in the root's store; printed once, one a line)."""
    from orchard.files import private_dir, restrict_umask
    from orchard.server.store import SQLiteStore

    restrict_umask()
    if role not in ("client", "aggregator"):
        fail(OrchardError(f"--role must be client or aggregator, got {role!r}"))
    st = SQLiteStore(private_dir(data_dir) / "orchard.db")
    try:
        for _ in range(count or 1):
            out.print(st.issue_token(role, label, device=count is not None), highlight=False)
    finally:
        st.close()


@tokens_app.command("list")
def tokens_list(data_dir: Annotated[Path, typer.Option("--data-dir")],
                as_json: Annotated[bool, typer.Option("--json")] = False) -> None:
    """Enrollment tokens (by id; the tokens themselves are never stored) and enrolled nodes."""
    import json

    st = _open(data_dir)
    try:
        tokens = [{"token_id": t.token_id, "role": t.role, "kind": t.kind, "label": t.label, "created": t.created,
                   "node_id": t.node_id, "state": _token_state(t)} for t in st.list_tokens()]
        nodes = [{"node_id": d.node_id, "role": d.role, "token_id": d.token_id, "issued": d.issued,
                  "public_key": d.public_key.hex(), "state": "revoked" if d.revoked else "enrolled"}
                 for d in st.list_devices()]
    finally:
        st.close()
    if as_json:
        typer.echo(json.dumps({"tokens": tokens, "nodes": nodes}, indent=2))
        return
    out.print(f"{'token id':<13} {'role':<10} {'kind':<6} {'state':<8} {'node':<24} label", highlight=False)
    for t in tokens:
        out.print(f"{t['token_id']:<13} {t['role']:<10} {t['kind']:<6} {t['state']:<8} {t['node_id'] or '-':<24} "
                  f"{t['label']}", highlight=False)
    out.print(f"\n{'node':<24} {'role':<10} {'state':<8} {'token id':<13} device key", highlight=False)
    for d in nodes:
        out.print(f"{d['node_id']:<24} {d['role']:<10} {d['state']:<8} {d['token_id']:<13} {d['public_key'][:16]}…",
                  highlight=False)


@tokens_app.command("revoke")
def tokens_revoke(data_dir: Annotated[Path, typer.Option("--data-dir")],
                  token_id: Annotated[str, typer.Argument(help="A token id from `orchard tokens list`.")] = "",
                  node: Annotated[str, typer.Option("--node", help="Revoke this node's credential instead.")] = "") -> None:
    """Revoke a token and every credential it enrolled, or (--node) one node's credential.
    The root refuses it at once; an aggregator within seconds (docs/operating.md)."""
    if bool(token_id) == bool(node):
        fail(OrchardError("name a token id or --node NODE_ID (one of them)"))
    st = _open(data_dir)
    try:
        got = st.revoke(token_id=token_id, node_id=node)
    finally:
        st.close()
    if not got.tokens and not got.nodes:
        fail(OrchardError(f"nothing to revoke: no live {'token ' + token_id if token_id else 'node ' + node} in "
                          f"{data_dir} (see `orchard tokens list`)"))
    out.print(f"revoked: tokens {', '.join(got.tokens) or '-'}; nodes {', '.join(got.nodes) or '-'}",
              highlight=False)


def _open(data_dir: Path):  # the root's existing store; never a new one in a mistyped dir
    from orchard.server.store import SQLiteStore

    if not (data_dir / "orchard.db").is_file():
        fail(OrchardError(f"no root store in {data_dir} (orchard.db): pass the root's --data-dir"))
    return SQLiteStore(data_dir / "orchard.db")


def _token_state(t) -> str:
    if t.revoked:
        return "revoked"
    if t.kind == "device":
        return "spent" if t.spent else ("bound" if t.node_id else "unused")
    return "live"
