"""The simulator: determinism, vectorised == per-client, tree == flat, memory that does
not grow with the population, deadlines, validation, secure aggregation, the CLI."""

from __future__ import annotations

import dataclasses
import json
import tracemalloc
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from orchard.client.update import train_seed
from orchard.compression import build_codec, decode_update
from orchard.config import CodecSpec, CohortConfig, RunConfig
from orchard.errors import OrchardError
from orchard.messages import TaskAssignment, UploadHeader, UploadKind
from orchard.simulation import DeviceProfile, SimulationConfig, run_simulation, simulation_problems
from orchard.simulation.clients import ClientJob, run_jobs
from orchard.simulation.vectorized import supports, train_many
from orchard.tasks import get_task
from orchard.tasks.torch_trainer import TensorData, TorchTrainer
from orchard.trainer import TrainConfig
from orchard.typing import TensorSpec, schema_of
from orchard.updates import split

DIGITS = {"with_replacement": True, "samples_per_client": 20}
ALWAYS_ON = DeviceProfile(gflops=10.0, battery=False, availability=[1.0] * 24, dropout=0.0, latency_s=0.05)


def _run(**kw: object) -> RunConfig:
    base: dict[str, object] = dict(task="digits", task_params=DIGITS,
                                   train={"epochs": 1, "batch_size": 10, "learning_rate": 0.1})
    base.update(kw)
    return RunConfig.model_validate(base)


def _sim(**kw: object) -> SimulationConfig:
    base: dict[str, object] = dict(clients=400, clients_per_round=40, rounds=2, aggregators=2, progress=False,
                                   run=_run())
    base.update(kw)
    return SimulationConfig.model_validate(base)


def _deterministic(n: int, **kw: object) -> SimulationConfig:
    """Every device always on, never dropping, selected every round: the cohort is the population."""
    run = _run(cohort=CohortConfig(target=n, over_selection=1.0, min_fraction=1.0, deadline_s=600.0))
    base: dict[str, object] = dict(clients=n, clients_per_round=n, rounds=2, progress=False,
                                   profiles={"box": ALWAYS_ON}, devices={"box": 1.0}, run=run)
    base.update(kw)
    return SimulationConfig.model_validate(base)


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


# ---------------------------------------------------------------------- vectorised path


def _trainers(n: int) -> tuple[list[TorchTrainer], dict[str, np.ndarray]]:
    task = get_task("digits", **DIGITS)
    return [task.client_trainer(i, 200, 0) for i in range(n)], task.initial_arrays(0)


@pytest.mark.parametrize("cfg", [
    TrainConfig(epochs=1, batch_size=10, learning_rate=0.1),
    TrainConfig(epochs=2, batch_size=8, learning_rate=0.05, weight_decay=1e-3, proximal_mu=0.1),
    TrainConfig(steps=3, batch_size=32, learning_rate=0.2),  # one batch holds all 20 examples
])
def test_vectorized_equals_per_client(cfg: TrainConfig) -> None:
    trainers, g = _trainers(24)
    cfgs = [dataclasses.replace(cfg, seed=train_seed(0, 1, i)) for i in range(24)]
    assert supports(trainers[0], cfg)
    fast = train_many(trainers, g, cfgs)
    slow_trainers, _ = _trainers(24)
    for t, c, f in zip(slow_trainers, cfgs, fast, strict=True):
        ref = t.train(g, c)
        assert f.num_steps == ref.num_steps and f.num_examples == ref.num_examples
        for k in g:
            np.testing.assert_allclose(f.arrays[k], ref.arrays[k], atol=1e-5, rtol=0)
        assert f.metrics["train_loss"] == pytest.approx(ref.metrics["train_loss"], abs=1e-5)
        assert f.metrics["train_accuracy"] == pytest.approx(ref.metrics["train_accuracy"])


