"""``orchard run start | status | stop | list | logs | pull``: runs on a live root.

The work is :mod:`orchard.runs` and :mod:`orchard.pull`; these commands parse flags,
connect, call them and print.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Annotated, Any

import typer

from orchard.cli.common import (
    EXIT_FAILED,
    AdminToken,
    CaCert,
    DataDirOpt,
    Insecure,
    console,
    control,
    fail,
    out,
)
from orchard.errors import OrchardError

app = typer.Typer(no_args_is_help=True, help="Start, watch and stop runs on a live root.")

Server = Annotated[str, typer.Option("--server")]
RunArg = Annotated[str, typer.Argument(metavar="RUN", help="A run id (see `orchard run list`), or 'latest'.")]
LatestRunArg = Annotated[str, typer.Argument(metavar="[RUN]", show_default=False,
                                             help="A run id (see `orchard run list`), or 'latest' (the default).")]
# `run status` and `run stop` took the run as --run-id before every run command took it as
# an argument; the old spelling still works, with a note.
RunIdAlias = Annotated[str | None, typer.Option("--run-id", hidden=True, help="Deprecated: pass RUN as the argument.")]


def _run_arg(run: str, run_id: str | None = None) -> str:
    """The run id the control API takes for RUN ('' for the latest run)."""
    if run_id is not None:
        if run not in ("latest", run_id):
            fail(f"two runs named: {run!r} and --run-id {run_id!r}; pass the run once, as the argument")
        console.print(f"note: --run-id is deprecated; pass the run as the argument: `{run_id}`", highlight=False)
        run = run_id
    return "" if run == "latest" else run


@app.command("start")
def run_start(
    server: Server,
    task: Annotated[str | None, typer.Option("--task", help="The task; it makes the initial model. A registered name "
                                             "(orchard tasks list) or an import path package.module:build.")] = None,
    rounds: Annotated[int | None, typer.Option("--rounds")] = None,
    config: Annotated[Path | None, typer.Option("--config", help="Run config TOML.")] = None,
    clients_per_round: Annotated[int | None, typer.Option("--clients-per-round")] = None,
    codec: Annotated[str | None, typer.Option("--codec")] = None,
    secure_aggregation: Annotated[bool | None, typer.Option("--secure-aggregation/--no-secure-aggregation")] = None,
    initial_arrays: Annotated[Path | None, typer.Option("--initial-arrays", help="Initial global model (.safetensors), e.g. for a Flower app.")] = None,
    base_model: Annotated[Path | None, typer.Option("--base-model", help="Base model dir from `orchard pretrain`: the LoRA task adapts it.")] = None,
    task_param: Annotated[list[str] | None, typer.Option(
        "--task-param", help="KEY=VALUE task parameter (repeatable), e.g. alpha=0.1; clients build the task with it.")] = None,
    detach: Annotated[bool, typer.Option("--detach", help="Return once the run is started.")] = False,
    tensorboard: Annotated[Path | None, typer.Option(
        "--tensorboard", help="Write per-round metrics, bytes and participation as TensorBoard events here.")] = None,
    mlflow_uri: Annotated[str | None, typer.Option(
        "--mlflow-uri", help="Log the same to MLflow at this tracking URI (the mlflow extra).")] = None,
    mlflow_experiment: Annotated[str, typer.Option("--mlflow-experiment")] = "orchard",
    evaluate: Annotated[bool, typer.Option(
        "--evaluate", help="Pull each round's global model and score it on the task's held-out data "
                           "(shown in the progress line and tracked as eval/accuracy, eval/loss).")] = False,
    admin_token: AdminToken = None,
    ca_cert: CaCert = None,
    insecure: Insecure = False,
    data_dir: DataDirOpt = None,
) -> None:
    """Start a run against a live root; without --detach, show progress until it ends."""
    from orchard.runs import (
        build_run_config,
        initial_blob,
        progress_line,
        tracked_params,
        with_base_model,
    )
    from orchard.tasks.params import parse_task_params
    from orchard.tracking import open_trackers

    if detach and (tensorboard is not None or mlflow_uri or evaluate):
        fail(OrchardError("--tensorboard, --mlflow-uri and --evaluate follow the run as it goes: drop --detach"))
    cfg = build_run_config(config, {"task": task, "rounds": rounds, "cohort.target": clients_per_round,
                                    "codec.name": codec, "secure_aggregation.enabled": secure_aggregation,
                                    **{f"task_params.{k}": v for k, v in parse_task_params(task_param).items()}})
    with control(server, admin_token, ca_cert, insecure, data_dir) as ctl:
        cfg = with_base_model(ctl, cfg, base_model)
        blob = initial_blob(cfg, initial_arrays)
        track = None if detach else open_trackers(tensorboard, mlflow_uri, "", tracked_params(cfg, server),
                                                  mlflow_experiment)
        run_id = ctl.start_run(cfg, blob)
        out.print(f"started {run_id}: task {cfg.task}, {cfg.rounds} rounds, {cfg.cohort.target} clients per round")
        if track is None:
            return
        st = _follow(ctl, run_id, cfg, track, evaluate)
    if st["status"] != "completed":  # failed, stopped or interrupted: the rounds asked for did not all happen
        fail(f"run {run_id} {progress_line(st)}", EXIT_FAILED)


def _follow(ctl: Any, run_id: str, cfg: Any, track: Any, evaluate: bool) -> dict[str, Any]:
    """Show a progress bar until the run ends; log each round (and its score) to
    ``track``; the run's last status."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from orchard.runs import progress_line, round_scorer, watch_run

    track.name_run(run_id)
    scorer = round_scorer(ctl, run_id, cfg) if evaluate else None

    def on_round(r: dict[str, Any]) -> None:
        rec = {**r, **(scorer(r["round"]) if scorer else {})}
        if scorer:
            out.print(f"round {r['round']}: accuracy {rec['accuracy']:.4f}, loss {rec['loss']:.4f}", highlight=False)
        track.log_round(r["round"], rec)

    status = "failed"
    try:
        with Progress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                      TextColumn("{task.fields[info]}"), console=console, transient=False) as prog:
            bar = prog.add_task(run_id, total=cfg.rounds, info="")

            def on_status(st: dict[str, Any]) -> None:
                prog.update(bar, completed=st["completed_rounds"], info=progress_line(st))

            st = watch_run(ctl, run_id, on_round=on_round, on_status=on_status)
            status = st["status"]
    finally:
        track.close(status)
    return st


