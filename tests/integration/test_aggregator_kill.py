"""kill -9 of an aggregator holding acknowledged uploads: its restart (same data dir and
node id) reports them upstream, and the root's store records each one as dropped, with
the reason (docs/operating.md, "What a killed aggregator loses")."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import grpc
import numpy as np
from fed_harness import join_all, start_with_tasks
from test_bad_input import make_upload
from test_durability import free_port, start_root_process

from orchard import wire
from orchard.config import CohortConfig, RunConfig
from orchard.messages import TaskAssignment
from orchard.ops import ControlClient
from orchard.server.ackjournal import RESTARTED
from orchard.server.droplog import DropLog
from orchard.tasks import get_task
from orchard.v1 import orchard_pb2 as pb
from orchard.v1 import orchard_pb2_grpc as pbg

NODES = ("a", "b", "c", "d")


def _aggregator(tmp: Path, root: str, port: int) -> subprocess.Popen:
    port_file = tmp / "agg.port"
    port_file.unlink(missing_ok=True)
    cfg = tmp / "agg.toml"
    cfg.write_text("[server]\nheartbeat_s = 1.0\nnode_timeout_s = 5.0\nlong_poll_s = 1.0\n")
    p = subprocess.Popen([sys.executable, "-m", "orchard.cli", "aggregator", "start", "--upstream", root, "--port",
                          str(port), "--insecure", "--node-id", "agg-0", "--data-dir", str(tmp / "agg"), "--config",
                          str(cfg), "--port-file", str(port_file)], stdout=subprocess.DEVNULL,
                         stderr=subprocess.DEVNULL)
    end = time.monotonic() + 60
    while not port_file.is_file():
        assert p.poll() is None and time.monotonic() < end, "the aggregator did not start"
        time.sleep(0.1)
    return p


def _push(fleet: pbg.FleetStub, t: TaskAssignment, node: str) -> pb.UploadReply:
    h, payload = make_upload(t, node, {s.name: np.ones(s.shape, np.float32) for s in t.schema})

    def parts():
        yield pb.UploadPart(header=wire.header_to_proto(h))
        for _, d in wire.iter_chunks(payload, 1 << 16):
            yield pb.UploadPart(data=d)

    return fleet.PushUpdate(parts())


def test_a_killed_aggregators_acknowledged_uploads_are_recorded_dropped_at_the_root(tmp_path: Path) -> None:
    root_port, agg_port = free_port(), free_port()
    root = start_root_process(tmp_path / "root", root_port)
    agg = _aggregator(tmp_path, f"127.0.0.1:{root_port}", agg_port)
    ctl = ControlClient(f"127.0.0.1:{root_port}", insecure=True)
    ch = grpc.insecure_channel(f"127.0.0.1:{agg_port}")
    try:
        fleet = pbg.FleetStub(ch)
        join_all(fleet, ctl, NODES)
        # Four selected, two deliver: the aggregator holds their sum, acknowledged, waiting.
        cfg = RunConfig(task="digits", rounds=1, cohort=CohortConfig(target=4, over_selection=1.0, deadline_s=600))
        init = wire.arrays_to_blob(get_task("digits").initial_arrays(0))
        run_id, tasks = start_with_tasks(fleet, ctl, NODES, cfg, init)
        for n in ("a", "b"):
            assert _push(fleet, tasks[n], n).accepted
        os.kill(agg.pid, signal.SIGKILL)
        agg.wait(10)

        agg = _aggregator(tmp_path, f"127.0.0.1:{root_port}", agg_port)
        log = DropLog(tmp_path / "root" / "orchard.db")
        try:
            deadline, rows = time.monotonic() + 60, []
            while len(rows) < 2 and time.monotonic() < deadline:
                rows = log.dropped(run_id)
                time.sleep(0.2)
        finally:
            log.close()
        assert {(r["node_id"], r["task_id"], r["round"], r["attempt"]) for r in rows} == {
            (n, tasks[n].task_id, tasks[n].round, tasks[n].attempt) for n in ("a", "b")}, rows
        assert {r["reason"] for r in rows} == {RESTARTED} and {r["via"] for r in rows} == {"agg-0"}
        assert not list((tmp_path / "agg" / "acks").glob("*.acks"))  # reported: the journal let them go
    finally:
        ch.close()
        ctl.close()
        for p in (agg, root):
            p.send_signal(signal.SIGTERM)
            p.wait(20)
