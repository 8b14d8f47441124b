"""A trial: one simulated federation through :func:`orchard.simulation.runner.run_simulation`.

The trial draws its parameters from the space, runs the config with them (every round
evaluated on the task's held-out data), reports the objective to Optuna after each round
and stops as soon as the pruner says so (the simulator's ``stop`` predicate, so a pruned
trial spends no further round). Its value is the objective at the last round, or at the
best round. What it spent, in client-rounds, is kept on the trial as it goes; a trial
running when the study's client-round budget is spent stops there, recorded as pruned.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from orchard.errors import OrchardError
from orchard.simulation.tune.space import TuneSpec

# User attributes a trial carries in the study (read by the driver's ledger and reports).
TICKET = "ticket"  # which dispatch ran it: the driver finds a dead worker's trial by it
CLIENT_ROUNDS = "client_rounds"  # clients trained, summed over its rounds so far
ERROR = "error"  # why the trial failed, when its config (not its worker) failed it


class TrialFailed(OrchardError):
    """A trial's federation ended without a value for the objective (a failed round, a
    model whose evaluation is not finite)."""


@dataclass(frozen=True)
class TrialSetup:
    """What every trial of a study needs; picklable, sent once to each worker."""

    sim_data: dict[str, Any]  # the parsed simulation config (a dict with [simulation])
    spec: TuneSpec
    storage_url: str
    study_name: str
    rounds: int
    tensorboard: str | None = None  # a TensorBoard run per trial below this folder
    mlflow_uri: str | None = None  # an MLflow run per trial at this tracking URI
    mlflow_experiment: str = "orchard"


def trial_config(setup: TrialSetup, params: dict[str, Any]) -> Any:
    """The :class:`SimulationConfig` a trial with ``params`` runs: the config with the
    parameters set, every round evaluated, nothing written, no progress bar."""
    from orchard.simulation.config import build_simulation_config

    cfg = build_simulation_config(setup.sim_data, setup.spec.overrides(params))
    return cfg.model_copy(update={"evaluate_every": 1, "out": None, "progress": False})


def run_trial(trial: Any, setup: TrialSetup, ticket: str, alive: Callable[[], bool] = lambda: True) -> float:
    """Run ``trial`` (an ``optuna.Trial``): its value, or ``optuna.TrialPruned``.

    ``alive``: asked after each round; False (the process that dispatched this trial is
    gone) ends this process at once, leaving the trial running in the study for the
    heartbeat to fail and retry (what a ``kill -9`` of the whole study would leave).
    """
    import optuna

    from orchard.simulation.runner import run_simulation
    from orchard.tracking import open_trackers

    spec = setup.spec
    trial.set_user_attr(TICKET, ticket)
    trial.set_user_attr(CLIENT_ROUNDS, 0)
    params = {key: p.suggest(trial, key) for key, p in spec.space.items()}
    cfg = trial_config(setup, params)
    better = max if spec.objective == "accuracy" else min
    state: dict[str, Any] = {"spent": 0, "best": None, "last": None, "pruned": False}
    tb = Path(setup.tensorboard) / f"trial-{trial.number}" if setup.tensorboard else None
    track = open_trackers(tb, setup.mlflow_uri, f"tune-{setup.study_name}-trial{trial.number}",
                          {**params, "trial": trial.number, "study": setup.study_name}, setup.mlflow_experiment)

    def on_round(row: dict[str, Any]) -> None:
        if not alive():
            os._exit(3)  # the study's process is gone: stop spending, leave the trial to the heartbeat
        state["spent"] += int(row.get("participants") or 0)
        trial.set_user_attr(CLIENT_ROUNDS, state["spent"])
        track.log_round(row["round"], row)
        value = row.get(spec.objective)
        if value is None or not math.isfinite(value):
            raise TrialFailed(f"round {row['round']} reported no finite {spec.objective} (the model diverged, or "
                              "the task could not evaluate it)")
        state["last"] = float(value)
        state["best"] = value if state["best"] is None else better(state["best"], value)
        trial.report(state[spec.at], row["round"])

    def stop(row: dict[str, Any]) -> bool:
        # Pruned, or the study's client-round budget spent (by this trial and the others
        # running beside it): either way this trial ends at the round it reached.
        state["pruned"] = trial.should_prune() or _budget_spent(trial, spec)
        return bool(state["pruned"])

    status = "failed"
    try:
        report = run_simulation(cfg, progress=on_round, stop=stop)
        if report.status.startswith("failed"):
            raise TrialFailed(report.status)
        if state["pruned"]:
            status = "pruned"
            raise optuna.TrialPruned(f"pruned after round {len(report.rounds)}")
        if state[spec.at] is None:
            raise TrialFailed("the federation completed no round")
        status = "completed"
        return float(state[spec.at])
    except (OrchardError, ValueError, RuntimeError) as err:
        trial.set_user_attr(ERROR, str(err)[:500])
        raise
    finally:
        track.close(status)


def _budget_spent(trial: Any, spec: TuneSpec) -> bool:
    if spec.client_rounds is None:
        return False
    spent = sum(int(t.user_attrs.get(CLIENT_ROUNDS, 0)) for t in trial.study.get_trials(deepcopy=False))
    return spent >= spec.client_rounds


def objective_problems(setup: TrialSetup) -> list[str]:
    """Whether the task reports the objective: its held-out evaluation of the initial
    model must hold a finite value of that name. One evaluation, before any trial."""
    from orchard import wire
    from orchard.simulation.config import build_simulation_config
    from orchard.tasks import get_task

    cfg = build_simulation_config(setup.sim_data, {})
    run = cfg.run_config()
    task = get_task(run.task, **run.task_params)
    arrays = wire.blob_to_arrays(wire.arrays_to_blob(task.initial_arrays(run.seed)))
    metrics = task.evaluate(arrays)
    value = metrics.get(setup.spec.objective)
    if value is None or not math.isfinite(float(value)):
        reported = sorted(k for k, v in metrics.items() if isinstance(v, float) and math.isfinite(v))
        return [f"tune.objective: task {run.task!r} does not report {setup.spec.objective!r} on its held-out data "
                f"(it reports: {', '.join(reported) or 'nothing'}); choose one it reports"]
    return []
