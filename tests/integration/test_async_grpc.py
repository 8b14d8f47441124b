"""Asynchronous buffered aggregation over real gRPC: root -> aggregator -> 6 clients, two
of them slow. The model version advances without waiting for the slow ones; a slow
update is folded with its staleness weight while it is within S, and refused past it."""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path

import numpy as np
from fed_harness import FAST, Federation, add_clients, start_run, wait_joined, wait_status

from orchard.config import CohortConfig, ModeConfig, RunConfig
from orchard.server.app import start_aggregator, start_root

K, S, ROUNDS = 2, 4, 10
FOLDED_AT, REFUSED_AT = 2, 7  # the model version at which each slow client is let go


class Gate:
    """A trainer that waits for the test to open its gate: a slow device, controlled."""

    def __init__(self, inner, gate: threading.Event, pause: float = 0.0) -> None:
        self.inner, self.gate, self.pause = inner, gate, pause

    def train(self, arrays, config):
        if not self.gate.wait(120):
            raise TimeoutError("gate never opened")
        time.sleep(self.pause)
        return self.inner.train(arrays, config)

    def evaluate(self, arrays, config):
        return self.inner.evaluate(arrays, config)


async def _run(tmp: Path) -> dict:
    root = await start_root(tmp / "root", insecure=True, server_cfg=FAST, start_grace_s=0.5)
    fed = Federation(root)
    agg = await start_aggregator(root.address, insecure=True, server_cfg=FAST)
    fed.aggregators.append(agg)
    always = threading.Event()
    always.set()
    gates = {4: threading.Event(), 5: threading.Event()}
    for k in range(6):
        # Fast devices take 0.2 s a task (so versions move at a steady pace); 4 and 5 wait.
        gate, pause = (gates[k], 0.0) if k in gates else (always, 0.2)
        await add_clients(fed, agg.address, [k], 6, wrap=lambda t, g=gate, p=pause: Gate(t, g, p))
    try:
        await wait_joined(agg, 6)
        cfg = RunConfig(task="digits", rounds=ROUNDS, seed=3,
                        cohort=CohortConfig(target=K, over_selection=3.0, deadline_s=60),
                        mode=ModeConfig(kind="async", buffer_size=K, max_staleness=S, staleness="polynomial"))
        await start_run(root, cfg)
        st = await wait_status(root, lambda s: s.get("completed_rounds", 0) >= FOLDED_AT, 120)
        slow_reports_then = {k: len(fed.clients[k].reports) for k in gates}
        gates[4].set()
        st = await wait_status(root, lambda s: s.get("completed_rounds", 0) >= REFUSED_AT, 120)
        gates[5].set()
        st = await wait_status(root, lambda s: s.get("status") in ("completed", "failed"), 120)
        # Client 5's update was refused or folded before the run ended: wait for its report.
        end = time.monotonic() + 30
        while not fed.clients[5].reports and time.monotonic() < end:
            await asyncio.sleep(0.05)
        return {"status": st, "slow_reports_then": slow_reports_then,
                "reports": {k: list(fed.clients[k].reports) for k in range(6)},
                "agg_staleness": dict(agg.coordinator.staleness),
                "agg_rejected": dict(agg.coordinator.counters)}
    finally:
        await fed.stop()


