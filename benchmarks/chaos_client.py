"""The chaos run's client process: Orchard's real client runtime (join, long poll, model
pull, ``build_upload``, upload or SecAgg+ session) with a trainer whose update names the
upload it belongs to.

Client ``i``'s ``s``-th upload is the one-hot vector ``e[i * SLOTS + s]`` of the model's
single tensor ``count``: every upload has a coordinate of its own, so a recorded
aggregate (``Σ w·x``, weight 1 each) says, coordinate by coordinate, how many times each
upload was counted. ``s`` is kept in the client's state dir and moved on *before* the
upload is built, so an upload of a killed and restarted client never reuses a coordinate.

Every task's end is one JSON line appended to ``--log`` (one ``write`` of the whole line:
a kill -9 leaves whole lines): the upload's coordinate, its (run, round, attempt, task),
whether the tier acknowledged it, and when. Before each phase the client also writes a
``phase`` line, so the driver can say what a client was doing when it killed it.

    python benchmarks/chaos_client.py --server HOST:PORT --node-id c-3 --index 3 --state DIR --log FILE
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import time
from pathlib import Path

import numpy as np

from orchard.client.runtime import ClientRuntime
from orchard.config import RunConfig
from orchard.files import atomic_write
from orchard.link import FleetLink, LinkConfig
from orchard.messages import Idle, TaskAssignment
from orchard.trainer import TrainResult
from orchard.typing import Role

SLOTS = 2048  # coordinates per client: uploads one client can make in a run before they wrap
TENSOR = "count"


def initial_model(clients: int) -> dict[str, np.ndarray]:
    return {TENSOR: np.zeros(clients * SLOTS, np.float32)}


class EventLog:
    """Whole JSON lines appended with one ``write`` each (O_APPEND)."""

    def __init__(self, path: Path) -> None:
        self.fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)

    def write(self, **event: object) -> None:
        os.write(self.fd, (json.dumps({"t": time.time(), **event}) + "\n").encode())


class CountingTrainer:
    """Puts 1 at this upload's own coordinate, after ``train_s`` seconds of "training"."""

    def __init__(self, index: int, state: Path, log: EventLog, train_s: float) -> None:
        self.index, self.state, self.log, self.train_s = index, state, log, train_s
        self.seq_file = state / "upload-seq"
        self.last_seq = -1
        self.task: TaskAssignment | None = None

    def _next_seq(self) -> int:
        seq = int(self.seq_file.read_text()) if self.seq_file.is_file() else 0
        atomic_write(self.seq_file, str(seq + 1).encode())  # moved on before the upload exists
        return seq

    def train(self, arrays, config) -> TrainResult:
        seq = self._next_seq()
        if seq >= SLOTS:
            raise RuntimeError(f"client {self.index} made {SLOTS} uploads; raise SLOTS for a longer run")
        self.last_seq = seq
        self.log.write(event="phase", phase="training", seq=seq)
        time.sleep(self.train_s)
        out = {k: np.array(v, np.float32, copy=True) for k, v in arrays.items()}
        out[TENSOR][self.index * SLOTS + seq] += np.float32(1.0)
        self.log.write(event="phase", phase="uploading", seq=seq)
        return TrainResult(arrays=out, weight=1.0, num_examples=1, num_steps=1, metrics={})

    def evaluate(self, arrays, config):  # pragma: no cover - the chaos run never evaluates
        return {}


async def serve(args: argparse.Namespace) -> None:
    state = Path(args.state)
    state.mkdir(parents=True, exist_ok=True)
    log = EventLog(Path(args.log))
    trainer = CountingTrainer(args.index, state, log, args.train_s)
    link = FleetLink(LinkConfig(target=args.server, role=Role.CLIENT, insecure=True, node_id=args.node_id,
                                max_backoff_s=1.0))
    rt = ClientRuntime(link, lambda cfg: trainer, partition_id=args.index, state_dir=state)
    log.write(event="phase", phase="joining")
    await link.join(rt.device())
    lost: set[str] = set()  # secure tasks whose session failed here: they cannot be joined again
    while True:
        log.write(event="phase", phase="polling")
        got = await link.poll(rt.device())
        if isinstance(got, Idle):
            if got.retry_after_s > 0:
                await asyncio.sleep(got.retry_after_s)
            continue
        if got.task_id in lost:
            await asyncio.sleep(0.5)
            continue
        trainer.last_seq = -1
        log.write(event="phase", phase="pulling")
        rep = await rt.do_task(got)
        if not rep.accepted and RunConfig.model_validate_json(got.config_json).secure_aggregation.enabled:
            lost.add(got.task_id)
        log.write(event="upload", node=args.node_id, index=args.index, seq=trainer.last_seq, run=got.run_id,
                  round=got.round, attempt=got.attempt, task=got.task_id, accepted=rep.accepted,
                  reason=rep.reason[:200])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--server", required=True)
    ap.add_argument("--node-id", required=True)
    ap.add_argument("--index", type=int, required=True)
    ap.add_argument("--state", required=True)
    ap.add_argument("--log", required=True)
    ap.add_argument("--train-s", type=float, default=0.3)
    asyncio.run(serve(ap.parse_args()))


if __name__ == "__main__":
    main()
