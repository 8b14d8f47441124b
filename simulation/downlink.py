"""What a simulated device downloads for a round's model (``run.downlink_delta``).

A device keeps the model it last pulled; its tier replies with a delta from it when
that is smaller (``downlink.reply_now``, the gRPC tier's own), and the device rebuilds
the model with the client's ``apply_downlink_delta``. The servers' model stays exact; a
client trains from its reconstruction.
"""

from __future__ import annotations

from orchard import wire
from orchard.config import RunConfig
from orchard.simulation.tree import Tier
from orchard.typing import NDArrays
from orchard.wire import sha256_hex


class Downlink:
    """The model each device holds (sha256) and those models' blobs, pruned every round
    to what its tier can still delta from."""

    def __init__(self, run: RunConfig, leaves: list[Tier]) -> None:
        self._on = run.downlink_delta
        self._leaves = leaves
        self.held: dict[int, str] = {}
        self.held_blobs: dict[str, bytes] = {}

    def pull(self, leaf: Tier, device: int, blob: bytes,
             starts: dict[str, tuple[bytes, NDArrays]]) -> tuple[int, str]:
        """What a device downloads for the round's model, as ``FleetLink.pull_model`` with
        the hash it holds and the tier's ``model_reply``: (bytes sent, the start key).
        Each distinct reconstruction is rebuilt once per round (into ``starts``), with the
        client's ``apply_downlink_delta``, and checked against the hash the reply states."""
        assert leaf.cr is not None
        target = leaf.cr.task.model_hash
        if not self._on:
            return len(blob), ""
        have = self.held.get(device, "")
        spec = leaf.cr.task.config.downlink_codec
        reply = leaf.coord.downlink.reply_now(blob, target, have, spec) if have else None
        if reply is None or not reply.is_delta:
            self._hold(device, target, blob)
            return len(blob), ""
        key = reply.result_sha256
        if key not in starts:
            from orchard.client.runtime import apply_downlink_delta  # the client's own code

            rebuilt = apply_downlink_delta(self.held_blobs[have], reply.blob, have, reply.encoding)
            if sha256_hex(rebuilt) != key:
                # As the link does: a delta that does not rebuild the stated model is
                # dropped and the full model pulled.
                self._hold(device, target, blob)
                return len(reply.blob) + len(blob), ""
            starts[key] = (rebuilt, wire.blob_to_arrays(rebuilt))
        self._hold(device, key, starts[key][0])
        return len(reply.blob), key

    def _hold(self, device: int, model_hash: str, blob: bytes) -> None:
        self.held[device] = model_hash
        self.held_blobs.setdefault(model_hash, blob)

    def prune(self) -> None:
        """Forget what no tier can delta from any more: memory follows the devices of the
        last rounds, not the population."""
        if not self._on:
            return
        n = len(self._leaves)
        self.held = {d: h for d, h in self.held.items() if self._leaves[d % n].coord.downlink.knows(h)}
        used = set(self.held.values())
        self.held_blobs = {h: b for h, b in self.held_blobs.items() if h in used}
