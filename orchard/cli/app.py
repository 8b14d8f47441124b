"""The ``orchard`` command: the root typer app with each group's commands attached."""

from __future__ import annotations

import typer

from orchard.cli import aggregator, client, credentials, edge, local, nodes, run, server, tasks
from orchard.cli.common import guarded


def build_app() -> typer.Typer:
    root = typer.Typer(no_args_is_help=True, add_completion=False, pretty_exceptions_enable=False,
                       help="Orchard: hierarchical federated learning with secure aggregation and compressed updates.")
    for name, sub in [("server", server.app), ("aggregator", aggregator.app), ("client", client.app),
                      ("run", run.app), ("nodes", nodes.app), ("certs", credentials.certs_app),
                      ("tokens", credentials.tokens_app), ("edge", edge.app), ("tasks", tasks.app)]:
        root.add_typer(sub, name=name)
    root.command("validate")(local.validate)
    root.command("demo")(local.demo)
    root.command("baseline")(local.baseline)
    # The simulator's command is its own module's; importing it loads no simulator code
    # (its body imports the runner when it runs).
    from orchard.simulation.cli import simulate

    root.command("simulate", help="Simulate a federation in-process through the real client and tier code.")(simulate)
    from orchard.cli.tune import tune

    root.command("tune")(tune)
    root.command("pretrain", context_settings={"allow_extra_args": True, "ignore_unknown_options": True})(local.pretrain)
    _guard(root)
    return root


def _guard(t: typer.Typer) -> None:
    """Every command of ``t`` and of its groups runs inside :func:`guarded`: how a refusal
    or a failure reaches the user is decided here, once, not by each command."""
    for cmd in t.registered_commands:
        if cmd.callback is not None:
            cmd.callback = guarded(cmd.callback)
    for group in t.registered_groups:
        if group.typer_instance is not None:
            _guard(group.typer_instance)


app = build_app()


def main() -> None:
    app()
