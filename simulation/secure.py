"""Secure aggregation of one lowest-tier cohort, in-process (SecAgg+, ``orchard.secure_agg``).

The coordinator has no secure-aggregation upload kind yet, so the simulator is the
transport here, as a real tier would be: it moves each stage's messages, as bytes,
between the cohort's :class:`SecAggClient` state machines and one :class:`SecAggServer`,
and the tier learns only the cohort's sum.

What a client masks. Its upload is built as a real client builds it (``build_upload``:
the run's codec, the header with its weight); a field-linear codec's payloads add, so
the client maps its own payload back to the values the codec carries
(``decode_update``) and puts ``(w / w_scale) * values`` into the field with
``secure_agg.quantize`` (clip and bits from the run's ``secure_aggregation``). The
weights travel in the clear, as every header's do; ``w_scale`` is a public constant
(the largest client dataset), so the scaled values stay inside the clip. The server
unmasks the sum, dequantises it with the number of contributors and multiplies by
``w_scale``: ``sum_u w_u * values_u``, the cohort's partial sum, which goes up the
tree as a PARTIAL_SUM like any other.

Who drops out. Every selected client takes part in the key stages; clients that are
late for the cohort's close, or that vanished, send no masked input and are dropped
from the sum (the protocol's dropout path recovers their pairwise masks).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from orchard.aggregation import MetricSums, Partial
from orchard.compression import Codec, decode_update
from orchard.config import SecureAggregationConfig
from orchard.messages import UploadHeader
from orchard.secure_agg import (
    SecAggClient,
    SecAggServer,
    SessionConfig,
    Stage,
    check_headroom,
    decode,
    dequantize,
    parameters_from_config,
    quantize,
)
from orchard.typing import TensorSpec
from orchard.updates import split

_STAGES = (Stage.ADVERTISE_KEYS, Stage.SHARE_KEYS, Stage.MASKED_INPUT, Stage.UNMASKING)


def _entropy(*parts: object) -> bytes:
    # Deterministic per (run seed, round, node): the same seed replays the same session.
    return hashlib.sha256("/".join(str(p) for p in parts).encode()).digest()


@dataclass
class CohortResult:
    partial: Partial
    bytes_up: int
    bytes_down: int
    dropped: int
    measurements: dict[str, float] = field(default_factory=dict)


def cohort_sum(cfg: SecureAggregationConfig, codec: Codec, schema: Sequence[TensorSpec], shared_seed: int,
               participants: Sequence[str], uploads: dict[str, tuple[UploadHeader, bytes]],
               w_scale: float, round_number: int, seed: int) -> CohortResult:
    """Run one SecAgg+ session over ``participants``; ``uploads`` are the ones that made it."""
    ids = sorted(participants)
    d = sum(s.numel for s in schema)
    params = parameters_from_config(cfg, len(ids))
    check_headroom(len(ids), cfg.bits, cfg.modulus_bits)
    session = SessionConfig.create(ids, d, neighbours=params.neighbours, threshold=params.threshold,
                                   round_number=round_number, entropy=_entropy(seed, round_number, "session"),
                                   modulus_bits=cfg.modulus_bits)
    server = SecAggServer(session)
    clients = {p: SecAggClient(p, entropy=_entropy(seed, round_number, p)) for p in ids}
    shapes = {s.name: tuple(s.shape) for s in schema}
    up = down = 0
    for stage in _STAGES:
        for node in sorted(server.pending()):
            if stage in (Stage.MASKED_INPUT, Stage.UNMASKING) and node not in uploads:
                continue  # late or gone: silent from here on
            bcast = server.broadcast_for(node).to_bytes()
            down += len(bcast)
            vector = None
            if stage is Stage.MASKED_INPUT:
                h, payload = uploads[node]
                parts = dict(zip(shapes, split(payload, h.payload_sizes), strict=True))
                values = decode_update(codec, parts, shapes, num_summands=1, shared_seed=shared_seed)
                flat = np.concatenate([np.asarray(values[k], np.float64).ravel() for k in shapes])
                rng = np.random.default_rng([seed, round_number, int(hashlib.sha256(node.encode()).hexdigest()[:8], 16)])
                vector = quantize(flat * (h.weight / w_scale), cfg.clip, cfg.bits, rng)
            reply = clients[node].respond(decode(bcast), vector).to_bytes()
            up += len(reply)
            server.receive(stage, node, reply)
        server.close_stage()
    res = server.result()
    n = len(res.contributors)
    total = dequantize(res.total, cfg.clip, cfg.bits, n) * w_scale
    sums, off = {}, 0
    for s in schema:
        sums[s.name] = total[off:off + s.numel].reshape(s.shape)
        off += s.numel
    metrics = MetricSums()
    weight = 0.0
    for node in res.contributors:
        h = uploads[node][0]
        weight += h.weight
        metrics.merge(MetricSums(dict(h.metric_sums), dict(h.metric_weights)))
    partial = Partial(sums=sums, weight=weight, count=n, metrics=metrics)
    return CohortResult(partial, up, down, len(res.dropped), dict(res.measurements))
