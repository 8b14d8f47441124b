"""kill -9 of an asynchronous root with a half-full buffer: the restarted root has every
acknowledged update back in its buffer, once (a retried upload whose acknowledgement was
lost is a duplicate), takes the updates of clients still training on the old version,
and applies exactly the buffer the clients sent."""

from __future__ import annotations

import json
import time
from dataclasses import replace
from pathlib import Path

import grpc
import numpy as np
import pytest
from fed_harness import poll_together
from test_bad_input import make_upload
from test_durability import RootProcess

from orchard import wire
from orchard.config import CohortConfig, ModeConfig, RunConfig
from orchard.messages import TaskAssignment
from orchard.ops import ControlClient
from orchard.tasks import get_task
from orchard.v1 import orchard_pb2 as pb
from orchard.v1 import orchard_pb2_grpc as pbg

NODES = ("a", "b", "c", "d")
VALUE = {"a": 1.0, "b": 2.0, "c": 4.0, "d": 8.0}


def _status(ctl: ControlClient, until, timeout: float = 60.0) -> dict:
    end = time.monotonic() + timeout
    st: dict = {}
    while time.monotonic() < end:
        try:
            st = ctl.status()
        except grpc.RpcError:
            time.sleep(0.1)
            continue
        if until(st):
            return st
        time.sleep(0.05)
    raise AssertionError(f"condition not met in {timeout}s: {json.dumps(st)[:2000]}")


def _push(fleet: pbg.FleetStub, t: TaskAssignment, node: str) -> pb.UploadReply:
    arrays = {s.name: np.full(s.shape, VALUE[node], np.float32) for s in t.schema}
    h, payload = make_upload(t, node, arrays)

    def parts():
        yield pb.UploadPart(header=wire.header_to_proto(h))
        for _, d in wire.iter_chunks(payload, 4096):
            yield pb.UploadPart(data=d)

    return fleet.PushUpdate(parts())


def test_kill_minus_9_with_a_half_full_buffer(tmp_path: Path) -> None:
    data = tmp_path / "root"
    root = RootProcess(data)
    ctl = root.ctl
    ch = grpc.insecure_channel(root.addr)
    try:
        fleet = pbg.FleetStub(ch)
        for n in NODES:
            fleet.Join(pb.JoinRequest(node_id=n, role="client"))
        init = get_task("digits").initial_arrays(0)
        # K = 3, S = 2, concurrency ceil(3 x 4/3) = 4: all four train on version 0.
        cfg = RunConfig(task="digits", rounds=2,
                        cohort=CohortConfig(target=3, over_selection=4 / 3, deadline_s=600),
                        mode=ModeConfig(kind="async", buffer_size=3, max_staleness=2, staleness="constant"))
        tasks = {}
        for n, r in poll_together(fleet, NODES, lambda: ctl.start_run(cfg, wire.arrays_to_blob(init))).items():
            assert r.WhichOneof("kind") == "task", r
            tasks[n] = wire.task_from_proto(r.task)
        assert _push(fleet, tasks["a"], "a").accepted
        assert _push(fleet, tasks["b"], "b").accepted
        st = _status(ctl, lambda s: (s.get("buffer") or {}).get("fill") == 2)
        assert st["model_version"] == 0
        root.kill_and_restart()
        for n in NODES:  # the clients reconnect; those that delivered poll for work again
            fleet.Join(pb.JoinRequest(node_id=n, role="client"), wait_for_ready=True, timeout=30)
        for n in ("a", "b"):
            assert fleet.Poll(pb.PollRequest(node_id=n, wait_s=0)).WhichOneof("kind") == "idle"
        st = _status(ctl, lambda s: (s.get("buffer") or {}).get("fill") is not None)
        assert st["status"] == "running" and st["model_version"] == 0
        assert st["buffer"]["fill"] == 2 and st["staleness_histogram"] == {"0": 2}, st
        # b never saw its acknowledgement and retries: the same update is not counted twice.
        with pytest.raises(grpc.RpcError) as ei:
            _push(fleet, tasks["b"], "b")
        assert ei.value.code() == grpc.StatusCode.ALREADY_EXISTS, ei.value.details()
        # c trained on version 0 through the restart; its assignment survived it.
        assert _push(fleet, tasks["c"], "c").accepted
        st = _status(ctl, lambda s: s["model_version"] >= 1)
        ck = (data / "checkpoints" / st["run_id"] / "round-000001.safetensors").read_bytes()
        got = wire.blob_to_arrays(ck)
        # FedAvg, lr 1, equal weights: the new model is the old one plus the mean of a, b, c.
        mean = np.float32((VALUE["a"] + VALUE["b"] + VALUE["c"]) / 3)
        for k, v in init.items():
            np.testing.assert_allclose(got[k], v + mean, rtol=1e-6, atol=1e-6)
        done = [r for r in st["rounds"] if r["status"] == "completed"]
        assert done[0]["participants"] == 3
        # d's update (still version 0) goes into version 1's buffer with staleness 1.
        assert _push(fleet, replace(tasks["d"]), "d").accepted
        st = _status(ctl, lambda s: sum(s["staleness_histogram"].values()) == 4)
        assert st["staleness_histogram"] == {"0": 3, "1": 1}
    finally:
        ch.close()
        root.stop()
