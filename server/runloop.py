"""The run loop, written once: a run's rounds and their attempts, the privacy ledger, the
rule for how many updates a round needs, the server step, and the record of each attempt.

Two backends run it. The gRPC root (``orchard.server.root``) plays a round by opening it
on its coordinator and waiting for the tiers below; the simulator
(``orchard.simulation.runner``) plays one on its in-process tree with a virtual clock.
Each supplies a :class:`RoundBackend` (how a round is played, where CPU-heavy steps run)
and a :class:`RunSink` (where the records go: the root's store and checkpoints, the
simulator's report). Everything a round's result depends on is decided here, so the two
cannot drift apart::

    for each round r, attempt a (retried up to cohort.max_retries times):
        plan      the ledger checks the budget (PrivacyBudgetExceeded ends the run) and
                  gives the round its config (clip norm, noise multiplier) and noise
        charge    the ledger charges the attempt and draws its noise (DP-FTRL's tree
                  leaf), and the sink records both, before it opens (its sums may
                  leave the tiers)
        play      the backend opens the round and returns its outcome
        judge     enough(outcome): at least ceil(buffer_target x min_fraction) updates
                  with a positive weight, else the attempt fails and the model stays
        release   the ledger's mechanism adds what it adds at the root after the tiers
                  (DP-FTRL: the tree noise drawn since the last release)
        step      server_step (finalize, FedNova rescale, server optimizer)
        adapt     adaptive clipping moves the ledger's clip norm
        record    the sink writes the attempt (a completed one with its new model)

The loop is a coroutine. On the root it awaits the tiers; the simulator's backend never
suspends, so the simulator drives the same coroutine to its end on its own thread
(``orchard.server.tier``'s ``run_inline``).
"""

from __future__ import annotations

import math
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field, replace
from typing import Any, Protocol, TypeVar

import numpy as np

from orchard.aggregation import server_step
from orchard.aggregation.layer import CLIP_BELOW
from orchard.aggregation.ledger import PrivacyLedger
from orchard.aggregation.server_opt import ServerOptimizer
from orchard.config import RunConfig
from orchard.errors import PrivacyBudgetExceeded
from orchard.server.round import RoundOutcome, RoundRecord, RoundStatus
from orchard.typing import NDArrays

T = TypeVar("T")


def updates_needed(cfg: RunConfig) -> int:
    """Updates a round (a buffer, in asynchronous mode) needs to count:
    ``ceil(buffer_target x min_fraction)``."""
    return math.ceil(cfg.buffer_target * cfg.cohort.min_fraction)


def enough(out: RoundOutcome, cfg: RunConfig) -> bool:
    """Whether a round's outcome moves the model: enough updates, and a weight to divide by."""
    return out.partial.count >= updates_needed(cfg) and out.partial.weight > 0


@dataclass
class RunState:
    """What a run carries from round to round: the global model, the server optimizer,
    the privacy ledger, how far it got. The loop moves it on; backends read it."""

    run_id: str
    config: RunConfig
    config_json: str
    arrays: NDArrays
    optimizer: ServerOptimizer
    completed_rounds: int = 0
    privacy: PrivacyLedger | None = None  # with DP on: the mechanism and what it has spent
    stop_requested: bool = False  # an operator's stop, or the caller's stop predicate
    status: str = "running"  # completed | stopped | failed, once the loop returns
    reason: str = ""  # why it stopped or failed


@dataclass(frozen=True)
class RoundPlan:
    """One attempt of one round, as the loop opens it."""

    round: int
    attempt: int
    config: RunConfig  # with DP: the ledger's (this round's clip norm and noise multiplier)
    config_json: str
    noise_stddev: float  # the root's central DP noise
    private: bool  # whether ``config`` is the ledger's rather than the run's


@dataclass
class Played:
    """What a backend's round gives back: the root's outcome and, from the simulator, its
    counts of devices (``RoundRecord.simulated``) and extra record fields."""

    outcome: RoundOutcome
    started: float = 0.0  # wall time the attempt opened at
    simulated: Any = None
    extra: dict[str, Any] = field(default_factory=dict)


class RoundBackend(Protocol):
    """How rounds are played: the gRPC tree, or the simulator's."""

    async def play(self, state: RunState, plan: RoundPlan) -> Played | None:
        """Open the attempt, return its outcome once it closed; None if the run was
        stopped before the round opened."""
        ...

    def offload(self, fn: Callable[..., T], *args: Any) -> Awaitable[T]:
        """Run CPU-heavy ``fn`` (the server step) where this backend runs such work."""
        ...


