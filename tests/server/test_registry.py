"""Who a tier selects: only nodes waiting for work (a long poll outstanding, or one just
ended); a node that joined and never polled is never selected; a node whose long poll
was cancelled (its peer went away) is gone at once, not after its timeout."""

from __future__ import annotations

import asyncio
import time

import numpy as np

from orchard.config import CohortConfig, RunConfig, ServerConfig
from orchard.server.coordinator import Coordinator
from orchard.server.decoding import ClientUpdateDecoder
from orchard.server.round import RoundTask
from orchard.server.tier.registry import Child, Registry
from orchard.typing import DeviceState, Role, TensorSpec
from tests.server.clock import Clock


def test_a_node_that_joined_and_never_polled_is_live_but_never_selectable() -> None:
    clock = Clock(1000.0)
    reg = Registry(node_timeout_s=10.0, monotonic=clock, ready_s=2.0)
    reg.join("ghost", Role.CLIENT, "tok", DeviceState(), waiting=False)
    ghost = reg.children["ghost"]
    assert reg.live(ghost) and not reg.waiting(ghost) and reg.selectable(ghost) == 0
    assert reg.capacity() == (1, 0)
    # Forgotten after one timeout (a node that polled is kept ten).
    clock.t += 10.5
    assert reg.expire(lambda n: False) == ["ghost"] and "ghost" not in reg.children


def _polling(clock: Clock) -> tuple[Registry, Child]:
    """A registry (10 s timeout, 2 s ready) with one client "c" that has a long poll outstanding."""
    reg = Registry(node_timeout_s=10.0, monotonic=clock, ready_s=2.0)
    reg.join("c", Role.CLIENT, "tok", DeviceState(), waiting=False)
    c = reg.children["c"]
    reg.poll_started(c)
    return reg, c


def test_a_node_waits_for_work_while_it_polls_and_a_moment_after() -> None:
    clock = Clock(1000.0)
    reg, c = _polling(clock)
    clock.t += 30.0  # a long poll outstanding: live and waiting however long it lasts
    assert reg.live(c) and reg.waiting(c) and reg.capacity() == (1, 1)
    reg.poll_ended(c, cancelled=False)
    clock.t += 1.9
    assert reg.waiting(c)  # between two polls
    clock.t += 0.2
    assert not reg.waiting(c) and reg.live(c)  # it took a task, or stopped asking: not selected
    reg.delivered("c")  # an update delivered: it polls again right away
    assert reg.waiting(c)
    clock.t += 2.1
    assert not reg.waiting(c)
    clock.t += 8.0
    assert not reg.live(c)  # silent past its timeout
    reg.touch("c")
    assert reg.live(c) and not reg.waiting(c)


def test_a_cancelled_poll_is_a_node_gone_now_until_it_calls_again() -> None:
    clock = Clock(1000.0)
    reg, c = _polling(clock)
    reg.poll_ended(c, cancelled=True)
    assert not reg.live(c) and not reg.waiting(c) and reg.capacity() == (0, 0)
    reg.touch("c")
    assert reg.live(c)


def test_an_aggregator_offers_its_eligible_pool_only_while_it_waits_for_work() -> None:
    clock = Clock(1000.0)
    reg = Registry(node_timeout_s=10.0, monotonic=clock, ready_s=2.0)
    reg.join("agg", Role.AGGREGATOR, "tok", DeviceState(), waiting=False)
    reg.touch("agg", pool_size=50, pool_eligible=40)
    agg = reg.children["agg"]
    assert reg.selectable(agg) == 0 and reg.capacity() == (50, 0)
    reg.poll_started(agg)
    assert reg.selectable(agg) == 40 and reg.capacity() == (50, 40)


def test_an_in_process_check_in_waits_for_work_from_its_join() -> None:
    reg = Registry(node_timeout_s=10.0, monotonic=Clock(1000.0), ready_s=2.0)
    reg.join("sim", Role.CLIENT, "tok", DeviceState())
    assert reg.waiting(reg.children["sim"])


def _task(target: int) -> RoundTask:
    cfg = RunConfig(cohort=CohortConfig(target=target, over_selection=1.0))
    return RoundTask(run_id="run", round=1, attempt=0, config=cfg, config_json=cfg.model_dump_json(),
                     model_blob=b"", model_hash="h", schema=(TensorSpec("w", (2,), "float32"),),
                     deadline_unix=time.time() + 600, target=target, shared_seed=1)


def test_a_round_selects_pollers_not_ghosts_and_drops_a_poller_that_vanished() -> None:
    async def main() -> None:
        clock = Clock(1000.0)
        coord = Coordinator("tier", ServerConfig(node_timeout_s=10.0, heartbeat_s=2.0),
                            np.random.default_rng(0), ClientUpdateDecoder(), monotonic=clock)
        for n in ("a", "b", "gone"):
            coord.join(n, Role.CLIENT, "tok", DeviceState(), waiting=False)
        for k in range(20):
            coord.join(f"ghost-{k}", Role.CLIENT, "tok", DeviceState(), waiting=False)
        polls = {n: asyncio.create_task(coord.poll(n, None, None, None, 60.0)) for n in ("a", "b", "gone")}
        await asyncio.sleep(0)
        polls["gone"].cancel()  # what gRPC does to a call whose peer was killed
        await asyncio.gather(polls["gone"], return_exceptions=True)
        assert coord.capacity() == (22, 2)
        cr = coord.open_round(_task(3))
        assert set(cr.assignments) == {"a", "b"}
        got = await asyncio.gather(polls["a"], polls["b"])
        assert all(t.task_id for t in got)
        coord.shutdown()

    asyncio.run(main())


def test_a_selected_node_that_stops_waiting_before_it_takes_its_task_is_dropped_within_seconds() -> None:
    clock = Clock(1000.0)
    coord = Coordinator("tier", ServerConfig(node_timeout_s=60.0, heartbeat_s=2.0), np.random.default_rng(0),
                        ClientUpdateDecoder(), monotonic=clock, inline=True)
    coord.join("a", Role.CLIENT, "tok", DeviceState(), waiting=False)
    c = coord.children["a"]
    coord.registry.poll_started(c)
    coord.registry.poll_ended(c, cancelled=False)  # it was between two polls when the round opened
    cr = coord.open_round(_task(1))
    assert "a" in cr.assignments
    clock.t += 4.0
    coord.sweep()
    assert not cr.assignments["a"].dropped
    clock.t += 1.5  # no poll for 5 s: it does not wait for work any more (not 60 s, its timeout)
    coord.sweep()
    assert cr.assignments["a"].dropped
