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
    console.print(f"[bold red]error:[/] {err}")
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
    config: Annotated[Path | None, typer.Option("--config", help="TOML with a [server] table (ServerConfig).")] = None,
    insecure: Insecure = False,
    tls_dir: Annotated[Path | None, typer.Option("--tls-dir", help="server.pem/server.key/ca.pem (default DATA_DIR/tls, created if absent).")] = None,
    metrics_port: Annotated[int | None, typer.Option("--metrics-port", help="Serve Prometheus metrics on this port.")] = None,
    base_model: Annotated[Path | None, typer.Option("--base-model", help="Pretrained base model dir (from `orchard pretrain`).")] = None,
    verbose: Annotated[bool, typer.Option("--verbose", "-v")] = True,
) -> None:
    """Start the root server."""
    _logging(verbose)
    from orchard.config import ServerConfig, load_toml
    from orchard.server.app import start_root

    scfg = ServerConfig.model_validate(load_toml(config).get("server", {})) if config else ServerConfig()
    if base_model is not None and not (base_model / "config.json").is_file():
        _fail(OrchardError(f"--base-model {base_model} has no config.json; pass a dir written by `orchard pretrain`"))

    async def main() -> None:
        h = await start_root(data_dir, host=host, port=port, insecure=insecure, server_cfg=scfg, tls_dir=tls_dir,
                             metrics_port=metrics_port)
        if base_model is not None:
            (data_dir / "base_model").write_text(str(base_model.resolve()))
        console.print(f"[green]root listening on {h.address}[/] ({'INSECURE' if insecure else 'TLS'}); "
                      f"data in {data_dir}")
        if h.admin_token:
            console.print(f"admin token (shown once, also in {data_dir / 'admin.token'}): {h.admin_token}")
        if h.ca_cert:
            console.print(f"clients trust the CA at {h.ca_cert}")
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
    config: Annotated[Path | None, typer.Option("--config", help="TOML with a [server] table (ServerConfig).")] = None,
    metrics_port: Annotated[int | None, typer.Option("--metrics-port")] = None,
    port_file: Annotated[Path | None, typer.Option("--port-file", help="Write the bound port here.")] = None,
    verbose: Annotated[bool, typer.Option("--verbose", "-v")] = True,
) -> None:
    """Start an aggregator: serves clients below, dials its upstream."""
    _logging(verbose)
    from orchard.config import ServerConfig, load_toml
    from orchard.server.app import start_aggregator

    scfg = ServerConfig.model_validate(load_toml(config).get("server", {})) if config else ServerConfig()

    async def main() -> None:
        h = await start_aggregator(upstream, host=host, port=port, insecure=insecure, token=token, ca_cert=ca_cert,
                                   tls_dir=tls_dir, node_id=node_id, metrics_port=metrics_port, server_cfg=scfg)
        if port_file is not None:
            port_file.write_text(str(h.port))
        console.print(f"[green]aggregator {h.coordinator.name} listening on {h.address}[/], upstream {upstream}")
        await _serve_until_signal(h)

    _run_async(main())


# ---------------------------------------------------------------------------- client


def _warm_up(task: str | None, partition: int, num_partitions: int, seed: int) -> None:
    """Build and run the trainer once before joining: torch's first optimizer import alone
    takes seconds, and a round should not wait for framework start-up."""
    if task is None:
        return
    from orchard.tasks import get_task
    from orchard.trainer import TrainConfig

    t = get_task(task)
    t.client_trainer(partition, num_partitions, seed).train(t.initial_arrays(seed), TrainConfig(steps=1))


def _trainer_factory(task: str | None, flower_app: str | None, partition: int, num_partitions: int, seed: int):
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
    bundle: Annotated[Path | None, typer.Option("--bundle", help="Run from a client bundle dir.")] = None,
    systemd: Annotated[bool, typer.Option("--systemd", help="Print a systemd unit for this bundle and exit.")] = False,
    seed: Annotated[int, typer.Option("--seed")] = 0,
    verbose: Annotated[bool, typer.Option("--verbose", "-v")] = True,
) -> None:
    """Start an edge client: join, long-poll, train, push."""
    _logging(verbose)
    if bundle is not None:
        from orchard.edge_runtime import bundle as bundle_mod

        b = bundle_mod.read_bundle(bundle)
        if systemd:
            out.print(bundle_mod.systemd_unit(bundle, sys.executable), highlight=False)
            return
        server = server or b.server
        token = token or b.token
        ca_cert = ca_cert or b.ca_cert
        task = task or b.task
        partition = b.partition if partition == 0 else partition
        num_partitions = b.num_partitions if num_partitions == 1 else num_partitions
    if server is None:
        _fail(OrchardError("--server HOST:PORT is required (or --bundle DIR)"))
    if task is None and flower_app is None:
        _fail(OrchardError("pass --task NAME (a reference task) or --flower-app module:app"))
    from orchard.client.runtime import ClientRuntime
    from orchard.link import FleetLink, LinkConfig
    from orchard.typing import Role

    _warm_up(task, partition, num_partitions, seed)

    async def main() -> None:
        link = FleetLink(LinkConfig(target=server, role=Role.CLIENT, token=token, ca_cert=ca_cert, insecure=insecure,
                                    node_id=node_id, capabilities=(("task", task or "flower"),)))
        rt = ClientRuntime(link, _trainer_factory(task, flower_app, partition, num_partitions, seed),
                           partition_id=partition, state_dir=state_dir, seed=seed)
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


