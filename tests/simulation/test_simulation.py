"""The simulator: determinism, vectorised == per-client, tree == flat, memory that does
not grow with the population, deadlines, validation, secure aggregation, the CLI."""


from __future__ import annotations

import dataclasses
import json
import tracemalloc
from pathlib import Path

import numpy as np
import pytest
from sim_cases import ALWAYS_ON, DIGITS, _deterministic, _run, _sim

from orchard.client.update import train_seed
from orchard.config import CodecSpec, CohortConfig, RunConfig
from orchard.errors import OrchardError
from orchard.messages import TaskAssignment
from orchard.simulation import DeviceProfile, SimulationConfig, run_simulation, simulation_problems
from orchard.simulation.clients import ClientJob
from orchard.tasks import get_task
from orchard.trainer import TrainConfig

# ---------------------------------------------------------------------- determinism


def test_same_seed_same_report(tmp_path: Path) -> None:
    a = run_simulation(_sim(out=tmp_path / "a"))
    b = run_simulation(_sim(out=tmp_path / "b"))
    assert a.seed_dependent() == b.seed_dependent()
    for k in a.final_arrays:
        np.testing.assert_array_equal(a.final_arrays[k], b.final_arrays[k])
    rows = [json.loads(x) for x in (tmp_path / "a" / "rounds.jsonl").read_text().splitlines()]
    assert [r["round"] for r in rows] == [1, 2]
    c = run_simulation(_sim(seed=1))
    assert c.seed_dependent()["rounds"] != a.seed_dependent()["rounds"]


# ---------------------------------------------------------------------- tiers


@pytest.mark.parametrize("aggregators", [2, [2, 3]])
def test_tree_gives_the_flat_global_model(aggregators: object) -> None:
    flat = run_simulation(_deterministic(24, aggregators=0, vectorize=False))
    tree = run_simulation(_deterministic(24, aggregators=aggregators, vectorize=False))
    assert [r["participants"] for r in flat.rounds] == [r["participants"] for r in tree.rounds] == [24, 24]
    for k, v in flat.final_arrays.items():
        scale = float(np.abs(v).max())
        np.testing.assert_allclose(tree.final_arrays[k], v, rtol=0, atol=1e-6 * scale)
    assert sum(tree.rounds[-1]["tier_participants"].values()) == 24


def test_vectorized_simulation_equals_per_client_simulation() -> None:
    fast = run_simulation(_deterministic(24, aggregators=2, vectorize=True))
    slow = run_simulation(_deterministic(24, aggregators=2, vectorize=False))
    for k, v in slow.final_arrays.items():
        np.testing.assert_allclose(fast.final_arrays[k], v, rtol=0, atol=1e-5)


# ---------------------------------------------------------------------- memory


def _traced_peak(fn: object) -> int:
    tracemalloc.start()
    try:
        fn()  # type: ignore[operator]
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def test_memory_follows_the_cohort_not_the_population() -> None:
    """100,000 devices with 100 per round cost no more than 1,000 devices, beyond the task's
    own partition indices (which the task computes for every client up front)."""
    small, big = 1_000, 100_000
    cfg = lambda n: _sim(clients=n, clients_per_round=100, rounds=2, aggregators=2, evaluate_every=0)  # noqa: E731
    run_simulation(cfg(small))  # warm imports and caches outside the measurement
    peak_small = _traced_peak(lambda: run_simulation(cfg(small)))
    peak_big = _traced_peak(lambda: run_simulation(cfg(big)))
    partition_big = _traced_peak(lambda: get_task("digits", **DIGITS).partition(big, 0))
    # Population rows are ~30 bytes per device: 3 MB for 100k. Per-client objects
    # (datasets, trainers, devices) would cost kilobytes each, hundreds of MB here.
    extra = peak_big - peak_small - partition_big
    assert extra < 12 * 2**20, f"simulator state grew by {extra / 2**20:.1f} MiB for {big - small} more devices"


# ---------------------------------------------------------------------- time


