"""In-process federations over real gRPC on loopback (port 0), for the integration tests."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from orchard import wire
from orchard.client.runtime import ClientRuntime
from orchard.config import RunConfig, ServerConfig
from orchard.link import FleetLink, LinkConfig
from orchard.ops import ControlClient
from orchard.server.app import TierHandle, start_aggregator, start_root
from orchard.tasks import get_task
from orchard.typing import Role

FAST = ServerConfig(heartbeat_s=1.0, node_timeout_s=5.0, long_poll_s=2.0)


@dataclass
class Federation:
    root: TierHandle | None = None  # None when the root is a separate process
    aggregators: list[TierHandle] = field(default_factory=list)
    clients: list[ClientRuntime] = field(default_factory=list)
    client_tasks: list[asyncio.Task[None]] = field(default_factory=list)

    async def stop(self) -> None:
        for t in self.client_tasks:
            t.cancel()
        await asyncio.gather(*self.client_tasks, return_exceptions=True)
        for c in self.clients:
            await c.link.close()
        for a in reversed(self.aggregators):
            await a.stop(0.1)
        if self.root is not None:
            await self.root.stop(0.1)


def task_factory(num_partitions: int, task: str = "digits", **params: Any):
    t = get_task(task, **params)

    def make(partition: int):
        return lambda cfg: t.client_trainer(partition, num_partitions, cfg.seed)

    return make


async def add_clients(fed: Federation, target: str, partitions: list[int], num_partitions: int,
                      task: str = "digits", token: str | None = None, ca: Path | None = None,
                      insecure: bool = True, wrap: Any = None, max_backoff_s: float = 30.0,
                      task_params: dict[str, Any] | None = None) -> list[ClientRuntime]:
    """Clients for the given partitions; ``wrap(trainer)`` may decorate each trainer."""
    make = task_factory(num_partitions, task, **(task_params or {}))
    new = []
    for k in partitions:
        link = FleetLink(LinkConfig(target=target, role=Role.CLIENT, token=token, ca_cert=ca, insecure=insecure,
                                    node_id=f"client-{k}", max_backoff_s=max_backoff_s))
        factory = make(k)
        if wrap is not None:
            factory = (lambda f: lambda cfg: wrap(f(cfg)))(factory)
        # Rounding as the simulator rounds (from the training seed), so that a federation and
        # a simulation agree bit for bit; a deployed client rounds from OS entropy.
        rt = ClientRuntime(link, factory, partition_id=k, reproducible_rounding=True)
        fed.clients.append(rt)
        fed.client_tasks.append(asyncio.create_task(rt.run()))
        new.append(rt)
    return new


async def start_run(root: TierHandle, cfg: RunConfig, insecure: bool = True) -> str:
    blob = wire.arrays_to_blob(get_task(cfg.task, **cfg.task_params).initial_arrays(cfg.seed))
    ctl = ControlClient(root.address, admin_token=root.admin_token, ca_cert=root.ca_cert, insecure=insecure)
    try:
        return await asyncio.to_thread(ctl.start_run, cfg, blob)
    finally:
        ctl.close()


async def wait_status(root: TierHandle, pred, timeout: float = 120.0) -> dict[str, Any]:
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout
    st: dict[str, Any] = {}
    while loop.time() < end:
        st = root.runner.status() if root.runner else {}
        if pred(st):
            return st
        await asyncio.sleep(0.1)
    raise AssertionError(f"condition not met within {timeout}s; last status: {st}")


async def tree(tmp: Path, depth: int, clients_per_leaf: int, fanout: int = 1, seed: int = 0) -> Federation:
    """root -> `depth - 1` levels of aggregators (fanout each) -> clients under the leaves."""
    root = await start_root(tmp / "root", insecure=True, server_cfg=FAST, start_grace_s=0.5, seed=seed)
    fed = Federation(root)
    level = [root]
    for _ in range(depth - 1):
        nxt = []
        for parent in level:
            for _ in range(fanout):
                a = await start_aggregator(parent.address, insecure=True, server_cfg=FAST, seed=seed)
                fed.aggregators.append(a)
                nxt.append(a)
        level = nxt
    n = len(level) * clients_per_leaf
    k = 0
    for leaf in level:
        await add_clients(fed, leaf.address, list(range(k, k + clients_per_leaf)), n)
        k += clients_per_leaf
    return fed


async def wait_joined(tier: TierHandle, n: int, timeout: float = 30.0) -> None:
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout
    while tier.coordinator.capacity()[0] < n:
        if loop.time() > end:
            raise AssertionError(f"only {tier.coordinator.capacity()[0]} of {n} clients joined in {timeout}s")
        await asyncio.sleep(0.05)


class BackgroundRoot:
    """A root serving from its own event loop in a thread, for tests that speak to it
    synchronously (raw gRPC stubs, subprocess clients); ``insecure=False`` serves TLS."""

    def __init__(self, data_dir: Path, cfg: ServerConfig = FAST, start_grace_s: float = 0.1,
                 insecure: bool = True, **root_kw: Any) -> None:
        import threading

        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.root: TierHandle = self.call(start_root(data_dir, insecure=insecure, server_cfg=cfg,
                                                     start_grace_s=start_grace_s, **root_kw))

    def call(self, coro: Any, timeout: float = 60.0) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def stop(self) -> None:
        self.call(self.root.stop(0.1))
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)


def join_all(fleet: Any, ctl: ControlClient, nodes: list[str] | tuple[str, ...], timeout: float = 30.0) -> None:
    """Join ``nodes`` as clients through ``fleet`` (a raw stub, to any tier) and wait until
    the root counts every one of them."""
    import time

    from orchard.v1 import orchard_pb2 as pb

    for n in nodes:
        fleet.Join(pb.JoinRequest(node_id=n, role="client"))
    deadline = time.monotonic() + timeout
    while ctl.status().get("nodes", {}).get("clients_total", 0) < len(nodes):
        assert time.monotonic() < deadline, ctl.status()
        time.sleep(0.1)


def start_with_tasks(fleet: Any, ctl: ControlClient, nodes: list[str] | tuple[str, ...], cfg: RunConfig,
                     init: bytes) -> tuple[str, dict[str, Any]]:
    """Start a run while every node polls (:func:`poll_together`); the run id and each
    node's task, asserting that every node got one."""
    run: list[str] = []
    got = poll_together(fleet, nodes, lambda: run.append(ctl.start_run(cfg, init)), timeout=60)
    tasks = {n: wire.task_from_proto(r.task) for n, r in got.items() if r.WhichOneof("kind") == "task"}
    assert set(tasks) == set(nodes), got
    return run[0], tasks


def poll_together(fleet: Any, nodes: list[str] | tuple[str, ...], during: Any = None,
                  timeout: float = 30.0) -> dict[str, Any]:
    """Every node polls at once, on threads, as clients do (again after each Idle, until a
    task or ``timeout``); ``during()`` runs while they wait (a run's start). A round selects
    nodes waiting for work: a raw node that polls only after another's poll returned was
    not waiting when the round opened."""
    import time
    from concurrent.futures import ThreadPoolExecutor

    from orchard.v1 import orchard_pb2 as pb

    def poll(n: str) -> Any:
        end = time.monotonic() + timeout
        while True:
            r = fleet.Poll(pb.PollRequest(node_id=n, wait_s=10))
            if r.WhichOneof("kind") == "task" or time.monotonic() > end:
                return r

    with ThreadPoolExecutor(len(nodes)) as ex:
        futs = {n: ex.submit(poll, n) for n in nodes}
        if during is not None:
            time.sleep(0.2)  # the polls are in
            during()
        return {n: f.result() for n, f in futs.items()}
