"""A Flower ClientApp, written as Flower's quickstart writes one, runs unchanged as the
client program of `orchard client start --flower-app`, over real gRPC, and its train
metrics (weighted by num-examples) appear per round in the run status."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
from fed_harness import BackgroundRoot

from orchard import wire
from orchard.config import CohortConfig, RunConfig, ServerConfig
from orchard.ops import ControlClient

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"


def test_flower_quickstart_app_over_grpc(tmp_path: Path) -> None:
    sys.path.insert(0, str(FIXTURES))
    try:
        import flower_quickstart_app as fq
    finally:
        sys.path.remove(str(FIXTURES))
    initial = {k: v.detach().numpy().astype(np.float32) for k, v in fq.Net().state_dict().items()}
    # The client processes import torch and Flower when their first task starts, before
    # they heartbeat; on a loaded machine that takes longer than the harness's 5 s node
    # timeout, so this root waits for them longer.
    srv = BackgroundRoot(tmp_path / "root", ServerConfig(heartbeat_s=1.0, node_timeout_s=60.0, long_poll_s=2.0))
    env = dict(os.environ, PYTHONPATH=str(FIXTURES), OMP_NUM_THREADS="1")
    procs = [subprocess.Popen([sys.executable, "-m", "orchard.cli", "client", "start", "--server", srv.root.address,
                               "--insecure", "--flower-app", "flower_quickstart_app:app", "--partition", str(k),
                               "--num-partitions", "2", "--node-id", f"flower-{k}", "--max-tasks", "2"],
                              env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL) for k in range(2)]
    try:
        cfg = RunConfig(task="digits", rounds=2, cohort=CohortConfig(target=2, over_selection=1.0, deadline_s=60))
        with ControlClient(srv.root.address, insecure=True) as ctl:
            ctl.start_run(cfg, wire.arrays_to_blob(initial))
            end = time.monotonic() + 120
            while time.monotonic() < end:
                st = ctl.status()
                if st["status"] != "running":
                    break
                time.sleep(0.2)
            final = wire.blob_to_arrays(ctl.pull_global())
    finally:
        for p in procs:
            p.wait(30) if p.poll() is None else None
        srv.stop()
    assert st["status"] == "completed", st
    for r in st["rounds"]:
        assert r["participants"] == 2
        assert "train_loss" in r["metrics"], r["metrics"]  # the app's own MetricRecord
    assert set(final) == set(initial)
    assert any(not np.allclose(final[k], initial[k]) for k in initial)
    assert all(p.returncode == 0 for p in procs), [p.returncode for p in procs]


def test_a_live_flower_app_reads_the_round_from_its_config_record(tmp_path: Path) -> None:
    """A live client gives a Flower app the round as "server-round", as a Flower strategy
    does (and as the simulator does): an app that schedules by round works live too."""
    import asyncio

    from fed_harness import FAST, Federation, start_run, wait_status
    from flwr.app import Message, MetricRecord, RecordDict
    from flwr.clientapp import ClientApp

    from orchard.client.flower_adapter import FlowerTrainer
    from orchard.client.runtime import ClientRuntime
    from orchard.link import FleetLink, LinkConfig
    from orchard.server.app import start_root
    from orchard.typing import Role

    seen: list[int] = []
    app = ClientApp()

    @app.train()
    def train(msg: Message, context):  # type: ignore[no-untyped-def]
        seen.append(int(msg.content["config"]["server-round"]))
        return Message(RecordDict({"arrays": msg.content["arrays"], "metrics": MetricRecord({"num-examples": 4})}),
                       reply_to=msg)

    async def main() -> dict:
        fed = Federation(await start_root(tmp_path / "root", insecure=True, server_cfg=FAST, start_grace_s=0.1))
        try:
            link = FleetLink(LinkConfig(target=fed.root.address, role=Role.CLIENT, insecure=True, node_id="flower-0"))
            rt = ClientRuntime(link, lambda cfg: FlowerTrainer(app, partition_id=0, num_partitions=1), partition_id=0)
            fed.clients.append(rt)
            fed.client_tasks.append(asyncio.create_task(rt.run()))
            await start_run(fed.root, RunConfig(task="digits", rounds=2,
                                                cohort=CohortConfig(target=1, over_selection=1.0, deadline_s=30)))
            return await wait_status(fed.root, lambda s: s.get("status") in ("completed", "failed"), 90)
        finally:
            await fed.stop()

    st = asyncio.run(main())
    assert st["status"] == "completed", st
    assert seen == [1, 2]
