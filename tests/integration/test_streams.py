"""Chunked streams and liveness: models larger than one gRPC message, silent clients dropped."""

from __future__ import annotations

import asyncio
from pathlib import Path

import numpy as np
from fed_harness import FAST, Federation, wait_status

from orchard import wire
from orchard.client.runtime import ClientRuntime
from orchard.config import CohortConfig, RunConfig
from orchard.link import FleetLink, LinkConfig
from orchard.ops import ControlClient
from orchard.server.app import start_aggregator, start_root
from orchard.trainer import EvalResult, TrainResult
from orchard.typing import Role


class AddOne:
    """A trainer that adds 1 to every weight: the result of a round is known exactly."""

    def train(self, arrays, config):
        return TrainResult({k: v + 1.0 for k, v in arrays.items()}, weight=1.0, num_examples=1, num_steps=1)

    def evaluate(self, arrays, config):
        return EvalResult(1)


def test_a_12_mib_model_moves_through_two_tiers_in_chunks(tmp_path: Path) -> None:
    big = {"w": np.random.default_rng(0).normal(size=(3, 1024, 1024)).astype(np.float32)}  # 12 MiB
    blob = wire.arrays_to_blob(big)
    assert len(blob) > 3 * wire.MAX_CHUNK_BYTES

    async def main():
        root = await start_root(tmp_path / "root", insecure=True, server_cfg=FAST, start_grace_s=0.1)
        agg = await start_aggregator(root.address, insecure=True, server_cfg=FAST)
        fed = Federation(root, [agg])
        for k in range(2):
            link = FleetLink(LinkConfig(target=agg.address, role=Role.CLIENT, insecure=True, node_id=f"c{k}"))
            rt = ClientRuntime(link, lambda cfg: AddOne(), partition_id=k)
            fed.clients.append(rt)
            fed.client_tasks.append(asyncio.create_task(rt.run()))
        cfg = RunConfig(task="digits", rounds=2, cohort=CohortConfig(target=2, over_selection=1.0))
        with ControlClient(root.address, insecure=True) as ctl:
            await asyncio.to_thread(ctl.start_run, cfg, blob)
            st = await wait_status(root, lambda s: s.get("status") in ("completed", "failed"), 120)
            out = wire.blob_to_arrays(await asyncio.to_thread(ctl.pull_global))
        pulls = [c.link.bytes_down for c in fed.clients]
        await fed.stop()
        return st, out, pulls

    st, out, pulls = asyncio.run(main())
    assert st["status"] == "completed", st
    np.testing.assert_allclose(out["w"], big["w"] + 2.0, rtol=0, atol=1e-5)
    # Each client pulled the model once per round (a new global each round).
    assert all(p == 2 * len(blob) for p in pulls)


def test_silent_selected_client_is_dropped_and_round_closes_early(tmp_path: Path) -> None:
    async def main():
        root = await start_root(tmp_path / "root", insecure=True, server_cfg=FAST.model_copy(
            update={"node_timeout_s": 1.5}), start_grace_s=0.1)
        fed = Federation(root)
        for k in range(2):
            link = FleetLink(LinkConfig(target=root.address, role=Role.CLIENT, insecure=True, node_id=f"c{k}"))
            rt = ClientRuntime(link, lambda cfg: AddOne(), partition_id=k)
            fed.clients.append(rt)
            fed.client_tasks.append(asyncio.create_task(rt.run()))
        ghost = FleetLink(LinkConfig(target=root.address, role=Role.CLIENT, insecure=True, node_id="ghost"))
        await ghost.join()
        cfg = RunConfig(task="digits", rounds=1,
                        cohort=CohortConfig(target=3, over_selection=1.0, min_fraction=0.6, deadline_s=60))
        blob = wire.arrays_to_blob({"w": np.zeros(4, np.float32)})
        with ControlClient(root.address, insecure=True) as ctl:
            await asyncio.to_thread(ctl.start_run, cfg, blob)
        task = await ghost.poll()  # takes its task, then never speaks again
        assert not isinstance(task, type(None))
        st = await wait_status(root, lambda s: s.get("status") in ("completed", "failed"), 30)
        await ghost.close()
        await fed.stop()
        return st

    st = asyncio.run(main())
    r = st["rounds"][0]
    assert st["status"] == "completed" and r["participants"] == 2 and r["dropped"] == 1, st
    assert r["closed_because"] == "every selected node delivered or dropped" and r["seconds"] < 30


def test_prometheus_metrics_endpoint(tmp_path: Path) -> None:
    import urllib.request

    async def main():
        root = await start_root(tmp_path / "root", insecure=True, server_cfg=FAST, metrics_port=0)
        link = FleetLink(LinkConfig(target=root.address, role=Role.CLIENT, insecure=True, node_id="m"))
        await link.join()
        body = await asyncio.to_thread(
            lambda: urllib.request.urlopen(f"http://127.0.0.1:{root.metrics_port}/metrics", timeout=10).read())
        await link.close()
        await root.stop(0.1)
        return body.decode()

    text = asyncio.run(main())
    assert 'orchard_clients{role="root",tier="root"} 1.0' in text
    assert "orchard_uploads_accepted_total" in text
