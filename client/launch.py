"""A client from its launch options: what ``orchard client start`` is told, resolved into
the link, the trainer and the device governance that :class:`ClientRuntime` runs.

A bundle (``--bundle DIR``) supplies what the options leave out: the server, the
enrollment token, the CA, the device policy and the task. The client's key and the
credential it gets for its enrollment token are kept under ``--state-dir``. Everything is checked before
the client joins, so a bad bundle or a contradictory option is refused with its reason
rather than after the first task arrives.

The ExecuTorch runtime must run without torch on the device: this module imports the
torch side (the reference tasks, the Flower adapter) only inside the functions that
need it, and only for ``runtime="torch"``.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from orchard.errors import ConfigError, OrchardError
from orchard.files import private_dir, report_loose
from orchard.link import LinkConfig
from orchard.typing import Role

log = logging.getLogger("orchard.client")

RUNTIMES = ("torch", "executorch")


@dataclass(frozen=True)
class ClientOptions:
    """What the operator said; None and defaults mean "not given" (a bundle may fill in)."""

    server: str | None = None
    task: str | None = None
    partition: int = 0
    num_partitions: int = 1
    flower_app: str | None = None  # module:attr of a Flower ClientApp
    insecure: bool = False
    token: str | None = None
    ca_cert: Path | None = None
    node_id: str = ""
    state_dir: Path | None = None
    bundle: Path | None = None
    policy: Path | None = None  # device policy TOML; overrides the bundle's
    runtime: str = "torch"
    # The device's own data: the ExecuTorch program's, or with a task, a file or directory
    # its samples are appended to, read by a continual run (orchard.tasks.stream).
    data: Path | None = None
    seed: int = 0


@dataclass(frozen=True)
class ClientSetup:
    """A client resolved and checked: ready to warm up and serve."""

    options: ClientOptions  # with the bundle's server, token, CA and task filled in
    task_params: dict[str, Any] = field(default_factory=dict)
    policy: Any = None  # DevicePolicy | None
    device_factory: Any = None  # the ExecuTorch trainer factory, already loaded; None: torch
    root_public_key: bytes | None = None  # the bundle's, when it names the root's certificate key

    def link_config(self) -> LinkConfig:
        o = self.options
        assert o.server is not None  # resolve_client refuses a client without one
        return LinkConfig(target=o.server, role=Role.CLIENT, token=o.token, ca_cert=o.ca_cert, insecure=o.insecure,
                          node_id=o.node_id, capabilities=(("task", o.task or "flower"),),
                          identity_dir=identity_dir(o.state_dir), root_public_key=self.root_public_key)


def identity_dir(state_dir: Path | None) -> Path | None:
    """Where a client with this ``--state-dir`` keeps its key and credential
    (``STATE_DIR/identity``, mode 0700): a restart resumes the same node. Without a
    state dir the credential lives in memory, and a restarted client needs a new token."""
    return None if state_dir is None else Path(state_dir) / "identity"


def load_policy(path: Path) -> Any:
    """A DevicePolicy from TOML: a [policy] table, or the whole file."""
    from pydantic import ValidationError

    from orchard.config import load_toml
    from orchard.edge_runtime.policy import DevicePolicy

    raw = load_toml(path)
    try:
        return DevicePolicy.model_validate(raw.get("policy", raw))
    except ValidationError as err:
        raise ConfigError([f"{path}: policy.{'.'.join(map(str, e['loc']))}: {e['msg']}"
                           for e in err.errors()]) from None


def resolve_client(opts: ClientOptions) -> ClientSetup:
    """``opts`` with the bundle's defaults filled in, the ExecuTorch program (if any)
    loaded and the device policy read; OrchardError says what is missing or wrong."""
    if opts.runtime not in RUNTIMES:
        raise OrchardError(f"--runtime must be torch or executorch, got {opts.runtime!r}")
    device_factory = None
    if opts.runtime == "executorch":
        if opts.bundle is None or opts.flower_app is not None:
            raise OrchardError("--runtime executorch trains a bundle's training program: pass --bundle DIR "
                               "(and no --flower-app)")
        from orchard.edge_runtime.et_trainer import executorch_trainer_factory

        # Loads and checks the bundle's training program now: a bad bundle is refused
        # before the client joins.
        device_factory = executorch_trainer_factory(opts.bundle, data_path=opts.data, seed=opts.seed)
    task_params: dict[str, Any] = {}
    policy = None
    root_key = None
    if opts.bundle is not None:
        from orchard.edge_runtime.bundle import read_bundle
        from orchard.edge_runtime.bundle_task import read_bundle_task

        b = read_bundle(opts.bundle)
        sidecar = read_bundle_task(opts.bundle)
        opts = replace(opts, server=opts.server or b.config.server_address, token=opts.token or b.enrollment_token(),
                       ca_cert=opts.ca_cert or b.ca_cert_path)
        policy = b.config.policy
        root_key = b.root_public_key
        if opts.task is None and sidecar is not None and opts.flower_app is None:
            opts = replace(opts, task=sidecar.task)
            task_params = sidecar.task_params
    if opts.policy is not None:
        policy = load_policy(opts.policy)
    if opts.server is None:
        raise OrchardError("--server HOST:PORT is required (or --bundle DIR)")
    if opts.task is None and opts.flower_app is None:
        raise OrchardError("pass --task NAME (a reference task) or --flower-app module:app")
    return ClientSetup(opts, task_params, policy, device_factory, root_key)


def warm_up(setup: ClientSetup) -> None:
    """Build and run the trainer once before joining: torch's first optimizer import alone
    takes seconds, and a round should not wait for framework start-up. Nothing to do for
    the ExecuTorch runtime or a Flower app."""
    o = setup.options
    if setup.device_factory is not None or o.task is None:
        return
    from orchard.tasks import get_task
    from orchard.trainer import TrainConfig

    t = get_task(o.task, **setup.task_params)
    t.client_trainer(o.partition, o.num_partitions, o.seed).train(t.initial_arrays(o.seed), TrainConfig(steps=1))


def trainer_factory(setup: ClientSetup) -> Any:
    """RunConfig -> Trainer: the ExecuTorch program's, the Flower app's, or the reference
    task's (refusing a run of another task than the one this client holds data for)."""
    if setup.device_factory is not None:
        return setup.device_factory
    o = setup.options

    def factory(cfg: Any) -> Any:
        if o.flower_app:
            from orchard.client.flower_adapter import FlowerTrainer

            return FlowerTrainer(o.flower_app, partition_id=o.partition, num_partitions=o.num_partitions)
        from orchard.tasks import get_task

        if o.task and cfg.task != o.task:
            raise OrchardError(f"this client trains task {o.task!r}, but the run is for {cfg.task!r}")
        task = get_task(o.task or cfg.task, **cfg.task_params)
        if cfg.continual is not None and o.data is not None:
            from orchard.tasks.stream import device_trainer

            return device_trainer(task, cfg.continual, o.data, o.state_dir, setup.policy, o.seed)
        return task.client_trainer(o.partition, o.num_partitions, o.seed)

    return factory