def test_vmap_path_equals_per_client(monkeypatch: pytest.MonkeyPatch) -> None:
    # The digits MLP takes the written-out MLP step; with it turned off, the general vmap
    # step gives the per-client result too.
    import orchard.simulation.vectorized as vectorized

    trainers, g = _trainers(12)
    assert vectorized._mlp_plan(trainers[0].model, trainers[0].trainable) is not None
    monkeypatch.setattr(vectorized, "_mlp_plan", lambda model, names: None)
    cfg = TrainConfig(epochs=2, batch_size=8, learning_rate=0.05, weight_decay=1e-3, proximal_mu=0.1)
    cfgs = [dataclasses.replace(cfg, seed=train_seed(0, 1, i)) for i in range(12)]
    fast = train_many(trainers, g, cfgs)
    for t, c, f in zip(_trainers(12)[0], cfgs, fast, strict=True):
        ref = t.train(g, c)
        for k in g:
            np.testing.assert_allclose(f.arrays[k], ref.arrays[k], atol=1e-5, rtol=0)
        assert f.metrics["train_accuracy"] == pytest.approx(ref.metrics["train_accuracy"])


def _mlp_data(n: int, seed: int) -> TensorData:
    gen = torch.Generator().manual_seed(seed)
    return TensorData(torch.randn(n, 6, generator=gen), torch.randint(0, 3, (n,), generator=gen))


@pytest.mark.parametrize("build", [
    lambda: nn.Linear(6, 3),
    lambda: nn.Sequential(nn.Linear(6, 5, bias=False), nn.ReLU(), nn.Linear(5, 4), nn.ReLU(), nn.Linear(4, 3)),
    lambda: nn.Sequential(nn.Linear(6, 5), nn.ReLU(), nn.ReLU(), nn.Linear(5, 3, bias=False)),
])
def test_mlp_step_equals_per_client(build: object) -> None:
    import orchard.simulation.vectorized as vectorized

    def trainers() -> list[TorchTrainer]:
        return [TorchTrainer(build, _mlp_data(14, i), _mlp_data(4, 100 + i), seed=i)  # type: ignore[arg-type]
                for i in range(9)]

    ts = trainers()
    assert vectorized._mlp_plan(ts[0].model, ts[0].trainable) is not None
    g = {k: v.detach().numpy().copy() for k, v in ts[0].model.state_dict().items()}
    cfg = TrainConfig(epochs=2, batch_size=4, learning_rate=0.3, weight_decay=1e-2, proximal_mu=0.5)
    cfgs = [dataclasses.replace(cfg, seed=train_seed(3, 2, i)) for i in range(9)]
    fast = train_many(ts, g, cfgs)
    for t, c, f in zip(trainers(), cfgs, fast, strict=True):
        ref = t.train(g, c)
        assert f.num_steps == ref.num_steps == 8
        for k in g:
            np.testing.assert_allclose(f.arrays[k], ref.arrays[k], atol=1e-5, rtol=0)
        assert f.metrics["train_loss"] == pytest.approx(ref.metrics["train_loss"], abs=1e-5)
        assert f.metrics["train_accuracy"] == pytest.approx(ref.metrics["train_accuracy"])


def test_mlp_step_only_for_plain_mlps() -> None:
    from orchard.simulation.vectorized import _mlp_plan

    def plan(model: nn.Module, trainable: list[str] | None = None) -> object:
        return _mlp_plan(model, trainable or [n for n, _ in model.named_parameters()])

    assert plan(nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2))) == [
        ("linear", "0.weight", "0.bias"), ("relu", "", None), ("linear", "2.weight", "2.bias")]
    assert plan(nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))) is None  # another activation
    assert plan(nn.Sequential(nn.Linear(3, 4), nn.ReLU())) is None  # ends in an activation
    assert plan(nn.Sequential(nn.Flatten(), nn.Linear(3, 2))) is None
    assert plan(nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2)), ["2.weight", "2.bias"]) is None


