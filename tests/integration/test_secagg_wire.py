"""Secure aggregation over real gRPC: the tier learns only the cohort's sum, which equals
the plain weighted sum up to quantisation, through a tree, over the whole tree (scope
"tree": the root's one session, aggregators relaying), and with a client lost between
stages."""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from fed_harness import FAST, Federation, wait_joined, wait_status

from orchard import wire
from orchard.client.runtime import ClientRuntime
from orchard.config import CohortConfig, RunConfig, SecureAggregationConfig
from orchard.link import FleetLink, LinkConfig
from orchard.ops import ControlClient
from orchard.server.app import start_aggregator, start_root
from orchard.server.maskworkers import MaskWorkers, WorkerSession
from orchard.server.tier import executor
from orchard.trainer import EvalResult, TrainResult
from orchard.typing import Role

D = 1000


class Shift:
    """Adds a fixed per-client offset (weight `w`); dies before its update if `die`."""

    def __init__(self, k: int, w: float, die: bool = False) -> None:
        self.k, self.w, self.die = k, w, die

    def train(self, arrays, config):
        if self.die:
            time.sleep(0.2)
            raise RuntimeError("battery died mid-training")
        off = 0.01 * (self.k + 1) * np.cos(np.arange(D, dtype=np.float32) + self.k)
        return TrainResult({k: v + off for k, v in arrays.items()}, weight=self.w, num_examples=int(self.w),
                           num_steps=1, metrics={"train_loss": float(self.k)})

    def evaluate(self, arrays, config):
        return EvalResult(1)


def expected(ks: list[int], ws: list[float]) -> np.ndarray:
    offs = [0.01 * (k + 1) * np.cos(np.arange(D) + k) for k in ks]
    return sum(w * o for w, o in zip(ws, offs, strict=True)) / sum(ws)


async def _run(tmp: Path, n: int, aggregators: int, dead: set[int], deadline: float = 20.0,
               scope: str = "cohort", reports: dict | None = None):
    """``n`` clients under the root, or spread over ``aggregators`` aggregators below it;
    ``reports``, if given, receives each dead client's task reports."""
    root = await start_root(tmp / "root", insecure=True, server_cfg=FAST, start_grace_s=0.2)
    fed = Federation(root)
    for _ in range(aggregators):
        fed.aggregators.append(await start_aggregator(root.address, insecure=True, server_cfg=FAST))
    tiers = fed.aggregators or [root]
    weights = [10.0 * (k + 1) for k in range(n)]
    for k in range(n):
        target = tiers[k % len(tiers)]
        link = FleetLink(LinkConfig(target=target.address, role=Role.CLIENT, insecure=True, node_id=f"c{k}"))
        trainer = Shift(k, weights[k], k in dead)
        rt = ClientRuntime(link, lambda cfg, t=trainer: t, partition_id=k)
        fed.clients.append(rt)
        fed.client_tasks.append(asyncio.create_task(rt.run()))
    for i, tier in enumerate(tiers):
        await wait_joined(tier, len(range(i, n, len(tiers))))
    await wait_joined(root, n)
    cfg = RunConfig(task="digits", rounds=1,
                    cohort=CohortConfig(target=n, over_selection=1.0, min_fraction=0.5, deadline_s=deadline),
                    secure_aggregation=SecureAggregationConfig(enabled=True, scope=scope, clip=0.5, bits=16,
                                                               dropout_rate=0.3))
    with ControlClient(root.address, insecure=True) as ctl:
        await asyncio.to_thread(ctl.start_run, cfg, wire.arrays_to_blob({"w": np.zeros(D, np.float32)}))
        st = await wait_status(root, lambda s: s.get("status") in ("completed", "failed"), 60)
        out = wire.blob_to_arrays(await asyncio.to_thread(ctl.pull_global))["w"]
    await fed.stop()
    if reports is not None:
        reports.update({k: list(fed.clients[k].reports) for k in dead})
    return st, out, weights


def test_secure_round_equals_plain_weighted_mean(tmp_path: Path) -> None:
    st, out, w = asyncio.run(_run(tmp_path, 4, aggregators=0, dead=set()))
    assert st["status"] == "completed", st
    r = st["rounds"][0]
    assert r["participants"] == 4
    # Quantisation: 16 bits over [-0.5, 0.5] per scaled value; far below the 0.01 offsets.
    np.testing.assert_allclose(out, expected([0, 1, 2, 3], w), atol=2e-3)
    assert abs(r["metrics"]["train_loss"] - sum(k * wk for k, wk in enumerate(w)) / sum(w)) < 1e-9


def test_secure_cohort_under_an_aggregator(tmp_path: Path) -> None:
    st, out, w = asyncio.run(_run(tmp_path, 4, aggregators=1, dead=set()))
    assert st["status"] == "completed", st
    assert sum(st["rounds"][0]["tier_participants"].values()) == 4
    np.testing.assert_allclose(out, expected([0, 1, 2, 3], w), atol=2e-3)


