"""The study's driver: what to run next, from the study's storage alone.

One loop: fail the trials whose heartbeat went stale (Optuna retries each once), read
the ledger, dispatch while the budget and the launcher's free slots allow, wait for a
dispatch to end. A worker that dies has its running trial failed at once and retried
once; a process that died with the whole study (``kill -9``) leaves its trial running,
and the heartbeat fails it once ``grace_s`` has passed, here or in any trial that starts.
Nothing is kept outside the storage, so a restarted driver picks up where one stopped.
"""

from __future__ import annotations

import time
import uuid
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from orchard.simulation.tune.launchers import Launcher
from orchard.simulation.tune.objective import TICKET, TrialSetup
from orchard.simulation.tune.study import Ledger, dispatch_seed, load_study, make_storage


@dataclass(frozen=True)
class Progress:
    """What the live table shows: the ledger, this process's dispatches, the time."""

    ledger: Ledger
    in_flight: int
    elapsed_s: float
    stopping: str | None  # why no further trial starts, once the budget is spent


@dataclass
class StudyOutcome:
    study: Any  # the optuna.Study
    ledger: Ledger
    stopped_by: str
    elapsed_s: float
    retried: list[int]  # trials failed because their worker died, and retried


def _fail_dead(study: Any, storage: Any, ticket: str, study_id: int) -> int | None:
    """Fail the running trial ``ticket`` ran and queue its retry (once). Its number, or
    None when it had ended, or had not started, when its worker died."""
    from optuna.trial import TrialState

    for t in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
        if t.user_attrs.get(TICKET) == ticket:
            trial_id = storage.get_trial_id_from_study_id_trial_number(study_id, t.number)
            if not storage.set_trial_state_values(trial_id, TrialState.FAIL):
                return None
            retry = storage.get_heartbeat_stale_trial_callback()
            if retry is not None:
                retry(study, storage.get_trial(trial_id))
            return int(t.number)
    return None


def drive(setup: TrialSetup, launcher: Launcher, on_progress: Callable[[Progress], None] | None = None,
          poll_s: float = 0.5) -> StudyOutcome:
    """Run the study of ``setup`` to its budget on ``launcher``; resumes a study of the
    same name in the same storage."""
    import optuna

    spec = setup.spec
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    storage = make_storage(setup.storage_url, spec)
    study = load_study(storage, setup.study_name, spec, setup.rounds, spec.seed, create=True)
    study_id = storage.get_study_id_from_name(setup.study_name)
    serial = len(study.get_trials(deepcopy=False))  # a resumed study's dispatches draw new seeds
    mine: set[str] = set()
    retried: list[int] = []
    t0 = time.monotonic()
    stopping: str | None = None
    try:
        while True:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
                optuna.storages.fail_stale_trials(study)
            ledger = Ledger.of(study.get_trials(deepcopy=False), spec.direction)
            stopping = ledger.exhausted(spec, time.monotonic() - t0, mine)
            while stopping is None and launcher.free() > 0:
                ticket = uuid.uuid4().hex
                launcher.submit(ticket, dispatch_seed(spec.seed, serial))
                serial += 1
                mine.add(ticket)
                stopping = ledger.exhausted(spec, time.monotonic() - t0, mine)
            if on_progress is not None:
                on_progress(Progress(ledger, len(mine), time.monotonic() - t0, stopping))
            if not mine and stopping is not None and not ledger.foreign(mine):
                break
            if not mine and stopping is None and launcher.free() <= 0:
                raise RuntimeError("the launcher has no free slot and nothing running")
            for kind, ticket, _detail in launcher.poll(poll_s if mine else min(poll_s, 1.0)):
                mine.discard(ticket)
                if kind == "died":
                    number = _fail_dead(study, storage, ticket, study_id)
                    if number is not None:
                        retried.append(number)
            if not mine:
                time.sleep(poll_s)  # waiting on another process's trials
    except BaseException:
        # Interrupted (Ctrl-C): this process's running trials fail now and are retried
        # when the study resumes, instead of waiting out their heartbeat.
        launcher.close()
        for ticket in mine:
            _fail_dead(study, storage, ticket, study_id)
        raise
    launcher.close()
    ledger = Ledger.of(study.get_trials(deepcopy=False), spec.direction)
    return StudyOutcome(study, ledger, stopping or "budget", time.monotonic() - t0, retried)
