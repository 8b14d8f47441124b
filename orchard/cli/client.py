"""``orchard client start | health | bundle``: an edge client and the bundle it runs from."""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path
from typing import Annotated

import typer

from orchard.cli.common import (
    AdminToken,
    CaCert,
    DataDirOpt,
    Insecure,
    Token,
    Verbose,
    console,
    control,
    fail,
    out,
    setup_logging,
    stop_on_signal,
)
from orchard.errors import OrchardError
from orchard.files import restrict_umask

app = typer.Typer(no_args_is_help=True, help="An edge client.")


@app.command("start")
def client_start(
    server: Annotated[str | None, typer.Option("--server", help="HOST:PORT of an aggregator or the root.")] = None,
    task: Annotated[str | None, typer.Option("--task", help="The task whose data this client holds: a registered name "
                                             "(orchard tasks list) or an import path package.module:build.")] = None,
    partition: Annotated[int, typer.Option("--partition", help="This client's partition index K.")] = 0,
    num_partitions: Annotated[int, typer.Option("--num-partitions", help="N partitions in all.")] = 1,
    flower_app: Annotated[str | None, typer.Option("--flower-app", help="module:attr of a Flower ClientApp.")] = None,
    insecure: Insecure = False,
    token: Token = None,
    ca_cert: CaCert = None,
    node_id: Annotated[str, typer.Option("--node-id")] = "",
    state_dir: Annotated[Path | None, typer.Option("--state-dir", help="Persist device-side codec state and personal adapters here.")] = None,
    max_tasks: Annotated[int | None, typer.Option("--max-tasks", help="Exit after this many tasks.")] = None,
    bundle: Annotated[Path | None, typer.Option("--bundle", help="Run from a client bundle dir (server, token, CA, policy).")] = None,
    policy: Annotated[Path | None, typer.Option("--policy", help="Device policy TOML: train under its budgets (overrides the bundle's).")] = None,
    systemd: Annotated[bool, typer.Option("--systemd", help="Print a systemd unit for this bundle and exit.")] = False,
    runtime: Annotated[str, typer.Option("--runtime", help="torch, or executorch: train through the bundle's "
                                         "ExecuTorch training program, without torch.")] = "torch",
    data: Annotated[Path | None, typer.Option("--data", help="The device's own data: with --runtime executorch, its text "
                                              "or an .npz of x and y token windows; in a continual run, the file or "
                                              "directory its samples are appended to.")] = None,
    seed: Annotated[int, typer.Option("--seed")] = 0,
    verbose: Verbose = True,
) -> None:
    """Start an edge client: join, long-poll, train (under the device policy's budgets), push."""
    restrict_umask()  # whatever it writes is owner-only (orchard.files)
    setup_logging(verbose)
    from orchard.client.launch import ClientOptions, resolve_client, serve_client, warm_up

    try:
        if systemd:
            _print_systemd_unit(bundle)
            return
        setup = resolve_client(ClientOptions(
            server=server, task=task, partition=partition, num_partitions=num_partitions, flower_app=flower_app,
            insecure=insecure, token=token, ca_cert=ca_cert, node_id=node_id, state_dir=state_dir, bundle=bundle,
            policy=policy, runtime=runtime, data=data, seed=seed))
        warm_up(setup)
    except OrchardError as err:
        fail(err)

    async def main() -> None:
        await serve_client(setup, stop=stop_on_signal(), max_tasks=max_tasks)

    asyncio.run(main())


def _print_systemd_unit(bundle: Path | None) -> None:
    from orchard.edge_runtime.bundle import read_bundle, systemd_unit

    if bundle is None:
        raise OrchardError("--systemd prints the unit of a bundle: pass --bundle DIR")
    read_bundle(bundle)  # an intact bundle, or say why not
    # The console script next to this interpreter (a venv's bin/), so the unit runs this
    # installation, not whatever "orchard" PATH finds first.
    exe = Path(sys.executable).parent / "orchard"
    # Plain echo: rich would wrap the long ExecStart line, breaking the unit.
    typer.echo(systemd_unit(bundle, exe if exe.is_file() else "orchard"), nl=False)


