"""Asynchronous mode's refusals over raw gRPC: an update for an unknown model version, for
a future one, or more than S versions stale is refused with its own status and message,
nothing reaches the buffer, and the root keeps serving."""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import replace

import grpc
import pytest
from fed_harness import BackgroundRoot, poll_together
from test_bad_input import make_upload, zeros

from orchard import wire
from orchard.config import CohortConfig, ModeConfig, RunConfig, ServerConfig
from orchard.messages import TaskAssignment, UploadHeader
from orchard.ops import ControlClient
from orchard.tasks import get_task
from orchard.v1 import orchard_pb2 as pb
from orchard.v1 import orchard_pb2_grpc as pbg

NODES = ("a", "b", "c")


@pytest.fixture(scope="module")
def env(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict]:
    srv = BackgroundRoot(tmp_path_factory.mktemp("root"), ServerConfig(node_timeout_s=600, long_poll_s=1.0))
    ch = grpc.insecure_channel(srv.root.address)
    fleet = pbg.FleetStub(ch)
    for n in NODES:
        fleet.Join(pb.JoinRequest(node_id=n, role="client"))
    # K = 1, S = 1, concurrency 3: every node trains at once.
    cfg = RunConfig(task="digits", rounds=5, cohort=CohortConfig(target=1, over_selection=3.0, deadline_s=600),
                    mode=ModeConfig(kind="async", buffer_size=1, max_staleness=1))
    got = poll_together(fleet, NODES, lambda: ControlClient(srv.root.address, insecure=True).start_run(
        cfg, wire.arrays_to_blob(get_task("digits").initial_arrays(0))))
    tasks = {n: wire.task_from_proto(r.task) for n, r in got.items()}
    assert {t.round for t in tasks.values()} == {1}
    yield {"srv": srv, "fleet": fleet, "tasks": tasks}
    ch.close()
    srv.stop()


def poll(fleet: pbg.FleetStub, node: str) -> TaskAssignment:
    r = fleet.Poll(pb.PollRequest(node_id=node, wait_s=10))
    assert r.WhichOneof("kind") == "task", r
    return wire.task_from_proto(r.task)


def push(env: dict, header: UploadHeader, payload: bytes) -> pb.UploadReply:
    def parts():
        yield pb.UploadPart(header=wire.header_to_proto(header))
        for _, d in wire.iter_chunks(payload, 4096):
            yield pb.UploadPart(data=d)

    return env["fleet"].PushUpdate(parts())


def version(env: dict) -> int:
    return int(env["srv"].root.runner.status()["model_version"])


def wait_version(env: dict, v: int) -> None:
    end = time.monotonic() + 60
    while version(env) < v:
        assert time.monotonic() < end, env["srv"].root.runner.status()
        time.sleep(0.02)


def refused(env: dict, code: grpc.StatusCode, match: str, header: UploadHeader, payload: bytes) -> None:
    coord = env["srv"].root.coordinator
    before = (coord.current.received, coord.counters["uploads_accepted"])
    with pytest.raises(grpc.RpcError) as ei:
        push(env, header, payload)
    assert ei.value.code() == code, ei.value.details()
    assert match in ei.value.details(), ei.value.details()
    assert (coord.current.received, coord.counters["uploads_accepted"]) == before
    # The root keeps serving (c, still training on round 1, is answered its task again).
    assert env["fleet"].Poll(pb.PollRequest(node_id="c", wait_s=0)).WhichOneof("kind") == "task"


def test_unknown_model_version(env):
    t = env["tasks"]["b"]
    h, p = make_upload(t, "b", zeros(t))
    refused(env, grpc.StatusCode.NOT_FOUND, "names no model version this tier served", replace(h, run_id="another-run"), p)
    refused(env, grpc.StatusCode.NOT_FOUND, "names no model version this tier served", replace(h, round=0), p)


def test_future_model_version(env):
    t = env["tasks"]["b"]
    h, p = make_upload(t, "b", zeros(t))
    refused(env, grpc.StatusCode.OUT_OF_RANGE, "round 9 is from the future", replace(h, round=9), p)


def test_a_client_update_carrying_a_staleness_histogram_is_refused(env):
    t = env["tasks"]["c"]
    h, p = make_upload(t, "c", zeros(t))
    refused(env, grpc.StatusCode.INVALID_ARGUMENT, "staleness histogram", replace(h, staleness={0: 1}), p)


def test_zz_stale_past_s_then_a_fresh_update_still_folds(env):
    """a's update closes version 1's buffer; a trains again on version 2 and closes that one:
    b, still on version 1, is now 2 versions stale (S = 1) and refused."""
    fleet, tasks = env["fleet"], env["tasks"]
    t = tasks["a"]
    assert push(env, *make_upload(t, "a", zeros(t))).accepted
    wait_version(env, 1)
    t2 = poll(fleet, "a")
    assert t2.round == 2
    assert push(env, *make_upload(t2, "a", zeros(t2))).accepted
    wait_version(env, 2)
    tb = tasks["b"]
    refused(env, grpc.StatusCode.ABORTED, "2 versions stale", *make_upload(tb, "b", zeros(tb)))
    st = env["srv"].root.runner.status()
    assert st["model_version"] == 2 and st["staleness_histogram"] == {"0": 2}



def test_zzz_run_status_prints_version_buffer_and_staleness(env):
    from typer.testing import CliRunner

    from orchard.cli import app

    r = CliRunner().invoke(app, ["run", "status", "--server", env["srv"].root.address, "--insecure"])
    assert r.exit_code == 0, r.output
    text = " ".join(r.output.split())  # rich wraps long lines
    assert "asynchronous: model version 2, buffer 0/1 updates (serving version 2); staleness 0: 2" in text
