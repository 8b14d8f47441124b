"""`backend = "auto"`: worker processes where the machine and the config allow, said in
one line; explicit backends and worker counts kept as they are. The machine's core count
is the one input injected (the validation context's ``cores``)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from orchard.cli import app
from orchard.config import load_toml
from orchard.secure_agg.prg import available_cores
from orchard.simulation.config import SimulationConfig, build_simulation_config, simulation_problems
from orchard.simulation.defaults import PROCESS_MIN_CLIENTS_PER_ROUND, choose_backend
from orchard.simulation.report import SimulationReport

SIM_TOML = Path(__file__).resolve().parents[2] / "configs" / "sim.toml"
# The issue's command: orchard simulate --config configs/sim.toml --clients 100000
# --clients-per-round 10000 --rounds 3
ISSUE = {"clients": 100_000, "clients_per_round": 10_000, "rounds": 3}


def _auto(cores: int, **kw: object) -> SimulationConfig:
    base: dict[str, object] = dict(clients=20_000, clients_per_round=2_000, aggregators=2, backend="auto")
    base.update(kw)
    return SimulationConfig.model_validate(base, context={"cores": cores})


def test_auto_is_worker_processes_on_two_cores_and_this_process_on_one() -> None:
    two = _auto(2)
    assert (two.backend, two.workers) == ("process", 1)
    assert two.backend_choice.line() == "backend: process (1 worker; auto: 2 cores, sharded rounds)"
    one = _auto(1)
    assert (one.backend, one.workers) == ("local", 1)
    assert one.backend_choice.line() == "backend: local (in this process; auto: 1 core)"


def test_the_issue_command_resolves_to_sharded_worker_processes() -> None:
    data = load_toml(SIM_TOML)
    assert data["simulation"]["backend"] == "auto"
    cfg = build_simulation_config(data, ISSUE, cores=2)
    assert (cfg.backend, cfg.workers, cfg.shard) == ("process", 1, True)
    assert "sharded rounds" in cfg.backend_choice.reason
    assert build_simulation_config(data, ISSUE, cores=1).backend == "local"
    # The validated config names what runs: the runner's own check sees no "auto".
    dumped = cfg.model_dump(mode="python", exclude_none=True)
    assert dumped["backend"] == "process" and dumped["workers"] == 1
    assert simulation_problems({"simulation": dumped}, cores=1) == []


def test_workers_are_one_fewer_than_the_cores_and_no_more_than_the_shards() -> None:
    # The engine's process is busy too (its own subtrees and the root): cores - 1 workers,
    # and with sharded rounds no more than the root's subtrees beyond the engine's.
    assert _auto(8, aggregators=16).workers == 7
    assert _auto(8, aggregators=4).workers == 3
    flat = _auto(8, aggregators=0)
    assert flat.workers == 7 and "rounds not sharded: fewer than 2 aggregators" in flat.backend_choice.reason
    assert _auto(8, workers=2).workers == 2  # a number given is kept


@pytest.mark.parametrize(("kw", "why"), [
    ({"run": {"secure_aggregation": {"enabled": True}}}, "rounds not sharded: secure aggregation"),
    ({"shard": False}, "rounds not sharded: shard = false"),
    ({"run": {"mode": {"kind": "async"}}, "aggregators": 0}, "rounds not sharded: asynchronous mode"),
])
def test_auto_says_why_rounds_are_not_sharded(kw: dict[str, object], why: str) -> None:
    cfg = _auto(2, **kw)
    assert cfg.backend == "process" and cfg.backend_choice.reason == f"auto: 2 cores, {why}"


def test_auto_stays_in_this_process_where_workers_cannot_help() -> None:
    small = _auto(4, clients_per_round=PROCESS_MIN_CLIENTS_PER_ROUND - 1)
    assert small.backend == "local" and "clients per round" in small.backend_choice.reason
    et = _auto(4, runtime="executorch")
    assert et.backend == "local" and "ExecuTorch" in et.backend_choice.reason
    assert simulation_problems({"simulation": {"backend": "auto", "runtime": "executorch"}}, cores=4) == []


@pytest.mark.parametrize("backend", ["local", "process", "ray"])
@pytest.mark.parametrize("cores", [1, 2, 8])
def test_an_explicit_backend_is_kept(backend: str, cores: int) -> None:
    cfg = _auto(cores, backend=backend, workers=3)
    assert (cfg.backend, cfg.workers) == (backend, 3)
    assert cfg.backend_choice.reason.startswith("as configured")
    bare = SimulationConfig.model_validate({"backend": backend}, context={"cores": cores})
    # Without a number: one worker, except on the process backend (cores - 1).
    assert bare.workers == (max(1, cores - 1) if backend == "process" else 1)


def test_a_config_built_in_python_runs_in_this_process_unless_it_asks() -> None:
    assert SimulationConfig().backend == "local" and SimulationConfig().workers == 1
    assert choose_backend(SimulationConfig(clients_per_round=5_000, clients=10_000, aggregators=2), 2).backend \
        == "process"


def test_throughput_after_the_warm_up_counts_as_the_benchmark_does() -> None:
    rep = SimulationReport(task="digits", population=10, clients_per_round=5, aggregators=[], codec="float32",
                           secure_aggregation=False, backend="local", vectorized=True)
    rep.rounds = [{"round": 1, "trained": 100, "seconds": 1.0}, {"round": 2, "trained": 100, "seconds": 0.5},
                  {"round": 3, "trained": 110, "seconds": 0.5}]
    assert rep.warm_clients_per_second() == 210.0
    assert rep.to_dict()["warm_clients_per_second"] == 210.0
    assert "warm_clients_per_second" not in rep.seed_dependent()
    rep.rounds = rep.rounds[:1]
    assert rep.warm_clients_per_second() is None


def test_simulate_names_the_backend_and_why(tmp_path: Path) -> None:
    # A small round: auto stays in this process whatever the machine, and says why.
    res = CliRunner().invoke(app, ["simulate", "--task", "digits", "--clients-per-round", "10", "--rounds", "2",
                                   "--out", str(tmp_path)])
    assert res.exit_code == 0, res.output
    assert "backend: local (in this process; auto: " in res.output and "fewer than the 1000" in res.output
    assert "clients/s (rounds 2-2;" in res.output and "peak RSS:" in res.output
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["backend"] == "local" and report["peak_rss_mib"]["engine"] > 0
    assert report["warm_clients_per_second"] > 0
    # An explicit backend is named as configured.
    res = CliRunner().invoke(app, ["simulate", "--task", "digits", "--clients-per-round", "10", "--rounds", "1",
                                   "--backend", "local", "--out", str(tmp_path)])
    assert res.exit_code == 0, res.output
    assert "backend: local (in this process; as configured)" in res.output


def test_simulate_on_this_machine_runs_what_auto_chooses_for_its_cores(tmp_path: Path) -> None:
    n = PROCESS_MIN_CLIENTS_PER_ROUND
    args = ["simulate", "--task", "digits", "--clients", str(2 * n), "--clients-per-round", str(n), "--rounds", "2",
            "--aggregators", "2", "--out", str(tmp_path)]
    res = CliRunner().invoke(app, args)
    assert res.exit_code == 0, res.output
    want = choose_backend(SimulationConfig(clients=2 * n, clients_per_round=n, aggregators=2), available_cores())
    assert want.line() in res.output
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["backend"] == want.backend and report["rounds"][-1]["participants"] > 0
    if want.backend == "process":  # the workers' peak is read once they have ended
        assert report["peak_rss_mib"]["largest_child"] > 0 and "worker" in res.output