def test_vectorized_slices_change_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    # On a CPU a group trains in slices (cache-sized); a client's result is the same
    # whatever slice it is trained in.
    import orchard.simulation.vectorized as vectorized

    cfg = TrainConfig(epochs=2, batch_size=4, learning_rate=0.1)
    trainers, g = _trainers(24)
    cfgs = [dataclasses.replace(cfg, seed=train_seed(0, 1, i)) for i in range(24)]
    whole = train_many(trainers, g, cfgs)
    monkeypatch.setattr(vectorized, "_CPU_CLIENTS", 5)
    sliced = train_many(trainers, g, cfgs)
    for a, b in zip(whole, sliced, strict=True):
        assert a.metrics == b.metrics
        for k in g:
            np.testing.assert_array_equal(a.arrays[k], b.arrays[k])


def test_cpu_slices_are_sized_by_activations(monkeypatch: pytest.MonkeyPatch) -> None:
    # A slice holds at most _CPU_SLICE_BYTES of forward activations: the digits MLP takes
    # the cap, the MNIST CNN (about 1.7 MiB a client at batch 10) far fewer; and a slice
    # cut by bytes changes no client's result either.
    import orchard.simulation.vectorized as vectorized

    digits = get_task("digits", **DIGITS).client_trainer(0, 100, 0)
    mnist = get_task("mnist", with_replacement=True, samples_per_client=20).client_trainer(0, 100, 0)
    cfg = TrainConfig(batch_size=10)
    assert vectorized.activation_bytes(mnist.model, mnist.train_data.x[0], 10) == 10 * 4 * (
        2 * 16 * 28 * 28 + 16 * 14 * 14 + 2 * 32 * 14 * 14 + 2 * 32 * 7 * 7 + 2 * 64 + 10)
    assert vectorized.cpu_slice(digits, cfg) == vectorized._CPU_CLIENTS
    assert 1 <= vectorized.cpu_slice(mnist, cfg) < 20
    trainers, g = _trainers(12)
    cfgs = [dataclasses.replace(TrainConfig(epochs=2, batch_size=4, learning_rate=0.1), seed=train_seed(0, 1, i))
            for i in range(12)]
    whole = train_many(trainers, g, cfgs)
    monkeypatch.setattr(vectorized, "_CPU_SLICE_BYTES", 3 * vectorized.activation_bytes(
        trainers[0].model, trainers[0].train_data.x[0], 4))
    assert vectorized.cpu_slice(trainers[0], cfgs[0]) == 3
    for a, b in zip(whole, train_many(trainers, g, cfgs), strict=True):
        assert a.metrics == b.metrics
        for k in g:
            np.testing.assert_array_equal(a.arrays[k], b.arrays[k])


def test_vectorized_uploads_equal_per_client_uploads() -> None:
    """Through build_upload and the codec: the decoded updates agree to float tolerance."""
    task = get_task("digits", **DIGITS)
    g = task.initial_arrays(0)
    cfg = _run(codec=CodecSpec(name="float32"))
    codec = build_codec(cfg.codec)
    schema = tuple(schema_of(g))
    t = TaskAssignment(run_id="r", round=3, attempt=0, task_id="t", model_hash="h", model_bytes=0,
                       config_json=cfg.model_dump_json(), schema=schema, deadline_unix=0.0, cohort_target=1,
                       shared_seed=7)
    jobs = [ClientJob(i, f"device-{i}", t) for i in range(0, 60, 3)]
    fast = run_jobs(task, 200, cfg, codec, g, jobs, vectorize=True)
    slow = run_jobs(task, 200, cfg, codec, g, jobs, vectorize=False)
    shapes = {s.name: s.shape for s in schema}
    for f, s in zip(fast, slow, strict=True):
        assert f.header is not None and s.header is not None
        assert f.header.weight == s.header.weight and f.header.num_steps == s.header.num_steps
        fd = decode_update(codec, dict(zip(shapes, split(f.payload, f.header.payload_sizes), strict=True)), shapes)
        sd = decode_update(codec, dict(zip(shapes, split(s.payload, s.header.payload_sizes), strict=True)), shapes)
        for k in shapes:
            np.testing.assert_allclose(fd[k], sd[k], atol=1e-5, rtol=0)