async def serve_client(setup: ClientSetup, *, stop: asyncio.Event, max_tasks: int | None = None) -> None:
    """Join and serve tasks until ``stop`` is set or ``max_tasks`` were done; a failure of
    the runtime is raised."""
    from orchard.client.runtime import ClientRuntime
    from orchard.link import FleetLink

    edge = None
    if setup.policy is not None:
        from orchard.client.edge import EdgeGovernance
        from orchard.edge_runtime.device import default_provider

        # The host's own sensors (sysfs, else psutil) and real time: the governor paces
        # the actual device.
        edge = EdgeGovernance(default_provider(), setup.policy)
    o = setup.options
    if o.state_dir is not None:  # the device's key, credential and codec state: owner-only
        report_loose(o.state_dir, "the client's state dir", log)
        private_dir(o.state_dir)
    link = FleetLink(setup.link_config())
    rt = ClientRuntime(link, trainer_factory(setup), partition_id=o.partition, state_dir=o.state_dir, seed=o.seed,
                       edge=edge)
    runner = asyncio.create_task(rt.run(max_tasks=max_tasks, stop=stop))
    stopper = asyncio.create_task(stop.wait())
    await asyncio.wait({runner, stopper}, return_when=asyncio.FIRST_COMPLETED)
    for t in (runner, stopper):
        t.cancel()
    if runner.done() and not runner.cancelled() and runner.exception() is not None:
        raise runner.exception()  # type: ignore[misc]
    await link.close()
