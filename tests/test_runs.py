"""orchard.runs: following a run reports each completed round once, in order, and ends
with the run; the config overrides land at their dotted paths."""

from __future__ import annotations

from typing import Any

from orchard.runs import build_run_config, progress_line, watch_run


class _Root:
    """The Control API's status answers of a run that completes two rounds."""

    def __init__(self) -> None:
        done = [{"round": 1, "status": "completed"}, {"round": 2, "status": "completed"}]
        self._answers: list[dict[str, Any]] = [
            {"status": "running", "completed_rounds": 0, "rounds": [],
             "current_round": {"round": 1, "phase": "training", "received": 2, "target": 3}},
            {"status": "running", "completed_rounds": 1, "rounds": done[:1], "current_round": {"round": 2}},
            {"status": "running", "completed_rounds": 1, "rounds": done[:1],
             "current_round": {"round": 2, "waiting": {"message": "waiting for 3 clients"}}},
            {"status": "completed", "completed_rounds": 2, "rounds": done},
        ]

    def status(self, run_id: str = "") -> dict[str, Any]:
        return self._answers.pop(0)


def test_watch_run_reports_each_round_once_and_returns_the_last_status() -> None:
    rounds: list[int] = []
    lines: list[str] = []
    st = watch_run(_Root(), "run-1", on_round=lambda r: rounds.append(r["round"]),  # type: ignore[arg-type]
                   on_status=lambda s: lines.append(progress_line(s)), poll_s=0.0)
    assert st["status"] == "completed" and rounds == [1, 2]
    assert lines == ["round 1: training 2/3 updates", "round 2: running", "round 2: waiting for 3 clients",
                     "completed"]


def test_overrides_land_at_their_dotted_paths() -> None:
    cfg = build_run_config(None, {"task": "heart", "cohort.target": 4, "codec.name": None,
                                  "task_params.alpha": 0.5})
    assert (cfg.task, cfg.cohort.target, cfg.task_params) == ("heart", 4, {"alpha": 0.5})
    assert cfg.codec.name == build_run_config(None, {}).codec.name


def test_a_run_from_flags_trains_its_task_as_the_task_declares(tmp_path) -> None:
    """`run start --task digits` and `orchard demo` train digits with the recipe the task
    declares (tasks.trains_with), not TrainConfig's generic defaults; a [run.train] table wins."""
    from orchard.tasks import train_defaults
    from orchard.trainer import TrainConfig

    declared = train_defaults("digits")
    assert declared and TrainConfig(**declared) != TrainConfig()
    assert build_run_config(None, {"task": "digits"}).train == TrainConfig(**declared)
    assert build_run_config(None, {"task": "mnist"}).train == TrainConfig()  # declares none
    cfg = tmp_path / "run.toml"
    cfg.write_text('[run]\ntask = "digits"\n[run.train]\nlearning_rate = 0.01\n')
    assert build_run_config(cfg, {}).train == TrainConfig(learning_rate=0.01)