def test_vectorized_path_refuses_what_it_cannot_reproduce() -> None:
    trainers, _ = _trainers(1)
    assert not supports(trainers[0], TrainConfig(momentum=0.9))
    assert not supports(trainers[0], TrainConfig(optimizer="adam"))
    data = TensorData(torch.zeros(4, 3), torch.zeros(4, dtype=torch.int64))
    dropout = TorchTrainer(lambda: nn.Sequential(nn.Linear(3, 4), nn.Dropout(0.5), nn.Linear(4, 2)), data, data)
    assert not supports(dropout, TrainConfig())
    head_only = TorchTrainer(lambda: nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2)), data, data,
                             trainable=["1.weight", "1.bias"])
    assert not supports(head_only, TrainConfig())


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
    assert bad.exit_code == 1 and "exceeds the population" in bad.output


def test_ray_backend_matches_local() -> None:
    pytest.importorskip("ray")
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    local = run_simulation(_deterministic(12, aggregators=2, rounds=1))
    # In a fresh process, as `orchard simulate --backend ray` runs (Ray forks its local
    # cluster's processes; a test worker that ran gRPC servers has threads a fork can
    # catch mid-call).
    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        remote = pool.submit(run_simulation, _deterministic(12, aggregators=2, rounds=1, backend="ray",
                                                            workers=2)).result()
    for k, v in local.final_arrays.items():
        np.testing.assert_array_equal(remote.final_arrays[k], v)


def test_process_backend_matches_local() -> None:
    # Worker processes (spawned, each with its own task) send their outputs back packed
    # (PackedOutputs): the same uploads, so the same model, as training in this process.
    local = run_simulation(_sim(rounds=2, chunk_size=16))
    remote = run_simulation(_sim(rounds=2, chunk_size=16, backend="process", workers=2))
    assert [r["participants"] for r in remote.rounds] == [r["participants"] for r in local.rounds]
    assert [r["bytes_up"] for r in remote.rounds] == [r["bytes_up"] for r in local.rounds]
    for k, v in local.final_arrays.items():
        np.testing.assert_array_equal(remote.final_arrays[k], v)


_ROUND_KEYS = ("participants", "selected", "dropped", "weight", "bytes_up", "bytes_down", "closed_because",
               "tier_participants", "rejected", "checked_in", "trained", "late", "vanished", "stopped_by_governor",
               "stopped_early", "failed_clients", "simulated_seconds")


def _same_rounds(a: list[dict], b: list[dict]) -> None:
    assert len(a) == len(b)
    for ra, rb in zip(a, b, strict=True):
        for key in _ROUND_KEYS:
            assert ra.get(key) == rb.get(key), (ra["round"], key, ra.get(key), rb.get(key))