def test_secure_session_over_the_whole_tree(tmp_path: Path) -> None:
    """Scope "tree": one session at the root over the 6 clients of 2 aggregators, which
    relay their clients' messages and push no partial; the sum is the plain weighted mean."""
    st, out, w = asyncio.run(_run(tmp_path, 6, aggregators=2, dead=set(), scope="tree"))
    assert st["status"] == "completed", st
    r = st["rounds"][0]
    assert r["participants"] == 6 and r["selected"] == 2 and r["dropped"] == 0, r
    per_tier = r["tier_participants"]
    assert sorted(per_tier.values()) == [3, 3] and "root" not in per_tier, per_tier
    np.testing.assert_allclose(out, expected(list(range(6)), w), atol=2e-3)
    assert abs(r["metrics"]["train_loss"] - sum(k * wk for k, wk in enumerate(w)) / sum(w)) < 1e-9


def test_client_lost_between_stages_is_recovered(tmp_path: Path) -> None:
    """Client 2 shares its keys, then dies before its masked input: the sum is of the other four."""
    st, out, w = asyncio.run(_run(tmp_path, 5, aggregators=0, dead={2}, deadline=8.0))
    assert st["status"] == "completed", st
    r = st["rounds"][0]
    assert r["participants"] == 4 and r["dropped"] == 1, r
    np.testing.assert_allclose(out, expected([0, 1, 3, 4], [w[k] for k in (0, 1, 3, 4)]), atol=2e-3)


def test_client_lost_below_a_relay_is_recovered(tmp_path: Path) -> None:
    """Scope "tree": client 2 (under the first aggregator) dies before its masked input; the
    root's session recovers and sums the other five, and its relay closes with the session."""
    reports: dict = {}
    st, out, w = asyncio.run(_run(tmp_path, 6, aggregators=2, dead={2}, deadline=8.0, scope="tree",
                                  reports=reports))
    assert st["status"] == "completed", st
    # Its task failed once: a secure session cannot be joined again, so it does not take the
    # same task up again while the server still hands it out.
    assert [r.accepted for r in reports[2]] == [False], reports
    r = st["rounds"][0]
    assert r["participants"] == 5 and sorted(r["tier_participants"].values()) == [2, 3], r
    np.testing.assert_allclose(out, expected([0, 1, 3, 4, 5], [w[k] for k in (0, 1, 3, 4, 5)]), atol=2e-3)


def test_a_tier_unmasks_on_its_mask_workers(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """With sessions over the size that starts them (here any size), the tier starts its
    mask worker processes with the first session, unmasks on them (a dropped client's
    pairwise masks included: the sum is the other four's) and closes them when it stops."""
    started: list[_Recording] = []

    class _Recording(MaskWorkers):
        def __init__(self, processes: int | None = None) -> None:
            super().__init__(processes)
            self.sessions = 0
            started.append(self)

        def open(self, words: int, dtype: np.dtype, chunk_words: int) -> WorkerSession | None:
            session = super().open(words, dtype, chunk_words)
            self.sessions += session is not None
            return session

    monkeypatch.setattr(executor, "MASK_WORKERS_MIN_BYTES", 0)
    monkeypatch.setattr(executor, "MaskWorkers", _Recording)
    st, out, w = asyncio.run(_run(tmp_path, 5, aggregators=0, dead={2}, deadline=8.0))
    assert st["status"] == "completed", st
    assert st["rounds"][0]["participants"] == 4
    np.testing.assert_allclose(out, expected([0, 1, 3, 4], [w[k] for k in (0, 1, 3, 4)]), atol=2e-3)
    assert len(started) == 1 and started[0].sessions == 1
    assert started[0].closed


def test_the_unmasking_runs_off_the_event_loop(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A tier closes its session's unmasking stage (seconds of mask expansion in a large
    session; here made slow on purpose) on a thread of its own: the event loop that
    serves its heartbeats and polls keeps turning, and the round still gets the sum."""
    from orchard.secure_agg import Stage
    from orchard.server.secagg import SecureCohort

    threads: list[str] = []
    close = SecureCohort.close_due_stage

    def slow_close(self: SecureCohort) -> None:
        if self.stage is Stage.UNMASKING:
            threads.append(threading.current_thread().name)
            time.sleep(1.5)
        close(self)

    monkeypatch.setattr(SecureCohort, "close_due_stage", slow_close)
    gaps: list[float] = []

    async def main() -> tuple:
        async def tick() -> None:
            last = time.perf_counter()
            while True:
                await asyncio.sleep(0.05)
                now = time.perf_counter()
                gaps.append(now - last)
                last = now

        ticker = asyncio.create_task(tick())
        try:
            return await _run(tmp_path, 4, aggregators=0, dead=set())
        finally:
            ticker.cancel()

    st, out, w = asyncio.run(main())
    assert st["status"] == "completed", st
    np.testing.assert_allclose(out, expected([0, 1, 2, 3], w), atol=2e-3)
    assert threads and all(t.startswith("orchard-unmask") for t in threads), threads
    assert max(gaps) < 1.0, max(gaps)  # the 1.5 s close never held the loop
