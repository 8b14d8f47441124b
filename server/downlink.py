"""Model downlink at one tier: the full model, or a quantised delta from what a node holds.

The scheme is :mod:`orchard.compression.downlink`'s, made to run over the wire:

* The tier's global model stays exact. A node that holds model ``B`` (the previous
  global, or its own reconstruction of it) and asks for ``H`` may get ``Q(H - B)``
  instead of ``H``. It trains from ``R = B + decode(Q(H - B))`` and computes its update
  against ``R`` (``orchard.client.update.delta_of``), so the mean update the tier adds to
  the exact ``H`` is a mean of honest deltas, each measured from where its client began.
* Next round that node holds ``R``, and its delta is taken from ``R``: each delta re-sends
  what the previous one rounded away, so quantisation error never accumulates across
  versions. It is at most one delta's worth, at every round.
* The reply states the sha256 of ``R``'s blob. The node checks its own result against
  it, so a tampered or mis-decoded delta is refused and the node pulls the full model.

The tier remembers the blobs nodes may hold (previous exact globals and the
reconstructions it served), keyed by sha256, at most ``max_bases`` of them, least
recently used first out: memory is O(max_bases x model). A node whose base is not among
them gets the full model. Aggregators pull exact models (they serve them on under the
model's own hash) and serve deltas below them from their own bases, the same way.
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from concurrent.futures import Executor
from dataclasses import dataclass

import numpy as np

from orchard import wire
from orchard.compression import DOWNLINK_CODEC, encode_model_delta
from orchard.config import CodecSpec
from orchard.errors import OrchardError


@dataclass(frozen=True)
class ModelReply:
    """What PullModel streams: the full model, or a delta from ``delta_from``."""

    blob: bytes
    sha256: str  # of ``blob``
    target_hash: str  # the model asked for
    delta_from: str = ""  # empty: ``blob`` is the full model
    result_sha256: str = ""  # of the blob the node holds after applying the delta
    encoding: str = ""  # the delta codec as CodecSpec JSON

    @property
    def is_delta(self) -> bool:
        return bool(self.delta_from)


def full_reply(blob: bytes, model_hash: str) -> ModelReply:
    return ModelReply(blob=blob, sha256=model_hash, target_hash=model_hash)


def encode_delta_reply(base_blob: bytes, base_hash: str, target_blob: bytes, target_hash: str,
                       spec: CodecSpec = DOWNLINK_CODEC) -> tuple[ModelReply, bytes] | None:
    """The delta reply from base to target through ``spec`` (the run's
    ``downlink_codec``) and the reconstruction's blob; None when the full model is the
    better (or only) answer."""
    # In name order: a loaded blob's dict order varies from load to load, and the codec
    # draws its randomness tensor by tensor.
    base, target = (dict(sorted(wire.blob_to_arrays(b).items())) for b in (base_blob, target_blob))
    if any(v.dtype != np.float32 for v in target.values()):
        return None  # the reconstruction is float32; other dtypes would not survive it
    seed = wire.downlink_seed(base_hash)
    # Stochastic rounding draws from a generator fixed by (base, target): the same
    # request always gets the same delta, so a broken transfer resumes consistently.
    rng = np.random.default_rng([seed, wire.downlink_seed(target_hash)])
    try:
        md = encode_model_delta(base, target, rng, from_version=seed, spec=spec)
    except OrchardError:  # names or shapes changed between versions
        return None
    blob = wire.payloads_to_blob(md.payloads)
    if len(blob) >= len(target_blob):
        return None
    result = wire.arrays_to_blob(md.reconstructed)
    return ModelReply(blob=blob, sha256=wire.sha256_hex(blob), target_hash=target_hash, delta_from=base_hash,
                      result_sha256=wire.sha256_hex(result), encoding=spec.model_dump_json()), result


class DownlinkCache:
    """Bases a node may hold, and this round's replies per base (computed once each)."""

    def __init__(self, max_bases: int = 4) -> None:
        self.max_bases = max_bases
        self._bases: OrderedDict[str, bytes] = OrderedDict()
        self._target = ""
        self._replies: dict[str, ModelReply | None] = {}  # base hash -> reply (None: send the full model)
        self._lock = asyncio.Lock()

    def remember(self, blob_hash: str, blob: bytes) -> None:
        """A blob some node may hold from now on (a superseded global, a reconstruction)."""
        self._bases[blob_hash] = blob
        self._bases.move_to_end(blob_hash)
        while len(self._bases) > self.max_bases:
            self._bases.popitem(last=False)

    def knows(self, blob_hash: str) -> bool:
        return blob_hash in self._bases

    async def reply(self, target_blob: bytes, target_hash: str, have_hash: str, executor: Executor,
                    spec: CodecSpec = DOWNLINK_CODEC) -> ModelReply:
        full = full_reply(target_blob, target_hash)
        if have_hash == target_hash or have_hash not in self._bases:
            return full
        # One encode per (base, target), however many nodes ask at once.
        async with self._lock:
            if self._target != target_hash:
                self._target, self._replies = target_hash, {}
            if have_hash not in self._replies:
                base = self._bases.get(have_hash)
                if base is None:  # evicted while we waited
                    return full
                got = await asyncio.get_running_loop().run_in_executor(
                    executor, encode_delta_reply, base, have_hash, target_blob, target_hash, spec)
                self._store(have_hash, got)
            cached = self._replies[have_hash]
        return cached if cached is not None else full

    def reply_now(self, target_blob: bytes, target_hash: str, have_hash: str,
                  spec: CodecSpec = DOWNLINK_CODEC) -> ModelReply:
        """:meth:`reply` on the caller's thread, for tiers that run without an event loop
        (the simulator's). Not for use beside :meth:`reply`."""
        full = full_reply(target_blob, target_hash)
        if have_hash == target_hash or have_hash not in self._bases:
            return full
        if self._target != target_hash:
            self._target, self._replies = target_hash, {}
        if have_hash not in self._replies:
            self._store(have_hash, encode_delta_reply(self._bases[have_hash], have_hash, target_blob, target_hash,
                                                      spec))
        cached = self._replies[have_hash]
        return cached if cached is not None else full

    def _store(self, have_hash: str, got: tuple[ModelReply, bytes] | None) -> None:
        if got is None:
            self._replies[have_hash] = None
        else:
            reply, result = got
            self._replies[have_hash] = reply
            self.remember(reply.result_sha256, result)
        if have_hash in self._bases:
            self._bases.move_to_end(have_hash)
