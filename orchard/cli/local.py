"""Commands that need no live federation: ``validate``, ``demo``, ``baseline``,
``pretrain``. (``simulate`` is :func:`orchard.simulation.cli.simulate`.)"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Any

import typer

from orchard.cli.common import Insecure, console, fail, out
from orchard.errors import OrchardError


def validate(config: Annotated[Path, typer.Argument(help="A run or simulation config (TOML).")]) -> None:
    """Report every problem in a config at once."""
    from orchard.validation import config_problems

    problems = config_problems(config)
    if problems:
        console.print(f"[bold red]{config}: {len(problems)} problem(s)[/]")
        for p in problems:
            console.print(f"  - {p}")
        raise typer.Exit(1)
    out.print(f"{config}: OK")


def demo(
    rounds: Annotated[int, typer.Option("--rounds")] = 5,
    aggregators: Annotated[int, typer.Option("--aggregators")] = 2,
    clients: Annotated[int, typer.Option("--clients")] = 6,
    task: Annotated[str, typer.Option("--task", help="A task: a registered name (orchard tasks list) or an import path package.module:build.")] = "digits",
    out_dir: Annotated[Path, typer.Option("--out")] = Path("demo-out"),
    codec: Annotated[str | None, typer.Option("--codec")] = None,
    secure_aggregation: Annotated[bool, typer.Option("--secure-aggregation/--no-secure-aggregation")] = False,
    insecure: Insecure = False,
    dp_epsilon: Annotated[float | None, typer.Option(
        "--dp-epsilon", help="Differential privacy to this epsilon over the run (delta 1e-5): central, or "
                             "distributed with --secure-aggregation.")] = None,
    dashboard_port: Annotated[int | None, typer.Option(
        "--dashboard-port", help="The root serves its live dashboard on this port (0: a free one); the address, "
                                 "with the admin token, is printed.")] = None,
    linger: Annotated[float, typer.Option(
        "--linger", min=0.0, help="Seconds to keep the federation up after the run (to look at the dashboard).")] = 0.0,
) -> None:
    """A real local federation: root, aggregators and clients as processes over TLS."""
    from orchard.demo import DemoSpec, run_demo

    report = run_demo(DemoSpec(rounds=rounds, aggregators=aggregators, clients=clients, task=task,
                               out=out_dir, codec=codec, secure_aggregation=secure_aggregation,
                               insecure=insecure, dp_epsilon=dp_epsilon, dashboard_port=dashboard_port,
                               linger_s=linger),
                      console=out)
    out.print(f"report: {out_dir / 'report.json'}; plot: {report.get('plot')}")


def baseline(task: Annotated[str, typer.Option("--task", help="A task: a registered name (orchard tasks list) or an import path package.module:build.")],
             epochs: Annotated[int | None, typer.Option("--epochs")] = None,
             task_param: Annotated[list[str] | None, typer.Option(
                 "--task-param", help="KEY=VALUE task parameter (repeatable), e.g. alpha=0.1.")] = None) -> None:
    """Train the task's model centrally on the pooled training data: the reference accuracy."""
    from orchard.tasks.baseline import run_baseline
    from orchard.tasks.params import parse_task_params

    kw: dict[str, Any] = {} if epochs is None else {"epochs": epochs}
    try:
        res = run_baseline(task, **kw, **parse_task_params(task_param))
    except OrchardError as err:
        fail(err)
    out.print_json(json.dumps(res))


def pretrain(ctx: typer.Context,
             config: Annotated[Path, typer.Option("--config", help="Pretraining TOML (see configs/).")]) -> None:
    """Pretrain the base model (also: torchrun --nproc-per-node N -m orchard.pretrain --config ...).

    Extra flags are dotted config overrides, e.g. --steps 500 --optim.lr 3e-4."""
    from orchard.pretrain.__main__ import main as pretrain_main

    raise typer.Exit(pretrain_main(["--config", str(config), *ctx.args]))
