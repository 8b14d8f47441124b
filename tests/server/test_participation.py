"""DP-FTRL's participation bound as the selection enforces it (one implementation for
the gRPC tiers and the simulator), what `orchard validate` refuses, and a restarted
root that continues the same tree of noise and the same bound."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import numpy as np
import pytest

from orchard import wire
from orchard.aggregation.ledger import PrivacyLedger
from orchard.config import RunConfig, ServerConfig
from orchard.errors import ConfigError
from orchard.server.charges import Charge, SQLiteChargeLog
from orchard.server.coordinator import Coordinator
from orchard.server.decoding import ClientUpdateDecoder
from orchard.server.participation import ParticipationBound
from orchard.server.root import RootRunner
from orchard.server.round import RoundTask
from orchard.server.store import SQLiteStore, atomic_write
from orchard.typing import DeviceState, Role, TensorSpec
from orchard.validation import data_problems
from tests.server.restart import resume_root

PRIVACY = {"mode": "dpftrl", "noise_multiplier": 2.0, "population": 16, "delta": 1e-3, "max_participations": 2,
           "min_separation": 3}


def _cfg(rounds: int = 8, target: int = 4, **privacy: object) -> RunConfig:
    return RunConfig.model_validate({"rounds": rounds, "cohort": {"target": target, "over_selection": 1.0,
                                                                  "weighting": "uniform"},
                                     "privacy": {**PRIVACY, **privacy}})


def _task(cfg: RunConfig, rnd: int, attempt: int = 0) -> RoundTask:
    return RoundTask(run_id="run", round=rnd, attempt=attempt, config=cfg, config_json=cfg.model_dump_json(),
                     model_blob=b"", model_hash="h", schema=(TensorSpec("w", (4,), "float32"),),
                     deadline_unix=time.time() + 600, target=cfg.cohort.target, shared_seed=1)


def test_a_tier_selects_no_device_past_its_bound() -> None:
    cfg = _cfg()
    coord = Coordinator("tier", ServerConfig(node_timeout_s=600), np.random.default_rng(0), ClientUpdateDecoder(),
                        inline=True)
    for i in range(16):
        coord.join(f"d{i}", Role.CLIENT, "tok", DeviceState())
    history: dict[str, list[int]] = {}
    for rnd in range(1, 9):
        for attempt in (0, 1):  # a retry of the same round: nobody takes part twice in one round
            cr = coord.open_round(_task(cfg, rnd, attempt))
            for node in cr.assignments:
                history.setdefault(node, []).append(rnd)
            coord.close_round(cr, "test")
            for node in list(coord.children):  # every device waits for work again
                coord.registry.poll_started(coord.children[node])
    for rounds in history.values():
        assert len(rounds) <= 2
        assert all(b - a >= 3 for a, b in zip(rounds, rounds[1:], strict=False))
    assert sum(len(r) for r in history.values()) >= 16  # the bound, not a stall, limited it


def test_other_modes_are_not_bounded() -> None:
    b = ParticipationBound()
    b.begin("run", 1, _cfg().privacy.model_copy(update={"mode": "central", "max_participations": None,
                                                        "min_separation": None}))
    for _ in range(5):
        b.record("d")
    assert b.allows("d") and b.participations("d") == 0


def test_the_bound_round_trips_and_a_new_run_starts_afresh() -> None:
    b = ParticipationBound()
    b.begin("run", 1, _cfg().privacy)
    b.record("d")
    with pytest.raises(ConfigError, match="participation bound"):
        b.record("d")  # same round again: a path that skipped allows()
    c = ParticipationBound()
    c.restore(b.to_json())
    c.begin("run", 3, _cfg().privacy)
    assert not c.allows("d", 3) and c.allows("d", 4) and c.participations("d") == 1
    c.begin("other-run", 1, _cfg().privacy)
    assert c.participations("d") == 0
    with pytest.raises(ConfigError, match="cannot be read"):
        c.restore("{}")


@pytest.mark.parametrize("privacy,match", [
    ({"max_participations": None}, "set privacy.max_participations"),
    ({"mode": "central"}, "only apply to privacy.mode 'dpftrl'"),
    ({"population": 5}, "cannot fill"),
    ({"min_separation": 8, "population": 20}, "lower privacy.min_separation"),
    ({"adaptive": {}}, "fixed privacy.clip_norm"),
])
def test_validate_names_inconsistent_settings(privacy: dict, match: str) -> None:
    run = {"rounds": 8, "cohort": {"target": 4, "weighting": "uniform", "over_selection": 1.0},
           "privacy": {**PRIVACY, **privacy}}
    problems = data_problems({"run": run})
    assert any(match in p for p in problems), problems


def test_validate_refuses_dpftrl_in_asynchronous_mode() -> None:
    run = {"rounds": 8, "mode": {"kind": "async", "buffer_size": 4}, "cohort": {"target": 4, "weighting": "uniform"},
           "privacy": PRIVACY}
    assert any("kind = 'sync'" in p for p in data_problems({"run": run}))


def test_a_restarted_root_continues_the_tree_and_the_bound(tmp_path: Path) -> None:
    cfg = _cfg(clip_norm=0.5)
    arrays = {"w": np.zeros(4, np.float32)}
    store = SQLiteStore(tmp_path / "orchard.db")
    store.create_run("run-x", cfg.model_dump_json())
    blob = wire.arrays_to_blob(arrays)
    for rnd in (0, 1):  # the checkpoints rounds 0 and 1 left
        path = tmp_path / "checkpoints" / "run-x" / f"round-{rnd:06d}.safetensors"
        atomic_write(path, blob)
        store.index_checkpoint("run-x", rnd, str(path), wire.sha256_hex(blob))
    # What the killed root did: charged and journaled attempts 1 and 2, completed round 1
    # (attempt 1), and selected d0 for round 2, which never closed.
    ledger = PrivacyLedger.plan(cfg)
    assert ledger is not None
    charges = SQLiteChargeLog(tmp_path / "privacy-ledger.db")
    rng = np.random.default_rng(1)
    bound = ParticipationBound()
    for rnd in (1, 2):
        charge = ledger.charge()
        ledger.draw({"w": (4,)}, rng)
        charges.record(Charge("default", "run-x", rnd, 0, ledger.charge_multiplier, "replace_one"))
        charges.save_state("run-x", "tree", wire.arrays_to_blob(ledger.snapshot()))
        bound.begin("run-x", rnd, cfg.privacy)
        bound.record("d0" if rnd == 2 else "d1")
        charges.save_state("run-x", "participation", bound.to_json().encode())
        if rnd == 1:
            ledger.release({"w": np.zeros(4)})
            path = tmp_path / "checkpoints" / "run-x" / "round-000001.safetensors"
            store.complete_round("run-x", 1, 0, time.time(), {"privacy": charge}, str(path), wire.sha256_hex(blob), "")
    pending = ledger.mechanism.state.carry  # type: ignore[attr-defined]
    charges.close()
    coord, runner = resume_root(store, tmp_path)
    assert runner.run is not None and runner.run.privacy is not None
    back = runner.run.privacy
    assert back.rounds == 2 and back.epsilon == pytest.approx(ledger.epsilon, rel=1e-12)
    state = back.mechanism.state  # type: ignore[attr-defined]
    assert state.leaves == 2 and state.carry is not None
    np.testing.assert_array_equal(state.carry["w"], pending["w"])  # attempt 2's noise, not drawn again
    assert coord.registry.participation.participations("d0") == 1
    coord.registry.participation.begin("run-x", 3, cfg.privacy)
    assert not coord.registry.participation.allows("d0")  # round 2 + separation 3
    store.close()


def test_a_root_with_aggregators_refuses_dpftrl(tmp_path: Path) -> None:
    # An aggregator's participation counts live in its memory only: the root refuses.
    store = SQLiteStore(tmp_path / "orchard.db")
    coord = Coordinator("root", ServerConfig(), np.random.default_rng(0), ClientUpdateDecoder())
    coord.join("agg-1", Role.AGGREGATOR, "tok", DeviceState())
    coord.touch("agg-1", pool_size=20, pool_eligible=20)
    coord.registry.poll_started(coord.children["agg-1"])  # waiting for work
    runner = RootRunner(coord, store, tmp_path, ServerConfig(), start_grace_s=0.0)
    cfg = _cfg(rounds=2, target=2, population=100)

    async def go() -> str:
        run_id = await runner.start_run(cfg, wire.arrays_to_blob({"w": np.zeros(4, np.float32)}))
        assert runner._task is not None
        await asyncio.wait_for(runner._task, 30)
        return run_id

    run_id = asyncio.run(go())
    row = store.get_run(run_id)
    assert row is not None and row.status == "failed" and "directly under the root" in row.error
    store.close()


def test_a_fill_in_is_journaled_before_it_takes_its_task(tmp_path: Path) -> None:
    # A client that arrives after selection may fill an unused slot; its participation
    # must be durable before it is handed its task, or a root restarted mid-round would
    # forget it and could select the device again past its bound.
    store = SQLiteStore(tmp_path / "orchard.db")
    coord = Coordinator("root", ServerConfig(node_timeout_s=600), np.random.default_rng(0), ClientUpdateDecoder(),
                        inline=True)
    runner = RootRunner(coord, store, tmp_path, ServerConfig(), start_grace_s=0.0)
    cfg = _cfg(rounds=8, target=4)
    cfg = cfg.model_copy(update={"cohort": cfg.cohort.model_copy(update={"over_selection": 1.5})})
    for i in range(2):
        coord.join(f"d{i}", Role.CLIENT, "tok", DeviceState())
    cr = coord.open_round(_task(cfg, 1))
    assert sorted(cr.assignments) == ["d0", "d1"]  # over-selected for 3: one slot unused
    coord.join("late", Role.CLIENT, "tok", DeviceState())
    task = coord.assign("late")
    assert task is not None
    journaled = runner.charges.state("run", "participation")
    assert journaled is not None
    restarted = ParticipationBound()
    restarted.restore(journaled.decode())
    restarted.begin("run", 2, cfg.privacy)
    assert restarted.participations("late") == 1 and not restarted.allows("late", 3)  # 3 rounds apart: 4
    assert all(restarted.participations(d) == 1 for d in ("d0", "d1"))
    coord.close_round(cr, "test")
    runner.charges.close()
    store.close()


def test_the_simulator_refuses_a_population_the_bound_cannot_fill() -> None:
    from orchard.simulation.config import simulation_problems

    sim = {"clients": 100, "clients_per_round": 10, "rounds": 20,
           "run": {"cohort": {"weighting": "uniform", "over_selection": 1.0},
                   "privacy": {"mode": "dpftrl", "target_epsilon": 8.0, "delta": 1e-3, "max_participations": 1,
                               "min_separation": 20}}}
    assert any("cannot fill 20 rounds" in p for p in simulation_problems({"simulation": sim}))
    sim["rounds"] = 10
    assert simulation_problems({"simulation": sim}) == []
