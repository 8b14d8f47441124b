"""``orchard tune``: a hyperparameter study over simulated federations.

A recipe: plan the study (every problem refused before a trial starts), drive it on
worker processes or a Ray cluster with a live table, then print the results table and
write the plots, ``trials.json`` and the best config (docs/tuning.md).
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from orchard.cli.common import console, fail, out
from orchard.errors import OrchardError


def tune(
    config: Annotated[Path, typer.Option("--config", help="A simulation config (TOML with a \\[simulation] table).")],
    space: Annotated[Path, typer.Option("--space", help="The search space, objective and budget (TOML, \\[tune]).")],
    out_dir: Annotated[Path, typer.Option("--out", help="Folder for the study, plots, trials.json, best.toml.")] = Path(
        "tune-out"),
    trials: Annotated[int | None, typer.Option("--trials", help="Budget: trials that end.")] = None,
    client_rounds: Annotated[int | None, typer.Option("--client-rounds", help="Budget: client-rounds trained.")] = None,
    wall_time: Annotated[float | None, typer.Option("--wall-time", help="Budget: seconds before no trial starts.")] = None,
    parallel: Annotated[int | None, typer.Option("--parallel", help="Trials at once.")] = None,
    objective: Annotated[str | None, typer.Option("--objective", help="accuracy or loss (held-out).")] = None,
    at: Annotated[str | None, typer.Option("--at", help="last or best: the round whose value a trial gets.")] = None,
    storage: Annotated[str | None, typer.Option(
        "--storage", help="The study's database: a SQLite file or a URL (default OUT/study.db). Run the same "
                          "command again to resume.")] = None,
    study_name: Annotated[str, typer.Option("--study-name")] = "tune",
    ray_address: Annotated[str | None, typer.Option(
        "--ray-address", help="Run trials as tasks on this Ray cluster (every node must reach --storage).")] = None,
    tensorboard: Annotated[Path | None, typer.Option(
        "--tensorboard", help="A TensorBoard run per trial below this folder.")] = None,
    mlflow_uri: Annotated[str | None, typer.Option("--mlflow-uri", help="An MLflow run per trial at this URI.")] = None,
    mlflow_experiment: Annotated[str, typer.Option("--mlflow-experiment")] = "orchard",
) -> None:
    """Tune a federation's hyperparameters in simulation: Optuna TPE, pruning by rounds, resumable."""
    from rich.live import Live

    from orchard.config import load_toml
    from orchard.simulation.tune import drive, make_launcher, plan_study
    from orchard.simulation.tune.results import (
        progress_table,
        results_table,
        write_best_config,
        write_plots,
        write_trials,
    )

    try:
        setup = plan_study(load_toml(config), load_toml(space), out_dir,
                           overrides={"trials": trials, "client_rounds": client_rounds, "wall_time_s": wall_time,
                                      "parallel": parallel, "objective": objective, "at": at},
                           storage=storage, study_name=study_name, tensorboard=tensorboard, mlflow_uri=mlflow_uri,
                           mlflow_experiment=mlflow_experiment)
        spec = setup.spec
        console.print(f"[bold]orchard tune[/]: {len(spec.space)} parameters, {spec.sampler} sampler, pruner "
                      f"{spec.pruner}, {spec.parallel} at once on {'Ray at ' + ray_address if ray_address else 'this machine'}; "
                      f"study {setup.study_name!r} in {setup.storage_url}", highlight=False, soft_wrap=True)
        launcher = make_launcher(setup, ray_address)
        with Live(console=console, auto_refresh=False, transient=False) as live:
            outcome = drive(setup, launcher, lambda p: live.update(progress_table(p, spec), refresh=True))
    except OrchardError as err:
        fail(err)
    out.print(results_table(outcome.study, setup))
    led = outcome.ledger
    console.print(f"stopped by: {outcome.stopped_by}; {led.complete} complete, {led.pruned} pruned, {led.failed} "
                  f"failed{f' ({len(outcome.retried)} retried after their worker died)' if outcome.retried else ''}; "
                  f"{led.client_rounds:,} client-rounds", highlight=False)
    nodes = getattr(launcher, "nodes", None)  # a Ray launcher's: the nodes its trials ran on
    if nodes:
        console.print(f"trials ran on {len(nodes)} Ray node{'s' if len(nodes) != 1 else ''}", highlight=False)
    written = [write_trials(outcome.study, out_dir / "trials.json"), *write_plots(outcome.study, setup, out_dir)]
    best = write_best_config(setup, outcome.study, out_dir / "best.toml")
    console.print(f"wrote {', '.join(p.name for p in written)} in {out_dir}", highlight=False)
    if best is None:
        console.print("[bold red]no trial completed[/]: no best config")
        raise typer.Exit(1)
    out.print(f"best: trial {led.best_number}, {spec.objective} {led.best_value:.4f}; config {best} "
                  f"(orchard simulate --config / orchard run start --config)", highlight=False, soft_wrap=True)
