"""What every part of the round engine reads: the run, its seeds and the clock.

The engine (``simulation.engine``) is a handful of parts, each owning one rule: the
tree, check-in, hand-out, arrivals, secure clients, shards, the buffered mode. They
share this one object rather than each a copy of the run's settings, so a change
between rounds (the round's config, the backend once the workers became shards) is
seen by all of them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from orchard.config import RunConfig, ServerConfig
from orchard.simulation.clock import VirtualTime
from orchard.simulation.config import AttackConfig
from orchard.simulation.population import Population
from orchard.tasks import Task


@dataclass(eq=False)
class Context:
    task: Task
    pop: Population
    run: RunConfig
    # Where clients train (a simulation.backends backend); with sharded rounds, the
    # engine's own clients train here (shards.Here) while each worker runs a shard.
    backend: Any
    seed: int
    time: VirtualTime
    # Liveness is modelled by the engine (a vanished device is silent), so tiers use the
    # configured timeout on the virtual clock; limits are the real defaults.
    server_cfg: ServerConfig
    codec: Any  # the run's codec (orchard.compression.build_codec)
    chunk_size: int
    workers: int
    governor: bool
    checkin_factor: float
    aggregator_mbps: float
    attack: AttackConfig | None
    run_id: str
    config_json: str  # the run's config as its round tasks carry it
    round_cfg: RunConfig  # this round's config: the run's, or with DP the ledger's
    # Where each simulated device keeps its own files (``device-<partition>``: a replay
    # buffer, a personal adapter); None: nowhere (no personal adapter kept between rounds).
    device_root: str | None = None
