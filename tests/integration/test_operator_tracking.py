"""--tensorboard and --mlflow-uri on `simulate` and `run start`: the logged values are read back."""

from __future__ import annotations

import json

import pytest
from operator_harness import LiveRoot
from typer.testing import CliRunner

from orchard.cli import app
from orchard.tracking import round_scalars


def scalars(log_dir) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(log_dir))
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def test_round_scalars_names() -> None:
    got = round_scalars({"round": 3, "accuracy": 0.5, "loss": 1.0, "bytes_up": 10, "bytes_down": 20,
                         "participants": 4, "selected": 5, "dropped": 1, "rejected": {"late": 2, "dup": 1},
                         "metrics": {"train_loss": 0.7}, "epsilon": 1.5, "status": "completed"})
    assert got == {"eval/accuracy": 0.5, "eval/loss": 1.0, "bytes/up": 10.0, "bytes/down": 20.0,
                   "participation/updates": 4.0, "participation/selected": 5.0, "participation/dropped": 1.0,
                   "participation/refused": 3.0, "clients/train_loss": 0.7, "privacy/epsilon": 1.5}


def test_simulate_writes_tensorboard_events(tmp_path) -> None:
    res = CliRunner().invoke(app, ["simulate", "--task", "digits", "--clients", "200", "--clients-per-round", "20",
                                   "--rounds", "2", "--out", str(tmp_path / "sim"),
                                   "--tensorboard", str(tmp_path / "tb")])
    assert res.exit_code == 0, res.output
    rounds = json.loads((tmp_path / "sim" / "report.json").read_text())["rounds"]
    got = scalars(tmp_path / "tb")
    assert [s for s, _ in got["eval/accuracy"]] == [1, 2]
    for tag, key in (("eval/accuracy", "accuracy"), ("bytes/up", "bytes_up"), ("bytes/down", "bytes_down"),
                     ("participation/updates", "participants")):
        assert [v for _, v in got[tag]] == pytest.approx([r[key] for r in rounds], rel=1e-6), tag
    assert "clients/train_loss" in got


def test_run_start_tracks_a_live_run(tmp_path) -> None:
    live = LiveRoot(tmp_path / "root")
    try:
        res = CliRunner().invoke(app, ["run", "start", *live.cli(), "--task", "digits", "--rounds", "2",
                                       "--clients-per-round", "3", "--evaluate", "--tensorboard", str(tmp_path / "tb")])
        assert res.exit_code == 0, res.output
        with live.control() as ctl:
            st = ctl.status()
        assert st["status"] == "completed"
        got = scalars(tmp_path / "tb")
        assert [v for _, v in got["bytes/up"]] == [r["bytes_up"] for r in st["rounds"]]
        assert [v for _, v in got["participation/updates"]] == [3.0, 3.0]
        assert [s for s, _ in got["eval/accuracy"]] == [1, 2]
        assert all(0.0 <= v <= 1.0 for _, v in got["eval/accuracy"])
        assert [v for _, v in got["clients/train_loss"]] == pytest.approx(
            [r["metrics"]["train_loss"] for r in st["rounds"]], rel=1e-6)
        assert "accuracy" in res.output
    finally:
        live.stop()


def test_detach_refuses_tracking(tmp_path) -> None:
    res = CliRunner().invoke(app, ["run", "start", "--server", "127.0.0.1:1", "--insecure", "--detach",
                                   "--tensorboard", str(tmp_path)])
    assert res.exit_code != 0 and "drop --detach" in res.output


def test_simulate_logs_to_mlflow(tmp_path, monkeypatch) -> None:
    pytest.importorskip("mlflow", reason="the mlflow extra is not installed (pip install 'orchard-fl[mlflow]')")
    # A file-backed store keeps the test self-contained (MLflow 3 asks for this opt-in).
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    from mlflow.tracking import MlflowClient

    uri = (tmp_path / "mlruns").as_uri()
    res = CliRunner().invoke(app, ["simulate", "--task", "digits", "--clients", "200", "--clients-per-round", "20",
                                   "--rounds", "2", "--out", str(tmp_path / "sim"), "--mlflow-uri", uri,
                                   "--mlflow-experiment", "flags"])
    assert res.exit_code == 0, res.output
    rounds = json.loads((tmp_path / "sim" / "report.json").read_text())["rounds"]
    client = MlflowClient(tracking_uri=uri)
    exp = client.get_experiment_by_name("flags")
    (run,) = client.search_runs([exp.experiment_id])
    assert run.info.status == "FINISHED" and run.data.params["task"] == "digits"
    hist = client.get_metric_history(run.info.run_id, "eval/accuracy")
    assert [(m.step, m.value) for m in sorted(hist, key=lambda m: m.step)] == [
        (r["round"], pytest.approx(r["accuracy"])) for r in rounds]
