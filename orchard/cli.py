"""The ``orchard`` command. Each command is a short recipe: validate, build, run.

The CLI is the top of the dependency graph: it is the one module of the core package
that imports the subpackages, and it does so lazily inside each command so that
``orchard --help`` stays fast.
"""

from __future__ import annotations

import asyncio
import json
import logging
import signal
import sys
import time
from pathlib import Path
from typing import Annotated, Any, NoReturn

import typer
from rich.console import Console

from orchard.errors import OrchardError

console = Console(stderr=True)
out = Console()

app = typer.Typer(no_args_is_help=True, add_completion=False, pretty_exceptions_enable=False,
                  help="Orchard: hierarchical federated learning with secure aggregation and compressed updates.")
server_app = typer.Typer(no_args_is_help=True, help="The root server.")
aggregator_app = typer.Typer(no_args_is_help=True, help="An aggregator tier.")
client_app = typer.Typer(no_args_is_help=True, help="An edge client.")
run_app = typer.Typer(no_args_is_help=True, help="Start, watch and stop runs on a live root.")
nodes_app = typer.Typer(no_args_is_help=True, help="Nodes known to a root.")
certs_app = typer.Typer(no_args_is_help=True, help="TLS certificates.")
tokens_app = typer.Typer(no_args_is_help=True, help="Enrollment tokens.")
edge_app = typer.Typer(no_args_is_help=True, help="On-device inference from a client bundle.")
for name, sub in [("server", server_app), ("aggregator", aggregator_app), ("client", client_app), ("run", run_app),
                  ("nodes", nodes_app), ("certs", certs_app), ("tokens", tokens_app), ("edge", edge_app)]:
    app.add_typer(sub, name=name)

Insecure = Annotated[bool, typer.Option("--insecure", help="Loopback development: no TLS, open enrollment, no admin token.")]
CaCert = Annotated[Path | None, typer.Option("--ca-cert", help="CA certificate that signed the server's (TLS).")]
Token = Annotated[str | None, typer.Option("--token", envvar="ORCHARD_TOKEN", help="Enrollment token.")]
AdminToken = Annotated[str | None, typer.Option("--admin-token", help="Admin token (or ORCHARD_ADMIN_TOKEN).")]
DataDirOpt = Annotated[Path | None, typer.Option("--data-dir", help="The root's data dir: admin token and CA are read from it.")]


