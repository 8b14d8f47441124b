"""``orchard demo``: a real local federation, end to end.

Starts a root, A aggregators and C clients as separate processes on loopback, over TLS
with enrollment tokens (unless ``--insecure``), runs R rounds of a real task, prints a
line per round with the global model's accuracy on the task's held-out test set,
writes ``DIR/report.json`` and ``DIR/report.png``, and shuts everything down.

Like the CLI, this module sits at the top of the dependency graph.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rich.console import Console

from orchard import wire
from orchard.config import CodecSpec, CohortConfig, RunConfig, SecureAggregationConfig
from orchard.errors import ConfigError, OrchardError
from orchard.files import open_private, private_dir
from orchard.trainer import TrainConfig

# Below this many clients a round the demo says what DP noise does to so small a cohort.
FEW_FOR_DP = 100

# The demo trains a task as the task declares (orchard.tasks.trains_with), as a run
# started from flags does: the same recipe, the same learning curve.
@dataclass(frozen=True)
class DemoSpec:
    rounds: int = 5
    aggregators: int = 2
    clients: int = 6
    task: str = "digits"
    out: Path = Path("demo-out")
    codec: str | None = None
    secure_aggregation: bool = False
    insecure: bool = False
    deadline_s: float = 120.0
    start_timeout_s: float = 120.0
    # Differential privacy to this epsilon over the run (delta 1e-5): central DP, or
    # distributed DP with secure aggregation. Every client takes part in every round.
    dp_epsilon: float | None = None
    dashboard_port: int | None = None  # the root serves its dashboard here (0: a free port)
    linger_s: float = 0.0  # keep the federation up this long after the run, to look at the dashboard


class DemoError(OrchardError):
    """A demo process failed to start or the run did not finish."""


class Procs:
    def __init__(self, logs: Path) -> None:
        self.logs = logs
        self.items: list[tuple[str, subprocess.Popen[bytes]]] = []

    def start(self, name: str, args: list[str]) -> subprocess.Popen[bytes]:
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
        log = open_private(self.logs / f"{name}.log")  # noqa: SIM115 - closed with the process
        p = subprocess.Popen([sys.executable, "-m", "orchard.cli", *args], stdout=log, stderr=subprocess.STDOUT,
                             env=env, start_new_session=True)
        self.items.append((name, p))
        return p

    def check(self) -> None:
        for name, p in self.items:
            if p.poll() is not None:
                tail = (self.logs / f"{name}.log").read_text(errors="replace")[-2000:]
                raise DemoError(f"{name} exited with code {p.returncode}; its log ends:\n{tail}")

    def stop(self) -> None:
        # Clients first, then aggregators, then the root: nobody reconnects to a tier being stopped.
        for _, p in reversed(self.items):
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 20
        for _, p in reversed(self.items):
            try:
                p.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(5)


def _wait_for(pred: Any, what: str, procs: Procs, timeout: float) -> Any:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        got = pred()
        if got:
            return got
        procs.check()
        time.sleep(0.1)
    raise DemoError(f"timed out after {timeout:.0f}s waiting for {what}")


def run_demo(spec: DemoSpec, console: Console | None = None) -> dict[str, Any]:
    from orchard.ops import ControlClient
    from orchard.server.store import SQLiteStore
    from orchard.server.tls import init_certs
    from orchard.server.validation import validate_run_config
    from orchard.tasks import get_task, train_defaults

    console = console or Console()
    if spec.clients < 1 or spec.aggregators < 0 or spec.rounds < 1:
        raise ConfigError("--clients and --rounds must be >= 1 and --aggregators >= 0")
    task = get_task(spec.task)
    cfg = RunConfig(task=spec.task, rounds=spec.rounds, seed=0, train=TrainConfig(**train_defaults(spec.task)),
                    cohort=CohortConfig(target=spec.clients, over_selection=1.0, min_fraction=0.5,
                                        deadline_s=spec.deadline_s),
                    codec=CodecSpec(name=spec.codec) if spec.codec else CodecSpec(),
                    secure_aggregation=SecureAggregationConfig(enabled=spec.secure_aggregation))
    if spec.dp_epsilon is not None:
        cfg = RunConfig.model_validate({
            **cfg.model_dump(), "cohort": {**cfg.cohort.model_dump(), "weighting": "uniform"},
            "privacy": {"mode": "distributed" if spec.secure_aggregation else "central",
                        "target_epsilon": spec.dp_epsilon, "population": spec.clients},
            # Distributed DP: one secure session over the whole tree, so one noise (sized
            # for every client of the round) serves the round instead of one per aggregator.
            "secure_aggregation": {**cfg.secure_aggregation.model_dump(),
                                   "scope": "tree" if spec.secure_aggregation else "cohort"}})
    # The root would refuse the run only once every process is up: refuse it before.
    validate_run_config(cfg)
    if spec.dp_epsilon is not None and spec.clients < FEW_FOR_DP:
        # What --dp-epsilon promises, said before the curve shows it: the noise is sized for
        # the cohort, so with a handful of clients it drowns their updates.
        console.print(f"[yellow]note:[/] differential privacy at epsilon {spec.dp_epsilon:g} with {spec.clients} "
                      "clients a round: the noise is sized for the whole cohort, so with few clients it is large "
                      "against their updates and the model learns little here. DP pays off with hundreds to "
                      "thousands of clients a round (a simulation of them: docs/privacy.md).", soft_wrap=True)
    out = spec.out
    out.mkdir(parents=True, exist_ok=True)
    private_dir(out / "logs")  # the processes' logs: owner-only, as their data dirs
    root_dir = out / "root"
    if root_dir.exists():
        import shutil

        shutil.rmtree(root_dir)  # a demo always starts a fresh federation
    tls: list[str] = []
    ca: Path | None = None
    if not spec.insecure:
        paths = init_certs(out / "tls")
        ca = paths.ca_cert
        tls = ["--tls-dir", str(out / "tls")]
    private_dir(root_dir)
    store = SQLiteStore(root_dir / "orchard.db")
    agg_tokens = [store.issue_token("aggregator", f"demo-agg-{i}") for i in range(spec.aggregators)]
    client_tokens = [store.issue_token("client", f"demo-client-{i}") for i in range(spec.clients)]
    store.close()
    sec = ["--insecure"] if spec.insecure else []

    procs = Procs(out / "logs")
    t_start = time.monotonic()
    try:
        console.print(f"[bold]orchard demo[/]: root + {spec.aggregators} aggregators + {spec.clients} clients, "
                      f"task {spec.task}, {spec.rounds} rounds, {'INSECURE' if spec.insecure else 'TLS'}")
        dash = ["--dashboard-port", str(spec.dashboard_port)] if spec.dashboard_port is not None else []
        procs.start("root", ["server", "start", "--data-dir", str(root_dir), "--port", "0", *tls, *sec, *dash])
        info = _wait_for(lambda: json.loads((root_dir / "server.json").read_text())
                         if (root_dir / "server.json").is_file() else None, "the root", procs, spec.start_timeout_s)
        root_addr = f"127.0.0.1:{info['port']}"
        if info.get("dashboard"):
            token = "" if spec.insecure else "?token=" + (root_dir / "admin.token").read_text().strip()
            console.print(f"dashboard: {info['dashboard']}{token}"
                          + ("" if spec.insecure else f" (its certificate is signed by {ca})"), soft_wrap=True)
        cred = (["--ca-cert", str(ca)] if ca else [])
        agg_addrs = []
        for i in range(spec.aggregators):
            pf = out / f"aggregator-{i}.port"
            pf.unlink(missing_ok=True)
            tok = ["--token", agg_tokens[i]] if not spec.insecure else []
            procs.start(f"aggregator-{i}", ["aggregator", "start", "--upstream", root_addr, "--port", "0",
                                            "--port-file", str(pf), "--node-id", f"aggregator-{i}",
                                            *tls, *cred, *tok, *sec])
            port = _wait_for(lambda pf=pf: pf.read_text().strip() if pf.is_file() else None,
                             f"aggregator {i}", procs, spec.start_timeout_s)
            agg_addrs.append(f"127.0.0.1:{port}")
        for k in range(spec.clients):
            target = agg_addrs[k % len(agg_addrs)] if agg_addrs else root_addr
            tok = ["--token", client_tokens[k]] if not spec.insecure else []
            procs.start(f"client-{k}", ["client", "start", "--server", target, "--task", spec.task,
                                        "--partition", str(k), "--num-partitions", str(spec.clients),
                                        "--node-id", f"client-{k}", *cred, *tok, *sec])
        admin = None if spec.insecure else (root_dir / "admin.token").read_text().strip()
        with ControlClient(root_addr, admin_token=admin, ca_cert=ca, insecure=spec.insecure) as ctl:
            _wait_for(lambda: ctl.status()["nodes"]["clients_total"] >= spec.clients,
                      f"{spec.clients} clients to join", procs, spec.start_timeout_s)
            run_id = ctl.start_run(cfg, wire.arrays_to_blob(task.initial_arrays(cfg.seed)))
            console.print(f"all {spec.clients} clients joined; run {run_id} started")
            rows = _follow(ctl, run_id, spec, task, procs, console)
            status = ctl.status(run_id)
            if spec.linger_s > 0:
                console.print(f"the federation stays up for {spec.linger_s:g} s (--linger)")
                time.sleep(spec.linger_s)
    finally:
        procs.stop()
    report = {"run_id": run_id, "task": spec.task, "clients": spec.clients, "aggregators": spec.aggregators,
              "codec": cfg.codec.name, "secure_aggregation": spec.secure_aggregation,
              "secure_scope": cfg.secure_aggregation.scope if spec.secure_aggregation else None,
              "tls": not spec.insecure, "status": status["status"], "rounds": rows,
              "total_seconds": round(time.monotonic() - t_start, 2)}
    if status.get("privacy"):
        report["privacy"] = status["privacy"]  # epsilon spent, delta, noise multiplier
    report["plot"] = str(_plot(rows, out / "report.png", spec))
    (out / "report.json").write_text(json.dumps(report, indent=2))
    if status["status"] != "completed":
        raise DemoError(f"run ended {status['status']}: {status.get('error')}; logs in {out / 'logs'}")
    return report


def _follow(ctl: Any, run_id: str, spec: DemoSpec, task: Any, procs: Procs, console: Console) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    console.print(f"{'round':>5} {'clients':>7} {'accuracy':>8} {'loss':>7} {'bytes up':>10} {'bytes down':>10} "
                  f"{'seconds':>7}")
    deadline = time.monotonic() + spec.rounds * (spec.deadline_s + 30) + spec.start_timeout_s
    while time.monotonic() < deadline:
        procs.check()
        st = ctl.status(run_id)
        done = [r for r in st["rounds"] if r["status"] == "completed"]
        for r in done[len(rows):]:
            arrays = wire.blob_to_arrays(ctl.pull_global(run_id, r["round"]))
            ev = task.evaluate(arrays)
            row = {"round": r["round"], "participants": r["participants"], "accuracy": ev["accuracy"],
                   "loss": ev["loss"], "bytes_up": r["bytes_up"], "bytes_down": r["bytes_down"],
                   "seconds": r["seconds"], "tier_participants": r.get("tier_participants", {}),
                   "train_metrics": r.get("metrics", {})}
            if r.get("privacy"):
                row["epsilon"] = r["privacy"]["epsilon"]
            rows.append(row)
            eps = f" epsilon {row['epsilon']:.3g}" if "epsilon" in row else ""
            console.print(f"{row['round']:>5} {row['participants']:>7} {row['accuracy']:>8.4f} {row['loss']:>7.4f} "
                          f"{row['bytes_up']:>10} {row['bytes_down']:>10} {row['seconds']:>7.2f}{eps}")
        if st["status"] != "running":
            return rows
        time.sleep(0.25)
    raise DemoError("the run did not finish in time")


def _plot(rows: list[dict[str, Any]], path: Path, spec: DemoSpec) -> Path:
    from orchard import plots

    fig, (a1, a2) = plots.subplots(2)
    plots.accuracy(a1, rows, f"{spec.task}: global model", loss=True)
    plots.bytes_on_the_wire(a2, rows)
    return plots.save(fig, path)
