"""Defaults that let ``orchard simulate`` run every shipped task from flags alone.

A config file says how a population is split (``task_params``); flags alone do not, so
``orchard simulate --task digits --clients 10000`` would ask a without-replacement
Dirichlet split for 10,000 clients of 1,438 examples and stop. The rules here fill in
only what the user left unsaid, and say what they chose:

- a task with a fixed set of natural clients (heart's 4 hospitals) takes that set as
  its population when no population is given, as always-on edge boxes;
- a population that the task's default split cannot serve, for a task that can draw
  with replacement (digits, mnist), draws with replacement (each client a fixed number
  of examples under its own Dirichlet class mix): the population is then unbounded;
- the number of clients per round is capped at the population when it was not given;
- ``backend = "auto"`` (what ``orchard simulate`` runs when neither the config nor a
  flag names a backend) picks the fastest backend this machine and config allow
  (:func:`choose_backend`), and ``workers = "auto"`` (or no ``workers``) sizes the
  worker processes to the machine's cores.

Whatever the user set (a flag, ``--task-param``, or the config's own table) is kept as
it is: an explicit ``with_replacement = false`` still fails with the task's message.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from orchard.config import RunConfig
from orchard.errors import ConfigError
from orchard.simulation.config import merged_simulation_table

if TYPE_CHECKING:
    from orchard.simulation.config import SimulationConfig

# Below this many clients per round a round is a few milliseconds of training against
# the cross-process round trips of a sharded round (and starting a worker, a process
# that imports torch, costs seconds): the engine alone finishes sooner.
PROCESS_MIN_CLIENTS_PER_ROUND = 1000


@dataclass(frozen=True)
class BackendChoice:
    """Which backend runs, with how many workers, and why (``reason``, one phrase)."""

    backend: str
    workers: int
    reason: str

    def line(self) -> str:
        """``backend: process (1 worker; auto: 2 cores, sharded rounds)``."""
        if self.backend == "local":
            where = "in this process" if self.workers == 1 else f"{self.workers} threads"
        else:
            where = f"{self.workers} worker{'s' if self.workers != 1 else ''}"
        return f"backend: {self.backend} ({where}; {self.reason})"


def _why_not_sharded(cfg: SimulationConfig) -> str | None:
    """Why the process backend would not shard ``cfg``'s rounds (None: it would); the
    engine's own rule (``shards.can_shard``), read from the config."""
    run = cfg.run_config()
    fan = cfg.fanout()
    if not cfg.shard:
        return "shard = false"
    if run.mode.is_async:
        return "asynchronous mode"
    if run.secure_aggregation.enabled:
        return "secure aggregation"
    if not fan or fan[0] < 2:
        return "fewer than 2 aggregators under the root"
    return None


def choose_backend(cfg: SimulationConfig, cores: int, backend: str = "auto",
                   workers: int | None = None) -> BackendChoice:
    """The backend and worker count for ``cfg`` on a machine with ``cores`` cores.

    ``backend``: "auto", or the one asked for (kept as it is); ``workers``: None to size
    it here, or the number asked for (kept). ``cfg`` supplies the rest (its own backend
    and workers fields are not read).

    Auto picks the process backend when the machine has two cores or more, the config can
    run on it and a round is large enough to gain from it; the local backend otherwise.
    Worker processes number one fewer than the cores, because the engine's process is
    busy too: it trains its share of the clients (its own subtrees, with sharded rounds)
    and runs the tiers. More workers than the root has subtrees beyond the engine's would
    have no part of a sharded round to run, and each holds its own torch (~0.5 GiB).
    """
    unsharded = _why_not_sharded(cfg)
    how = "sharded rounds" if unsharded is None else f"rounds not sharded: {unsharded}"
    if backend != "auto":
        if backend == "process":
            if workers is None:
                workers = _process_workers(cfg, cores, unsharded)
            return BackendChoice(backend, workers, f"as configured, {how}")
        return BackendChoice(backend, workers or 1, "as configured")
    many = f"{cores} core{'s' if cores != 1 else ''}"
    why_local = None
    if cfg.runtime == "executorch":
        why_local = "auto: the ExecuTorch runtime runs on the local backend only"
    elif cores < 2:
        why_local = f"auto: {many}"
    elif cfg.clients_per_round < PROCESS_MIN_CLIENTS_PER_ROUND:
        why_local = (f"auto: {many}, but {cfg.clients_per_round} clients per round, fewer than the "
                     f"{PROCESS_MIN_CLIENTS_PER_ROUND} that repay starting worker processes")
    if why_local is not None:
        return BackendChoice("local", workers or 1, why_local)
    if workers is None:
        workers = _process_workers(cfg, cores, unsharded)
    return BackendChoice("process", workers, f"auto: {many}, {how}")


def _process_workers(cfg: SimulationConfig, cores: int, unsharded: str | None) -> int:
    workers = max(1, cores - 1)
    if unsharded is None:  # a shard per root subtree at most (the engine runs one group)
        workers = min(workers, cfg.fanout()[0] - 1)
    return workers


@dataclass
class PopulationFit:
    """Overrides to add to the simulation's, and one line per choice made."""

    overrides: dict[str, Any] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)


def fit_population(data: dict[str, Any], overrides: dict[str, Any]) -> PopulationFit:
    """What to add to ``overrides`` so that the simulation's task can split its population.

    ``data`` is the parsed TOML (possibly empty), ``overrides`` the dotted flag overrides
    (None: not given). Raises the task's own ConfigError when no default can help."""
    from orchard.simulation.config import SimulationConfig
    from orchard.tasks import get_task, task_params

    sim = merged_simulation_table(data, overrides)
    run = sim.get("run", {})
    task_name = run.get("task", RunConfig().task)
    params = dict(run.get("task_params", {}))
    seed = int(sim.get("seed", SimulationConfig.model_fields["seed"].default))
    fit = PopulationFit()
    task = get_task(task_name, **params)

    natural = task.info.get("clients")
    if "clients" in sim:
        clients = int(sim["clients"])
    elif isinstance(natural, list) and natural:
        clients = len(natural)
        fit.overrides["clients"] = clients
        fit.notes.append(f"{task_name} has {clients} natural clients ({', '.join(map(str, natural))}): "
                         f"population {clients}")
        if "devices" not in sim:
            # Natural clients are institutions (hospitals), online all day, not phones.
            fit.overrides["devices"] = {"edge_box": 1.0}
            fit.notes.append("its clients are always-on edge boxes")
    else:
        clients = int(SimulationConfig.model_fields["clients"].default)

    try:
        task.partition(clients, seed)
    except ConfigError:
        if "with_replacement" not in task_params(task_name) or "with_replacement" in params:
            raise
        sampled = get_task(task_name, **params, with_replacement=True)
        sampled.partition(clients, seed)  # raises the task's message if this cannot help either
        fit.overrides["run.task_params.with_replacement"] = True
        per = sampled.params.get("samples_per_client")
        fit.notes.append(f"{clients} clients exceed what {task_name}'s {len(task.train_labels)} training examples "
                         f"split without replacement: each client draws {per} examples with replacement "
                         "(--task-param with_replacement=false to refuse, samples_per_client=N to change)")

    per_round_default = int(SimulationConfig.model_fields["clients_per_round"].default)
    if "clients_per_round" not in sim and per_round_default > clients:
        fit.overrides["clients_per_round"] = clients
        fit.notes.append(f"{clients} clients per round (the whole population)")
    return fit