class RunSink(Protocol):
    """Where a run's records go."""

    def charged(self, state: RunState, plan: RoundPlan) -> None:
        """The ledger charged ``plan``'s attempt (DP on); called before the attempt opens.
        A root makes it durable in its population ledger before returning."""
        ...

    def first_attempt(self, state: RunState, rnd: int) -> int:
        """The attempt ``rnd`` starts at (a restarted root counts the attempts it made)."""
        ...

    async def failed(self, state: RunState, plan: RoundPlan, record: RoundRecord, played: Played) -> None:
        """An attempt that did not count (too few updates, or the run stopped)."""
        ...

    async def completed(self, state: RunState, plan: RoundPlan, record: RoundRecord, played: Played,
                        new_arrays: NDArrays) -> None:
        """An attempt that counted; ``new_arrays`` is the next global model (the state
        moves on to it after this returns). Set ``state.stop_requested`` to end the run."""
        ...


async def run_rounds(state: RunState, backend: RoundBackend, sink: RunSink,
                     adapt_rng: np.random.Generator | None = None) -> RunState:
    """Run ``state``'s remaining rounds. Ends with ``state.status`` completed, stopped (an
    operator, the caller's predicate, the privacy budget) or failed (a round that never
    reached its minimum), and ``state.reason``. ``adapt_rng``: the ledger's own noise
    (adaptive clipping's count, DP-FTRL's tree)."""
    cfg = state.config
    try:
        while state.completed_rounds < cfg.rounds and not state.stop_requested:
            rnd = state.completed_rounds + 1
            first = sink.first_attempt(state, rnd)
            for attempt in range(first, first + cfg.cohort.max_retries + 1):
                if state.stop_requested:
                    break
                if await _attempt(state, backend, sink, rnd, attempt, adapt_rng):
                    break
            else:
                state.status = "failed"
                state.reason = f"round {rnd} failed {cfg.cohort.max_retries + 1} times"
                return state
        state.status = "stopped" if state.stop_requested else "completed"
    except PrivacyBudgetExceeded as err:
        state.status, state.reason = "stopped", str(err)
    return state


def _plan(state: RunState, rnd: int, attempt: int) -> RoundPlan:
    ledger, cfg = state.privacy, state.config
    if ledger is None:
        return RoundPlan(rnd, attempt, cfg, state.config_json, 0.0, False)
    ledger.check_next()  # PrivacyBudgetExceeded ends the run before anything is released
    round_cfg = ledger.round_config(cfg)
    return RoundPlan(rnd, attempt, round_cfg, round_cfg.model_dump_json(), ledger.noise_stddev, True)


async def _attempt(state: RunState, backend: RoundBackend, sink: RunSink, rnd: int, attempt: int,
                   adapt_rng: np.random.Generator | None) -> bool:
    plan = _plan(state, rnd, attempt)
    ledger = state.privacy
    charge = None
    if ledger is not None:
        # Charged before the attempt opens, durably where the sink keeps charges: an
        # attempt whose wait raises, or a root killed mid-round, has paid for whatever its
        # tiers released. (One stopped before it opened is charged too: conservative.)
        charge = ledger.charge()
        ledger.draw({k: np.shape(v) for k, v in state.arrays.items()}, adapt_rng)
        sink.charged(state, plan)
    played = await backend.play(state, plan)
    if played is None:
        return False
    out, cfg = played.outcome, state.config
    privacy = None
    if charge is not None:
        # Nothing measured from the clients' data is released un-noised: not how many were
        # clipped, not the cohort's metric means (clip_below, train loss, ...), which no
        # noise covers; adaptive clipping reads clip_below here and noises it (ledger.adapt).
        privacy = {**charge, "noise_stddev": out.measurements.get("noise_stddev", 0.0)}
    if not enough(out, cfg):
        stopped = state.stop_requested
        record = RoundRecord.from_outcome(out, RoundStatus.STOPPED if stopped else RoundStatus.FAILED)
        record.simulated = played.simulated
        record.privacy = privacy
        if ledger is not None:
            record.metrics = {}
        if not stopped:
            record.reason = (f"{out.partial.count} of the {updates_needed(cfg)} updates needed arrived "
                             f"({out.reason}); global model unchanged, round retried")
        await sink.failed(state, plan, record, played)
        return False
    partial = out.partial
    if ledger is not None:
        partial = replace(partial, sums=ledger.release(partial.sums))
    new_arrays, metrics = await backend.offload(server_step, partial, cfg, state.optimizer)
    record = RoundRecord.from_outcome(out, RoundStatus.COMPLETED)
    record.simulated = played.simulated
    record.metrics = metrics
    if ledger is not None and privacy is not None:
        adaptive = cfg.privacy.adaptive
        if adaptive is not None:
            ledger.adapt(metrics.get(CLIP_BELOW), out.partial.count, adaptive.target_quantile,
                         adaptive.learning_rate, adapt_rng)
        privacy["next_clip_norm"] = ledger.clip_norm
        record.privacy = privacy
        record.metrics = {}
    await sink.completed(state, plan, record, played, new_arrays)
    state.arrays, state.completed_rounds = new_arrays, rnd
    return True
