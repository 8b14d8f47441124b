"""``orchard tasks list``: the tasks every command takes, with their parameters."""

from __future__ import annotations

from typing import Annotated

import typer

from orchard.cli.common import fail, out
from orchard.errors import OrchardError

app = typer.Typer(no_args_is_help=True, help="Tasks: Orchard's own and those installed packages register.")


@app.command("list")
def tasks_list(
    task: Annotated[list[str] | None, typer.Option(
        "--task", help="Also describe this import path, package.module:build (repeatable).")] = None,
) -> None:
    """List the registered tasks (entry points of group orchard.tasks) and their parameters.

    Any command's --task takes one of these names, or an import path package.module:build."""
    from rich.table import Table

    from orchard.tasks.registry import describe_tasks

    try:
        entries = describe_tasks(list(task or []))
    except OrchardError as err:
        fail(err)
    table = Table(show_lines=False)
    for col in ("task", "from", "builder", "parameters (default)"):
        table.add_column(col, overflow="fold")
    for e in entries:
        params = ", ".join(f"{p.name}" + (" (required)" if p.required else f"={p.default!r}") for p in e.params)
        table.add_row(e.name, e.distribution, e.target + (f"\n{e.summary}" if e.summary else ""), params or "-")
    out.print(table)