def _logging(verbose: bool) -> None:
    logging.basicConfig(level=logging.INFO if verbose else logging.WARNING,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")


def _fail(err: Exception) -> NoReturn:
    console.print(f"[bold red]error:[/] {err}", soft_wrap=True)
    raise typer.Exit(2)


def _run_async(coro: Any) -> Any:
    try:
        return asyncio.run(coro)
    except OrchardError as err:
        _fail(err)
    except KeyboardInterrupt:
        raise typer.Exit(130) from None


async def _serve_until_signal(handle: Any) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    await handle.stop(grace=2.0)


# ---------------------------------------------------------------------------- server


@server_app.command("start")
def server_start(
    data_dir: Annotated[Path, typer.Option("--data-dir", help="Store, checkpoints, TLS and admin token live here.")],
    port: Annotated[int, typer.Option("--port", help="0 picks a free port (written to DATA_DIR/server.json).")] = 7070,
    host: Annotated[str, typer.Option("--host")] = "127.0.0.1",
    config: Annotated[Path | None, typer.Option("--config", help="TOML with a \\[server] table (ServerConfig).")] = None,
    insecure: Insecure = False,
    tls_dir: Annotated[Path | None, typer.Option("--tls-dir", help="server.pem/server.key/ca.pem (default DATA_DIR/tls, created if absent).")] = None,
    metrics_port: Annotated[int | None, typer.Option("--metrics-port", help="Serve Prometheus metrics on this port.")] = None,
    dashboard_port: Annotated[int | None, typer.Option(
        "--dashboard-port", help="Serve the live read-only web dashboard on this port (HTTPS under TLS; needs the "
                                 "admin token; 0 picks a free port). Off by default.")] = None,
    base_model: Annotated[Path | None, typer.Option(
        "--base-model", help="Base model dir from `orchard pretrain`: runs of a LoRA task adapt it unless they name "
                             "their own.")] = None,
    verbose: Annotated[bool, typer.Option("--verbose", "-v")] = True,
) -> None:
    """Start the root server."""
    _logging(verbose)
    from orchard.config import ServerConfig, load_toml
    from orchard.server.app import start_root
    from orchard.server.process import tune_server_process

    scfg = ServerConfig.model_validate(load_toml(config).get("server", {})) if config else ServerConfig()

    async def main() -> None:
        h = await start_root(data_dir, host=host, port=port, insecure=insecure, server_cfg=scfg, tls_dir=tls_dir,
                             metrics_port=metrics_port, base_model=base_model, dashboard_port=dashboard_port)
        tune_server_process()
        console.print(f"[green]root listening on {h.address}[/] ({'INSECURE' if insecure else 'TLS'}); "
                      f"data in {data_dir}")
        if h.admin_token:
            console.print(f"admin token (shown once, also in {data_dir / 'admin.token'}): {h.admin_token}")
        if h.ca_cert:
            console.print(f"clients trust the CA at {h.ca_cert}")
        if h.dashboard is not None:
            console.print(f"dashboard: {h.dashboard.scheme}://{host}:{h.dashboard.port}/?token=ADMIN_TOKEN "
                          f"(the admin token; {'the CA above signs its certificate' if h.ca_cert else 'loopback only'})",
                          soft_wrap=True)
        await _serve_until_signal(h)

    _run_async(main())


# ---------------------------------------------------------------------------- aggregator


@aggregator_app.command("start")
def aggregator_start(
    upstream: Annotated[str, typer.Option("--upstream", help="HOST:PORT of the root or a higher aggregator.")],
    port: Annotated[int, typer.Option("--port")] = 0,
    host: Annotated[str, typer.Option("--host")] = "127.0.0.1",
    insecure: Insecure = False,
    token: Token = None,
    ca_cert: CaCert = None,
    tls_dir: Annotated[Path | None, typer.Option("--tls-dir", help="This aggregator's server.pem/server.key.")] = None,
    node_id: Annotated[str, typer.Option("--node-id")] = "",
    config: Annotated[Path | None, typer.Option("--config", help="TOML with a \\[server] table (ServerConfig).")] = None,
    metrics_port: Annotated[int | None, typer.Option("--metrics-port")] = None,
    port_file: Annotated[Path | None, typer.Option("--port-file", help="Write the bound port here.")] = None,
    verbose: Annotated[bool, typer.Option("--verbose", "-v")] = True,
) -> None:
    """Start an aggregator: serves clients below, dials its upstream."""
    _logging(verbose)
    from orchard.config import ServerConfig, load_toml
    from orchard.server.app import start_aggregator
    from orchard.server.process import tune_server_process

    scfg = ServerConfig.model_validate(load_toml(config).get("server", {})) if config else ServerConfig()

    async def main() -> None:
        h = await start_aggregator(upstream, host=host, port=port, insecure=insecure, token=token, ca_cert=ca_cert,
                                   tls_dir=tls_dir, node_id=node_id, metrics_port=metrics_port, server_cfg=scfg)
        tune_server_process()
        if port_file is not None:
            port_file.write_text(str(h.port))
        console.print(f"[green]aggregator {h.coordinator.name} listening on {h.address}[/], upstream {upstream}")
        await _serve_until_signal(h)

    _run_async(main())


# ---------------------------------------------------------------------------- client


def _warm_up(task: str | None, partition: int, num_partitions: int, seed: int,
             params: dict[str, Any] | None = None) -> None:
    """Build and run the trainer once before joining: torch's first optimizer import alone
    takes seconds, and a round should not wait for framework start-up."""
    if task is None:
        return
    from orchard.tasks import get_task
    from orchard.trainer import TrainConfig

    t = get_task(task, **(params or {}))
    t.client_trainer(partition, num_partitions, seed).train(t.initial_arrays(seed), TrainConfig(steps=1))


def _trainer_factory(task: str | None, flower_app: str | None, partition: int, num_partitions: int,
                     seed: int) -> Any:
    def factory(cfg: Any) -> Any:
        if flower_app:
            from orchard.client.flower_adapter import FlowerTrainer

            return FlowerTrainer(flower_app, partition_id=partition, num_partitions=num_partitions)
        from orchard.tasks import get_task

        name = task or cfg.task
        if task and cfg.task != task:
            raise OrchardError(f"this client trains task {task!r}, but the run is for {cfg.task!r}")
        return get_task(name, **cfg.task_params).client_trainer(partition, num_partitions, seed)

    return factory


def _load_policy(path: Path) -> Any:
    """A DevicePolicy from TOML: a [policy] table, or the whole file."""
    from pydantic import ValidationError

    from orchard.config import load_toml
    from orchard.edge_runtime.policy import DevicePolicy
    from orchard.errors import ConfigError

    raw = load_toml(path)
    try:
        return DevicePolicy.model_validate(raw.get("policy", raw))
    except ValidationError as err:
        raise ConfigError([f"{path}: policy.{'.'.join(map(str, e['loc']))}: {e['msg']}"
                           for e in err.errors()]) from None


@client_app.command("start")
def client_start(
    server: Annotated[str | None, typer.Option("--server", help="HOST:PORT of an aggregator or the root.")] = None,
    task: Annotated[str | None, typer.Option("--task", help="Reference task whose data this client holds.")] = None,
    partition: Annotated[int, typer.Option("--partition", help="This client's partition index K.")] = 0,
    num_partitions: Annotated[int, typer.Option("--num-partitions", help="N partitions in all.")] = 1,
    flower_app: Annotated[str | None, typer.Option("--flower-app", help="module:attr of a Flower ClientApp.")] = None,
    insecure: Insecure = False,
    token: Token = None,
    ca_cert: CaCert = None,
    node_id: Annotated[str, typer.Option("--node-id")] = "",
    state_dir: Annotated[Path | None, typer.Option("--state-dir", help="Persist device-side codec state here.")] = None,
    max_tasks: Annotated[int | None, typer.Option("--max-tasks", help="Exit after this many tasks.")] = None,
    bundle: Annotated[Path | None, typer.Option("--bundle", help="Run from a client bundle dir (server, token, CA, policy).")] = None,
    policy: Annotated[Path | None, typer.Option("--policy", help="Device policy TOML: train under its budgets (overrides the bundle's).")] = None,
    systemd: Annotated[bool, typer.Option("--systemd", help="Print a systemd unit for this bundle and exit.")] = False,
    runtime: Annotated[str, typer.Option("--runtime", help="torch, or executorch: train through the bundle's "
                                         "ExecuTorch training program, without torch.")] = "torch",
    data: Annotated[Path | None, typer.Option("--data", help="With --runtime executorch: the device's own data "
                                              "(its text, or an .npz of x and y token windows).")] = None,
    seed: Annotated[int, typer.Option("--seed")] = 0,
    verbose: Annotated[bool, typer.Option("--verbose", "-v")] = True,
) -> None:
    """Start an edge client: join, long-poll, train (under the device policy's budgets), push."""
    _logging(verbose)
    device_policy = None
    task_params: dict[str, Any] = {}
    device_factory: Any = None
    try:
        if runtime not in ("torch", "executorch"):
            raise OrchardError(f"--runtime must be torch or executorch, got {runtime!r}")
        if runtime == "executorch":
            if bundle is None or flower_app is not None:
                raise OrchardError("--runtime executorch trains a bundle's training program: pass --bundle DIR "
                                   "(and no --flower-app)")
            from orchard.edge_runtime.et_trainer import executorch_trainer_factory

            # Loads and checks the bundle's training program now: a bad bundle is
            # refused before the client joins.
            device_factory = executorch_trainer_factory(bundle, data_path=data, seed=seed)
        if bundle is not None:
            from orchard.edge_runtime.bundle import read_bundle, systemd_unit
            from orchard.edge_runtime.bundle_task import read_bundle_task

            b = read_bundle(bundle)
            if systemd:
                # The console script next to this interpreter (a venv's bin/), so the
                # unit runs this installation, not whatever "orchard" PATH finds first.
                exe = Path(sys.executable).parent / "orchard"
                # Plain echo: rich would wrap the long ExecStart line, breaking the unit.
                typer.echo(systemd_unit(bundle, exe if exe.is_file() else "orchard"), nl=False)
                return
            sidecar = read_bundle_task(bundle)
            server = server or b.config.server_address
            token = token or b.enrollment_token()
            ca_cert = ca_cert or b.ca_cert_path
            device_policy = b.config.policy
            if task is None and sidecar is not None and flower_app is None:
                task, task_params = sidecar.task, sidecar.task_params
        elif systemd:
            raise OrchardError("--systemd prints the unit of a bundle: pass --bundle DIR")
        if policy is not None:
            device_policy = _load_policy(policy)
    except OrchardError as err:
        _fail(err)
    if server is None:
        _fail(OrchardError("--server HOST:PORT is required (or --bundle DIR)"))
    if task is None and flower_app is None:
        _fail(OrchardError("pass --task NAME (a reference task) or --flower-app module:app"))
    from orchard.client.runtime import ClientRuntime
    from orchard.link import FleetLink, LinkConfig
    from orchard.typing import Role

    edge = None
    if device_policy is not None:
        from orchard.client.edge import EdgeGovernance
        from orchard.edge_runtime.device import default_provider

        # The host's own sensors (sysfs, else psutil) and real time: the governor paces
        # the actual device.
        edge = EdgeGovernance(default_provider(), device_policy)

    if device_factory is None:
        _warm_up(task, partition, num_partitions, seed, task_params)

    async def main() -> None:
        link = FleetLink(LinkConfig(target=server, role=Role.CLIENT, token=token, ca_cert=ca_cert, insecure=insecure,
                                    node_id=node_id, capabilities=(("task", task or "flower"),)))
        factory = device_factory or _trainer_factory(task, flower_app, partition, num_partitions, seed)
        rt = ClientRuntime(link, factory, partition_id=partition, state_dir=state_dir, seed=seed, edge=edge)
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        runner = asyncio.create_task(rt.run(max_tasks=max_tasks, stop=stop))
        stopper = asyncio.create_task(stop.wait())
        await asyncio.wait({runner, stopper}, return_when=asyncio.FIRST_COMPLETED)
        for t in (runner, stopper):
            t.cancel()
        if runner.done() and not runner.cancelled() and runner.exception() is not None:
            raise runner.exception()  # type: ignore[misc]
        await link.close()

    _run_async(main())


@client_app.command("health")
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


def _pull_current_adapter(server: str, task: str, run_id: str, admin_token: str | None, ca_cert: Path | None,
                          insecure: bool, data_dir: Path | None) -> tuple[Any, int] | None:
    """(global arrays, round) of the root's latest global model for ``task``, or None when
    the root cannot be reached or has no run yet (the bundle then ships the initial adapter)."""
    import grpc

    from orchard import wire

    try:
        with _control(server, admin_token, ca_cert, insecure, data_dir) as ctl:
            st = ctl.status(run_id)
            if st.get("run_id") is None:
                console.print("[yellow]the root has no run yet: bundling the task's initial adapter[/]")
                return None
            if st.get("task") != task:
                raise OrchardError(f"the root's run {st['run_id']} trains task {st.get('task')!r}, "
                                   f"not {task!r}: pass --task {st.get('task')}")
            blob = ctl.pull_global(st["run_id"], -1)
            return wire.blob_to_arrays(blob), int(st.get("completed_rounds", 0))
    except grpc.RpcError as err:
        code = err.code()  # type: ignore[attr-defined]
        if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
            console.print(f"[yellow]root {server} not reachable ({code.name}): bundling the task's "
                          "initial adapter[/]")
            return None
        raise OrchardError(f"pulling the global model from {server} failed: {code.name}: "
                           f"{err.details()}") from None  # type: ignore[attr-defined]


@client_app.command("bundle")
def client_bundle(
    server: Annotated[str, typer.Option("--server", help="HOST:PORT the device will dial.")],
    out_dir: Annotated[Path, typer.Option("--out", help="Bundle dir to write.")],
    task: Annotated[str, typer.Option("--task", help="A LoRA reference task.")] = "shakespeare",
    task_params: Annotated[str | None, typer.Option("--task-params", help="Task parameters as JSON, e.g. '{\"lora_rank\": 4}'.")] = None,
    token: Token = None,
    ca_cert: CaCert = None,
    policy: Annotated[Path | None, typer.Option("--policy", help="Device policy TOML (eligibility, window, budget, pacing).")] = None,
    admin_token: AdminToken = None,
    data_dir: DataDirOpt = None,
    run_id: Annotated[str, typer.Option("--run-id", help="Run whose global adapter to ship (default: the latest).")] = "",
    insecure: Insecure = False,
    overwrite: Annotated[bool, typer.Option("--overwrite", help="Replace an existing bundle.")] = False,
    training_program: Annotated[bool, typer.Option("--training-program/--no-training-program",
                                                   help="Also write the task's ExecuTorch training program.")] = True,
) -> None:
    """Write what a device needs: base ONNX model, current adapter, config with budgets, CA, token,
    and the task's ExecuTorch training program (for --runtime executorch).

    With --admin-token or --data-dir (or --insecure) the adapter is the root's latest
    global model; otherwise, or when the root is not reachable, the task's initial one."""
    from orchard.edge_runtime.task_bundle import write_task_bundle
    from orchard.tasks import get_task

    try:
        params = json.loads(task_params) if task_params else {}
        if not isinstance(params, dict):
            raise OrchardError(f"--task-params must be a JSON object, got {task_params!r}")
        device_policy = _load_policy(policy) if policy is not None else None
        if ca_cert is None and data_dir is not None and (data_dir / "tls" / "ca.pem").is_file():
            ca_cert = data_dir / "tls" / "ca.pem"
        pulled = None
        if admin_token or data_dir is not None or insecure:
            pulled = _pull_current_adapter(server, task, run_id, admin_token, ca_cert, insecure, data_dir)
        arrays, version = pulled if pulled is not None else (None, 0)
        b = write_task_bundle(out_dir, task=get_task(task, **params), server_address=server, global_arrays=arrays,
                              adapter_version=version, policy=device_policy, ca_cert=ca_cert,
                              enrollment_token=token, training_program=training_program, overwrite=overwrite)
    except json.JSONDecodeError as err:
        _fail(OrchardError(f"--task-params is not JSON: {err}"))
    except OrchardError as err:
        _fail(err)
    out.print(f"bundle written to {b.path}: task {task}, adapter version {b.config.adapter_version}"
              f"{', CA' if b.config.ca_cert else ''}{', enrollment token' if b.config.enrollment_token else ''}")


@edge_app.command("infer")
def edge_infer(
    bundle: Annotated[Path, typer.Option("--bundle", help="Client bundle dir.")],
    text: Annotated[str | None, typer.Option("--text", help="Prompt: print the predicted next characters.")] = None,
    input_file: Annotated[Path | None, typer.Option("--input", help="Model input as .npy: print a logits summary.")] = None,
    top_k: Annotated[int, typer.Option("--top-k", help="How many next characters to list.")] = 5,
    generate: Annotated[int, typer.Option("--generate", help="Greedy continuation length (characters).")] = 40,
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON.")] = False,
) -> None:
    """Run the bundle's base model with its active adapter through ONNX Runtime (no torch)."""
    if (text is None) == (input_file is None):
        _fail(OrchardError("pass exactly one of --text PROMPT or --input FILE.npy"))
    import numpy as np

    from orchard.edge_runtime import infer

    try:
        if text is not None:
            p = infer.predict_text(bundle, text, top_k=top_k, generate=generate)
            if as_json:
                out.print_json(json.dumps({"prompt": p.prompt, "adapter_version": p.adapter_version,
                                           "top": [{"char": c.char, "p": c.probability} for c in p.top],
                                           "continuation": p.continuation}))
                return
            out.print(f"adapter version {p.adapter_version}; next character after {p.prompt!r}:", highlight=False)
            for c in p.top:
                out.print(f"  {c.char!r:>6}  {c.probability:.3f}", highlight=False)
            out.print(f"greedy continuation: {p.prompt + p.continuation!r}", highlight=False, soft_wrap=True)
        elif input_file is not None:
            arr = np.load(input_file, allow_pickle=False)
            s = infer.summarize_array(bundle, arr)
            summary = {"shape": list(s.shape), "dtype": s.dtype, "min": s.min, "max": s.max, "mean": s.mean,
                       "argmax_last": s.argmax_last}
            if as_json:
                out.print_json(json.dumps(summary))
                return
            out.print(f"logits {s.shape} {s.dtype}: min {s.min:.4g}, max {s.max:.4g}, mean {s.mean:.4g}; "
                      f"argmax at the last position per row: {s.argmax_last}", highlight=False, soft_wrap=True)
    except (OrchardError, OSError, ValueError) as err:
        _fail(err)


# ---------------------------------------------------------------------------- operators


def _control(server: str, admin_token: str | None, ca_cert: Path | None, insecure: bool, data_dir: Path | None):
    from orchard.ops import ControlClient, resolve_admin_token

    if ca_cert is None and data_dir is not None and (data_dir / "tls" / "ca.pem").is_file():
        ca_cert = data_dir / "tls" / "ca.pem"
    return ControlClient(server, admin_token=resolve_admin_token(admin_token, data_dir), ca_cert=ca_cert,
                         insecure=insecure)


def _grpc_guard(fn: Any) -> Any:
    import functools

    import grpc

    @functools.wraps(fn)
    def wrapper(*a: Any, **k: Any) -> Any:
        try:
            return fn(*a, **k)
        except grpc.RpcError as err:
            console.print(f"[bold red]error:[/] {err.code().name}: {err.details()}",  # type: ignore[attr-defined]
                          soft_wrap=True)
            raise typer.Exit(1) from None
        except OrchardError as err:
            _fail(err)
        except OSError as err:  # e.g. an unreadable --ca-cert
            _fail(OrchardError(f"{err.strerror or err}: {err.filename}" if err.filename else str(err)))

    return wrapper


def build_run_config(config: Path | None, overrides: dict[str, Any]) -> Any:
    from orchard.config import load_toml, parse_run_config

    data: dict[str, Any] = {}
    if config is not None:
        raw = load_toml(config)
        data = dict(raw.get("run", raw))
    for dotted, v in overrides.items():
        if v is None:
            continue
        d = data
        *parents, leaf = dotted.split(".")
        for p in parents:
            d = d.setdefault(p, {})
        d[leaf] = v
    return parse_run_config(data)


@run_app.command("start")
@_grpc_guard
def run_start(
    server: Annotated[str, typer.Option("--server")],
    task: Annotated[str | None, typer.Option("--task", help="Task; names the initial model.")] = None,
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
    from orchard import wire

    if detach and (tensorboard is not None or mlflow_uri or evaluate):
        _fail(OrchardError("--tensorboard, --mlflow-uri and --evaluate follow the run as it goes: drop --detach"))

    from orchard.simulation.defaults import parse_task_params

    cfg = build_run_config(config, {"task": task, "rounds": rounds, "cohort.target": clients_per_round,
                                    "codec.name": codec, "secure_aggregation.enabled": secure_aggregation,
                                    **{f"task_params.{k}": v for k, v in parse_task_params(task_param).items()}})
    with _control(server, admin_token, ca_cert, insecure, data_dir) as ctl:
        if base_model is None and "base" not in cfg.task_params:
            # The root's own base (`server start --base-model`), for a task that takes one.
            from orchard.tasks import task_params

            server_base = ctl.status().get("base_model")
            if server_base and "base" in task_params(cfg.task):
                base_model = Path(server_base)
        if base_model is not None:
            cfg = cfg.model_copy(update={"task_params": {**cfg.task_params, **base_model_params(cfg.task, base_model)}})
        if initial_arrays is not None:
            from safetensors.numpy import load_file

            blob = wire.arrays_to_blob(dict(load_file(str(initial_arrays))))
        else:
            from orchard.tasks import get_task

            blob = wire.arrays_to_blob(get_task(cfg.task, **cfg.task_params).initial_arrays(cfg.seed))
        from orchard.tracking import open_trackers

        track = open_trackers(tensorboard, mlflow_uri, "", {
            "task": cfg.task, "rounds": cfg.rounds, "clients_per_round": cfg.cohort.target, "codec": cfg.codec.name,
            "secure_aggregation": cfg.secure_aggregation.enabled, "seed": cfg.seed, "task_params": cfg.task_params,
            "server": server}, mlflow_experiment) if not detach else None
        run_id = ctl.start_run(cfg, blob)
        out.print(f"started {run_id}: task {cfg.task}, {cfg.rounds} rounds, {cfg.cohort.target} clients per round")
        if not detach:
            assert track is not None
            track.name_run(run_id)
            scorer = _round_scorer(ctl, run_id, cfg) if evaluate else None

            def on_round(r: dict[str, Any]) -> None:
                rec = {**r, **(scorer(r["round"]) if scorer else {})}
                if scorer:
                    out.print(f"round {r['round']}: accuracy {rec['accuracy']:.4f}, loss {rec['loss']:.4f}",
                              highlight=False)
                track.log_round(r["round"], rec)

            status = "failed"
            try:
                status = watch_run(ctl, run_id, cfg.rounds, on_round=on_round)["status"]
            finally:
                track.close(status)


def _round_scorer(ctl: Any, run_id: str, cfg: Any) -> Any:
    """Scores a round's global model on the task's held-out data, as the demo does."""
    from orchard import wire
    from orchard.tasks import get_task

    task = get_task(cfg.task, **cfg.task_params)

    def score(rnd: int) -> dict[str, float]:
        ev = task.evaluate(wire.blob_to_arrays(ctl.pull_global(run_id, rnd)))
        return {"accuracy": float(ev["accuracy"]), "loss": float(ev["loss"])}

    return score


def base_model_params(task: str, base_dir: Path) -> dict[str, Any]:
    """Task parameters that make a LoRA task adapt a base written by `orchard pretrain`.

    Clients load the base from this path, so it must exist where they run (the demo and
    the simulator share the machine; devices get the base in their bundle)."""
    from orchard.config import BASE_CONFIG, BASE_WEIGHTS, base_model_dir
    from orchard.tasks import task_params

    base_dir = base_model_dir(base_dir)
    cfg_path, weights = base_dir / BASE_CONFIG, base_dir / BASE_WEIGHTS
    accepted = task_params(task)
    arch = json.loads(cfg_path.read_text())["model"]
    wanted = {"base": str(weights.resolve()), **{k: arch[k] for k in ("seq_len", "n_layer", "n_head", "d_model")}}
    missing = [k for k in wanted if k not in accepted]
    if missing:
        raise OrchardError(f"task {task!r} cannot take a pretrained base (it has no parameters {missing}); "
                           "use a LoRA task such as shakespeare")
    return wanted


def watch_run(ctl: Any, run_id: str, rounds: int, on_round: Any = None, poll_s: float = 0.5) -> dict[str, Any]:
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    seen = 0
    with Progress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  TextColumn("{task.fields[info]}"), console=console, transient=False) as prog:
        bar = prog.add_task(run_id, total=rounds, info="")
        while True:
            st = ctl.status(run_id)
            done = [r for r in st["rounds"] if r["status"] == "completed"]
            for r in done[seen:]:
                if on_round is not None:
                    on_round(r)
            seen = len(done)
            cur = st.get("current_round") or {}
            info = f"round {cur.get('round', '-')}: {cur.get('phase', st['status'])}"
            if "waiting" in cur:
                info = f"round {cur.get('round', '-')}: {cur['waiting']['message']}"
            if "received" in cur:
                info += f" {cur['received']}/{cur['target']} updates"
            prog.update(bar, completed=st["completed_rounds"], info=info)
            if st["status"] != "running":
                prog.update(bar, info=st["status"] + (f": {st['error']}" if st.get("error") else ""))
                return st
            time.sleep(poll_s)


@run_app.command("status")
@_grpc_guard
def run_status(
    server: Annotated[str, typer.Option("--server")],
    run_id: Annotated[str, typer.Option("--run-id")] = "",
    as_json: Annotated[bool, typer.Option("--json", help="Print the full status as JSON.")] = False,
    admin_token: AdminToken = None,
    ca_cert: CaCert = None,
    insecure: Insecure = False,
    data_dir: DataDirOpt = None,
) -> None:
    """Round, participants per tier, bytes up and down, durations, metrics."""
    with _control(server, admin_token, ca_cert, insecure, data_dir) as ctl:
        st = ctl.status(run_id)
    if as_json:
        out.print_json(json.dumps(st))
        return
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
                  ", ".join(f"{k}={v:.4g}" for k, v in r.get("metrics", {}).items()))
    out.print(t)
    if st.get("mode") == "async":
        buf = st.get("buffer") or {}
        hist = st.get("staleness_histogram") or {}
        fill = f"{buf['fill']}/{buf['size']} updates (serving version {buf['serving_version']})" if buf else "-"
        out.print(f"asynchronous: model version {st['model_version']}, buffer {fill}; staleness "
                  + (", ".join(f"{s}: {n}" for s, n in hist.items()) or "-"))


