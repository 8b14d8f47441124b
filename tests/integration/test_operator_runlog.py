"""The run log's observer: a run that ends before the observer first looks still gets its
every line, and a resumed run says so instead of starting over."""

from __future__ import annotations

import json

from orchard.config import RunConfig
from orchard.server.runlog import RunLog, RunObserver


class _Run:
    def __init__(self, run_id: str, cfg: RunConfig) -> None:
        self.run_id, self.config, self.current = run_id, cfg, None


class _Runner:
    """The two things the observer reads: the runner's run and the store."""

    def __init__(self, store, run) -> None:
        self.store, self.run = store, run


def _messages(log: RunLog, run_id: str) -> list[str]:
    lines, _ = log.read(run_id)
    return [json.loads(line)["message"] for line in lines]


def test_a_run_that_ended_before_the_first_look(tmp_path) -> None:
    from orchard.server.store import MemoryStore

    store = MemoryStore()
    cfg = RunConfig(task="digits", rounds=1)
    log = RunLog(tmp_path)
    obs = RunObserver(log, _Runner(store, _Run("run-a", cfg)))
    store.create_run("run-a", cfg.model_dump_json())
    store.record_round("run-a", 1, 0, "running", 1.0, None, {"selected": 4})
    store.complete_round("run-a", 1, 0, 1.0, {"participants": 4, "selected": 4, "dropped": 0, "rejected": {"late": 1},
                                               "bytes_up": 10, "bytes_down": 20}, "ck", "h", "")
    store.set_run_status("run-a", "completed")
    obs.step()
    obs.step()  # nothing twice
    msgs = _messages(log, "run-a")
    assert msgs[0].startswith("run run-a started: task digits, 1 rounds")
    assert msgs[1] == "round 1 attempt 0 opened: 4 selected for a target of 10, deadline 120 s"
    assert msgs[2] == ("round 1 attempt 0 completed: 4 updates of 4 selected; 0 dropped; refused: late ×1; "
                       "bytes up 10, down 20")
    assert msgs[3] == "run run-a completed after 1 rounds"
    assert len(msgs) == 4
    lines, nxt = log.read("run-a")
    assert json.loads(lines[-1])["event"] == "run_end"
    assert log.read("run-a", nxt) == ([], nxt)


def test_a_resumed_run_does_not_repeat_its_history(tmp_path) -> None:
    from orchard.server.store import MemoryStore

    store = MemoryStore()
    cfg = RunConfig(task="digits", rounds=3)
    store.create_run("run-b", cfg.model_dump_json())
    store.complete_round("run-b", 1, 0, 1.0, {"participants": 2}, "ck", "h", "")
    obs = RunObserver(RunLog(tmp_path), _Runner(store, _Run("run-b", cfg)))
    obs.since = 1e12  # the run predates this process: it was resumed
    obs.step()
    assert _messages(obs.runlog, "run-b") == ["run run-b resumed by the root after round 1"]
