"""The load benchmark's device generator (a child process of ``benchmarks/load.py``).

It plays N devices against one aggregator with the real client link
(:class:`orchard.link.FleetLink`), many device sessions multiplexed over a few TCP
connections (gRPC streams on shared HTTP/2 connections), as cheaply as it can so that
the aggregator, not the generator, bounds what is measured:

- every device joins, then long-polls for work, again and again (idle devices);
- a device that is handed a task heartbeats from then until its upload (every half a
  heartbeat period, as the client runtime does), pulls the model (a small one: the
  generator measures how many devices a tier holds, not bytes), and pushes its update,
  built by the client's own upload builder; the 16 distinct updates are built once.

It prints ``JOINED n`` when every device has joined (or failed to), then counts what it
does: polls answered (idle or with a task), heartbeats sent, tasks completed, failures
with their first message. ``STATS`` on stdin prints the counters as one JSON line;
``STOP`` ends it.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import sys
import time
from typing import Any

import numpy as np

from orchard import wire
from orchard.config import CodecSpec, CohortConfig, RunConfig

NUMEL = 4_810  # the digits MLP's size: a small model, so bytes do not bound the round
TENSOR = "w"
VARIANTS = 16


def initial_model() -> np.ndarray:
    return np.random.default_rng(1).standard_normal(NUMEL).astype(np.float32)


def model_blob() -> bytes:
    return wire.arrays_to_blob({TENSOR: initial_model()})


def delta_of(i: int) -> np.ndarray:
    """Device i's update: one of VARIANTS scaled copies of a fixed delta (a known mean)."""
    base = (np.random.default_rng(2).standard_normal(NUMEL) * 1e-3).astype(np.float32)
    return base * np.float32(1.0 + (i % VARIANTS) / VARIANTS)


def run_config(selected: int, rounds: int = 1) -> RunConfig:
    return RunConfig(task="digits", rounds=rounds, evaluate_every=0, codec=CodecSpec(name="float32"),
                     cohort=CohortConfig(target=selected, over_selection=1.0, min_fraction=1.0, deadline_s=300.0,
                                         max_retries=0, weighting="uniform"))


@dataclasses.dataclass
class Counters:
    joined: int = 0
    join_failed: int = 0
    polls: int = 0
    tasks: int = 0
    heartbeats: int = 0
    completed: int = 0
    failed: int = 0
    first_error: str = ""

    def fail(self, err: BaseException) -> None:
        self.failed += 1
        if not self.first_error:
            self.first_error = f"{type(err).__name__}: {err}"[:300]


class Uploads:
    """The VARIANTS uploads of a task, built once by the client's own upload builder."""

    def __init__(self) -> None:
        self._key: tuple[str, int, int] | None = None
        self._built: list[tuple[Any, bytes]] = []

    def get(self, i: int, node_id: str, t: Any) -> tuple[Any, bytes]:
        from orchard.client.update import build_upload
        from orchard.compression import build_codec
        from orchard.trainer import TrainResult

        if self._key != (t.run_id, t.round, t.attempt):
            cfg = RunConfig.model_validate_json(t.config_json)
            codec = build_codec(cfg.codec)
            result = TrainResult(arrays={}, weight=1.0, num_examples=1, num_steps=1)
            self._built = [build_upload(t, cfg, cfg.train, codec, "", {TENSOR: delta_of(k)}, result, seed=k,
                                        states=None)[:2] for k in range(VARIANTS)]
            self._key = (t.run_id, t.round, t.attempt)
        header, payload = self._built[i % VARIANTS]
        return dataclasses.replace(header, node_id=node_id, task_id=t.task_id), payload


async def _device(i: int, target: str, connection: int, c: Counters, uploads: Uploads, joined: asyncio.Queue,
                  stop: asyncio.Event) -> None:
    from orchard import link as link_mod
    from orchard.messages import TaskAssignment
    from orchard.typing import Role

    link = link_mod.FleetLink(link_mod.LinkConfig(
        target=target, role=Role.CLIENT, insecure=True, node_id=f"load-{i:06d}", max_backoff_s=5.0,
        channel_options=(("orchard.load.connection", connection),)))
    try:
        try:
            await link.join()
            c.joined += 1
        except Exception as err:
            c.join_failed += 1
            c.fail(err)
            return
        finally:
            joined.put_nowait(i)
        while not stop.is_set():
            got = await link.poll()
            c.polls += 1
            if not isinstance(got, TaskAssignment):
                continue
            c.tasks += 1

            async def beat(task_id: str = got.task_id) -> None:
                # As the client runtime does from the pull to the upload: every half a
                # heartbeat period (the period the tier gave at Join).
                while True:
                    await link.heartbeat(task_id, progress=0.5)
                    c.heartbeats += 1
                    await asyncio.sleep(max(0.5, link.heartbeat_s / 2))

            beats = asyncio.create_task(beat())
            try:
                await link.pull_model(got.model_hash)
                header, payload = uploads.get(i, link.node_id, got)
                await link.push_update(header, payload)
                c.completed += 1
            except Exception as err:  # counted; the device goes back to waiting, as a phone would
                c.fail(err)
            finally:
                beats.cancel()
    except asyncio.CancelledError:
        pass
    except Exception as err:
        c.fail(err)
    finally:
        await link.close()


async def _main(target: str, first: int, n: int, connections: int) -> None:
    c = Counters()
    uploads = Uploads()
    joined: asyncio.Queue[int] = asyncio.Queue()
    stop = asyncio.Event()
    tasks = []
    for k in range(n):
        i = first + k
        tasks.append(asyncio.create_task(_device(i, target, i % connections, c, uploads, joined, stop)))
        if k % 200 == 199:
            await asyncio.sleep(0.05)  # joins in waves: a fleet does not arrive in one millisecond
    for _ in range(n):
        await joined.get()
    print(f"JOINED {c.joined}", flush=True)
    loop = asyncio.get_running_loop()
    while True:
        line = (await loop.run_in_executor(None, sys.stdin.readline)).strip()
        if line == "STATS" or not line or line == "STOP":
            ru_cpu = time.process_time()
            print("STATS " + json.dumps({**dataclasses.asdict(c), "cpu_seconds": ru_cpu}), flush=True)
        if not line or line == "STOP":
            break
    stop.set()
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


def main(argv: list[str]) -> None:
    target, first, n, connections = argv[0], int(argv[1]), int(argv[2]), int(argv[3])
    asyncio.run(_main(target, first, n, connections))


if __name__ == "__main__":
    main(sys.argv[1:])
