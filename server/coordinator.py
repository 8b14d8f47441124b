"""The coordinator's old address: the tier now lives in ``orchard.server.tier`` (one
file per rule, see ``orchard.server.tier.coordinator``). Importers keep working."""

from orchard.server.tier import (
    Child,
    ClientDecoder,
    Coordinator,
    ParentUpstream,
    Upload,
    UploadSlot,
    run_inline,
)

__all__ = ["Child", "ClientDecoder", "Coordinator", "ParentUpstream", "Upload", "UploadSlot", "run_inline"]