def test_deadline_drops_late_clients() -> None:
    slow = DeviceProfile(gflops=1e-6, battery=False, availability=[1.0] * 24, dropout=0.0, latency_s=0.05)
    run = _run(cohort=CohortConfig(target=20, over_selection=2.0, min_fraction=0.1, deadline_s=60.0))
    cfg = _sim(clients=200, clients_per_round=20, rounds=1, aggregators=0, governor=False, run=run,
               profiles={"box": ALWAYS_ON, "slow": slow}, devices={"box": 0.5, "slow": 0.5})
    rep = run_simulation(cfg)
    r = rep.rounds[0]
    assert r["closed_because"] == "deadline"
    assert r["simulated_seconds"] == pytest.approx(60.0, abs=1e-6)
    assert r["late"] > 0 and r["participants"] > 0
    assert r["participants"] + r["late"] == r["selected"]
    assert r["participants"] < 20  # the slow half never made it


def test_target_closes_the_round_before_stragglers() -> None:
    run = _run(cohort=CohortConfig(target=20, over_selection=1.5, min_fraction=0.5, deadline_s=600.0))
    rep = run_simulation(_sim(clients=300, clients_per_round=20, rounds=1, aggregators=0, run=run))
    r = rep.rounds[0]
    assert r["closed_because"] == "target reached"
    assert r["participants"] == 20
    assert r["selected"] == 30
    assert r["late"] + r["vanished"] + r["participants"] + r["stopped_by_governor"] == r["selected"]
    assert r["simulated_seconds"] < 600.0


def test_clients_expected_late_are_not_trained_unless_their_tier_stays_open(monkeypatch: pytest.MonkeyPatch) -> None:
    # Over-selection 1.5: 30 selected for a target of 20. The 10 expected to arrive after
    # the target closed the tier are not trained...
    run = _run(cohort=CohortConfig(target=20, over_selection=1.5, min_fraction=0.5, deadline_s=600.0))
    cfg = _sim(clients=300, clients_per_round=20, rounds=1, aggregators=0, run=run, profiles={"box": ALWAYS_ON},
               devices={"box": 1.0})
    r = run_simulation(cfg).rounds[0]
    assert (r["selected"], r["participants"], r["trained"], r["late"]) == (30, 20, 20, 10)
    # ... but when the first three uploads fail, the tier stays open and three of them train.
    import orchard.simulation.clients as clients

    calls = {"n": 0}
    real = clients.build_upload

    def flaky(*a: object, **kw: object) -> object:
        calls["n"] += 1
        if calls["n"] <= 3:
            raise OrchardError("the device lost its upload")
        return real(*a, **kw)

    monkeypatch.setattr(clients, "build_upload", flaky)
    monkeypatch.setattr(clients, "build_uploads", lambda *a, **kw: None)  # every upload built alone, by flaky
    r = run_simulation(cfg).rounds[0]
    assert r["closed_because"] == "target reached"
    assert (r["participants"], r["failed_clients"], r["trained"], r["late"]) == (20, 3, 23, 7)


def test_governor_stops_slow_devices_early_and_they_report_fewer_steps() -> None:
    slow = DeviceProfile(gflops=2e-5, speed_sigma=0.0, battery=False, availability=[1.0] * 24, dropout=0.0,
                         latency_s=0.05)
    run = _run(cohort=CohortConfig(target=10, over_selection=1.0, min_fraction=0.1, deadline_s=60.0,
                                   weighting="steps"),
               train={"epochs": 3, "batch_size": 5, "learning_rate": 0.1})
    cfg = _sim(clients=10, clients_per_round=10, rounds=1, aggregators=0, governor=True, run=run,
               profiles={"slow": slow}, devices={"slow": 1.0})
    rep = run_simulation(cfg)
    r = rep.rounds[0]
    # 12 planned steps of 5 examples at ~7.2 s per step (87 s > 60 s): the time budget stops each one early.
    assert r["participants"] == 10 and r["late"] == 0
    assert r["stopped_early"] == 10
    assert r["closed_because"] == "target reached"
    assert r["simulated_seconds"] <= 60.0


# ---------------------------------------------------------------------- validation


