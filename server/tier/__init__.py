"""The tier: the coordinator every root and aggregator runs, and its sibling protocols
(see ``coordinator.py`` for which file owns which rule)."""

from orchard.server.tier.coordinator import ClientDecoder, Coordinator
from orchard.server.tier.executor import InlineExecutor, PooledExecutor, run_inline
from orchard.server.tier.registry import Child
from orchard.server.tier.relay import ParentUpstream
from orchard.server.tier.uploads import Upload, UploadSlot

__all__ = ["Child", "ClientDecoder", "Coordinator", "InlineExecutor", "ParentUpstream", "PooledExecutor",
           "Upload", "UploadSlot", "run_inline"]