@pytest.mark.parametrize(("aggregators", "extra"), [
    (3, {}),
    ([2, 2], {}),
    # Central DP (each round's config carries the clip, the root adds the noise) and
    # downlink deltas (each shard's devices hold their models, its tiers reply deltas).
    (3, {"downlink_delta": True, "privacy": {"mode": "central", "target_epsilon": 8.0, "clip_norm": 1.0}}),
])
def test_a_sharded_tree_runs_the_round_of_one_process(aggregators: object, extra: dict) -> None:
    # With worker processes, the root's subtrees are split between the engine and the
    # workers (shards), each checking in, training and folding its own. Some rounds here
    # are cut by the tiers' deadlines (slow devices that never make it, and devices that
    # vanish), so clients arrive late; codec states carry from round to round (error
    # feedback). Every count, every byte, the simulated time
    # and the model are those of one process running the whole tree, and of workers
    # that only train.
    from orchard.simulation import shards

    slow = DeviceProfile(gflops=1e-6, battery=False, availability=[1.0] * 24, dropout=0.1, latency_s=0.05)
    weighting = "uniform" if "privacy" in extra else "examples"  # (central DP bounds each client's share)
    run = _run(cohort=CohortConfig(target=24, over_selection=1.5, min_fraction=0.1, deadline_s=60.0,
                                   weighting=weighting),
               codec={"name": "error_feedback", "params": {"codec": {"name": "topk", "params": {"fraction": 0.1}}}},
               **extra)
    kw: dict[str, object] = dict(clients=300, clients_per_round=24, rounds=3, aggregators=aggregators, run=run,
                                 profiles={"box": ALWAYS_ON, "slow": slow}, devices={"box": 0.6, "slow": 0.4},
                                 chunk_size=8)
    runs: list[int] = []
    real = shards.Shard.run

    def counting(self: shards.Shard, *a: object) -> object:
        runs.append(len(self._tree.tops or []))
        return real(self, *a)  # type: ignore[arg-type]

    local = run_simulation(_sim(**kw))
    whole = run_simulation(_sim(**kw, backend="process", workers=1, shard=False))
    assert not runs
    shards.Shard.run = counting  # type: ignore[method-assign]
    try:
        sharded = run_simulation(_sim(**kw, backend="process", workers=2))
    finally:
        shards.Shard.run = real  # type: ignore[method-assign]
    assert runs and all(0 < n < (3 if aggregators == 3 else 2) for n in runs)  # the engine ran part of the tree
    assert any(r["closed_because"] != "target reached" for r in local.rounds)
    assert any(r["late"] > 0 for r in local.rounds)
    _same_rounds(local.rounds, whole.rounds)
    _same_rounds(local.rounds, sharded.rounds)
    for k, v in local.final_arrays.items():
        np.testing.assert_array_equal(whole.final_arrays[k], v)
        np.testing.assert_array_equal(sharded.final_arrays[k], v)


def test_a_sharded_round_that_fails_is_retried_as_in_one_process() -> None:
    # Every update is needed (min_fraction 1) and some devices vanish: attempts fail and
    # are retried (a new attempt: other check-ins, a fresh session at every tier) until
    # the retries run out. The sharded run fails the same attempts, with the same
    # counts and reason, as one process.
    run = _run(cohort=CohortConfig(target=20, over_selection=1.0, min_fraction=1.0, deadline_s=60.0, max_retries=2))
    kw: dict[str, object] = dict(clients=200, clients_per_round=20, rounds=2, aggregators=2, run=run, chunk_size=8)
    local = run_simulation(_sim(**kw))
    sharded = run_simulation(_sim(**kw, backend="process", workers=1))
    assert local.failed_attempts > 0
    assert (sharded.status, sharded.failed_attempts) == (local.status, local.failed_attempts)
    _same_rounds(local.rounds, sharded.rounds)
    for k, v in local.final_arrays.items():
        np.testing.assert_array_equal(sharded.final_arrays[k], v)


def test_a_shard_counts_only_what_happened_before_the_root_closed() -> None:
    # A shard runs its subtrees to the end; the root, in the engine, says when the round
    # ended. What the shard logged from then on is late (clients) or not counted at all
    # (partials), as when one loop stops at the root's close.
    from orchard.server.round import SimulatedCounts
    from orchard.simulation.jobs import count_log

    log = [(1.0, True, ""), (2.0, True, "failed"), (2.5, False, "LateRoundError"), (3.0, True, "StaleUpdateError"),
           (4.0, True, ""), (4.0, False, "LateRoundError"), (5.0, True, "late")]
    stats = SimulatedCounts()
    count_log(stats, log, 4.0)
    assert (stats.trained, stats.failed_clients, stats.late) == (3, 1, 2)
    assert stats.rejected == {"LateRoundError": 1, "StaleUpdateError": 1}