def test_validation_reports_every_problem() -> None:
    data = {"simulation": {
        "clients": 10, "clients_per_round": 50, "aggregators": 100, "backend": "local",
        "devices": {"toaster": 1.0},
        "run": {"task": "nope", "codec": {"name": "topk"}, "secure_aggregation": {"enabled": True}},
    }}
    problems = simulation_problems(data)
    text = "\n".join(problems)
    assert "clients_per_round (50) exceeds the population" in text
    assert "100 lowest-tier aggregators" in text
    assert "toaster" in text
    assert "'nope' is not a registered task" in text
    assert "cannot run under secure aggregation" in text
    assert len(problems) >= 5

    bad_types = {"simulation": {"clients": 1, "workers": 0, "devices": {"toaster": 1.0}}}
    text = "\n".join(simulation_problems(bad_types))
    assert "simulation.clients" in text and "simulation.workers" in text and "toaster" in text

    from orchard.validation import data_problems

    assert data_problems(data) == problems
    assert simulation_problems({"simulation": {"run": {"task": "digits"}}}) == []


# ---------------------------------------------------------------------- secure aggregation


def test_secure_aggregation_gives_the_plain_result_to_quantisation() -> None:
    plain = run_simulation(_deterministic(12, aggregators=2, rounds=1, vectorize=False))
    run = _run(cohort=CohortConfig(target=12, over_selection=1.0, min_fraction=1.0, deadline_s=600.0),
               secure_aggregation={"enabled": True, "bits": 20, "clip": 1.0})
    secure = run_simulation(_deterministic(12, aggregators=2, rounds=1, vectorize=False, run=run))
    assert secure.rounds[0]["participants"] == plain.rounds[0]["participants"] == 12
    assert secure.rounds[0]["bytes_up"] > plain.rounds[0]["bytes_up"]  # masks and shares cost bytes
    for k, v in plain.final_arrays.items():
        np.testing.assert_allclose(secure.final_arrays[k], v, rtol=0, atol=2e-4)


@pytest.mark.parametrize("aggregators", [0, [2], [2, 2]])
def test_one_session_over_the_tree_sums_what_cohort_sessions_sum(aggregators: object) -> None:
    """Scope "tree": the root's one session over every client, the aggregators relaying,
    gives bit for bit the model of a session per cohort (each client's quantised vector is
    the same; only where the masks cancel differs), and the record names each lowest tier."""
    def sim(scope: str) -> object:
        run = _run(cohort=CohortConfig(target=12, over_selection=1.0, min_fraction=1.0, deadline_s=600.0),
                   secure_aggregation={"enabled": True, "bits": 20, "clip": 1.0, "scope": scope})
        kw = {"aggregators": aggregators} if aggregators else {}
        return run_simulation(_deterministic(12, rounds=2, vectorize=False, run=run, **kw))

    cohort, tree = sim("cohort"), sim("tree")
    for k, v in cohort.final_arrays.items():
        np.testing.assert_array_equal(tree.final_arrays[k], v)
    for row_c, row_t in zip(cohort.rounds, tree.rounds, strict=True):
        assert row_t["participants"] == row_c["participants"] == 12
        assert row_t["tier_participants"] == row_c["tier_participants"]
        assert row_t["bytes_down"] > 0 and row_t["bytes_up"] > 0


def test_tree_scope_distributed_dp_runs_one_noise_for_the_round() -> None:
    """Distributed DP over the tree: one session of 12 sizes every noise share for 12
    clients, and the run spends the epsilon the accountant says (the same as per cohort)."""
    def sim(scope: str) -> object:
        run = _run(cohort=CohortConfig(target=12, over_selection=1.0, min_fraction=1.0, deadline_s=600.0,
                                       weighting="uniform"),
                   secure_aggregation={"enabled": True, "scope": scope},
                   privacy={"mode": "distributed", "target_epsilon": 8.0, "clip_norm": 1.0})
        return run_simulation(_deterministic(12, aggregators=[2], rounds=2, vectorize=False, run=run))

    tree, cohort = sim("tree"), sim("cohort")
    assert [r["participants"] for r in tree.rounds] == [12, 12]
    assert tree.privacy["epsilon"] == pytest.approx(cohort.privacy["epsilon"])
    assert tree.privacy["epsilon"] <= 8.0


