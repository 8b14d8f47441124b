"""Real gRPC federations on loopback: depth-3 trees, tree == flat (also with one secure
session over the whole tree), failed rounds, retries."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import numpy as np
import pytest
from fed_harness import FAST, Federation, add_clients, start_run, tree, wait_joined, wait_status

from orchard import wire
from orchard.client.runtime import ClientRuntime
from orchard.config import CohortConfig, RunConfig, SecureAggregationConfig
from orchard.link import FleetLink, LinkConfig
from orchard.ops import ControlClient
from orchard.server.app import start_root
from orchard.tasks import get_task
from orchard.typing import Role

ALL_IN = CohortConfig(target=4, over_selection=1.0, min_fraction=1.0, deadline_s=60)


def _global(fed: Federation) -> dict[str, np.ndarray]:
    ctl = ControlClient(fed.root.address, insecure=True)
    try:
        return wire.blob_to_arrays(ctl.pull_global())
    finally:
        ctl.close()


async def _run_tree(tmp: Path, depth: int, rounds: int = 2,
                    secure: SecureAggregationConfig | None = None) -> tuple[dict, dict]:
    fed = await tree(tmp, depth=depth, clients_per_leaf=4)
    try:
        await start_run(fed.root, RunConfig(task="digits", rounds=rounds, cohort=ALL_IN, seed=7,
                                            secure_aggregation=secure or SecureAggregationConfig()))
        st = await wait_status(fed.root, lambda s: s.get("status") in ("completed", "failed"), 90)
        arrays = await asyncio.to_thread(_global, fed)
        return st, arrays
    finally:
        await fed.stop()


def test_depth3_tree_equals_flat(tmp_path: Path) -> None:
    """root -> aggregator -> aggregator -> clients gives the flat FedAvg model to 1e-6 relative."""
    st3, tree_model = asyncio.run(_run_tree(tmp_path / "tree", depth=3))
    st1, flat_model = asyncio.run(_run_tree(tmp_path / "flat", depth=1))
    assert st3["status"] == "completed" and st3["completed_rounds"] == 2, st3
    assert st1["status"] == "completed"
    for r in st3["rounds"]:
        assert r["participants"] == 4
        # The leaf aggregator reports its cohort; the root saw one partial.
        assert sum(r["tier_participants"].values()) == 4 and "root" not in r["tier_participants"]
        assert r["bytes_up"] > 0 and r["bytes_down"] > 0 and "train_loss" in r["metrics"]
    for k in flat_model:
        scale = np.abs(flat_model[k]).max() + 1e-12
        assert np.abs(tree_model[k] - flat_model[k]).max() <= 1e-6 * scale, k
    # And training did something.
    init = get_task("digits").initial_arrays(7)
    assert any(not np.allclose(flat_model[k], init[k]) for k in init)


def test_depth3_secure_session_over_the_whole_tree(tmp_path: Path) -> None:
    """Scope "tree" through root -> aggregator -> aggregator -> clients: the leaf reports
    its roster to the middle tier, which reports it on to the root, and both relay every
    exchange; the root's one session gives the flat FedAvg model up to quantisation."""
    secure = SecureAggregationConfig(enabled=True, scope="tree")
    st, model = asyncio.run(_run_tree(tmp_path / "tree", depth=3, rounds=1, secure=secure))
    assert st["status"] == "completed" and st["completed_rounds"] == 1, st
    r = st["rounds"][0]
    assert r["participants"] == 4 and r["selected"] == 1, r
    # Counted for the lowest tier, the one the clients came through.
    (leaf, n), = r["tier_participants"].items()
    assert n == 4 and leaf != "root", r
    _, flat = asyncio.run(_run_tree(tmp_path / "flat", depth=1, rounds=1))
    init = get_task("digits").initial_arrays(7)
    # 16-bit quantisation of each client's scaled update: errors near 5e-5 on steps of 1e-2.
    for k in flat:
        assert np.abs(model[k] - flat[k]).max() <= 3e-4, k
    assert max(np.abs(flat[k] - init[k]).max() for k in init) > 3e-3