@run_app.command("stop")
@_grpc_guard
def run_stop(server: Annotated[str, typer.Option("--server")], run_id: Annotated[str, typer.Option("--run-id")] = "",
             admin_token: AdminToken = None, ca_cert: CaCert = None, insecure: Insecure = False,
             data_dir: DataDirOpt = None) -> None:
    """Stop the current run after its open round."""
    with _control(server, admin_token, ca_cert, insecure, data_dir) as ctl:
        out.print("stopped" if ctl.stop(run_id) else "no such running run")


def _run_arg(run: str) -> str:
    return "" if run == "latest" else run


RunArg = Annotated[str, typer.Argument(metavar="RUN", help="A run id (see `orchard run list`), or 'latest'.")]


@run_app.command("list")
@_grpc_guard
def run_list(server: Annotated[str, typer.Option("--server")],
             limit: Annotated[int, typer.Option("--limit", min=0, help="Newest N runs (0: all).")] = 0,
             as_json: Annotated[bool, typer.Option("--json", help="Print the runs as JSON.")] = False,
             admin_token: AdminToken = None, ca_cert: CaCert = None, insecure: Insecure = False,
             data_dir: DataDirOpt = None) -> None:
    """Every run the root has had, newest first."""
    with _control(server, admin_token, ca_cert, insecure, data_dir) as ctl:
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


