"""``orchard simulate``: the command function (registered by ``orchard.cli.app``).

A recipe: load ``[simulation]`` from ``--config`` (or start from defaults), apply the
flag overrides, validate everything at once, run with a progress bar, print a table.

The backend is ``auto`` unless the config or ``--backend`` names one: worker processes
when the machine and the config allow, said in one line (``backend: process (1 worker;
auto: 2 cores, sharded rounds)``). The closing line counts clients per second as
``benchmarks/simulation.py`` does (after the first round) and gives the processes' peak
memory.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.markup import escape

from orchard.errors import OrchardError


def flower_app_overrides(app: str | None, initial_arrays: Path | None, task: str | None) -> dict[str, Any]:
    """``--flower-app`` and ``--initial-arrays`` as the task they name: ``flower``, with
    the app and its initial arrays as its parameters (``orchard tasks list``)."""
    if app is None or initial_arrays is None:
        raise OrchardError("--flower-app module:app and --initial-arrays FILE.safetensors go together: the app "
                           "holds no initial model of its own")
    if task not in (None, "flower"):
        raise OrchardError(f"--flower-app runs a Flower ClientApp as the task; drop --task {task}")
    return {"run.task": "flower", "run.task_params.app": app,
            "run.task_params.initial_arrays": str(initial_arrays.resolve())}


def simulate(
    config: Annotated[Path | None, typer.Option("--config", help="TOML with a \\[simulation] table.")] = None,
    task: Annotated[str | None, typer.Option("--task", help="A task: a registered name (orchard tasks list) or an import path package.module:build.")] = None,
    clients: Annotated[int | None, typer.Option("--clients", help="Population size.")] = None,
    clients_per_round: Annotated[int | None, typer.Option("--clients-per-round")] = None,
    rounds: Annotated[int | None, typer.Option("--rounds")] = None,
    aggregators: Annotated[int | None, typer.Option("--aggregators", help="Aggregators under the root.")] = None,
    secure_aggregation: Annotated[bool | None,
                                  typer.Option("--secure-aggregation/--no-secure-aggregation")] = None,
    codec: Annotated[str | None, typer.Option("--codec")] = None,
    backend: Annotated[str | None, typer.Option(
        "--backend", help="auto (default: worker processes when the machine has 2+ cores), local, process or ray")] = None,
    workers: Annotated[int | None, typer.Option(
        "--workers", help="worker processes (process backend; default: cores - 1) or threads (local)")] = None,
    shard: Annotated[bool | None, typer.Option(
        "--shard/--no-shard", help="process backend, synchronous tree: the workers run part of the tree "
        "(default), or only train")] = None,
    device: Annotated[str | None, typer.Option(
        "--device", help="cpu, or cuda: where the vectorised path trains many clients at once")] = None,
    runtime: Annotated[str | None, typer.Option(
        "--runtime", help="torch, or executorch: clients train through the task's ExecuTorch program")] = None,
    seed: Annotated[int | None, typer.Option("--seed")] = None,
    out: Annotated[Path | None, typer.Option("--out", help="Directory for rounds.jsonl, report.json, plots.")] = None,
    base_model: Annotated[Path | None, typer.Option(
        "--base-model", help="Base model dir from `orchard pretrain`: the LoRA task adapts it.")] = None,
    task_param: Annotated[list[str] | None, typer.Option(
        "--task-param", help="KEY=VALUE task parameter (repeatable), e.g. alpha=0.1 or with_replacement=true.")] = None,
    flower_app: Annotated[str | None, typer.Option(
        "--flower-app", help="module:app of a Flower ClientApp: every simulated client runs it (the task 'flower').")] = None,
    initial_arrays: Annotated[Path | None, typer.Option(
        "--initial-arrays", help="With --flower-app: the initial global model (.safetensors).")] = None,
    tensorboard: Annotated[Path | None, typer.Option(
        "--tensorboard", help="Write per-round metrics, bytes and participation as TensorBoard events here.")] = None,
    mlflow_uri: Annotated[str | None, typer.Option(
        "--mlflow-uri", help="Log the same to MLflow at this tracking URI (the mlflow extra).")] = None,
    mlflow_experiment: Annotated[str, typer.Option("--mlflow-experiment")] = "orchard",
) -> None:
    """Simulate a federation in-process: real client, codec, secure-aggregation and tier code."""
    from orchard.config import load_toml
    from orchard.simulation.config import build_simulation_config
    from orchard.simulation.runner import run_simulation

    console = Console()
    overrides: dict[str, Any] = {
        "run.task": task, "clients": clients, "clients_per_round": clients_per_round, "rounds": rounds,
        "aggregators": aggregators, "run.secure_aggregation.enabled": secure_aggregation, "run.codec.name": codec,
        "backend": backend, "workers": workers, "shard": shard, "device": device, "runtime": runtime, "seed": seed, "out": str(out) if out is not None else None,
    }
    started = False
    try:
        from orchard.simulation.defaults import fit_population
        from orchard.tasks.params import parse_task_params

        overrides.update({f"run.task_params.{k}": v for k, v in parse_task_params(task_param).items()})
        if flower_app is not None or initial_arrays is not None:
            overrides.update(flower_app_overrides(flower_app, initial_arrays, task))
        data = load_toml(config) if config is not None else {}
        if backend is None and "backend" not in data.get("simulation", {}):
            overrides["backend"] = "auto"  # the fastest this machine and config allow
        fit = fit_population(data, overrides)
        for note in fit.notes:
            console.print(f"[dim]default:[/] {note}", highlight=False)
        overrides.update(fit.overrides)
        cfg = build_simulation_config(data, overrides)
        if base_model is not None:
            from orchard.tasks.params import base_model_params

            params = base_model_params(cfg.run.task, base_model)
            cfg = build_simulation_config(data, {**overrides, **{f"run.task_params.{k}": v for k, v in params.items()}})
        if cfg.out is None:
            cfg = cfg.model_copy(update={"out": Path("sim-out")})
        if cfg.backend == "process":
            # One torch thread here, as in each worker: the engine is one of 1 + workers
            # busy processes, one a core; a second intra-op thread would take a worker's.
            import torch

            torch.set_num_threads(1)
        from orchard.tracking import open_trackers

        track = open_trackers(tensorboard, mlflow_uri, f"simulate-{cfg.run.task}-seed{cfg.seed}",
                              {"task": cfg.run.task, "clients": cfg.clients, "clients_per_round": cfg.clients_per_round,
                               "rounds": cfg.rounds, "aggregators": cfg.aggregators, "codec": cfg.run.codec.name,
                               "secure_aggregation": cfg.run.secure_aggregation.enabled, "seed": cfg.seed,
                               "task_params": cfg.run.task_params}, mlflow_experiment)
        status = "failed"
        started = True
        try:
            report = _run_with_progress(cfg, run_simulation, console, track)
            status = report.status
        finally:
            track.close(status)
    except OrchardError as err:
        # The CLI's exit codes (docs/operating.md): 2 when the input is refused before the
        # simulation starts, 1 when it started and failed.
        Console(stderr=True).print("[bold red]error:[/]", escape(str(err)), soft_wrap=True)
        raise typer.Exit(1 if started else 2) from None
    console.print(_throughput(report), highlight=False, soft_wrap=True)
    console.print(_memory(report, cfg), highlight=False, soft_wrap=True)
    console.print(f"simulated {report.simulated_seconds:.0f} s; report {cfg.out / 'report.json'}; "
                  f"plots {', '.join(Path(p).name for p in report.plots)}", highlight=False)
    if report.status.startswith("failed"):
        console.print(f"[bold red]{report.status}[/]")
        raise typer.Exit(1)


def _throughput(report: Any) -> str:
    """Clients trained per wall second, evaluation excluded: over the rounds after the
    first (what benchmarks/simulation.py reports), then over every round."""
    warm = report.warm_clients_per_second()
    if warm is None:
        return f"{report.clients_per_second:,.0f} clients/s (1 round, no warm-up excluded)"
    return (f"{warm:,.0f} clients/s (rounds 2-{len(report.rounds)}; {report.clients_per_second:,.0f} "
            "with round 1, the warm-up)")


def _memory(report: Any, cfg: Any) -> str:
    peaks = report.peak_rss_mib or {}
    engine, child = peaks.get("engine", 0.0), peaks.get("largest_child", 0.0)
    if cfg.backend != "process" or not child:
        return f"peak RSS: {engine:,.0f} MiB (this process)"
    n = cfg.workers
    each = "" if n == 1 else f" x {n} (the largest worker's peak)"
    return (f"peak RSS: {engine + n * child:,.0f} MiB at most: engine {engine:,.0f} MiB + "
            f"worker{'s' if n > 1 else ''} {child:,.0f} MiB{each} (the sum of each process's peak)")


def _run_with_progress(cfg: Any, run: Any, console: Console, track: Any = None) -> Any:
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    console.print(f"[bold]orchard simulate[/]: {cfg.run.task}, {cfg.clients} devices, {cfg.clients_per_round} per "
                  f"round, {cfg.rounds} rounds, tiers {cfg.fanout() or 'flat'}, codec {cfg.run.codec.name}, "
                  f"secure aggregation {cfg.run.secure_aggregation.enabled}")
    console.print(cfg.backend_choice.line(), highlight=False, soft_wrap=True)  # one line, to grep
    # Redrawn when a round ends, not by a timer: a refresh thread would take the engine's
    # GIL ten times a second in the middle of rounds.
    with Progress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  TextColumn("{task.fields[info]}"), console=console, transient=False, auto_refresh=False,
                  disable=not cfg.progress) as prog:
        bar = prog.add_task("rounds", total=cfg.rounds, info="")

        def on_round(row: dict[str, Any]) -> None:
            if track:
                track.log_round(row["round"], row)
            acc = "-" if row.get("accuracy") is None else f"{row['accuracy']:.4f}"
            prog.update(bar, advance=1, info=f"round {row['round']}: {row['participants']} clients, accuracy {acc}, "
                                              f"{row.get('clients_per_second') or 0:.0f} clients/s",
                        refresh=True)
        return run(cfg, progress=on_round)