@app.command("status")
def run_status(
    server: Server,
    run: LatestRunArg = "latest",
    run_id: RunIdAlias = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print the full status as JSON.")] = False,
    admin_token: AdminToken = None,
    ca_cert: CaCert = None,
    insecure: Insecure = False,
    data_dir: DataDirOpt = None,
) -> None:
    """Round, participants per tier, bytes up and down, durations, metrics.

    RUN: a run id (orchard run list), or latest (the default)."""
    run = _run_arg(run, run_id)
    with control(server, admin_token, ca_cert, insecure, data_dir) as ctl:
        st = ctl.status(run)
    if as_json:
        out.print_json(json.dumps(st))
        return
    if st["run_id"] is None:
        out.print("this root has no run yet (start one with `orchard run start`)")
        return
    _print_status(st)


def _print_status(st: dict[str, Any]) -> None:
    from rich.table import Table

    out.print(f"run {st['run_id']}: {st['status']} — {st['completed_rounds']}/{st.get('target_rounds')} rounds, "
              f"task {st.get('task')}, codec {st.get('codec')}, secure aggregation {st.get('secure_aggregation')}")
    if st.get("privacy"):
        pv = st["privacy"]
        target = f" of the target {pv['target_epsilon']}" if pv.get("target_epsilon") else ""
        out.print(f"privacy: {pv['mode']} DP, epsilon {pv['epsilon']:.4g} spent{target} (delta {pv['delta']:g})")
    cur = st.get("current_round") or {}
    if cur:
        line = cur.get("waiting", {}).get("message") or cur.get("phase", "")
        if "received" in cur:
            line += f": {cur['received']}/{cur['target']} updates, {cur.get('selected')} selected"
        out.print(f"round {cur.get('round')} (attempt {cur.get('attempt')}): {line}", highlight=False, soft_wrap=True)
    t = Table("round", "status", "participants", "per tier", "bytes up", "bytes down", "seconds", "metrics")
    for r in st["rounds"]:
        t.add_row(str(r["round"]), r["status"], str(r.get("participants", "")),
                  ", ".join(f"{k}={v}" for k, v in r.get("tier_participants", {}).items()),
                  str(r.get("bytes_up", "")), str(r.get("bytes_down", "")), str(r.get("seconds", "")),
                  ", ".join(f"{k}={v:.4g}" for k, v in r.get("metrics", {}).items() if not k.startswith("device.")))
    out.print(t)
    if st.get("personalization"):
        pz = st["personalization"]
        out.print(f"devices' own held-out accuracy (round {pz.get('round')}): "
                  + "; ".join(f"{m} adapter mean {pz[m]['mean']:.4f}, p10 {pz[m]['p10']:.4f}"
                              for m in ("global", "personal") if m in pz), highlight=False)
    if st.get("mode") == "async":
        buf = st.get("buffer") or {}
        hist = st.get("staleness_histogram") or {}
        fill = f"{buf['fill']}/{buf['size']} updates (serving version {buf['serving_version']})" if buf else "-"
        out.print(f"asynchronous: model version {st['model_version']}, buffer {fill}; staleness "
                  + (", ".join(f"{s}: {n}" for s, n in hist.items()) or "-"))


