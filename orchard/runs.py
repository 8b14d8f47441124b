"""A run on a live root, from the operator's side: the config it starts with, its initial
model, following its rounds, and the latest global adapter a device bundle ships.

Everything here talks to a root through :class:`~orchard.ops.ControlClient` and draws
nothing: ``orchard run start`` and ``orchard client bundle`` print what these return.
Like the CLI this module sits at the top of the dependency graph; it imports the tasks
lazily, inside the functions that build a model, and never the simulator.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import numpy as np

from orchard import wire
from orchard.config import RunConfig
from orchard.errors import OrchardError
from orchard.ops import ControlClient, resolve_admin_token


def control_client(server: str, *, admin_token: str | None = None, ca_cert: Path | None = None,
                   insecure: bool = False, data_dir: Path | None = None) -> ControlClient:
    """A Control API client for ``server``; a root's ``data_dir`` supplies the admin token
    and the CA (``tls/ca.pem``) when they are not given."""
    if ca_cert is None and data_dir is not None and (data_dir / "tls" / "ca.pem").is_file():
        ca_cert = data_dir / "tls" / "ca.pem"
    return ControlClient(server, admin_token=resolve_admin_token(admin_token, data_dir), ca_cert=ca_cert,
                         insecure=insecure)


def build_run_config(config: Path | None, overrides: dict[str, Any]) -> RunConfig:
    """The run config of ``config`` (its ``[run]`` table, or the whole file) with dotted
    ``overrides`` (``"cohort.target": 10``) applied; None values are not given."""
    from orchard.config import apply_overrides, load_toml, parse_run_config

    data: dict[str, Any] = {}
    if config is not None:
        raw = load_toml(config)
        data = dict(raw.get("run", raw))
    return parse_run_config(with_task_training(apply_overrides(data, overrides)))


def with_task_training(data: dict[str, Any]) -> dict[str, Any]:
    """``data`` (a ``[run]`` table) training as its task declares (``orchard.tasks.trains_with``)
    where it sets no ``train`` table of its own: a run started from flags and the demo train a
    task the same way."""
    if "train" in data:
        return data
    from orchard.tasks import train_defaults

    try:
        declared = train_defaults(str(data.get("task") or RunConfig.model_fields["task"].default))
    except OrchardError:  # an unknown task: parsing the config names it with the others
        return data
    return {**data, "train": declared} if declared else data


def with_base_model(ctl: ControlClient, cfg: RunConfig, base_model: Path | None) -> RunConfig:
    """``cfg`` adapting ``base_model``, or the root's own base (``server start --base-model``)
    when none is given, the run names none and its task takes one."""
    from orchard.tasks import task_params
    from orchard.tasks.params import base_model_params

    if base_model is None and "base" not in cfg.task_params:
        server_base = ctl.status().get("base_model")
        if server_base and "base" in task_params(cfg.task):
            base_model = Path(server_base)
    if base_model is None:
        return cfg
    return cfg.model_copy(update={"task_params": {**cfg.task_params, **base_model_params(cfg.task, base_model)}})


def initial_blob(cfg: RunConfig, initial_arrays: Path | None = None) -> bytes:
    """The run's initial global model as a wire blob: ``initial_arrays`` (.safetensors,
    e.g. a Flower app's), else the task's own initial model for ``cfg.seed``."""
    if initial_arrays is not None:
        from safetensors.numpy import load_file

        return wire.arrays_to_blob(dict(load_file(str(initial_arrays))))
    from orchard.tasks import get_task

    return wire.arrays_to_blob(get_task(cfg.task, **cfg.task_params).initial_arrays(cfg.seed))


def tracked_params(cfg: RunConfig, server: str) -> dict[str, Any]:
    """What a tracker (TensorBoard, MLflow) records about a run started on ``server``."""
    return {"task": cfg.task, "rounds": cfg.rounds, "clients_per_round": cfg.cohort.target, "codec": cfg.codec.name,
            "secure_aggregation": cfg.secure_aggregation.enabled, "seed": cfg.seed, "task_params": cfg.task_params,
            "server": server}


def round_scorer(ctl: ControlClient, run_id: str, cfg: RunConfig) -> Callable[[int], dict[str, float]]:
    """Scores a round's global model on the task's held-out data, as the demo does."""
    from orchard.tasks import get_task

    task = get_task(cfg.task, **cfg.task_params)

    def score(rnd: int) -> dict[str, float]:
        ev = task.evaluate(wire.blob_to_arrays(ctl.pull_global(run_id, rnd)))
        return {"accuracy": float(ev["accuracy"]), "loss": float(ev["loss"])}

    return score


def progress_line(st: dict[str, Any]) -> str:
    """One line on where a run stands: its open round's phase, wait or updates so far,
    or, once the run is over, its status (and error)."""
    if st["status"] != "running":
        return st["status"] + (f": {st['error']}" if st.get("error") else "")
    cur = st.get("current_round") or {}
    info = f"round {cur.get('round', '-')}: {cur.get('phase', st['status'])}"
    if "waiting" in cur:
        info = f"round {cur.get('round', '-')}: {cur['waiting']['message']}"
    if "received" in cur:
        info += f" {cur['received']}/{cur['target']} updates"
    return info


def watch_run(ctl: ControlClient, run_id: str, on_round: Callable[[dict[str, Any]], None] | None = None,
              on_status: Callable[[dict[str, Any]], None] | None = None, poll_s: float = 0.5) -> dict[str, Any]:
    """Poll ``run_id`` until it is no longer running and return its last status.

    ``on_round`` gets each completed round's record once, in order; ``on_status`` every
    status polled (the last one included)."""
    seen = 0
    while True:
        st = ctl.status(run_id)
        done = [r for r in st["rounds"] if r["status"] == "completed"]
        for r in done[seen:]:
            if on_round is not None:
                on_round(r)
        seen = len(done)
        if on_status is not None:
            on_status(st)
        if st["status"] != "running":
            return st
        time.sleep(poll_s)


def log_records(ctl: ControlClient, run_id: str = "", *, follow: bool = False, poll_s: float = 0.5,
                quiet_s: float = 3.0) -> Iterator[dict[str, Any]]:
    """The records of a run's log (the latest run when ``run_id`` is empty), in order.

    With ``follow``, keep polling every ``poll_s`` until the run's closing line; a log
    without one (the root stopped while the run ran) ends once the run is over and the
    log has been quiet for ``quiet_s``."""
    after, ended, quiet_since = 0, False, time.monotonic()
    while True:
        records, after, status = ctl.run_log(run_id, after)
        for rec in records:
            ended = ended or rec.get("event") == "run_end"
            yield rec
        if records:
            quiet_since = time.monotonic()
        if not follow or ended or (status != "running" and time.monotonic() - quiet_since > quiet_s):
            return
        if not records:
            time.sleep(poll_s)


@dataclass(frozen=True)
class LatestAdapter:
    """The adapter a new device bundle ships: the root's latest global model, or (arrays
    None) the task's initial one, with the reason in ``fallback``."""

    arrays: dict[str, np.ndarray] | None
    version: int
    fallback: str = ""


def latest_adapter(ctl: ControlClient, task: str, run_id: str = "", *, server: str) -> LatestAdapter:
    """The root's latest global model for ``task`` (of ``run_id``; the latest run when
    empty). A root that cannot be reached or has no run yet means the initial adapter;
    a run of another task, or any other failure, raises OrchardError."""
    try:
        st = ctl.status(run_id)
        if st.get("run_id") is None:
            return LatestAdapter(None, 0, "the root has no run yet: bundling the task's initial adapter")
        if st.get("task") != task:
            raise OrchardError(f"the root's run {st['run_id']} trains task {st.get('task')!r}, "
                               f"not {task!r}: pass --task {st.get('task')}")
        blob = ctl.pull_global(st["run_id"], -1)
        return LatestAdapter(wire.blob_to_arrays(blob), int(st.get("completed_rounds", 0)))
    except grpc.RpcError as err:
        code = err.code()  # type: ignore[attr-defined]
        if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
            return LatestAdapter(None, 0, f"root {server} not reachable ({code.name}): bundling the task's "
                                          "initial adapter")
        raise OrchardError(f"pulling the global model from {server} failed: {code.name}: "
                           f"{err.details()}") from None  # type: ignore[attr-defined]