def test_clients_trained_ahead_change_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    # With worker processes, the engine hands the idle worker jobs of clients while it is
    # still dispatching devices (small jobs here, so it happens in a 40-client round):
    # some are later expected late and never needed. The model, the participants and the
    # bytes are the same as training every client at its turn, in this process.
    from orchard.simulation import ahead as ahead_module

    monkeypatch.setattr(ahead_module, "_AHEAD_BATCH", 4)
    monkeypatch.setattr(ahead_module, "_AHEAD_MAX", 24)
    ahead: list[int] = []
    real = ahead_module.TrainingAhead.send

    def counting(self: ahead_module.TrainingAhead, queued: list, *a: object) -> list:
        ahead.append(len(self.parts))
        return real(self, queued, *a)  # type: ignore[arg-type]

    monkeypatch.setattr(ahead_module.TrainingAhead, "send", counting)
    local = run_simulation(_sim(rounds=2, chunk_size=16))
    assert not ahead  # in-process backends train nothing ahead
    remote = run_simulation(_sim(rounds=2, chunk_size=16, backend="process", workers=1, shard=False))
    assert ahead and max(ahead) > 0
    assert [r["participants"] for r in remote.rounds] == [r["participants"] for r in local.rounds]
    assert [r["trained"] for r in remote.rounds] == [r["trained"] for r in local.rounds]
    assert [r["bytes_up"] for r in remote.rounds] == [r["bytes_up"] for r in local.rounds]
    for k, v in local.final_arrays.items():
        np.testing.assert_array_equal(remote.final_arrays[k], v)


def test_device_models_run_on_a_worker_change_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    # With worker processes, the engine sends batches of devices (as snapshots) to run
    # their governors on the idle worker, first while it hands the cohort its tasks,
    # then while it runs the others (small batches here, so it happens in a 40-client
    # round). Every device's steps, time and state -- so the fates, the uploads and the
    # model -- are those of running each one here.
    import orchard.simulation.device_model as device_model
    from orchard.simulation.backends import ProcessBackend

    monkeypatch.setattr(device_model, "_DEVICE_BATCH", 4)
    sent: list[int] = []
    during_hand_out: list[int] = []
    real = ProcessBackend.run_devices
    real_results = device_model.DeviceRuns.results

    def counting(self: ProcessBackend, params: dict, batch: list) -> object:
        sent.append(len(batch))
        return real(self, params, batch)

    def results(self: device_model.DeviceRuns) -> list[tuple[float, int]]:
        during_hand_out.append(self._sent)
        return real_results(self)

    monkeypatch.setattr(ProcessBackend, "run_devices", counting)
    monkeypatch.setattr(device_model.DeviceRuns, "results", results)
    local = run_simulation(_sim(rounds=2, chunk_size=16))
    remote = run_simulation(_sim(rounds=2, chunk_size=16, backend="process", workers=1, shard=False))
    assert sum(sent) >= sum(during_hand_out) > 0  # some went while the cohort was handed out
    for key in ("participants", "trained", "bytes_up", "simulated_seconds", "stopped_by_governor", "stopped_early",
                "vanished", "late"):
        assert [r[key] for r in remote.rounds] == [r[key] for r in local.rounds], key
    for k, v in local.final_arrays.items():
        np.testing.assert_array_equal(remote.final_arrays[k], v)


def test_engine_trains_while_it_waits_on_a_slow_worker(monkeypatch: pytest.MonkeyPatch) -> None:
    # A backend whose worker is slow (each job takes 50 ms, on a thread) and that can run
    # jobs in the engine's process: the engine trains the next clients itself while it
    # waits, and the round's uploads -- so the model -- are the same.
    import threading
    import time
    from concurrent.futures import Future

    import orchard.simulation.runner as runner
    from orchard.simulation.backends import LocalBackend

    class SlowWorker(LocalBackend):
        def __init__(self, *a: object) -> None:
            super().__init__(*a)
            self.here = 0

        def submit(self, jobs, global_arrays, starts=None):  # type: ignore[no-untyped-def]
            fut: Future = Future()

            def work() -> None:
                time.sleep(0.05)
                fut.set_result(self._run(jobs, global_arrays, starts))

            threading.Thread(target=work).start()
            return fut

        def run_here(self, jobs, global_arrays, starts=None):  # type: ignore[no-untyped-def]
            self.here += len(jobs)
            return self._run(jobs, global_arrays, starts)

    made: list[SlowWorker] = []

    def make(kind, task, task_name, task_params, population, cfg, workers, vectorize, device="cpu"):  # type: ignore[no-untyped-def]
        made.append(SlowWorker(task, population, cfg, 1, vectorize))
        return made[-1]

    plain = run_simulation(_sim(rounds=2, chunk_size=8))
    monkeypatch.setattr(runner, "make_backend", make)
    helped = run_simulation(_sim(rounds=2, chunk_size=8))
    assert made[0].here > 0
    assert [r["trained"] for r in helped.rounds] == [r["trained"] for r in plain.rounds]
    for k, v in plain.final_arrays.items():
        np.testing.assert_array_equal(helped.final_arrays[k], v)