@app.command("stop")
def run_stop(server: Server, run: LatestRunArg = "latest", run_id: RunIdAlias = None,
             admin_token: AdminToken = None, ca_cert: CaCert = None, insecure: Insecure = False,
             data_dir: DataDirOpt = None) -> None:
    """Stop a running run: its open round closes now.

    RUN: a run id (orchard run list), or latest (the default): the run in progress."""
    run = _run_arg(run, run_id)
    with control(server, admin_token, ca_cert, insecure, data_dir) as ctl:
        if not ctl.stop(run):
            st = ctl.status(run)  # a run the root never had is refused here, in the root's words
            if st["run_id"] is None:
                fail("nothing to stop: this root has no run yet", EXIT_FAILED)
            fail(f"nothing to stop: run {st['run_id']} is {st['status']}, not running", EXIT_FAILED)
    out.print(f"stopped {run or 'the current run'}", highlight=False)


@app.command("list")
def run_list(server: Server,
             limit: Annotated[int, typer.Option("--limit", min=0, help="Newest N runs (0: all).")] = 0,
             as_json: Annotated[bool, typer.Option("--json", help="Print the runs as JSON.")] = False,
             admin_token: AdminToken = None, ca_cert: CaCert = None, insecure: Insecure = False,
             data_dir: DataDirOpt = None) -> None:
    """Every run the root has had, newest first."""
    with control(server, admin_token, ca_cert, insecure, data_dir) as ctl:
        runs = ctl.list_runs(limit)
    if as_json:
        out.print_json(json.dumps(runs))
        return
    if not runs:
        out.print("no runs yet")
        return
    from rich.table import Table

    t = Table()
    t.add_column("run", no_wrap=True)
    for col in ("status", "task", "rounds", "started", "error"):
        t.add_column(col)
    for r in runs:
        t.add_row(r["run_id"], r["status"], str(r["task"]), f"{r['completed_rounds']}/{r['target_rounds']}",
                  time.strftime("%Y-%m-%d %H:%M", time.localtime(r["created"])), r["error"])
    out.print(t)


@app.command("logs")
def run_logs(run: RunArg,
             server: Server,
             follow: Annotated[bool, typer.Option("--follow", "-f", help="Keep printing until the run ends.")] = False,
             as_json: Annotated[bool, typer.Option("--json", help="One JSON object per line.")] = False,
             poll_s: Annotated[float, typer.Option("--poll", min=0.05, help="Seconds between polls (--follow).")] = 0.5,
             admin_token: AdminToken = None, ca_cert: CaCert = None, insecure: Insecure = False,
             data_dir: DataDirOpt = None) -> None:
    """A run's log: round openings, waits, outcomes (refusals with reasons), the root's warnings.

    RUN: a run id (orchard run list), or latest."""
    from orchard.runs import log_records

    with control(server, admin_token, ca_cert, insecure, data_dir) as ctl:
        for rec in log_records(ctl, _run_arg(run), follow=follow, poll_s=poll_s):
            if as_json:
                typer.echo(json.dumps(rec))
            else:
                stamp = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(rec["t"]))
                out.print(f"{stamp} {rec['level']:<7} {rec['message']}", highlight=False, soft_wrap=True)


@app.command("pull")
def run_pull(run: RunArg,
             out_dir: Annotated[Path, typer.Option("--out", help="Directory to write (created if absent).")],
             server: Server,
             rnd: Annotated[int | None, typer.Option("--round", help="Round to pull (0: the initial model; "
                                                                     "default: the last completed).")] = None,
             as_json: Annotated[bool, typer.Option("--json", help="Print what was written as JSON.")] = False,
             admin_token: AdminToken = None, ca_cert: CaCert = None, insecure: Insecure = False,
             data_dir: DataDirOpt = None) -> None:
    """Download a run's global model: safetensors, a peft adapter (LoRA tasks), config and report.

    RUN: a run id (orchard run list), or latest."""
    from orchard.pull import check_writable, pull_run

    check_writable(out_dir)  # before any network call: a bad --out fails fast
    with control(server, admin_token, ca_cert, insecure, data_dir) as ctl:
        info = pull_run(ctl, _run_arg(run), rnd, out_dir)
    if as_json:
        out.print_json(json.dumps({k: v for k, v in info.items() if k != "config"}))
        return
    out.print(f"pulled {info['run_id']} round {info['round']} (sha256 {info['sha256'][:12]}…) into {out_dir}: "
              f"{', '.join(info['files'])}", highlight=False, soft_wrap=True)
