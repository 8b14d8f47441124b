"""Typed configuration (pydantic). Every field has a sensible default; every problem in a
config file is reported at once (``orchard validate CONFIG``).

Cross-package checks (a codec that is not linear under secure aggregation, a task name
that is not registered) need the codec and task registries, which sit above the core;
they live in :mod:`orchard.validation`, which the CLI and the server call.
"""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from orchard.errors import ConfigError
from orchard.trainer import TrainConfig
from orchard.typing import Weighting


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class CodecSpec(_Strict):
    """Which update codec a run uses; ``params`` are codec-specific (validated by the codec)."""

    name: str = "float32"
    params: dict[str, Any] = Field(default_factory=dict)


class SecureAggregationConfig(_Strict):
    """SecAgg+ settings (Bell et al., 2020).

    ``threshold`` is Shamir's t as a fraction of the neighbourhood (0 < t <= 1) or None
    to derive it from ``dropout_rate``; ``neighbours`` is k, or None to derive it from
    the cohort size as the paper does (k of order log n).
    """

    enabled: bool = False
    threshold: float | None = None
    neighbours: int | None = None
    dropout_rate: float = Field(0.1, ge=0.0, lt=0.5)
    clip: float = Field(1.0, gt=0.0)
    bits: int = Field(16, ge=2, le=24)
    modulus_bits: int = Field(32, ge=16, le=62)
    # Clients mask (w / weight_scale) * update so that weighted values stay inside the
    # clip; weights above weight_scale are capped. Weights travel in the clear.
    weight_scale: float = Field(1000.0, gt=0.0)


class ServerOptimizerConfig(_Strict):
    """The server optimizer applied to the pseudo-gradient (Reddi et al., 2021, Alg. 2)."""

    name: Literal["fedavg", "fedavgm", "fedadam", "fedyogi", "fedadagrad"] = "fedavg"
    lr: float = Field(1.0, gt=0.0)
    momentum: float = Field(0.9, ge=0.0, lt=1.0)
    beta1: float = Field(0.9, ge=0.0, lt=1.0)
    beta2: float = Field(0.99, ge=0.0, lt=1.0)
    tau: float = Field(1e-3, gt=0.0)  # adaptivity (epsilon) of FedAdam/FedYogi/FedAdagrad


class CohortConfig(_Strict):
    """Who takes part in a round and when it closes.

    A round selects ``ceil(target * over_selection)`` clients, closes as soon as
    ``target`` updates are in (or at the deadline), and fails unless at least
    ``ceil(target * min_fraction)`` arrived. A failed round leaves the global model
    unchanged and is retried up to ``max_retries`` times.
    """

    target: int = Field(10, ge=1)
    over_selection: float = Field(1.3, ge=1.0, le=10.0)
    min_fraction: float = Field(0.8, gt=0.0, le=1.0)
    deadline_s: float = Field(120.0, gt=0.0)
    max_retries: int = Field(3, ge=0)
    # "fednova": FedNova (Wang et al., 2020): clients send their delta divided by their
    # local step count, weighted by data; the root rescales the mean by the cohort's
    # mean step count (orchard.client.edge, orchard.edge_runtime.fednova).
    weighting: Weighting = Weighting.EXAMPLES


class ModeConfig(_Strict):
    """Synchronous rounds (the default) or buffered asynchronous aggregation (FedBuff:
    Nguyen et al., 2022, "Federated Learning with Buffered Asynchronous Aggregation").

    In ``"async"`` mode a round is one buffer: clients train on the model version they
    pulled, every tier folds arriving updates into its buffer, and the root applies a
    server step (bumping the model version) as soon as ``buffer_size`` updates are in,
    without waiting for the clients still training. An update trained on version ``v``
    and folded while the tier serves version ``V`` has staleness ``s = V - v``; it is
    refused when ``s > max_staleness`` and otherwise weighted by ``staleness`` (Alg. 1
    of the paper): ``"constant"`` 1, ``"polynomial"`` ``(1 + s) ** -staleness_exponent``
    (the paper's ``1 / sqrt(1 + s)`` at 0.5), ``"hinge"`` 1 up to ``hinge_after`` and
    ``1 / (1 + staleness_exponent * (s - hinge_after))`` beyond (Xie et al., 2019).
    ``cohort.over_selection`` is the concurrency: a tier keeps
    ``ceil(buffer target * over_selection)`` clients training.
    """

    kind: Literal["sync", "async"] = "sync"
    buffer_size: int | None = Field(None, ge=1)  # K; None: cohort.target
    max_staleness: int | None = Field(None, ge=0)  # S; None: 4
    staleness: Literal["constant", "polynomial", "hinge"] | None = None  # None: "polynomial"
    staleness_exponent: float | None = Field(None, ge=0.0)  # None: 0.5
    hinge_after: int | None = Field(None, ge=0)  # None: 2

    @model_validator(mode="after")
    def _check_kind(self) -> ModeConfig:
        if self.kind == "sync":
            set_ = [k for k in ("buffer_size", "max_staleness", "staleness", "staleness_exponent", "hinge_after")
                    if getattr(self, k) is not None]
            if set_:
                raise ValueError(f"{', '.join(set_)} only appl{'ies' if len(set_) == 1 else 'y'} to kind = "
                                 "\"async\" (buffered asynchronous aggregation); remove "
                                 f"{'it' if len(set_) == 1 else 'them'} or set kind = \"async\"")
        elif self.staleness not in (None, "hinge") and self.hinge_after is not None:
            raise ValueError("hinge_after only applies to staleness = \"hinge\"")
        return self

    @property
    def is_async(self) -> bool:
        return self.kind == "async"

    @property
    def max_stale(self) -> int:
        """S: 0 in sync mode (only the open round's updates count)."""
        if not self.is_async:
            return 0
        return 4 if self.max_staleness is None else self.max_staleness

    @property
    def weighting(self) -> str:
        return self.staleness or "polynomial"

    @property
    def exponent(self) -> float:
        return 0.5 if self.staleness_exponent is None else self.staleness_exponent

    @property
    def hinge(self) -> int:
        return 2 if self.hinge_after is None else self.hinge_after


