"""Asynchronous mode in the simulator: the same coordinator, on the virtual clock and the
device population. K = target with S = 0 is the synchronous run, bit for bit; with
S > 0 the devices still training carry into the next buffers and count, stale."""

from __future__ import annotations

import numpy as np
from test_simulation import _run, _sim

from orchard.config import CohortConfig, ModeConfig
from orchard.simulation import run_simulation, simulation_problems

COHORT = CohortConfig(target=10, over_selection=1.5, min_fraction=0.5, deadline_s=600.0)


def test_k_equal_target_and_s_zero_gives_the_synchronous_run() -> None:
    sync = run_simulation(_sim(clients=300, clients_per_round=10, rounds=3, aggregators=0, run=_run(cohort=COHORT)))
    mode = ModeConfig(kind="async", buffer_size=10, max_staleness=0)
    asyn = run_simulation(_sim(clients=300, clients_per_round=10, rounds=3, aggregators=0,
                               run=_run(cohort=COHORT, mode=mode)))
    assert [r["participants"] for r in asyn.rounds] == [r["participants"] for r in sync.rounds] == [10, 10, 10]
    assert [r["simulated_seconds"] for r in asyn.rounds] == [r["simulated_seconds"] for r in sync.rounds]
    for k, v in sync.final_arrays.items():
        np.testing.assert_array_equal(asyn.final_arrays[k], v, err_msg=k)
    assert all(r["staleness"] == {"0": 10} for r in asyn.rounds)


def test_stragglers_carry_into_later_buffers_with_their_staleness() -> None:
    mode = ModeConfig(kind="async", buffer_size=5, max_staleness=3)
    cohort = CohortConfig(target=5, over_selection=4.0, min_fraction=0.5, deadline_s=600.0)
    rep = run_simulation(_sim(clients=300, clients_per_round=5, rounds=8, aggregators=0, round_gap_s=0.0,
                              run=_run(cohort=cohort, mode=mode)))
    assert rep.status == "completed" and len(rep.rounds) == 8
    hist: dict[int, int] = {}
    for r in rep.rounds:
        for s, n in r["staleness"].items():
            hist[int(s)] = hist.get(int(s), 0) + n
        assert r["participants"] >= 5
    assert sum(hist.values()) == sum(r["participants"] for r in rep.rounds)
    assert max(hist) >= 1 and max(hist) <= 3, hist  # stale updates were folded, none past S
    assert any(r["in_flight"] > 0 for r in rep.rounds)  # devices kept training across buffers


def test_the_simulator_says_which_async_setups_it_cannot_run() -> None:
    run = _run(mode=ModeConfig(kind="async", buffer_size=4), secure_aggregation={"enabled": True})
    problems = simulation_problems({"simulation": _sim(aggregators=2, run=run).model_dump(mode="json")})
    assert sum("for a root and its clients only" in p for p in problems) == 2, problems


def test_the_benchmark_runs_both_modes_and_writes_its_json(tmp_path, monkeypatch, capsys) -> None:
    import json
    import runpy
    import sys
    from pathlib import Path

    out = tmp_path / "async.json"
    script = Path(__file__).resolve().parents[2] / "benchmarks" / "async.py"
    monkeypatch.setattr(sys, "argv", ["async.py", "--clients", "300", "--seeds", "0", "--max-rounds", "3",
                                      "--target", "10", "--target-accuracy", "0.3", "--buffer", "4",
                                      "--concurrency", "8", "--max-versions", "40", "--json", str(out)])
    runpy.run_path(str(script), run_name="__main__")
    got = json.loads(out.read_text())
    seed = got["seeds"][0]
    assert [r["mode"] for r in seed["sync"]] == [f"sync: {name}" for name in got["sync_policies"]]
    assert all(1 <= r["versions"] <= 3 for r in seed["sync"])
    assert seed["async"][0]["versions"] >= 1
    assert sum(seed["async"][0]["staleness"].values()) == seed["async"][0]["updates_folded"]
    assert got["ratios"] == [seed["ratio"]] and "async_vs_best_sync_time_ratio" in got
    assert "async / best sync per seed" in capsys.readouterr().out


def test_the_shipped_async_config_validates() -> None:
    from pathlib import Path

    from orchard.validation import config_problems

    assert config_problems(Path(__file__).resolve().parents[2] / "configs" / "async.toml") == []