def test_a_run_the_privacy_budget_stops_is_tested_on_the_model_it_ends_with() -> None:
    """Failed attempts are charged too: with a quarter of the devices vanishing, retries
    spend the budget before round 4, and the run stops. Its report still tests the model
    it ends with (the last completed round's)."""
    flaky = ALWAYS_ON.model_copy(update={"dropout": 0.25})
    run = _run(rounds=4, cohort=CohortConfig(target=10, over_selection=1.0, min_fraction=0.9, deadline_s=600.0,
                                             weighting="uniform"),
               privacy={"mode": "central", "target_epsilon": 8.0, "clip_norm": 1.0})
    rep = run_simulation(SimulationConfig.model_validate(dict(
        clients=40, clients_per_round=10, rounds=4, progress=False, seed=3, evaluate_every=0, profiles={"box": flaky},
        devices={"box": 1.0}, run=run)))
    assert rep.status.startswith("stopped: round") and 0 < len(rep.rounds) < 4, rep.status
    assert rep.final_accuracy is not None and rep.rounds[-1]["accuracy"] == rep.final_accuracy
    ev = get_task("digits", **DIGITS).evaluate(rep.final_arrays)
    assert rep.final_accuracy == pytest.approx(float(ev["accuracy"]))


def test_tree_scope_is_refused_in_asynchronous_mode() -> None:
    with pytest.raises(ValueError, match="scope 'tree'"):
        _run(mode={"kind": "async"}, secure_aggregation={"enabled": True, "scope": "tree"})


# ---------------------------------------------------------------------- outputs and CLI


def test_cli_writes_report_jsonl_and_plots(tmp_path: Path) -> None:
    import typer
    from typer.testing import CliRunner

    from orchard.simulation.cli import simulate

    app = typer.Typer()
    app.command()(simulate)
    cfg = tmp_path / "sim.toml"
    cfg.write_text('[simulation]\nclients = 300\nclients_per_round = 20\nprogress = false\n'
                   '[simulation.run]\ntask = "digits"\ntask_params = { with_replacement = true }\n')
    out = tmp_path / "out"
    res = CliRunner().invoke(app, ["--config", str(cfg), "--rounds", "2", "--aggregators", "2", "--out", str(out)])
    assert res.exit_code == 0, res.output
    rep = json.loads((out / "report.json").read_text())
    for row in rep["rounds"]:
        assert {"round", "participants", "accuracy", "loss", "bytes_up", "bytes_down", "seconds",
                "simulated_seconds"} <= set(row)
    assert rep["clients_per_second"] > 0 and rep["aggregators"] == [2]
    assert len((out / "rounds.jsonl").read_text().splitlines()) == 2
    for name in ("accuracy.png", "bytes.png", "participation.png"):
        assert (out / name).read_bytes()[:4] == b"\x89PNG"
    bad = CliRunner().invoke(app, ["--config", str(cfg), "--clients-per-round", "1000", "--out", str(out)])
    assert bad.exit_code == 2 and "exceeds the population" in bad.output


# ---------------------------------------------------------------------- downlink deltas


def test_downlink_deltas_cut_bytes_down_and_clients_train_from_their_reconstruction() -> None:
    """As over the wire (tests/integration/test_downlink.py): a device that trained last
    round holds that model, pulls a quantised delta instead of the full model, trains from
    its reconstruction, and the global model stays within a rounding step of the plain run."""
    n = 12
    plain = run_simulation(_deterministic(n, rounds=3, aggregators=2, vectorize=True))
    cfg = _deterministic(n, rounds=3, aggregators=2, vectorize=True)
    delta_cfg = cfg.model_copy(update={"run": cfg.run.model_copy(update={"downlink_delta": True})})
    delta = run_simulation(delta_cfg)
    p = [r["bytes_down"] for r in plain.rounds]
    d = [r["bytes_down"] for r in delta.rounds]
    assert p[0] == d[0] and p[1] == p[0]  # round 1: everyone pulls the full model
    assert d[1] < 0.5 * p[1] and d[2] < 0.5 * p[2], (p, d)  # later rounds: deltas (plus the tiers' full pulls)
    gap = max(float(np.abs(delta.final_arrays[k] - v).max()) for k, v in plain.final_arrays.items())
    assert 0 < gap < 1e-3, gap  # trained from a reconstruction: close to, not equal to, the plain run
    again = run_simulation(delta_cfg)
    for k, v in delta.final_arrays.items():
        np.testing.assert_array_equal(again.final_arrays[k], v)


