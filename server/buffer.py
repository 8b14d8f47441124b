"""An asynchronous buffer as durable data: what a root journals after every fold.

In asynchronous mode (``[run.mode] kind = "async"``) the root acknowledges an update
only after the buffer that holds it is in the store, so a root killed at any point
restarts with every acknowledged update in its buffer, once. A :class:`BufferState`
is that record: the buffer's float64 weighted sum (lossless), its weight, count and
metric sums, the (node, task) pairs folded in (a retried upload of one of them is then
a duplicate, not a second update), the assignments still training (so their updates
are taken after the restart), the buffer's staleness histogram and the tier's counters.
Nothing here does I/O: the store keeps the bytes (``Store.save_buffer``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from orchard.aggregation import MetricSums, Partial
from orchard.aggregation.staleness import merge_histograms
from orchard.typing import TensorSpec
from orchard.updates import decode_partial, encode_partial


@dataclass(frozen=True)
class Held:
    """An assignment a node holds: its task id, the model version it trains on, its target,
    and the node's role and token hash (to register it again after a restart)."""

    node_id: str
    task_id: str
    round: int
    target: int
    role: str
    token_hash: str


@dataclass
class BufferState:
    round: int  # the buffer's round: it folds updates for the model of checkpoint round - 1
    seq: int  # folds the tier had made when this was taken: a newer state has a larger seq
    partial: Partial
    accepted: list[tuple[str, str]] = field(default_factory=list)
    held: list[Held] = field(default_factory=list)
    staleness: dict[int, int] = field(default_factory=dict)
    counters: dict[str, int] = field(default_factory=dict)

    def to_bytes(self) -> tuple[str, bytes]:
        """(state JSON, float64 sums): what ``Store.save_buffer`` keeps."""
        sums, sizes = encode_partial(self.partial.sums)
        meta: dict[str, Any] = {
            "round": self.round, "seq": self.seq, "weight": self.partial.weight, "count": self.partial.count,
            "metric_sums": self.partial.metrics.sums, "metric_weights": self.partial.metrics.weights,
            "sizes": list(sizes), "accepted": [list(a) for a in self.accepted],
            "held": [[h.node_id, h.task_id, h.round, h.target, h.role, h.token_hash] for h in self.held],
            "staleness": {str(k): v for k, v in self.staleness.items()}, "counters": self.counters,
        }
        return json.dumps(meta), sums

    @classmethod
    def from_bytes(cls, state_json: str, sums: bytes, schema: tuple[TensorSpec, ...]) -> BufferState:
        m = json.loads(state_json)
        arrays = {k: np.array(v, dtype=np.float64) for k, v in decode_partial(sums, schema, tuple(m["sizes"])).items()}
        p = Partial(sums=arrays, weight=float(m["weight"]), count=int(m["count"]),
                    metrics=MetricSums(dict(m["metric_sums"]), dict(m["metric_weights"])))
        return cls(round=int(m["round"]), seq=int(m["seq"]), partial=p,
                   accepted=[(a[0], a[1]) for a in m["accepted"]],
                   held=[Held(h[0], h[1], int(h[2]), int(h[3]), h[4], h[5]) for h in m["held"]],
                   staleness={int(k): int(v) for k, v in m["staleness"].items()},
                   counters={k: int(v) for k, v in m["counters"].items()})

    def absorb(self, other: BufferState) -> None:
        """Add ``other`` (a later buffer of the same run) into this one: sums, accepted,
        held (the later state wins for a node), histograms; counters are the later's."""
        p, q = self.partial, other.partial
        if q.count:
            for k, v in q.sums.items():
                p.sums[k] = p.sums[k] + v
            p.weight += q.weight
            p.count += q.count
            p.metrics.merge(q.metrics)
        self.accepted += [a for a in other.accepted if a not in self.accepted]
        held = {h.node_id: h for h in self.held}
        held.update({h.node_id: h for h in other.held})
        self.held = list(held.values())
        self.staleness = merge_histograms(self.staleness, other.staleness)
        self.counters = dict(other.counters)
        self.seq = max(self.seq, other.seq)
