"""An asynchronous run's end, seen from an aggregator: what its continuation of the last
buffer acknowledged after its partial went up reaches no aggregate, and the root's store
records each such upload as dropped, with the reason (docs/operating.md, "What a killed
aggregator loses": ``run over before applied``)."""

from __future__ import annotations

import time
from pathlib import Path

import grpc
from fed_harness import BackgroundRoot, join_all, start_with_tasks
from test_aggregator_kill import _push

from orchard import wire
from orchard.config import CohortConfig, ModeConfig, RunConfig, ServerConfig
from orchard.ops import ControlClient
from orchard.server.app import start_aggregator
from orchard.server.droplog import DropLog
from orchard.tasks import get_task
from orchard.v1 import orchard_pb2_grpc as pbg

FAST = ServerConfig(heartbeat_s=0.5, node_timeout_s=5.0, long_poll_s=0.5)
NODES = ("a", "b", "c")


def test_what_the_last_buffers_continuation_took_is_recorded_dropped_once_the_run_is_over(tmp_path: Path) -> None:
    bg = BackgroundRoot(tmp_path / "root", FAST)
    agg = bg.call(start_aggregator(bg.root.address, insecure=True, server_cfg=FAST, node_id="agg-0",
                                   data_dir=tmp_path / "agg"))
    ctl = ControlClient(bg.root.address, insecure=True)
    ch = grpc.insecure_channel(agg.address)
    try:
        fleet = pbg.FleetStub(ch)
        join_all(fleet, ctl, NODES)
        # One version, a buffer of 2: the aggregator hands out 3 tasks (over-selection 2),
        # its buffer fills with a's and b's updates and goes up; the root's buffer is full
        # and the run is over. c's update lands in the aggregator's continuation.
        cfg = RunConfig(task="digits", rounds=1, cohort=CohortConfig(target=2, over_selection=2.0, deadline_s=2.0),
                        mode=ModeConfig(kind="async", max_staleness=1))
        init = wire.arrays_to_blob(get_task("digits").initial_arrays(0))
        run_id, tasks = start_with_tasks(fleet, ctl, NODES, cfg, init)
        for n in ("a", "b"):
            assert _push(fleet, tasks[n], n).accepted
        deadline = time.monotonic() + 60
        while ctl.status(run_id)["status"] == "running":
            assert time.monotonic() < deadline, ctl.status(run_id)
            time.sleep(0.1)
        assert ctl.status(run_id)["completed_rounds"] == 1
        assert _push(fleet, tasks["c"], "c").accepted  # acknowledged: nothing will apply it

        log = DropLog(tmp_path / "root" / "orchard.db")
        try:
            deadline, rows = time.monotonic() + 30, []
            while not rows and time.monotonic() < deadline:
                rows = log.dropped(run_id)
                time.sleep(0.2)
        finally:
            log.close()
        assert [(r["node_id"], r["task_id"]) for r in rows] == [("c", tasks["c"].task_id)], rows
        assert rows[0]["reason"].startswith("run over before applied"), rows
        deadline = time.monotonic() + 10  # the poll's reply is on its way back: then the journal lets it go
        while list((tmp_path / "agg" / "acks").glob("*.acks")):
            assert time.monotonic() < deadline, "the aggregator kept the reported upload's journal file"
            time.sleep(0.1)
    finally:
        ch.close()
        ctl.close()
        bg.call(agg.stop(0.1))
        bg.stop()