@client_app.command("bundle")
def client_bundle(
    server: Annotated[str, typer.Option("--server", help="HOST:PORT the device will dial.")],
    out_dir: Annotated[Path, typer.Option("--out", help="Bundle dir to write.")],
    task: Annotated[str, typer.Option("--task")] = "digits",
    partition: Annotated[int, typer.Option("--partition")] = 0,
    num_partitions: Annotated[int, typer.Option("--num-partitions")] = 1,
    token: Token = None,
    ca_cert: CaCert = None,
    base_model: Annotated[Path | None, typer.Option("--base-model", help="Pretrained base model dir.")] = None,
) -> None:
    """Write what a device needs: base ONNX model, adapter, config with budgets, CA, token."""
    from orchard.edge_runtime import bundle as bundle_mod

    try:
        p = bundle_mod.make_bundle(out_dir, server=server, task=task, partition=partition,
                                   num_partitions=num_partitions, token=token, ca_cert=ca_cert,
                                   base_model=base_model)
    except OrchardError as err:
        _fail(err)
    out.print(f"bundle written to {p}")


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
            console.print(f"[bold red]error:[/] {err.code().name}: {err.details()}")  # type: ignore[attr-defined]
            raise typer.Exit(1) from None
        except OrchardError as err:
            _fail(err)

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
    detach: Annotated[bool, typer.Option("--detach", help="Return once the run is started.")] = False,
    admin_token: AdminToken = None,
    ca_cert: CaCert = None,
    insecure: Insecure = False,
    data_dir: DataDirOpt = None,
) -> None:
    """Start a run against a live root; without --detach, show progress until it ends."""
    from orchard import wire

    cfg = build_run_config(config, {"task": task, "rounds": rounds, "cohort.target": clients_per_round,
                                    "codec.name": codec, "secure_aggregation.enabled": secure_aggregation})
    if initial_arrays is not None:
        from safetensors.numpy import load_file

        blob = wire.arrays_to_blob(dict(load_file(str(initial_arrays))))
    else:
        from orchard.tasks import get_task

        blob = wire.arrays_to_blob(get_task(cfg.task, **cfg.task_params).initial_arrays(cfg.seed))
    with _control(server, admin_token, ca_cert, insecure, data_dir) as ctl:
        run_id = ctl.start_run(cfg, blob)
        out.print(f"started {run_id}: task {cfg.task}, {cfg.rounds} rounds, {cfg.cohort.target} clients per round")
        if not detach:
            watch_run(ctl, run_id, cfg.rounds)


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
    t = Table("round", "status", "participants", "per tier", "bytes up", "bytes down", "seconds", "metrics")
    for r in st["rounds"]:
        t.add_row(str(r["round"]), r["status"], str(r.get("participants", "")),
                  ", ".join(f"{k}={v}" for k, v in r.get("tier_participants", {}).items()),
                  str(r.get("bytes_up", "")), str(r.get("bytes_down", "")), str(r.get("seconds", "")),
                  ", ".join(f"{k}={v:.4g}" for k, v in r.get("metrics", {}).items()))
    out.print(t)


@run_app.command("stop")
@_grpc_guard
def run_stop(server: Annotated[str, typer.Option("--server")], run_id: Annotated[str, typer.Option("--run-id")] = "",
             admin_token: AdminToken = None, ca_cert: CaCert = None, insecure: Insecure = False,
             data_dir: DataDirOpt = None) -> None:
    """Stop the current run after its open round."""
    with _control(server, admin_token, ca_cert, insecure, data_dir) as ctl:
        out.print("stopped" if ctl.stop(run_id) else "no such running run")


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
    from orchard.server.store import Store

    if role not in ("client", "aggregator"):
        _fail(OrchardError(f"--role must be client or aggregator, got {role!r}"))
    data_dir.mkdir(parents=True, exist_ok=True)
    st = Store(data_dir / "orchard.db")
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
) -> None:
    """A real local federation: root, aggregators and clients as processes over TLS."""
    from orchard.demo import DemoSpec, run_demo

    try:
        report = run_demo(DemoSpec(rounds=rounds, aggregators=aggregators, clients=clients, task=task,
                                   out=out_dir, codec=codec, secure_aggregation=secure_aggregation,
                                   insecure=insecure), console=out)
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
