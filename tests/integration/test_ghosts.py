"""Ghost nodes and dead nodes: a node that joins and never polls is never selected, at
the root or at an aggregator, and a node whose long poll dies with its process (kill -9)
is gone at once, not after its timeout.

Found by a probe of a federation on loopback: 20 joins that never polled made a 3-round
run take 174 s, and re-joining them every 10 s failed it."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import grpc
from fed_harness import FAST, Federation, add_clients, start_run, wait_joined, wait_status

from orchard.config import CohortConfig, RunConfig
from orchard.server.app import start_aggregator, start_root
from orchard.v1 import orchard_pb2 as pb
from orchard.v1 import orchard_pb2_grpc as pbg

GHOSTS = 20
REJOIN_S = 10.0


def _ghosts(addresses: list[str], stop: threading.Event) -> None:
    """Join ``GHOSTS`` nodes at each address and join them again every ``REJOIN_S``; never
    poll (what a probe with the shared client token did)."""
    chans = [grpc.insecure_channel(a) for a in addresses]
    stubs = [pbg.FleetStub(c) for c in chans]
    try:
        while not stop.is_set():
            for i, stub in enumerate(stubs):
                for k in range(GHOSTS):
                    with contextlib.suppress(grpc.RpcError):  # refused (rate limits): a ghost does not care
                        stub.Join(pb.JoinRequest(node_id=f"ghost-{i}-{k}", role="client"), timeout=5)
            stop.wait(REJOIN_S)
    finally:
        for c in chans:
            c.close()


async def _run(tmp: Path, ghosts: bool) -> tuple[float, dict]:
    root = await start_root(tmp / "root", insecure=True, server_cfg=FAST, start_grace_s=0.5)
    agg = await start_aggregator(root.address, insecure=True, server_cfg=FAST)
    fed = Federation(root, [agg])
    stop = threading.Event()
    t = threading.Thread(target=_ghosts, args=([root.address, agg.address], stop), daemon=True)
    try:
        await add_clients(fed, agg.address, [0, 1, 2, 3], 6)
        await add_clients(fed, root.address, [4, 5], 6)
        await wait_joined(root, 6)
        if ghosts:
            t.start()
            await wait_joined(agg, 4 + GHOSTS)
        cfg = RunConfig(task="digits", rounds=3, cohort=CohortConfig(target=6, over_selection=1.0, deadline_s=60))
        start = time.monotonic()
        await start_run(root, cfg)
        st = await wait_status(root, lambda s: s.get("status") in ("completed", "failed"), 300)
        return time.monotonic() - start, st
    finally:
        stop.set()
        await fed.stop()
        if t.is_alive():
            await asyncio.to_thread(t.join, 10)


def test_ghost_joiners_cost_a_run_less_than_twice_its_time(tmp_path: Path) -> None:
    base, st0 = asyncio.run(_run(tmp_path / "base", ghosts=False))
    assert st0["status"] == "completed", st0
    with_ghosts, st1 = asyncio.run(_run(tmp_path / "ghosts", ghosts=True))
    assert st1["status"] == "completed", st1
    assert all(r["participants"] == 6 for r in st1["rounds"] if r["status"] == "completed"), st1["rounds"]
    assert with_ghosts < 2 * base, (f"{with_ghosts:.1f}s with ghosts vs {base:.1f}s without",
                                    st0["rounds"], st1["rounds"])


POLLER = """
import sys, grpc
from orchard.v1 import orchard_pb2 as pb, orchard_pb2_grpc as pbg
stub = pbg.FleetStub(grpc.insecure_channel(sys.argv[1]))
stub.Join(pb.JoinRequest(node_id="doomed", role="client"))
print("joined", flush=True)
while True:
    stub.Poll(pb.PollRequest(node_id="doomed", wait_s=60))
"""


def test_a_client_killed_while_polling_is_gone_within_seconds(tmp_path: Path) -> None:
    async def main() -> float:
        root = await start_root(tmp_path / "root", insecure=True, server_cfg=FAST.model_copy(
            update={"node_timeout_s": 60.0, "long_poll_s": 60.0}))
        proc = await asyncio.create_subprocess_exec(sys.executable, "-c", POLLER, root.address,
                                                    stdout=subprocess.PIPE)
        try:
            assert proc.stdout is not None
            await asyncio.wait_for(proc.stdout.readline(), 60)
            reg = root.coordinator.registry
            end = time.monotonic() + 30
            while not reg.waiting(reg.children["doomed"]):
                assert time.monotonic() < end
                await asyncio.sleep(0.05)
            os.kill(proc.pid, signal.SIGKILL)
            killed = time.monotonic()
            while reg.live(reg.children["doomed"]) or reg.waiting(reg.children["doomed"]):
                assert time.monotonic() - killed < 5, "a node killed while polling still counts as live"
                await asyncio.sleep(0.05)
            return time.monotonic() - killed
        finally:
            if proc.returncode is None:
                proc.kill()
            await proc.wait()
            await root.stop(0.1)

    assert asyncio.run(main()) < 5
