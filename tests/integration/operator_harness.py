"""A TLS root with clients in a background thread, that operator commands talk to."""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path
from typing import Any

from fed_harness import FAST, Federation, add_clients

from orchard import wire
from orchard.config import CohortConfig, RunConfig
from orchard.ops import ControlClient
from orchard.server.app import TierHandle, start_aggregator, start_root
from orchard.tasks import get_task
from orchard.trainer import TrainConfig


class LiveRoot:
    """A root over TLS (admin token, enrollment tokens) serving from its own event loop."""

    def __init__(self, data_dir: Path, clients: int = 3, aggregators: int = 0, **root_kw: Any) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.data_dir = data_dir
        self.root: TierHandle = self.call(start_root(data_dir, server_cfg=FAST, start_grace_s=0.1, **root_kw))
        self.address = self.root.address
        self.admin = (data_dir / "admin.token").read_text().strip()
        self.ca = data_dir / "tls" / "ca.pem"
        self.fed = Federation()
        assert self.root.store is not None
        token = self.root.store.issue_token("client")
        agg_token = self.root.store.issue_token("aggregator")

        async def join() -> None:
            targets = [self.address]
            for i in range(aggregators):
                a = await start_aggregator(self.address, token=agg_token, ca_cert=self.ca, tls_dir=data_dir / "tls",
                                           node_id=f"aggregator-{i}", server_cfg=FAST)
                self.fed.aggregators.append(a)
            if self.fed.aggregators:
                targets = [a.address for a in self.fed.aggregators]
            for k in range(clients):
                await add_clients(self.fed, targets[k % len(targets)], [k], clients, token=token, ca=self.ca,
                                  insecure=False)

        self.call(join())
        with self.control() as ctl:
            end = time.monotonic() + 60
            while ctl.status()["nodes"]["clients_total"] < clients:
                if time.monotonic() > end:
                    raise AssertionError("clients did not join")
                time.sleep(0.05)

    def control(self) -> ControlClient:
        return ControlClient(self.address, admin_token=self.admin, ca_cert=self.ca)

    def cli(self) -> list[str]:
        return ["--server", self.address, "--admin-token", self.admin, "--ca-cert", str(self.ca)]

    def start_run(self, rounds: int = 2, target: int = 3) -> str:
        cfg = RunConfig(task="digits", rounds=rounds, train=TrainConfig(epochs=1, learning_rate=0.2, batch_size=16),
                        cohort=CohortConfig(target=target, over_selection=1.0, min_fraction=0.5, deadline_s=60))
        with self.control() as ctl:
            return ctl.start_run(cfg, wire.arrays_to_blob(get_task("digits").initial_arrays(0)))

    def wait(self, run_id: str, pred: Any, timeout: float = 120.0) -> dict[str, Any]:
        end = time.monotonic() + timeout
        with self.control() as ctl:
            while True:
                st = ctl.status(run_id)
                if pred(st):
                    return st
                if time.monotonic() > end:
                    raise AssertionError(f"condition not met in {timeout}s; status {st}")
                time.sleep(0.1)

    def call(self, coro: Any, timeout: float = 60.0) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def stop(self) -> None:
        self.call(self.fed.stop())
        self.call(self.root.stop(0.1))
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)
