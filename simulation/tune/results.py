"""What a study leaves for people: the results table, PNG plots, and the best config.

The best config is one TOML file with two tables: ``[simulation]`` (the study's config
with the best trial's parameters set: ``orchard simulate --config``) and ``[run]`` (the
same run, with the simulation's clients per round, rounds and seed written into it:
``orchard run start --config``, which reads a file's ``[run]`` table).
"""

from __future__ import annotations

import copy
import json
import warnings
from pathlib import Path
from typing import Any

from orchard.simulation.tune.objective import CLIENT_ROUNDS, ERROR, TrialSetup


def best_config(setup: TrialSetup, params: dict[str, Any]) -> dict[str, Any]:
    """The config a trial with ``params`` ran, as a file both commands take."""
    from orchard.simulation.config import build_simulation_config, merged_simulation_table

    overrides = setup.spec.overrides(params)
    cfg = build_simulation_config(setup.sim_data, overrides)  # refuses what a trial could not run
    sim = merged_simulation_table(setup.sim_data, overrides)
    run = copy.deepcopy(dict(sim.get("run", {})))
    run["rounds"], run["seed"] = cfg.rounds, cfg.seed
    run.setdefault("cohort", {})["target"] = cfg.clients_per_round
    return {"simulation": sim, "run": run}


def write_best_config(setup: TrialSetup, study: Any, path: Path) -> Path | None:
    """Write the best trial's config to ``path``; None when no trial completed."""
    import tomli_w

    from orchard.simulation.tune.study import Ledger

    best = Ledger.of(study.get_trials(deepcopy=False), setup.spec.direction).best_number
    if best is None:
        return None
    trial = study.get_trials(deepcopy=False)[best]
    data = best_config(setup, trial.params)
    head = (f"# The best trial of study {setup.study_name!r}: trial {trial.number}, {setup.spec.objective} "
            f"{trial.value:.6g} ({setup.spec.at} round).\n# orchard simulate --config {path.name}   |   "
            f"orchard run start --server HOST:PORT --config {path.name}\n")
    path.write_text(head + tomli_w.dumps(data))
    return path


def trial_rows(study: Any) -> list[dict[str, Any]]:
    """One row per trial: number, state, value, rounds run, client-rounds, parameters."""
    rows = []
    for t in study.get_trials(deepcopy=False):
        rows.append({"trial": t.number, "state": t.state.name.lower(), "value": t.value,
                     "rounds": max(t.intermediate_values) if t.intermediate_values else 0,
                     "client_rounds": int(t.user_attrs.get(CLIENT_ROUNDS, 0)),
                     "retry_of": t.system_attrs.get("failed_trial"), "error": t.user_attrs.get(ERROR),
                     "params": dict(t.params)})
    return rows


def results_table(study: Any, setup: TrialSetup, limit: int = 20) -> Any:
    """A rich table of the trials, best first (the ``limit`` best, then the rest summed)."""
    from rich.table import Table

    rows = trial_rows(study)
    sign = -1.0 if setup.spec.direction == "maximize" else 1.0
    rows.sort(key=lambda r: (r["value"] is None, sign * (r["value"] or 0.0), r["trial"]))
    table = Table(title=f"study {setup.study_name}: {setup.spec.objective} ({setup.spec.at} round), "
                        f"{'higher' if sign < 0 else 'lower'} is better")
    for col in ("trial", "state", setup.spec.objective, "rounds", "client-rounds", *setup.spec.space):
        table.add_column(col, overflow="fold")
    for r in rows[:limit]:
        value = "-" if r["value"] is None else f"{r['value']:.4f}"
        state = r["state"] + (f" (retry of {r['retry_of']})" if r["retry_of"] is not None else "")
        table.add_row(str(r["trial"]), state, value, str(r["rounds"]), f"{r['client_rounds']:,}",
                      *[_fmt(r["params"].get(k)) for k in setup.spec.space])
    if len(rows) > limit:
        table.caption = f"{len(rows) - limit} more trials in trials.json"
    return table


def _fmt(v: Any) -> str:
    if v is None:
        return "-"
    return f"{v:.4g}" if isinstance(v, float) else str(v)


def write_trials(study: Any, path: Path) -> Path:
    path.write_text(json.dumps(trial_rows(study), indent=1, default=str))
    return path


def write_plots(study: Any, setup: TrialSetup, out: Path) -> list[Path]:
    """PNG plots: optimization history, each parameter's effect (a slice per parameter),
    parameter importances, and every trial's per-round values with the pruned ones."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import optuna
    from matplotlib.ticker import MaxNLocator
    from optuna.trial import TrialState
    from optuna.visualization import matplotlib as ov

    done = [t for t in study.get_trials(deepcopy=False) if t.state == TrialState.COMPLETE]
    target_name = setup.spec.objective
    written: list[Path] = []
    plots = [("optimization_history", ov.plot_optimization_history, "trial"),
             ("param_effects", ov.plot_slice, None),
             ("param_importances", ov.plot_param_importances, None),
             ("intermediate_values", ov.plot_intermediate_values, "round")]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        warnings.filterwarnings("ignore", message=".*tight_layout.*")
        for name, plot, integer_x in plots:
            if name == "param_importances" and (len(done) < 2 or len(setup.spec.space) < 2):
                continue  # importances need two finished trials and two parameters
            if name != "intermediate_values" and not done:
                continue
            try:
                kw = {} if name == "intermediate_values" else {"target_name": target_name}
                result = plot(study, **kw)
            except (ValueError, RuntimeError):  # e.g. every finished trial has the same value
                continue
            axes = list(result.flat) if hasattr(result, "flat") else [result]
            for ax in axes:
                if integer_x:
                    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
                    ax.set_xlabel("round" if integer_x == "round" else "trial")
            if name == "intermediate_values":
                axes[0].set_ylabel(f"{target_name} ({setup.spec.at} so far)" if setup.spec.at == "best"
                                   else target_name)
                axes[0].set_title("per-round values (pruned trials stop early)")
            fig = axes[0].get_figure()
            path = out / f"{name}.png"
            fig.set_size_inches(max(6.4, 3.2 * len(axes)), 4.8)
            fig.tight_layout()
            fig.savefig(path, dpi=100)
            plt.close(fig)
            written.append(path)
    return written


def progress_table(p: Any, spec: Any) -> Any:
    """The live table: trials done, pruned, failed, running, best so far, spent."""
    from rich.table import Table

    led = p.ledger
    table = Table(title="orchard tune", show_header=True)
    for col in ("ended", "complete", "pruned", "failed", "running", f"best {spec.objective}", "client-rounds",
                "elapsed"):
        table.add_column(col)
    ended = f"{led.counted}" + (f" / {spec.trials}" if spec.trials else "")
    spent = f"{led.client_rounds:,}" + (f" / {spec.client_rounds:,}" if spec.client_rounds else "")
    best = "-" if led.best_value is None else f"{led.best_value:.4f} (trial {led.best_number})"
    table.add_row(ended, str(led.complete), str(led.pruned), str(led.failed), str(len(led.running)), best, spent,
                  f"{p.elapsed_s:.0f} s" + ("" if p.stopping is None else f" (stopping: {p.stopping})"))
    return table