def test_async_tree_does_not_wait_for_slow_clients(tmp_path: Path) -> None:
    got = asyncio.run(_run(tmp_path))
    st = got["status"]
    assert st["status"] == "completed" and st["completed_rounds"] == ROUNDS, st
    # The model reached version FOLDED_AT while both slow devices were still on their first task.
    assert got["slow_reports_then"] == {4: 0, 5: 0}
    assert st["mode"] == "async" and st["model_version"] == ROUNDS
    hist = {int(s): n for s, n in st["staleness_histogram"].items()}
    assert sum(hist.values()) == sum(r["participants"] for r in st["rounds"] if r["status"] == "completed")
    # Slow device 4 was let go at version FOLDED_AT: its update, trained on version 0, was
    # folded with staleness between 1 and S (weight (1 + s) ** -0.5 < 1).
    first4 = got["reports"][4][0]
    assert first4.accepted, first4
    assert any(1 <= s <= S and n > 0 for s, n in got["agg_staleness"].items()), got["agg_staleness"]
    # The aggregator's partials carried their updates' staleness up: the root's histogram
    # is the clients', and it has the slow update in it.
    assert any(1 <= s <= S + 1 and n > 0 for s, n in hist.items()), hist
    # Slow device 5 was let go at version REFUSED_AT: more than S versions stale, refused by name.
    first5 = got["reports"][5][0]
    assert not first5.accepted and "versions stale" in first5.reason, first5
    assert got["agg_rejected"]["uploads_rejected"] >= 1
    # Every fast device contributed several times.
    assert all(sum(r.accepted for r in got["reports"][k]) >= 2 for k in range(4)), got["reports"]


async def _secure(tmp: Path) -> tuple[dict, np.ndarray, list[float]]:
    from test_secagg_wire import D, Shift

    from orchard import wire
    from orchard.client.runtime import ClientRuntime
    from orchard.config import SecureAggregationConfig
    from orchard.link import FleetLink, LinkConfig
    from orchard.ops import ControlClient
    from orchard.typing import Role

    root = await start_root(tmp / "root", insecure=True, server_cfg=FAST, start_grace_s=0.2)
    fed = Federation(root)
    agg = await start_aggregator(root.address, insecure=True, server_cfg=FAST)
    fed.aggregators.append(agg)
    weights = [10.0 * (k + 1) for k in range(5)]
    for k in range(5):
        link = FleetLink(LinkConfig(target=agg.address, role=Role.CLIENT, insecure=True, node_id=f"c{k}"))
        trainer = Shift(k, weights[k], die=k == 2)  # c2 shares its keys, then dies before its masked input
        rt = ClientRuntime(link, lambda cfg, t=trainer: t, partition_id=k)
        fed.clients.append(rt)
        fed.client_tasks.append(asyncio.create_task(rt.run()))
    try:
        await wait_joined(agg, 5)
        await wait_joined(root, 5)
        # K = 4 and a concurrency of 5: each buffer is one SecAgg+ session over 5 clients.
        cfg = RunConfig(task="digits", rounds=2,
                        cohort=CohortConfig(target=4, over_selection=1.25, min_fraction=0.5, deadline_s=8.0),
                        mode=ModeConfig(kind="async", buffer_size=4, max_staleness=2),
                        secure_aggregation=SecureAggregationConfig(enabled=True, clip=0.5, bits=16, dropout_rate=0.3))
        with ControlClient(root.address, insecure=True) as ctl:
            await asyncio.to_thread(ctl.start_run, cfg, wire.arrays_to_blob({"w": np.zeros(D, np.float32)}))
            st = await wait_status(root, lambda s: s.get("status") in ("completed", "failed"), 90)
            out = wire.blob_to_arrays(await asyncio.to_thread(ctl.pull_global))["w"]
        return st, out, weights
    finally:
        await fed.stop()


def test_a_secure_buffer_is_one_session_and_survives_a_dropout(tmp_path: Path) -> None:
    from test_secagg_wire import expected

    st, out, w = asyncio.run(_secure(tmp_path))
    assert st["status"] == "completed" and st["model_version"] == 2, st
    done = [r for r in st["rounds"] if r["status"] == "completed"]
    # Each buffer: the four survivors of the five masked, unmasked as one sum.
    assert [r["participants"] for r in done] == [4, 4]
    assert st["staleness_histogram"] == {"0": 8}
    # Two server steps of the survivors' weighted mean offset (each trains from the model it pulled).
    np.testing.assert_allclose(out, 2 * expected([0, 1, 3, 4], [w[k] for k in (0, 1, 3, 4)]), atol=4e-3)