@run_app.command("logs")
@_grpc_guard
def run_logs(run: RunArg,
             server: Annotated[str, typer.Option("--server")],
             follow: Annotated[bool, typer.Option("--follow", "-f", help="Keep printing until the run ends.")] = False,
             as_json: Annotated[bool, typer.Option("--json", help="One JSON object per line.")] = False,
             poll_s: Annotated[float, typer.Option("--poll", min=0.05, help="Seconds between polls (--follow).")] = 0.5,
             admin_token: AdminToken = None, ca_cert: CaCert = None, insecure: Insecure = False,
             data_dir: DataDirOpt = None) -> None:
    """A run's log: round openings, waits, outcomes (refusals with reasons), the root's warnings."""
    with _control(server, admin_token, ca_cert, insecure, data_dir) as ctl:
        after, ended, quiet_since = 0, False, time.monotonic()
        while True:
            records, after, status = ctl.run_log(_run_arg(run), after)
            for rec in records:
                ended = ended or rec.get("event") == "run_end"
                if as_json:
                    typer.echo(json.dumps(rec))
                else:
                    stamp = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(rec["t"]))
                    out.print(f"{stamp} {rec['level']:<7} {rec['message']}", highlight=False, soft_wrap=True)
            if records:
                quiet_since = time.monotonic()
            # Follow until the run's closing line; a log without one (the root stopped
            # while the run ran) ends once the run is over and the log has been quiet.
            if not follow or ended or (status != "running" and time.monotonic() - quiet_since > 3.0):
                return
            if not records:
                time.sleep(poll_s)


