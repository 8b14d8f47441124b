"""The study as Optuna keeps it: storage, sampler, pruner, and what the budget has spent.

The study lives in Optuna's RDB storage (a SQLite file by default), so a study that is
stopped, or killed, resumes where it was: its finished trials stay, and a trial left
running by a dead process stops sending heartbeats and is failed by the next process
that looks (``fail_stale_trials``), then retried once (``RetryHeartbeatStaleTrialCallback``)
with the same parameters. Samplers and pruners keep nothing of their own beyond the
storage, so each trial builds them afresh, seeded per dispatch.
"""

from __future__ import annotations

import hashlib
import warnings
from dataclasses import dataclass
from typing import Any

from orchard.simulation.tune.objective import CLIENT_ROUNDS, ERROR, TICKET
from orchard.simulation.tune.space import TuneSpec

# SQLite waits this long for a lock that another trial's process holds (heartbeats and
# per-round reports of parallel trials all write to the one file).
_SQLITE_TIMEOUT_S = 120


def storage_url(path_or_url: str) -> str:
    """A database URL: ``sqlite:///...``, ``postgresql://...``, or a file path (SQLite)."""
    if "://" in path_or_url:
        return path_or_url
    from pathlib import Path

    return f"sqlite:///{Path(path_or_url).resolve()}"


def make_storage(url: str, spec: TuneSpec) -> Any:
    """Optuna's RDB storage with heartbeats, a dead trial failed and retried once."""
    import optuna

    kwargs: dict[str, Any] = {"connect_args": {"timeout": _SQLITE_TIMEOUT_S}} if url.startswith("sqlite") else {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        return optuna.storages.RDBStorage(
            url, engine_kwargs=kwargs, heartbeat_interval=spec.heartbeat_s, grace_period=spec.grace_s,
            heartbeat_stale_trial_callback=optuna.storages.RetryHeartbeatStaleTrialCallback(max_retry=1))


def dispatch_seed(seed: int, serial: int) -> int:
    """The sampler's seed for the ``serial``-th dispatch of a study: one stream per
    dispatch, so parallel trials draw differently and a rerun draws the same."""
    digest = hashlib.sha256(f"{seed}:{serial}".encode()).digest()
    return int.from_bytes(digest[:4], "little")


def make_sampler(spec: TuneSpec, seed: int) -> Any:
    import optuna

    if spec.sampler == "random":
        return optuna.samplers.RandomSampler(seed=seed)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        # constant_liar: a running trial counts as a bad one, so parallel trials spread out.
        return optuna.samplers.TPESampler(seed=seed, n_startup_trials=spec.startup_trials,
                                          multivariate=True, constant_liar=spec.parallel > 1)


def make_pruner(spec: TuneSpec, rounds: int) -> Any:
    """Successive halving or Hyperband (Li et al. 2018) with rounds as the resource."""
    import optuna

    if spec.pruner == "none":
        return optuna.pruners.NopPruner()
    if spec.pruner == "successive_halving":
        return optuna.pruners.SuccessiveHalvingPruner(min_resource=spec.first_rung(rounds),
                                                      reduction_factor=spec.reduction_factor)
    return optuna.pruners.HyperbandPruner(min_resource=spec.first_rung(rounds), max_resource=rounds,
                                          reduction_factor=spec.reduction_factor)


def load_study(storage: Any, name: str, spec: TuneSpec, rounds: int, seed: int, create: bool = False) -> Any:
    import optuna

    sampler, pruner = make_sampler(spec, seed), make_pruner(spec, rounds)
    if create:
        return optuna.create_study(storage=storage, study_name=name, direction=spec.direction, sampler=sampler,
                                   pruner=pruner, load_if_exists=True)
    return optuna.load_study(storage=storage, study_name=name, sampler=sampler, pruner=pruner)


@dataclass(frozen=True)
class Ledger:
    """What a study has spent and holds, read from its trials.

    ``counted``: trials that ended and count toward ``trials`` (complete, pruned, or
    failed by their own config; a trial failed because its worker died is not counted:
    its retry is). ``running``: trial numbers running, with the dispatch each came from.
    ``waiting``: retries queued. ``client_rounds``: clients trained over every trial.
    """

    complete: int
    pruned: int
    failed: int
    counted: int
    running: dict[int, str]
    waiting: int
    client_rounds: int
    best_value: float | None
    best_number: int | None

    @classmethod
    def of(cls, trials: list[Any], direction: str) -> Ledger:
        from optuna.trial import TrialState

        complete = [t for t in trials if t.state == TrialState.COMPLETE]
        pruned = sum(t.state == TrialState.PRUNED for t in trials)
        failed = [t for t in trials if t.state == TrialState.FAIL]
        config_failed = sum(ERROR in t.user_attrs for t in failed)
        running = {t.number: str(t.user_attrs.get(TICKET, "")) for t in trials if t.state == TrialState.RUNNING}
        waiting = sum(t.state == TrialState.WAITING for t in trials)
        spent = sum(int(t.user_attrs.get(CLIENT_ROUNDS, 0)) for t in trials)
        best = None
        if complete:
            pick = max if direction == "maximize" else min
            best = pick(complete, key=lambda t: t.value)
        return cls(len(complete), pruned, len(failed), len(complete) + pruned + config_failed, running, waiting,
                   spent, None if best is None else best.value, None if best is None else best.number)

    def foreign(self, mine: set[str]) -> list[int]:
        """Running trials that no dispatch in ``mine`` ran: another process's, or a dead
        one's that its heartbeat has not yet declared stale."""
        return [n for n, ticket in self.running.items() if ticket not in mine]

    def exhausted(self, spec: TuneSpec, elapsed_s: float, mine: set[str]) -> str | None:
        """Why no further trial may start (None: one may), with ``mine`` the dispatches
        of this process not yet ended."""
        if spec.wall_time_s is not None and elapsed_s >= spec.wall_time_s:
            return f"wall time {spec.wall_time_s:g} s"
        if spec.client_rounds is not None and self.client_rounds >= spec.client_rounds:
            return f"{self.client_rounds:,} client-rounds of {spec.client_rounds:,}"
        if spec.trials is not None and self.counted + len(mine) + len(self.foreign(mine)) >= spec.trials:
            return f"{spec.trials} trials"
        return None