def test_packed_outputs_round_trip() -> None:
    import pickle

    from orchard.simulation.clients import ClientOutput, PackedOutputs

    outs = [ClientOutput(3, "device-3", None, b"", error="no training data"),
            ClientOutput(5, "device-5", None, b"\x01\x02\x03", {"w": {"residual": np.ones(2)}},
                         metrics={"train_loss": 0.5}),
            ClientOutput(7, "device-7", None, bytes(range(256)) * 80)]
    header = UploadHeader(node_id="device-9", run_id="r", round=2, attempt=0, task_id="t",
                          kind=UploadKind.CLIENT_UPDATE, schema=(TensorSpec("w", (2,), "float32"),),
                          payload_sizes=(4,), codec="float32", payload_sha256="ab", weight=3.0, count=1,
                          metric_sums={"train_loss": 1.5}, metric_weights={"train_loss": 3.0})
    outs.append(ClientOutput(9, "device-9", header, b"\x00\x01\x02\x03"))
    back = pickle.loads(pickle.dumps(PackedOutputs(outs))).unpack()
    assert [(o.partition, o.node_id, o.header, o.payload, o.error, o.metrics) for o in back] == \
        [(o.partition, o.node_id, o.header, o.payload, o.error, o.metrics) for o in outs]
    assert type(back[3].header) is UploadHeader and back[3].header.total_bytes == 4
    assert all(type(o.payload) is bytes for o in back)
    np.testing.assert_array_equal(back[1].codec_state["w"]["residual"], np.ones(2))
    # Given the jobs' schemas, a header takes the engine's own schema object when equal.
    assert back[3].header.schema is not header.schema
    mine, other = (TensorSpec("w", (2,), "float32"),), (TensorSpec("v", (2,), "float32"),)
    again = pickle.loads(pickle.dumps(PackedOutputs(outs))).unpack((other, mine))
    assert again[3].header.schema is mine and again[3].header == header
    assert pickle.loads(pickle.dumps(PackedOutputs(outs))).unpack((other,))[3].header.schema == header.schema


def test_packed_outputs_write_payloads_into_a_shared_buffer_when_they_fit() -> None:
    import pickle

    from orchard.simulation.clients import ClientOutput, PackedOutputs

    outs = [ClientOutput(1, "device-1", None, b"abc"), ClientOutput(2, "device-2", None, b""),
            ClientOutput(3, "device-3", None, bytes(range(200)))]
    seg = memoryview(bytearray(256))
    packed = pickle.loads(pickle.dumps(PackedOutputs(outs, seg)))
    assert packed.in_segment and packed.blob == b""
    with pytest.raises(ValueError, match="shared segment"):
        packed.unpack()
    back = packed.unpack((), seg)
    assert [(o.partition, o.payload) for o in back] == [(o.partition, o.payload) for o in outs]
    assert all(type(o.payload) is bytes for o in back)
    seg[:] = bytes(256)  # copied out: the segment can take the next job's
    assert back[2].payload == bytes(range(200))
    # Too little room: the payloads travel in the pickle, as without a segment.
    small = pickle.loads(pickle.dumps(PackedOutputs(outs, memoryview(bytearray(100)))))
    assert not small.in_segment
    assert [o.payload for o in small.unpack()] == [o.payload for o in outs]