@run_app.command("pull")
@_grpc_guard
def run_pull(run: RunArg,
             out_dir: Annotated[Path, typer.Option("--out", help="Directory to write (created if absent).")],
             server: Annotated[str, typer.Option("--server")],
             rnd: Annotated[int | None, typer.Option("--round", help="Round to pull (0: the initial model; "
                                                                     "default: the last completed).")] = None,
             as_json: Annotated[bool, typer.Option("--json", help="Print what was written as JSON.")] = False,
             admin_token: AdminToken = None, ca_cert: CaCert = None, insecure: Insecure = False,
             data_dir: DataDirOpt = None) -> None:
    """Download a run's global model: safetensors, a peft adapter (LoRA tasks), config and report."""
    from orchard.pull import check_writable, pull_run

    check_writable(out_dir)  # before any network call: a bad --out fails fast
    with _control(server, admin_token, ca_cert, insecure, data_dir) as ctl:
        info = pull_run(ctl, _run_arg(run), rnd, out_dir)
    if as_json:
        out.print_json(json.dumps({k: v for k, v in info.items() if k != "config"}))
        return
    out.print(f"pulled {info['run_id']} round {info['round']} (sha256 {info['sha256'][:12]}…) into {out_dir}: "
              f"{', '.join(info['files'])}", highlight=False, soft_wrap=True)


