"""Typed configuration (pydantic). Every field has a sensible default; every problem in a
config file is reported at once (``orchard validate CONFIG``).

Cross-package checks (a codec that is not linear under secure aggregation, a task name
that is not registered) need the codec and task registries, which sit above the core;
they live in :mod:`orchard.validation`, which the CLI and the server call.
"""

from __future__ import annotations

import math
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

    ``scope``: where the session runs. "cohort" (the default): one session per lowest
    tier over the clients it selected; the tier unmasks its cohort's sum and pushes it up.
    "tree": one session per round over every client selected anywhere in the tree, owned
    by the root; the tiers below relay the clients' messages and never unmask anything
    (``orchard.server.coordinator``, "secure aggregation over the whole tree"). With
    distributed DP this is what lets one noise, sized for the whole round, serve the
    round, as central DP's does: with "cohort", every cohort sum carries the full noise.
    """

    enabled: bool = False
    scope: Literal["cohort", "tree"] = "cohort"
    threshold: float | None = None
    neighbours: int | None = None
    dropout_rate: float = Field(0.1, ge=0.0, lt=0.5)
    # The fraction of clients assumed to collude with the server (gamma in the bounds of
    # orchard.secure_agg.params): k and t are chosen so that privacy holds against it.
    corrupt_fraction: float = Field(0.05, ge=0.0, lt=0.5)
    # "active": signed keys, the consistency round and verified shares (Bonawitz et al.,
    # 2017, s6), against a server that lies and clients that misbehave; "semi_honest":
    # the version-1 protocol, against a server that follows it (docs/secure-aggregation.md).
    adversary: Literal["active", "semi_honest"] = "active"
    clip: float = Field(1.0, gt=0.0)
    bits: int = Field(16, ge=2, le=24)
    modulus_bits: int = Field(32, ge=16, le=62)
    # Clients mask (w / weight_scale) * update so that weighted values stay inside the
    # clip; weights above weight_scale are capped. Weights travel in the clear.
    weight_scale: float = Field(1000.0, gt=0.0)

    @property
    def over_tree(self) -> bool:
        """On, and one session per round at the root (scope "tree")."""
        return self.enabled and self.scope == "tree"


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


class AdaptiveClipConfig(_Strict):
    """Adaptive clipping (Andrew et al., 2021): the clip norm follows a quantile of the
    clients' update norms. ``count_stddev``: noise on the count of clients within the norm
    (None: expected clients per round / 20, the paper's choice)."""

    target_quantile: float = Field(0.5, gt=0.0, lt=1.0)
    learning_rate: float = Field(0.2, gt=0.0)
    count_stddev: float | None = Field(None, gt=0.0)


class PrivacyConfig(_Strict):
    """``[run.privacy]``: device-level differential privacy (``orchard.aggregation.privacy``,
    docs/privacy.md says exactly what holds).

    ``mode``: "off"; "central" (the root and every tier that sees updates or cohort sums
    are trusted: updates are clipped where they are seen -- at the lowest tier, or on the
    client under secure aggregation -- and the root adds Gaussian noise); "distributed"
    (no tier is trusted: under secure aggregation each client clips and adds its share of
    discrete Gaussian noise, so every cohort sum a tier learns is already private);
    "dpftrl" (DP-FTRL, Kairouz et al. 2021: trusted as "central", but the root adds
    tree-aggregated noise, ``orchard.aggregation.ftrl``, and each device takes part at most
    ``max_participations`` times, ``min_separation`` rounds apart, which the selection
    enforces; ``restart_every``: rounds per tree, None for one tree over the run). The
    noise multiplier comes from ``target_epsilon`` (at ``delta``, over the planned rounds,
    every round accounted as if every device took part: no amplification by sampling) or
    is given as ``noise_multiplier``.

    ``adjacency``: which datasets the guarantee tells apart. "replace_one": one device's
    data replaced by any other (a round's sum moves by at most 2 clip norms; which
    devices take part, and how many, is public). "add_remove" is refused: the number of
    contributions is the divisor of every round's mean and decides retries, so it would
    have to be noised too. ``population``: how many devices the run may touch (the
    simulator knows it); ``delta`` must be at most ``1 / population``.
    ``sampling_rate`` is refused: it claimed amplification by Poisson sampling, which
    Orchard's selection does not perform.
    """

    mode: Literal["off", "central", "distributed", "dpftrl"] = "off"
    target_epsilon: float | None = Field(None, gt=0.0)
    delta: float = Field(1e-5, gt=0.0, lt=1.0)
    noise_multiplier: float | None = Field(None, gt=0.0)
    clip_norm: float = Field(1.0, gt=0.0)
    adjacency: Literal["replace_one", "add_remove"] = "replace_one"
    population: int | None = Field(None, ge=1)
    # The population ledger a gRPC root charges every round of this run to, before it
    # opens: runs on the same devices name the same ledger, and together may spend at
    # most lifetime_epsilon (None: no lifetime budget, but the charges are still kept).
    population_ledger: str = Field("default", min_length=1, max_length=200)
    lifetime_epsilon: float | None = Field(None, gt=0.0)
    sampling_rate: float | None = Field(None, gt=0.0, le=1.0)
    adaptive: AdaptiveClipConfig | None = None
    # DP-FTRL's participation bound (mode "dpftrl" only): the selection of every tier that
    # picks clients refuses a device past either (orchard.server.participation).
    max_participations: int | None = Field(None, ge=1)
    min_separation: int | None = Field(None, ge=1)
    restart_every: int | None = Field(None, ge=1)

    @property
    def enabled(self) -> bool:
        return self.mode != "off"

    @property
    def noised_at_root(self) -> bool:
        """The root adds the noise (central DP, DP-FTRL); tiers and clients only clip."""
        return self.mode in ("central", "dpftrl")

    @property
    def bounds_participation(self) -> bool:
        """The selection holds each device to the participation bound (DP-FTRL)."""
        return self.mode == "dpftrl"

    def problems(self) -> list[str]:
        """What this table claims that Orchard does not deliver, with what to change."""
        out = []
        if self.sampling_rate is not None:
            out.append("privacy.sampling_rate claims amplification by Poisson sampling, which Orchard's selection does "
                       "not perform (the root takes a fixed number among the devices live and eligible when a round "
                       "opens, late joiners first come, first served; the simulator, devices online at the hour): "
                       "remove it; every round is accounted as if every device took part")
        if self.enabled and self.adjacency == "add_remove":
            out.append("privacy.adjacency 'add_remove' is not supported: the number of contributions to a round is "
                       "its mean's divisor, is recorded and decides retries, so adding or removing a device changes "
                       "it un-noised; use 'replace_one' (the default)")
        if self.enabled and self.population is not None and self.delta > 1.0 / self.population:
            out.append(f"privacy.delta = {self.delta:g} is above 1 / population = {1.0 / self.population:.3g}: "
                       f"lower it to at most {1.0 / self.population:.3g}")
        bound = {"max_participations": self.max_participations, "min_separation": self.min_separation,
                 "restart_every": self.restart_every}
        if self.mode == "dpftrl":
            missing = [k for k in ("max_participations", "min_separation") if bound[k] is None]
            if missing:
                out.append(f"privacy.mode 'dpftrl' accounts for a participation bound: set privacy.{' and privacy.'.join(missing)} "
                           "(the selection enforces them; e.g. max_participations = 1, min_separation = the rounds)")
        else:
            given = [k for k, v in bound.items() if v is not None]
            if given:
                out.append(f"privacy.{', privacy.'.join(given)} only apply to privacy.mode 'dpftrl' (the other modes "
                           "account every round as if every device took part): remove them or set mode = 'dpftrl'")
        return out


class RobustConfig(_Strict):
    """``[run.robust]``: bounding and robust statistics against outlying updates.

    ``norm_bound``: L2 bound on each client's update (clipped where updates are seen: at
    the lowest tier, or on the client under secure aggregation). ``statistic``: how a
    lowest tier combines its cohort: "mean" (the weighted sum, linear), or the
    coordinate-wise "median" or "trimmed_mean" (not linear: not under secure aggregation;
    they hold the cohort's updates, so memory follows the cohort size)."""

    norm_bound: float | None = Field(None, gt=0.0)
    statistic: Literal["mean", "median", "trimmed_mean"] = "mean"
    trim_fraction: float = Field(0.1, ge=0.0, lt=0.5)


class PersonalizationConfig(_Strict):
    """``[run.personalization]``: a personal adapter that stays on the device
    (``orchard.client.personal``, docs/personalization.md).

    ``kind``: "none"; "finetune" (``steps`` local steps from the global adapter, taken
    before each evaluation); "ditto" (Li et al., 2021, "Ditto: Fair and Robust Federated
    Learning Through Personalization", Alg. 1: each time the device takes part it also
    trains its own adapter ``v`` for ``steps`` steps on ``F_k(v) + lam / 2 ||v - w||^2``,
    ``w`` the global adapter of the round). The personal adapter is never uploaded or
    aggregated; it is kept owner-only in the device's data dir and used for the device's
    own inference. ``learning_rate``: the personal steps' (None: ``train.learning_rate``).
    Devices evaluate the global and the personal adapter on their own held-out data, so
    the task must have a local test split."""

    kind: Literal["none", "finetune", "ditto"] = "none"
    steps: int = Field(20, ge=1)
    lam: float = Field(0.1, ge=0.0)
    learning_rate: float | None = Field(None, gt=0.0)

    @property
    def enabled(self) -> bool:
        return self.kind != "none"


class ContinualConfig(_Strict):
    """``[run.continual]``: clients' data arrive as a stream and each device keeps a replay
    buffer (docs/continual.md). Ranges are checked by ``orchard validate``
    (``orchard.tasks.stream.continual_problems``), which names each problem.

    ``periods``: class-incremental arrival, the classes of each period in order (a
    sample of a class in no period never arrives); each lasts ``period_s`` seconds of
    the stream's clock (virtual time in the simulator). ``replay_ratio``: the share of
    each local batch drawn from the buffer. ``sampling``: the buffer's admission and
    draw rule. ``simulated_budget_fraction`` / ``simulated_budget_bytes``: the buffer
    budget of simulated devices (at most this fraction of the samples each device has
    seen so far, or bytes); a real device's budget is its policy's (``client.json``: ``replay``).
    """

    periods: list[list[int]] = Field(default_factory=list)
    period_s: float = 3600.0
    replay_ratio: float = 0.5
    sampling: Literal["reservoir", "class_balanced"] = "reservoir"
    hot_samples: int = 4
    simulated_budget_fraction: float | None = None
    simulated_budget_bytes: int | None = None


# The downlink delta's codec unless a run names its own (``RunConfig.downlink_codec``).
DOWNLINK_CODEC = CodecSpec(name="qsgd", params={"bits": 8, "block": 4096})


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
    # delta through ``downlink_codec`` when that is smaller. Off by default: clients
    # then train from a reconstruction, not the exact global model.
    downlink_delta: bool = False
    # Any stateless codec (the delta is taken from what the client holds, so what one
    # delta leaves out the next re-sends); 8-bit qsgd by default, about a quarter of
    # the float32 model.
    downlink_codec: CodecSpec = DOWNLINK_CODEC
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
    privacy: PrivacyConfig = PrivacyConfig()
    robust: RobustConfig = RobustConfig()
    personalization: PersonalizationConfig = PersonalizationConfig()
    continual: ContinualConfig | None = None  # streams of device data and on-device replay

    @property
    def clip_norm(self) -> float | None:
        """The L2 bound each client update is clipped to this round, if any: the tighter of
        DP's clip norm and the robustness norm bound."""
        bounds = [b for b in (self.privacy.clip_norm if self.privacy.enabled else None, self.robust.norm_bound)
                  if b is not None]
        return min(bounds) if bounds else None

    @property
    def clips_on_client(self) -> bool:
        """Updates are clipped on the client (secure aggregation: no tier sees them)."""
        return self.secure_aggregation.enabled and self.clip_norm is not None

    @property
    def needs_decoded_updates(self) -> bool:
        """A tier must decode each client update (a robust statistic of them): no
        compressed-domain sum. Clipping does not need it: a tier reads an update's norm
        from its payload and scales its weight (``orchard.compression.sums_compressed``)."""
        return self.robust.statistic != "mean"
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
        problems += self._stack_problems()
        if problems:
            raise ValueError("; ".join(problems))
        return self

    def _stack_problems(self) -> list[str]:
        """Privacy and robustness settings that cannot work together, with what would."""
        p, r, secure = self.privacy, self.robust, self.secure_aggregation.enabled
        out = p.problems()
        if p.enabled and self.cohort.weighting != Weighting.UNIFORM:
            out.append(f"privacy.mode {p.mode!r} needs cohort.weighting = 'uniform' (each client's contribution "
                       f"must be bounded by the clip norm); got {self.cohort.weighting.value!r}")
        if p.mode == "distributed" and not secure:
            out.append("privacy.mode 'distributed' adds noise on the clients under secure aggregation: set "
                       "secure_aggregation.enabled = true, or use privacy.mode 'central'")
        if p.mode == "dpftrl":
            out += ftrl_problems(self)
        if p.adaptive is not None and secure:
            out.append("privacy.adaptive needs each client's clipped bit, which secure aggregation would send in "
                       "the clear: use a fixed privacy.clip_norm under secure aggregation")
        if p.enabled and p.noise_multiplier is None and p.target_epsilon is None:
            out.append("privacy: set target_epsilon (the noise follows from it) or noise_multiplier")
        if self.secure_aggregation.over_tree and self.mode.is_async:
            out.append("secure_aggregation.scope 'tree' runs one session per round; asynchronous buffers keep their "
                       "sessions at the lowest tier: use scope 'cohort' in asynchronous mode")
        if self.mode.is_async:
            # Asynchronous buffers fold through the same stack as rounds, with FedBuff's
            # staleness weight as its innermost stage: clipping, robust.norm_bound and the
            # root's central DP noise compose with it. What still cannot:
            if r.statistic != "mean":
                out.append(f"robust.statistic {r.statistic!r} takes fresh updates only and has no staleness "
                           "weighting: in asynchronous mode use 'mean', with robust.norm_bound to bound each update")
            if p.mode == "distributed":
                out.append("privacy.mode 'distributed' is not supported in asynchronous mode (its noise shares are "
                           "calibrated to one SecAgg+ session per round, not to a buffer's): use privacy.mode "
                           "'central', whose noise the root adds to each buffer")
        if r.statistic != "mean":
            # Under secure aggregation: orchard.server.validation.aggregation_problems, from
            # each statistic's declared linearity.
            if self.cohort.weighting != Weighting.UNIFORM:
                out.append(f"robust.statistic {r.statistic!r} weighs every client alike: set cohort.weighting = "
                           "'uniform'")
            if p.enabled:
                out.append(f"robust.statistic {r.statistic!r} has no DP analysis here: with privacy on use "
                           "'mean' with a clip norm")
        return out


def ftrl_problems(cfg: RunConfig, population: int | None = None) -> list[str]:
    """What DP-FTRL's tree and participation bound need from the rest of the run;
    ``population``: the devices the run touches, where the caller knows them (the
    simulator's), else ``privacy.population``."""
    p, out = cfg.privacy, []
    size = p.population if p.population is not None else population
    if cfg.mode.is_async:
        out.append("privacy.mode 'dpftrl' releases one tree leaf per round; asynchronous buffers carry updates "
                   "across versions: use [run.mode] kind = 'sync', or privacy.mode 'central'")
    if p.adaptive is not None:
        out.append("privacy.adaptive is accounted per round as a Gaussian beside the updates; DP-FTRL's tree has "
                   "no such share: use a fixed privacy.clip_norm with privacy.mode 'dpftrl'")
    if p.noise_multiplier is None and p.target_epsilon is None:
        return out
    if size is not None and p.max_participations is not None:
        per_round = math.ceil(cfg.cohort.target * cfg.cohort.over_selection)
        if size * p.max_participations < cfg.rounds * per_round:
            out.append(f"privacy: {size} devices taking part at most {p.max_participations} times cannot "
                       f"fill {cfg.rounds} rounds of {per_round} selected: raise privacy.max_participations or "
                       "privacy.population, or plan fewer rounds")
        if p.min_separation is not None and size < min(p.min_separation, cfg.rounds) * per_round:
            out.append(f"privacy: {size} devices, each at most once every {p.min_separation} rounds, "
                       f"cannot fill rounds of {per_round} selected: lower privacy.min_separation to at most "
                       f"{max(1, size // per_round)}")
    return out


class ServerConfig(_Strict):
    """How a root or aggregator serves."""

    host: str = "127.0.0.1"
    port: int = Field(0, ge=0, le=65535)
    max_inflight_uploads: int = Field(16, ge=1)  # staged uploads held at once: bounds memory
    max_upload_bytes: int = Field(2 << 30, ge=1)
    chunk_bytes: int = Field(4 << 20, ge=1024, le=4 << 20)  # model chunks sent down (orchard.wire)
    # Nodes beat every heartbeat_s / 2 while they work on a task; a node silent for
    # node_timeout_s (no call, no long poll outstanding) is dropped from its round.
    heartbeat_s: float = Field(4.0, gt=0.0)
    node_timeout_s: float = Field(12.0, gt=0.0)
    long_poll_s: float = Field(20.0, gt=0.0)
    # Join's limits per peer address and per credential (orchard.server.ratelimit): a burst,
    # then a rate per second, of failed joins and of joins whose node has not polled yet.
    join_failures_burst: int = Field(10, ge=1)
    join_failures_per_s: float = Field(0.2, gt=0.0)
    unpolled_joins_burst: int = Field(50, ge=1)
    unpolled_joins_per_s: float = Field(0.5, gt=0.0)
    # Processes that expand a secure session's masks when it unmasks (None: one per core;
    # 0: threads of the server process). Started with the first session large enough to
    # gain from them (orchard.server.secagg.MASK_WORKERS_MIN_BYTES), kept until shutdown.
    mask_workers: int | None = Field(None, ge=0)
    # The root keeps each completed round's aggregate (the float64 partial its server step
    # took, ``round-N.aggregate.safetensors`` beside the checkpoint) so that a run's final
    # model can be replayed from its start: one float64 model's worth of disk per round.
    keep_aggregates: bool = False


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


def apply_overrides(table: dict[str, Any], overrides: dict[str, Any]) -> dict[str, Any]:
    """Set each dotted key of ``overrides`` (``"cohort.target": 10``) in ``table``, in
    place, making the tables on the way; a None value is not given. Returns ``table``."""
    for dotted, v in overrides.items():
        if v is None:
            continue
        d = table
        *parents, leaf = dotted.split(".")
        for p in parents:
            d = d.setdefault(p, {})
        d[leaf] = v
    return table


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