class FlakyTrainer:
    """Fails every call during its first `fail_for_s` seconds, then trains normally.

    A client whose task fails polls again and is handed the same task, so failing for
    longer than the round deadline is what makes an attempt miss its minimum."""

    def __init__(self, inner, fail_for_s: float) -> None:
        self.inner = inner
        self.fail_for_s = fail_for_s
        self.t0: float | None = None

    def train(self, arrays, config):
        now = time.monotonic()
        self.t0 = now if self.t0 is None else self.t0
        if now - self.t0 < self.fail_for_s:
            time.sleep(0.05)
            raise RuntimeError("device ran out of memory")
        return self.inner.train(arrays, config)

    def evaluate(self, arrays, config):
        return self.inner.evaluate(arrays, config)


async def _flaky_federation(tmp: Path, fail_for_s: float, max_retries: int):
    root = await start_root(tmp / "root", insecure=True, server_cfg=FAST, start_grace_s=0.2, seed=1)
    fed = Federation(root)
    task = get_task("digits")
    await add_clients(fed, root.address, [0, 1], 3)
    link = FleetLink(LinkConfig(target=root.address, role=Role.CLIENT, insecure=True, node_id="flaky"))
    flaky = ClientRuntime(link, lambda cfg: FlakyTrainer(task.client_trainer(2, 3, 0), fail_for_s), partition_id=2)
    fed.clients.append(flaky)
    fed.client_tasks.append(asyncio.create_task(flaky.run()))
    cfg = RunConfig(task="digits", rounds=1, cohort=CohortConfig(target=3, over_selection=1.0, min_fraction=1.0,
                                                                 deadline_s=2.0, max_retries=max_retries))
    await start_run(root, cfg)
    st = await wait_status(root, lambda s: s.get("status") in ("completed", "failed"), 60)
    blob = await asyncio.to_thread(lambda: ControlClient(root.address, insecure=True).pull_global())
    await fed.stop()
    return st, wire.blob_to_arrays(blob), task.initial_arrays(0)


def test_round_below_minimum_fails_and_is_retried(tmp_path: Path) -> None:
    st, model, init = asyncio.run(_flaky_federation(tmp_path, fail_for_s=2.5, max_retries=2))
    assert st["status"] == "completed", st
    first, second = st["rounds"][0], st["rounds"][1]
    assert (first["round"], first["attempt"], first["status"]) == (1, 0, "failed")
    assert "global model unchanged" in first["reason"] and first["participants"] == 2
    assert (second["round"], second["attempt"], second["status"]) == (1, 1, "completed")
    assert second["participants"] == 3
    assert any(not np.array_equal(model[k], init[k]) for k in init)


def test_run_fails_when_retries_run_out_and_model_is_unchanged(tmp_path: Path) -> None:
    st, model, init = asyncio.run(_flaky_federation(tmp_path, fail_for_s=60.0, max_retries=1))
    assert st["status"] == "failed" and "failed 2 times" in st["error"], st
    assert st["completed_rounds"] == 0
    assert [r["status"] for r in st["rounds"]] == ["failed", "failed"]
    for k in init:
        np.testing.assert_array_equal(model[k], init[k])


def test_over_selection_closes_at_target(tmp_path: Path) -> None:
    """6 clients, target 4 at 130%: ceil(5.2)=6 selected, the round closes at 4 updates."""

    async def main():
        root = await start_root(tmp_path / "root", insecure=True, server_cfg=FAST, start_grace_s=0.2, seed=3)
        fed = Federation(root)
        await add_clients(fed, root.address, list(range(6)), 6)
        await wait_joined(root, 6)
        await start_run(root, RunConfig(task="digits", rounds=1,
                                        cohort=CohortConfig(target=4, over_selection=1.3, deadline_s=30)))
        st = await wait_status(root, lambda s: s.get("status") == "completed", 60)
        await asyncio.sleep(0.5)  # let the over-selected stragglers hear "closed"
        reports = [r for c in fed.clients for r in c.reports]
        await fed.stop()
        return st, reports

    st, reports = asyncio.run(main())
    r = st["rounds"][0]
    assert r["selected"] == 6 and r["participants"] == 4 and r["closed_because"] == "target reached"
    late = [x for x in reports if not x.accepted]
    assert all("late uploads are refused" in x.reason for x in late), [x.reason for x in late]


def test_insecure_refuses_non_loopback() -> None:
    from orchard.errors import ConfigError
    from orchard.server.app import check_bind

    with pytest.raises(ConfigError, match="loopback"):
        check_bind("0.0.0.0", insecure=True)
    check_bind("127.0.0.1", insecure=True)
    check_bind("0.0.0.0", insecure=False)