class EligibilityConfig(_Strict):
    """Server-side eligibility from reported device state (the device enforces its own budget too)."""

    min_battery_percent: float = Field(20.0, ge=0.0, le=100.0)
    allow_on_battery: bool = True
    max_temperature_c: float = 45.0
    require_unmetered: bool = False
    require_idle: bool = False


class RunConfig(_Strict):
    """One federated run: what to train, for how long, and how updates travel."""

    task: str = "digits"
    task_params: dict[str, Any] = Field(default_factory=dict)
    rounds: int = Field(5, ge=1)
    seed: int = 0
    cohort: CohortConfig = CohortConfig()
    train: TrainConfig = TrainConfig()
    codec: CodecSpec = CodecSpec()
    # Downlink: a client holding the previous global may receive the next one as a
    # quantised delta (orchard.compression.DOWNLINK_CODEC) when that is smaller. Off by
    # default: clients then train from a reconstruction, not the exact global model.
    downlink_delta: bool = False
    secure_aggregation: SecureAggregationConfig = SecureAggregationConfig()
    # "auto": when the codec is linear and secure aggregation is off, the lowest tier
    # sums its direct clients' payloads without decoding them, weighting each by its
    # header's weight itself (clients send their plain update; no weight is capped):
    # the same weighted sum as decoding. Integer codes (qsgd with a fixed scale, alone
    # or inside randk) add exactly only unweighted, so they take that path only under
    # weighting "uniform" and are decoded otherwise
    # (orchard.compression.sums_compressed). "off": tiers decode every update.
    compressed_aggregation: Literal["auto", "off"] = "auto"
    server_optimizer: ServerOptimizerConfig = ServerOptimizerConfig()
    eligibility: EligibilityConfig = EligibilityConfig()
    evaluate_every: int = Field(1, ge=0)  # 0: never
    # Synchronous rounds or buffered asynchronous aggregation ([run.mode], see ModeConfig).
    mode: ModeConfig = ModeConfig()

    @property
    def buffer_target(self) -> int:
        """Updates a round waits for: the cohort's target, or in async mode the buffer size K."""
        if self.mode.is_async and self.mode.buffer_size is not None:
            return self.mode.buffer_size
        return self.cohort.target

    @model_validator(mode="after")
    def _check_train(self) -> RunConfig:
        t = self.train
        problems = []
        if t.epochs < 1 and not t.steps:
            problems.append("train.epochs must be >= 1 (or set train.steps)")
        if t.batch_size < 1:
            problems.append(f"train.batch_size must be >= 1, got {t.batch_size}")
        if t.learning_rate <= 0:
            problems.append(f"train.learning_rate must be > 0, got {t.learning_rate}")
        if t.proximal_mu < 0:
            problems.append(f"train.proximal_mu must be >= 0, got {t.proximal_mu}")
        if problems:
            raise ValueError("; ".join(problems))
        return self


class ServerConfig(_Strict):
    """How a root or aggregator serves."""

    host: str = "127.0.0.1"
    port: int = Field(0, ge=0, le=65535)
    max_inflight_uploads: int = Field(16, ge=1)  # staged uploads held at once: bounds memory
    max_upload_bytes: int = Field(2 << 30, ge=1)
    chunk_bytes: int = Field(1 << 20, ge=1024, le=4 << 20)
    heartbeat_s: float = Field(10.0, gt=0.0)
    node_timeout_s: float = Field(60.0, gt=0.0)
    long_poll_s: float = Field(20.0, gt=0.0)


def _format_validation_error(err: ValidationError) -> list[str]:
    out = []
    for e in err.errors():
        loc = ".".join(str(p) for p in e["loc"]) or "(top level)"
        out.append(f"{loc}: {e['msg']}")
    return out


def parse_run_config(data: dict[str, Any]) -> RunConfig:
    """Build a RunConfig from a plain dict, reporting every problem at once."""
    try:
        return RunConfig.model_validate(data)
    except ValidationError as err:
        raise ConfigError(_format_validation_error(err)) from None


def load_toml(path: str | Path) -> dict[str, Any]:
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"config file {p} does not exist: pass the path of a TOML file")
    try:
        return tomllib.loads(p.read_text())
    except tomllib.TOMLDecodeError as err:
        raise ConfigError(f"{p} is not valid TOML: {err}") from None


def load_run_config(path: str | Path) -> RunConfig:
    data = load_toml(path)
    # A file may hold the run config at the top or under [run].
    return parse_run_config(data.get("run", data))


# The files of a base-model directory written by `orchard pretrain` (orchard.gpt reads it).
BASE_WEIGHTS = "model.safetensors"
BASE_CONFIG = "config.json"


def base_model_dir(path: str | Path) -> Path:
    """The absolute path of a base-model directory written by `orchard pretrain`, or
    ConfigError naming the files it lacks. Reads nothing: servers check it without torch."""
    p = Path(path).resolve()
    missing = [f for f in (BASE_CONFIG, BASE_WEIGHTS) if not (p / f).is_file()]
    if missing:
        raise ConfigError(f"--base-model {path} lacks {', '.join(missing)}; pass a directory written by "
                          "`orchard pretrain`")
    return p
