"""A round is charged before it can release anything, and durably; runs on the same
devices compose in the population ledger against its lifetime budget."""

from __future__ import annotations

import asyncio
from pathlib import Path

import numpy as np
import pytest

from orchard.aggregation.accounting import epsilon_of
from orchard.aggregation.ledger import PrivacyLedger
from orchard.aggregation.server_opt import ServerOptimizer
from orchard.config import RunConfig
from orchard.errors import ConfigError, PrivacyBudgetExceeded
from orchard.server.charges import Charge, MemoryChargeLog, SQLiteChargeLog
from orchard.server.runloop import RoundPlan, RunState, run_rounds


def _cfg(rounds: int = 3, **privacy: object) -> RunConfig:
    return RunConfig.model_validate({"rounds": rounds, "cohort": {"target": 4, "weighting": "uniform"},
                                     "privacy": {"mode": "central", "noise_multiplier": 4.0, "population": 100,
                                                 **privacy}})


class _Raises:
    """A backend whose round's wait raises (the tiers released partial sums, then failed)."""

    async def play(self, state: RunState, plan: RoundPlan) -> None:
        raise RuntimeError("the round's wait raised")

    def offload(self, fn, *args):  # type: ignore[no-untyped-def]
        raise AssertionError("never reached")


class _Sink:
    def __init__(self) -> None:
        self.charged_at: list[tuple[int, int, int]] = []  # (round, attempt, ledger rounds then)

    def charged(self, state: RunState, plan: RoundPlan) -> None:
        assert state.privacy is not None
        self.charged_at.append((plan.round, plan.attempt, state.privacy.rounds))

    def first_attempt(self, state: RunState, rnd: int) -> int:
        return 0


def test_an_attempt_whose_wait_raises_is_charged() -> None:
    cfg = _cfg()
    arrays = {"w": np.zeros(2, np.float32)}
    state = RunState("r", cfg, cfg.model_dump_json(), arrays, ServerOptimizer(cfg.server_optimizer, arrays),
                     privacy=PrivacyLedger.plan(cfg))
    sink = _Sink()
    with pytest.raises(RuntimeError, match="wait raised"):
        asyncio.run(run_rounds(state, _Raises(), sink))  # type: ignore[arg-type]
    assert state.privacy is not None and state.privacy.rounds == 1
    assert state.privacy.epsilon == pytest.approx(epsilon_of([(4.0, 1)], 1e-5))
    assert sink.charged_at == [(1, 0, 1)]  # recorded before the round was played


@pytest.mark.parametrize("kind", ["sqlite", "memory"])
def test_the_charge_log_keeps_every_charge_by_population(tmp_path: Path, kind: str) -> None:
    log = SQLiteChargeLog(tmp_path / "p.db") if kind == "sqlite" else MemoryChargeLog()
    for rnd in (1, 2):
        log.record(Charge("fleet", "run-a", rnd, 0, 4.0, "replace_one"))
    log.record(Charge("fleet", "run-a", 2, 0, 4.0, "replace_one"))  # the same charge again counts once
    log.record(Charge("fleet", "run-b", 1, 0, 2.0, "replace_one"))
    log.record(Charge("other", "run-c", 1, 0, 1.0, "replace_one"))
    assert log.prior("fleet", "replace_one") == ((2.0, 1), (4.0, 2))
    assert log.prior("fleet", "replace_one", exclude_run="run-b") == ((4.0, 2),)
    assert log.run_rounds("run-a") == 2
    with pytest.raises(ConfigError, match="adjacency"):
        log.prior("fleet", "add_remove")
    if kind == "sqlite":  # durable: a new log on the same file sees the charges
        log.close()
        assert SQLiteChargeLog(tmp_path / "p.db").prior("fleet", "replace_one") == ((2.0, 1), (4.0, 2))


def test_runs_on_the_same_devices_compose_against_the_lifetime_budget() -> None:
    cfg = _cfg(rounds=3, lifetime_epsilon=5.0)
    first = PrivacyLedger.plan(cfg, prior=())
    assert first is not None
    whole3 = epsilon_of([(4.0, 3)], 1e-5)
    assert whole3 < 5.0 < epsilon_of([(4.0, 6)], 1e-5)  # one run fits, two do not
    # A second run of 3 rounds on the same population after the first: refused at start.
    with pytest.raises(ConfigError, match="lifetime_epsilon"):
        PrivacyLedger.plan(cfg, prior=((4.0, 3),))
    # A shorter second run starts, and stops where the population's budget ends.
    second = PrivacyLedger.plan(_cfg(rounds=1, lifetime_epsilon=5.0), prior=((4.0, 3),))
    assert second is not None
    n = 0
    with pytest.raises(PrivacyBudgetExceeded, match="lifetime"):
        for _ in range(10):
            second.check_next()
            second.charge()
            n += 1
    assert epsilon_of([(4.0, 3 + n)], 1e-5) <= 5.0 < epsilon_of([(4.0, 4 + n)], 1e-5)
    assert second.as_dict()["population_epsilon"] == pytest.approx(epsilon_of([(4.0, 3 + n)], 1e-5), abs=1e-6)