@nodes_app.command("list")
@_grpc_guard
def nodes_list(server: Annotated[str, typer.Option("--server")], as_json: Annotated[bool, typer.Option("--json")] = False,
               admin_token: AdminToken = None, ca_cert: CaCert = None, insecure: Insecure = False,
               data_dir: DataDirOpt = None) -> None:
    """Nodes joined directly to the root (aggregators report their pools)."""
    with _control(server, admin_token, ca_cert, insecure, data_dir) as ctl:
        nodes = ctl.nodes()
    if as_json:
        out.print_json(json.dumps(nodes))
        return
    from rich.table import Table

    t = Table("node", "role", "live", "pool", "eligible")
    for n in nodes:
        t.add_row(n["node_id"], n["role"], str(n["live"]), str(n["pool_size"]), str(n["pool_eligible"]))
    out.print(t)


@app.command("validate")
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


@certs_app.command("init")
def certs_init(out_dir: Annotated[Path, typer.Option("--out")],
               host: Annotated[list[str] | None, typer.Option("--host", help="Server names/IPs (repeatable).")] = None) -> None:
    """Make a CA and a server certificate (for the root and aggregators)."""
    from orchard.server.tls import init_certs

    p = init_certs(out_dir, host)
    out.print(f"CA {p.ca_cert}; server certificate {p.server_cert} (key {p.server_key}, mode 0600)")