def test_worker_payloads_come_back_through_shared_segments(monkeypatch: pytest.MonkeyPatch) -> None:
    # After the first job (the payload size is not known before it), a worker writes its
    # jobs' payloads into the engine's shared segments; the round is the same as in this
    # process, and closing the backend removes every segment.
    from multiprocessing.shared_memory import SharedMemory

    import orchard.simulation.backends as backends
    from orchard.simulation.clients import PackedOutputs

    seen: list[bool] = []
    made: list[str] = []
    unpack, new_segment = PackedOutputs.unpack, backends._new_segment

    def recording_unpack(self, schemas=(), segment=None):  # type: ignore[no-untyped-def]
        seen.append(self.in_segment)
        return unpack(self, schemas, segment)

    def recording_new(size: int):  # type: ignore[no-untyped-def]
        seg = new_segment(size)
        made.append(seg.name)
        return seg

    monkeypatch.setattr(PackedOutputs, "unpack", recording_unpack)
    monkeypatch.setattr(backends, "_new_segment", recording_new)
    local = run_simulation(_sim(rounds=2, chunk_size=8))
    remote = run_simulation(_sim(rounds=2, chunk_size=8, backend="process", workers=1, shard=False))
    assert seen[0] is False and any(seen), seen
    assert 0 < len(made) <= 8  # about as many as jobs in flight, reused from job to job
    for k, v in local.final_arrays.items():
        np.testing.assert_array_equal(remote.final_arrays[k], v)
    for name in made:
        with pytest.raises(FileNotFoundError):
            SharedMemory(name)


def test_a_segment_goes_back_whatever_becomes_of_its_job() -> None:
    from concurrent.futures import Future

    from orchard.simulation.backends import _Segments, _Unpacked
    from orchard.simulation.clients import ClientOutput, PackedOutputs

    segments = _Segments()
    segments.give(None, 1000)  # a first job came back through the pipe: 1,000-byte payloads
    try:
        seg = segments.take(3)
        assert seg is not None and seg.size >= 3000
        failed: Future = Future()
        _Unpacked(failed, (), segments, seg)
        failed.set_exception(RuntimeError("worker died"))
        assert segments.take(3) is seg  # back in the pool, and reused
        done: Future = Future()
        outer = _Unpacked(done, (), segments, seg)
        assert done.set_running_or_notify_cancel()  # the worker took it
        outer.cancel()  # the engine no longer waits for it; the worker still writes to it
        assert segments.take(3) is not seg
        done.set_result(PackedOutputs([ClientOutput(1, "device-1", None, b"x" * 10)], seg.buf))
        assert segments.take(3) is seg
        queued: Future = Future()
        _Unpacked(queued, (), segments, seg).cancel()  # cancelled before a worker took it
        assert queued.cancelled() and segments.take(3) is seg
    finally:
        segments.close()


def test_a_finished_worker_job_is_freed_without_the_garbage_collector() -> None:
    # The packed outputs must not be kept alive by a reference cycle between the
    # worker's future and the unpacking one (~40 MB a job until a full collection).
    import gc
    import weakref
    from concurrent.futures import Future

    from orchard.simulation.backends import _Unpacked
    from orchard.simulation.clients import ClientOutput, PackedOutputs

    gc.disable()
    try:
        inner: Future = Future()
        outer = _Unpacked(inner)
        alive = weakref.ref(inner)
        inner.set_result(PackedOutputs([ClientOutput(1, "device-1", None, b"x" * 100)]))
        del inner
        assert alive() is None
        assert outer.result()[0].payload == b"x" * 100
    finally:
        gc.enable()


def test_job_sizes_do_not_change_the_round() -> None:
    # The engine starts each round with small training jobs and grows them to
    # chunk_size; which clients train and what they send must not depend on that.
    whole = run_simulation(_deterministic(40, aggregators=2, rounds=1, chunk_size=1024))
    pieces = run_simulation(_deterministic(40, aggregators=2, rounds=1, chunk_size=3, workers=2))
    assert whole.rounds[0]["participants"] == pieces.rounds[0]["participants"] == 40
    for k, v in whole.final_arrays.items():
        np.testing.assert_allclose(pieces.final_arrays[k], v, rtol=1e-6, atol=1e-7)


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


def test_a_jobs_train_config_is_the_runs_with_its_seed_and_steps() -> None:
    import dataclasses

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
