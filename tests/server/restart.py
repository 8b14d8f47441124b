"""A root restarted over a store, as ``orchard server start`` does after a crash: a fresh
root coordinator and runner that resume from the store, then close."""

from __future__ import annotations

import asyncio
from pathlib import Path

import numpy as np

from orchard.config import ServerConfig
from orchard.server.coordinator import Coordinator
from orchard.server.decoding import ClientUpdateDecoder
from orchard.server.root import RootRunner
from orchard.server.store import Store


def resume_root(store: Store, data_dir: Path) -> tuple[Coordinator, RootRunner]:
    """The coordinator and runner after ``resume()`` and ``close()`` (their state is what a
    restarted root would serve from)."""
    coord = Coordinator("root", ServerConfig(), np.random.default_rng(0), ClientUpdateDecoder())
    runner = RootRunner(coord, store, data_dir, ServerConfig())

    async def go() -> None:
        await runner.resume()
        await runner.close()

    asyncio.run(go())
    return coord, runner