@tokens_app.command("issue")
def tokens_issue(data_dir: Annotated[Path, typer.Option("--data-dir")],
                 role: Annotated[str, typer.Option("--role", help="client or aggregator")] = "client",
                 count: Annotated[int, typer.Option("--count")] = 1,
                 label: Annotated[str, typer.Option("--label")] = "") -> None:
    """Issue enrollment tokens (stored hashed in the root's store; printed once)."""
    from orchard.server.store import SQLiteStore

    if role not in ("client", "aggregator"):
        _fail(OrchardError(f"--role must be client or aggregator, got {role!r}"))
    data_dir.mkdir(parents=True, exist_ok=True)
    st = SQLiteStore(data_dir / "orchard.db")
    try:
        for _ in range(count):
            out.print(st.issue_token(role, label), highlight=False)
    finally:
        st.close()


@app.command("demo")
def demo(
    rounds: Annotated[int, typer.Option("--rounds")] = 5,
    aggregators: Annotated[int, typer.Option("--aggregators")] = 2,
    clients: Annotated[int, typer.Option("--clients")] = 6,
    task: Annotated[str, typer.Option("--task")] = "digits",
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

    try:
        report = run_demo(DemoSpec(rounds=rounds, aggregators=aggregators, clients=clients, task=task,
                                   out=out_dir, codec=codec, secure_aggregation=secure_aggregation,
                                   insecure=insecure, dp_epsilon=dp_epsilon, dashboard_port=dashboard_port,
                                   linger_s=linger),
                          console=out)
    except OrchardError as err:
        _fail(err)
    out.print(f"report: {out_dir / 'report.json'}; plot: {report.get('plot')}")


@app.command("baseline")
def baseline(task: Annotated[str, typer.Option("--task")],
             epochs: Annotated[int | None, typer.Option("--epochs")] = None) -> None:
    """Train the task's model centrally on the pooled training data: the reference accuracy."""
    from orchard.tasks.baseline import run_baseline

    kw = {} if epochs is None else {"epochs": epochs}
    try:
        res = run_baseline(task, **kw)
    except OrchardError as err:
        _fail(err)
    out.print_json(json.dumps(res))


def _register_simulate() -> None:
    from orchard.simulation.cli import simulate

    app.command("simulate", help="Simulate a federation in-process through the real client and tier code.")(simulate)


_register_simulate()


@app.command("pretrain", context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
def pretrain(ctx: typer.Context,
             config: Annotated[Path, typer.Option("--config", help="Pretraining TOML (see configs/).")]) -> None:
    """Pretrain the base model (also: torchrun --nproc-per-node N -m orchard.pretrain --config ...).

    Extra flags are dotted config overrides, e.g. --steps 500 --optim.lr 3e-4."""
    from orchard.pretrain.__main__ import main as pretrain_main

    raise typer.Exit(pretrain_main(["--config", str(config), *ctx.args]))


def main() -> None:
    app()


if __name__ == "__main__":
    main()