def test_a_runs_downlink_codec_is_the_one_deltas_are_sent_through() -> None:
    """``run.downlink_codec`` reaches the tier's delta: 4-bit codes are about half the
    8-bit default's bytes, and the devices rebuild the model the reply states."""
    n = 12
    cfg = _deterministic(n, rounds=3, aggregators=2, vectorize=True)
    down = {}
    for bits in (8, 4):
        run = cfg.run.model_copy(update={"downlink_delta": True, "downlink_codec": CodecSpec(
            name="qsgd", params={"bits": bits, "block": 4096})})
        down[bits] = [r["bytes_down"] for r in run_simulation(cfg.model_copy(update={"run": run})).rounds]
    assert down[4][0] == down[8][0]  # round 1: the full model either way
    assert down[4][2] < 0.75 * down[8][2], down


def test_a_jobs_train_config_is_the_runs_with_its_seed_and_steps() -> None:

    from orchard.simulation.clients import _train_config

    run = _run(train={"epochs": 2, "batch_size": 7, "learning_rate": 0.3, "optimizer": "sgd", "momentum": 0.5,
                      "weight_decay": 0.01, "proximal_mu": 0.1, "extra": {"k": 1}})
    a = TaskAssignment(run_id="r", round=4, attempt=0, task_id="t", model_hash="h", model_bytes=0, config_json="{}",
                       schema=(), deadline_unix=0.0, cohort_target=1, shared_seed=0)
    seed, tc = _train_config(run, ClientJob(9, "device-9", a))
    assert seed == train_seed(run.seed, 4, 9)
    assert tc == dataclasses.replace(run.train, seed=seed)
    _, tc = _train_config(run, ClientJob(9, "device-9", a, steps=3))
    assert tc == dataclasses.replace(run.train, seed=seed, steps=3)
    # _train_config names every field: a new one must be added there too.
    assert [f.name for f in dataclasses.fields(TrainConfig)] == [
        "epochs", "steps", "batch_size", "learning_rate", "optimizer", "momentum", "weight_decay", "proximal_mu",
        "seed", "extra"]


def test_a_round_records_where_its_time_went(tmp_path) -> None:
    # The engine's account of a synchronous round: every step's wall seconds, the device
    # models inside dispatch, and no more than the round took.
    cfg = SimulationConfig(clients=200, clients_per_round=20, rounds=2, aggregators=2, evaluate_every=0,
                           progress=False, out=tmp_path, run=RunConfig(task="digits"))
    report = run_simulation(cfg)
    for r in report.rounds:
        p = r["phase_seconds"]
        assert set(p) == {"check_in", "open", "dispatch", "device_models", "arrivals", "leave"}
        assert all(v >= 0 for v in p.values())
        assert p["device_models"] <= p["dispatch"]
        steps = sum(v for k, v in p.items() if k != "device_models")
        assert 0 < steps <= r["seconds"] + 1e-3


def test_a_round_that_cannot_fill_says_what_to_change() -> None:
    # Devices are online about 60% of the hour: a round of the whole population cannot fill.
    report = run_simulation(_sim(clients=60, clients_per_round=60, rounds=1, aggregators=1))
    assert report.status.startswith("failed at round 1 (")
    assert "devices checked in for the 60 wanted" in report.status
    assert "raise --clients or lower --clients-per-round" in report.status
    # Where everyone checks in, a failed round has no such advice (here: none fails).
    assert "failed" not in run_simulation(_deterministic(8, rounds=1)).status