@app.command("health")
def client_health(
    bundle: Annotated[Path, typer.Option("--bundle", help="The client's bundle dir.")],
    timeout_s: Annotated[float, typer.Option("--timeout", min=0.1, help="Seconds to wait for the server.")] = 5.0,
) -> None:
    """Exit 0 when the bundle is intact and its server accepts a connection (a container
    HEALTHCHECK); else print why on one line and exit 1."""
    import socket

    from orchard.edge_runtime.bundle import read_bundle

    try:
        b = read_bundle(bundle)
    except OrchardError as err:
        console.print(f"[bold red]unhealthy:[/] {err}", soft_wrap=True)
        raise typer.Exit(1) from None
    host, _, port = b.config.server_address.rpartition(":")
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s):
            pass
    except (OSError, ValueError) as err:
        console.print(f"[bold red]unhealthy:[/] cannot reach {b.config.server_address}: {err}", soft_wrap=True)
        raise typer.Exit(1) from None
    out.print(f"ok: bundle intact, {b.config.server_address} reachable", highlight=False)


@app.command("bundle")
def client_bundle(
    server: Annotated[str, typer.Option("--server", help="HOST:PORT the device will dial.")],
    out_dir: Annotated[Path, typer.Option("--out", help="Bundle dir to write.")],
    task: Annotated[str, typer.Option("--task", help="The task: a registered name (orchard tasks list) "
                                      "or an import path package.module:build.")] = "shakespeare",
    task_params: Annotated[str | None, typer.Option("--task-params", help="Task parameters as JSON, e.g. '{\"lora_rank\": 4}'.")] = None,
    token: Token = None,
    ca_cert: CaCert = None,
    policy: Annotated[Path | None, typer.Option("--policy", help="Device policy TOML (eligibility, window, budget, pacing).")] = None,
    admin_token: AdminToken = None,
    data_dir: DataDirOpt = None,
    run_id: Annotated[str, typer.Option("--run-id", help="Run whose global adapter to ship: a run id, or 'latest' (the default).")] = "latest",
    insecure: Insecure = False,
    overwrite: Annotated[bool, typer.Option("--overwrite", help="Replace an existing bundle.")] = False,
    training_program: Annotated[bool, typer.Option("--training-program/--no-training-program",
                                                   help="Also write the task's ExecuTorch training program.")] = True,
) -> None:
    """Write what a device needs: base ONNX model, current adapter, config with budgets, CA, token,
    and the task's ExecuTorch training program (for --runtime executorch).

    With --admin-token or --data-dir (or --insecure) the adapter is the root's latest
    global model; otherwise, or when the root is not reachable, the task's initial one."""
    from orchard.client.launch import load_policy
    from orchard.edge_runtime.task_bundle import write_task_bundle
    from orchard.runs import LatestAdapter, latest_adapter
    from orchard.tasks import get_task

    try:
        params = json.loads(task_params) if task_params else {}
        if not isinstance(params, dict):
            raise OrchardError(f"--task-params must be a JSON object, got {task_params!r}")
        device_policy = load_policy(policy) if policy is not None else None
    except json.JSONDecodeError as err:
        fail(OrchardError(f"--task-params is not JSON: {err}"))
    except OrchardError as err:
        fail(err)
    if ca_cert is None and data_dir is not None and (data_dir / "tls" / "ca.pem").is_file():
        ca_cert = data_dir / "tls" / "ca.pem"
    adapter = LatestAdapter(None, 0)
    if admin_token or data_dir is not None or insecure:
        with control(server, admin_token, ca_cert, insecure, data_dir) as ctl:
            adapter = latest_adapter(ctl, task, "" if run_id == "latest" else run_id, server=server)
        if adapter.fallback:
            console.print(f"[yellow]{adapter.fallback}[/]")
    try:
        b = write_task_bundle(out_dir, task=get_task(task, **params), server_address=server,
                              global_arrays=adapter.arrays, adapter_version=adapter.version, policy=device_policy,
                              ca_cert=ca_cert, enrollment_token=token, training_program=training_program,
                              overwrite=overwrite, task_ref=task)
    except OrchardError as err:
        fail(err)
    out.print(f"bundle written to {b.path}: task {task}, adapter version {b.config.adapter_version}"
              f"{', CA' if b.config.ca_cert else ''}{', enrollment token' if b.config.enrollment_token else ''}")
