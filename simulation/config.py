"""Typed simulation config: the ``[simulation]`` table of a TOML file.

A simulation is a run (the same :class:`orchard.config.RunConfig` a real root takes,
under ``[simulation.run]``) plus what a real deployment would not need to write down:
how many devices exist, how many take part per round, how the tree of aggregators is
shaped, what kinds of device the population holds, and how the simulator executes.

``clients_per_round``, ``rounds`` and ``seed`` set the run's ``cohort.target``,
``rounds`` and ``seed``: one number in one place, so a flag override cannot leave the
two disagreeing.

:func:`simulation_problems` returns every problem at once (``orchard validate``).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PrivateAttr,
    ValidationError,
    ValidationInfo,
    ValidatorFunctionWrapHandler,
    field_validator,
    model_validator,
)

from orchard.config import RunConfig, apply_overrides, ftrl_problems, load_toml
from orchard.errors import ConfigError


def _cores(info: ValidationInfo) -> int:
    """The cores ``backend = "auto"`` plans for: the validation context's ``cores`` when
    given (tests; a plan for another machine), else those this process may run on."""
    if isinstance(info.context, dict) and info.context.get("cores") is not None:
        return int(info.context["cores"])
    from orchard.secure_agg.prg import available_cores

    return available_cores()


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


def _hours(values: list[float]) -> list[float]:
    if len(values) != 24:
        raise ValueError(f"availability needs 24 hourly probabilities (00:00..23:00), got {len(values)}")
    bad = [v for v in values if not 0.0 <= v <= 1.0]
    if bad:
        raise ValueError(f"availability values must lie in [0, 1], got {bad[:3]}")
    return values


# Hourly probability that a device of a kind is online and idle enough to check in.
# Phones follow their owners (mostly overnight, on the charger); edge boxes are always on.
_PHONE_DAY = [0.9, 0.9, 0.9, 0.9, 0.85, 0.7, 0.4, 0.2, 0.15, 0.15, 0.15, 0.15,
              0.2, 0.15, 0.15, 0.15, 0.15, 0.2, 0.25, 0.3, 0.4, 0.55, 0.7, 0.85]
_BOX_DAY = [0.98] * 24


class DeviceProfile(_Strict):
    """One kind of device: compute speed, power, battery, thermal mass, availability.

    Compute: a training example costs ``6 * model_parameters`` floating-point operations
    (forward plus backward, the usual estimate), done at ``gflops`` (an effective rate,
    not a peak), times a per-device factor drawn lognormally with ``speed_sigma``.
    Units: watts, watt-hours, degrees Celsius, seconds, megabits per second.
    """

    gflops: float = Field(gt=0.0)
    speed_sigma: float = Field(0.3, ge=0.0, le=2.0)
    battery: bool = True
    capacity_wh: float = Field(15.0, gt=0.0)
    active_power_w: float = Field(4.0, ge=0.0)
    idle_power_w: float = Field(0.3, ge=0.0)  # background draw (the owner uses the phone)
    charge_power_w: float = Field(10.0, ge=0.0)
    r_th_c_per_w: float = Field(4.0, ge=0.0)
    tau_s: float = Field(60.0, gt=0.0)
    ambient_c: float = 25.0
    charging_start_hour: float = Field(23.0, ge=0.0, lt=24.0)  # plugged in daily from ...
    charging_end_hour: float = Field(7.0, ge=0.0, lt=24.0)  # ... to (wraps past midnight)
    availability: list[float] = Field(default_factory=lambda: list(_PHONE_DAY))
    dropout: float = Field(0.02, ge=0.0, le=1.0)  # chance a device vanishes mid-task
    down_mbps: float = Field(20.0, gt=0.0)
    up_mbps: float = Field(5.0, gt=0.0)
    latency_s: float = Field(0.2, ge=0.0)  # per transfer: connection set-up and round trips
    unmetered_network: bool = True

    @field_validator("availability")
    @classmethod
    def _check_hours(cls, v: list[float]) -> list[float]:
        return _hours(v)


DEFAULT_PROFILES: dict[str, DeviceProfile] = {
    "low_end_phone": DeviceProfile(gflops=0.5, capacity_wh=11.0, active_power_w=3.0, r_th_c_per_w=5.0,
                                   dropout=0.05, down_mbps=8.0, up_mbps=2.0, latency_s=0.4),
    "high_end_phone": DeviceProfile(gflops=4.0, capacity_wh=17.0, active_power_w=5.0, r_th_c_per_w=3.5,
                                    dropout=0.02, down_mbps=50.0, up_mbps=15.0, latency_s=0.1),
    "edge_box": DeviceProfile(gflops=20.0, battery=False, active_power_w=15.0, idle_power_w=5.0,
                              r_th_c_per_w=1.0, tau_s=300.0, availability=list(_BOX_DAY), dropout=0.005,
                              down_mbps=100.0, up_mbps=50.0, latency_s=0.02),
}
DEFAULT_MIX: dict[str, float] = {"low_end_phone": 0.5, "high_end_phone": 0.35, "edge_box": 0.15}


class AttackConfig(_Strict):
    """``[simulation.attack]``: a share of the population sends corrupted updates, to
    measure robustness. Attackers are drawn per device from the seed; an attacker's
    update is ``multiplier * delta`` (default: 100 for "scale", -1 for "sign_flip").
    "canary": the device's update is replaced by ``multiplier`` (default 1) times a random
    unit direction drawn from the seed and the device (``orchard.simulation.canary``), for
    empirical privacy estimation; the report counts how often each canary's update was
    folded (``canary_folds``)."""

    fraction: float = Field(0.0, ge=0.0, le=1.0)
    kind: Literal["scale", "sign_flip", "canary"] = "scale"
    multiplier: float | None = None

    @property
    def factor(self) -> float:
        if self.multiplier is not None:
            return self.multiplier
        return {"scale": 100.0, "sign_flip": -1.0, "canary": 1.0}[self.kind]


class SimulationConfig(_Strict):
    """``[simulation]``: a population, a tree, an executor, and the run they carry out.

    ``aggregators``: 0 runs every client under the root; ``n`` puts ``n`` aggregators
    under the root; a list ``[a, b, ...]`` builds a deeper tree (``a`` under the root,
    ``b`` under each of those, ...). Clients always dial a lowest-tier node.
    """

    clients: int = Field(1000, ge=2)  # the population
    clients_per_round: int = Field(100, ge=1)
    rounds: int = Field(5, ge=1)
    seed: int = 0
    aggregators: int | list[int] = 0
    # local: this process (threads when workers > 1); process: worker processes on this
    # machine (client work runs beside the engine, past the GIL); ray: Ray actors; auto:
    # the fastest this machine and config allow (simulation.defaults.choose_backend),
    # resolved when the config is validated, so a validated config names the one that
    # runs. `orchard simulate` and configs/sim.toml ask for auto; a config built in Python
    # runs in this process unless it asks otherwise (tests and notebooks stay in-process).
    backend: Literal["auto", "local", "process", "ray"] = "local"
    # Concurrent training jobs: "auto" (also when absent) is one worker process fewer
    # than the cores on the process backend, one otherwise. Validated, it is a number.
    workers: int = Field(1, ge=1)
    # With the process backend, a synchronous run over a tree without secure aggregation
    # splits the root's subtrees between this process and the workers: each runs its
    # own (check-ins, devices, training, folds), the engine also the root. The model is
    # the same either way; false keeps every tier in the engine (workers only train).
    shard: bool = True
    vectorize: bool = True  # train small models many clients at a time (torch.func.vmap)
    # Where the vectorised path trains: "cpu", or "cuda" (a GPU; local or process backend).
    device: Literal["cpu", "cuda"] = "cpu"
    chunk_size: int = Field(512, ge=1)  # clients per training job: what is materialised at once
    governor: bool = True  # pace training with the edge runtime's governor on each device
    # "executorch": clients train through the task's ExecuTorch training program (what a
    # phone-class device runs), not torch autograd; local backend only.
    runtime: Literal["torch", "executorch"] = "torch"
    out: Path | None = None
    devices: dict[str, float] = Field(default_factory=lambda: dict(DEFAULT_MIX))
    profiles: dict[str, DeviceProfile] = Field(default_factory=dict)  # add or replace kinds
    start_hour: float = Field(21.0, ge=0.0, lt=24.0)  # simulated local time of round 1
    round_gap_s: float = Field(60.0, ge=0.0)  # idle time between rounds
    checkin_factor: float = Field(1.5, ge=1.0, le=20.0)  # devices checked in per slot to select
    node_timeout_s: float = Field(60.0, gt=0.0)  # heartbeat silence before a tier drops a client
    aggregator_mbps: float = Field(1000.0, gt=0.0)  # links between tiers
    evaluate_every: int = Field(1, ge=0)  # 0: only after the last round
    progress: bool = True
    attack: AttackConfig = AttackConfig()
    run: RunConfig = RunConfig()

    _choice: Any = PrivateAttr(None)  # the BackendChoice that set backend and workers

    @model_validator(mode="wrap")
    @classmethod
    def _resolve_auto(cls, data: Any, handler: ValidatorFunctionWrapHandler,
                      info: ValidationInfo) -> SimulationConfig:
        """Settle ``backend = "auto"`` and ``workers = "auto"`` (or absent) on this machine's
        cores (``context={"cores": n}`` to say how many): the rest of the config is
        validated first, since what the backend can run depends on it."""
        if not isinstance(data, dict):
            return handler(data)
        from orchard.simulation.defaults import choose_backend

        backend, workers = data.get("backend", "local"), data.get("workers", "auto")
        if workers != "auto" and backend != "auto":
            cfg = handler(data)
            cfg._choice = choose_backend(cfg, _cores(info), cfg.backend, cfg.workers)
            return cfg
        draft = handler({**data, "backend": "local" if backend == "auto" else backend, "workers": 1})
        choice = choose_backend(draft, _cores(info), backend, None if workers == "auto" else workers)
        cfg = handler({**data, "backend": choice.backend, "workers": choice.workers})
        cfg._choice = choice
        return cfg

    @property
    def backend_choice(self) -> Any:
        """The :class:`~orchard.simulation.defaults.BackendChoice` behind ``backend`` and
        ``workers``: what runs, and why (``.line()`` says it in one line)."""
        if self._choice is None:  # built without validation (model_construct)
            from orchard.simulation.defaults import BackendChoice

            return BackendChoice(self.backend, self.workers, "as configured")
        return self._choice

    def all_profiles(self) -> dict[str, DeviceProfile]:
        return {**DEFAULT_PROFILES, **self.profiles}

    def fanout(self) -> list[int]:
        a = self.aggregators
        if isinstance(a, int):
            return [a] if a > 0 else []
        return list(a)

    def run_config(self) -> RunConfig:
        """The run the root carries out (with this table's target, rounds and seed)."""
        cohort = self.run.cohort.model_copy(update={"target": self.clients_per_round})
        return self.run.model_copy(update={"cohort": cohort, "rounds": self.rounds, "seed": self.seed})


def _format(err: ValidationError, prefix: str) -> list[str]:
    out = []
    for e in err.errors():
        loc = ".".join(str(p) for p in e["loc"])
        out.append(f"{prefix}{'.' + loc if loc else ''}: {e['msg']}")
    return out


def _semantic_problems(cfg: SimulationConfig) -> list[str]:
    problems: list[str] = []
    if cfg.clients_per_round > cfg.clients:
        problems.append(f"simulation.clients_per_round ({cfg.clients_per_round}) exceeds the population "
                        f"simulation.clients ({cfg.clients})")
    if cfg.run.continual is not None and cfg.backend != "local":
        problems.append(f"simulation.run.continual: streaming devices keep their replay buffers in this process's "
                        f"files and run on the local backend only, got backend {cfg.backend!r}: set backend = 'local'")
    if cfg.run.privacy.bounds_participation:  # with this table's rounds, target and population
        problems += ftrl_problems(cfg.run_config(), cfg.clients)
    if cfg.runtime == "executorch" and cfg.backend != "local":
        problems.append(f"simulation.runtime 'executorch' runs on the local backend only, got backend "
                        f"{cfg.backend!r}: set backend = 'local'")
    fan = cfg.fanout()
    if any(not isinstance(f, int) or f < 1 for f in fan):
        problems.append(f"simulation.aggregators: every tier needs >= 1 aggregator, got {cfg.aggregators}")
    else:
        leaves = math.prod(fan) if fan else 1
        if leaves > cfg.clients_per_round:
            problems.append(f"simulation.aggregators: {leaves} lowest-tier aggregators for {cfg.clients_per_round} "
                            "clients per round leaves some with no client; use fewer aggregators")
    profiles = cfg.all_profiles()
    unknown = sorted(set(cfg.devices) - set(profiles))
    if unknown:
        problems.append(f"simulation.devices: unknown device kinds {unknown}; known: {sorted(profiles)} "
                        "(define new ones under [simulation.profiles.NAME])")
    if any(v < 0 for v in cfg.devices.values()) or sum(cfg.devices.values()) <= 0:
        problems.append(f"simulation.devices: shares must be >= 0 with a positive total, got {cfg.devices}")
    if cfg.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            problems.append("simulation.device: 'cuda' needs a CUDA GPU and a CUDA build of torch; this machine has "
                            "none (torch.cuda.is_available() is False): use device = 'cpu'")
        if cfg.backend == "ray" or not cfg.vectorize:
            problems.append("simulation.device: 'cuda' runs the vectorised path on the local or process backend: "
                            "set vectorize = true and backend = 'local' or 'process'")
    if cfg.backend == "ray":
        import importlib.util

        if importlib.util.find_spec("ray") is None:
            problems.append("simulation.backend: 'ray' needs the ray extra (pip install 'orchard-fl[ray]'), "
                            "or use backend = 'local'")
    run = cfg.run_config()
    from orchard.server.validation import aggregation_problems

    problems += aggregation_problems(run)
    if run.mode.is_async:
        # The root's coordinator runs asynchronous mode for any tree; the simulator drives
        # it for a root with its clients only, without secure aggregation or downlink deltas.
        for what, bad in (("simulation.aggregators", bool(fan)),
                          ("secure_aggregation.enabled", run.secure_aggregation.enabled),
                          ("downlink_delta", run.downlink_delta)):
            if bad:
                problems.append(f"{what}: the simulator runs asynchronous mode (run.mode.kind = \"async\") for a "
                                "root and its clients only; set it off here, or run the tree over gRPC "
                                "(orchard server/aggregator start), which supports it")
    if run.secure_aggregation.enabled:
        leaves = math.prod(fan) if fan and all(isinstance(f, int) and f > 0 for f in fan) else 1
        per_cohort = cfg.clients_per_round // max(leaves, 1)
        if per_cohort < 2:
            problems.append(f"secure_aggregation: each lowest-tier cohort gets about {per_cohort} clients; "
                            "secure aggregation needs at least 2 per cohort (fewer aggregators or more "
                            "clients per round)")
    return problems


def simulation_problems(data: dict[str, Any], cores: int | None = None) -> list[str]:
    """Every problem in a parsed TOML dict with a ``[simulation]`` table, at once
    (``backend = "auto"`` settled for ``cores``, default this machine's)."""
    ctx = {"cores": cores}
    if "simulation" not in data:
        return ["simulation: no [simulation] table in this config"]
    raw = data["simulation"]
    if not isinstance(raw, dict):
        return ["simulation: must be a table"]
    problems: list[str] = []
    try:
        cfg = SimulationConfig.model_validate(raw, context=ctx)
    except ValidationError as err:
        problems += _format(err, "simulation")
        # Report the rest too: check what remains with the bad fields left at their
        # defaults, keeping only the problems that do not involve a bad field.
        bad = {str(e["loc"][0]) for e in err.errors() if e["loc"]}
        try:
            rest = SimulationConfig.model_validate({k: v for k, v in raw.items() if k not in bad}, context=ctx)
        except ValidationError:
            return problems
        problems += [p for p in _semantic_problems(rest)
                     if not any(f"simulation.{b}" in p for b in bad)]
        if "run" not in bad:
            from orchard.validation import run_problems

            problems += [f"simulation.run.{p}" for p in run_problems(rest.run_config())]
        return problems
    from orchard.validation import run_problems

    problems += _semantic_problems(cfg)
    problems += [f"simulation.run.{p}" for p in run_problems(cfg.run_config())]
    return problems


def parse_simulation_config(data: dict[str, Any], cores: int | None = None) -> SimulationConfig:
    """A validated SimulationConfig from a parsed TOML dict, or ConfigError with every problem.
    ``cores``: the machine ``backend = "auto"`` plans for (default: this one)."""
    problems = simulation_problems(data, cores)
    if problems:
        raise ConfigError(problems)
    return SimulationConfig.model_validate(data["simulation"], context={"cores": cores})


def load_simulation_config(path: str | Path, overrides: dict[str, Any] | None = None,
                           cores: int | None = None) -> SimulationConfig:
    """Load ``[simulation]`` from a TOML file and apply dotted overrides (None values skipped)."""
    data = load_toml(path) if path is not None else {}
    return build_simulation_config(data, overrides or {}, cores)


def merged_simulation_table(data: dict[str, Any], overrides: dict[str, Any]) -> dict[str, Any]:
    """A copy of ``data``'s ``[simulation]`` table with dotted overrides applied (None skipped)."""
    import copy

    return apply_overrides(copy.deepcopy(dict(data.get("simulation", {}))), overrides)


def build_simulation_config(data: dict[str, Any], overrides: dict[str, Any],
                            cores: int | None = None) -> SimulationConfig:
    return parse_simulation_config({**data, "simulation": merged_simulation_table(data, overrides)}, cores)
