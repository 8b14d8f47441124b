"""The simulator with streaming devices: each device trains on the slice of its stream
that has arrived by its virtual time, and keeps its replay buffer in its own directory."""

from __future__ import annotations

from sim_cases import _deterministic, _run

from orchard.client.replay import ReplayBuffer, budget_for
from orchard.config import CohortConfig
from orchard.simulation import run_simulation, simulation_problems
from orchard.tasks import get_task
from orchard.tasks.stream import StreamingTask

PERIODS = [[0, 1, 2, 3, 4], [5, 6, 7, 8, 9]]
N = 8


def _cfg(out, period_s: float, rounds: int = 2):
    continual = {"periods": PERIODS, "period_s": period_s, "replay_ratio": 0.5,
                 "simulated_budget_bytes": budget_for(4, 2, (64,)), "hot_samples": 2}
    run = _run(cohort=CohortConfig(target=N, over_selection=1.0, min_fraction=1.0, deadline_s=600.0),
               continual=continual, evaluate_every=0)
    return _deterministic(N, run=run, rounds=rounds, vectorize=False, backend="local", out=out)


def test_devices_train_on_what_arrived_by_their_virtual_time(tmp_path):
    # Both periods are over before the first round: each device's whole stream arrived.
    # (One round: in a second, nothing new would have arrived, and a device with no new
    # sample sends no update.)
    cfg = _cfg(tmp_path, 1e-6, rounds=1)
    report = run_simulation(cfg)
    assert not report.status.startswith("failed"), report.status
    run = cfg.run_config()
    st = StreamingTask(get_task(run.task, **run.task_params), run.continual, tmp_path / "probe")
    for d in range(N):
        buf = ReplayBuffer(tmp_path / "devices" / f"device-{d}", (64,), budget_for(4, 2, (64,)), hot_samples=2)
        stream = st.stream(d, N, run.seed)
        assert buf.cursor == len(stream) > 0
        assert 0 < len(buf) <= 4


def test_nothing_arrived_nothing_trained(tmp_path):
    # The first period's samples arrive over a billion virtual seconds: by the run's few
    # rounds none has (to within chance), and a device with no new sample sends nothing.
    report = run_simulation(_cfg(tmp_path, 1e9))
    assert report.status.startswith("failed")
    assert "0 of the 8 updates" in report.status
    assert not any((tmp_path / "devices").glob("device-*/replay.bin"))


def test_continual_runs_on_the_local_backend_only():
    cfg = _cfg(None, 10.0).model_dump(mode="python", exclude_none=True)
    cfg["backend"] = "process"
    assert any("continual" in p and "local backend only" in p for p in simulation_problems({"simulation": cfg}))
