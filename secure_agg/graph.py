"""The neighbour graph of SecAgg+ (Bell et al., 2020, §3.1 and §4): a Harary graph
H(n, k) whose vertices are relabelled by a random permutation.

H(n, k) for even k puts the n nodes on a ring and joins each node to the k/2 nearest on
either side. With a uniformly random relabelling, the set of dropped or corrupt nodes is
a random set along the ring, and the surviving honest nodes stay connected unless k/2
consecutive ring positions are all lost (the bound used in
:func:`orchard.secure_agg.params.choose_parameters`). k >= n - 1 is the complete graph:
the original protocol of Bonawitz et al. (2017).

The permutation is derived from a public 32-byte seed with AES-CTR and a stable sort, not
from numpy's Generator, so every party computes the same graph whatever its numpy
version.
"""

from __future__ import annotations

import numpy as np

from orchard.secure_agg.errors import SecAggConfigError
from orchard.secure_agg.prg import ByteStream

__all__ = ["NeighbourGraph"]


class NeighbourGraph:
    """Neighbourhoods over participant indices 0..n-1 (indices into the sorted id list)."""

    def __init__(self, num_nodes: int, degree: int, seed: bytes) -> None:
        if num_nodes < 2:
            raise SecAggConfigError(f"secure aggregation needs at least 2 participants, got {num_nodes}")
        if not 1 <= degree <= num_nodes - 1:
            raise SecAggConfigError(f"neighbours k must be in 1..{num_nodes - 1}, got {degree}")
        if degree < num_nodes - 1 and degree % 2:
            raise SecAggConfigError(
                f"neighbours k={degree} is odd: the Harary graph needs an even k "
                f"(or k = n - 1 = {num_nodes - 1} for the complete graph)"
            )
        if len(seed) != 32:
            raise SecAggConfigError(f"the graph seed is 32 bytes, got {len(seed)}")
        self.num_nodes = num_nodes
        self.degree = degree
        self.complete = degree == num_nodes - 1
        if self.complete:
            self._ring = np.arange(num_nodes)
        else:
            keys = np.frombuffer(ByteStream(seed).read(8 * num_nodes), dtype="<u8")
            self._ring = np.argsort(keys, kind="stable")  # ring position -> node
        self._pos = np.empty(num_nodes, dtype=np.int64)
        self._pos[self._ring] = np.arange(num_nodes)  # node -> ring position
        half = degree // 2
        self._offsets = np.concatenate([np.arange(1, half + 1), -np.arange(1, half + 1)])

    def neighbours(self, node: int) -> frozenset[int]:
        """The k neighbours of ``node`` (never ``node`` itself)."""
        if not 0 <= node < self.num_nodes:
            raise IndexError(node)
        if self.complete:
            return frozenset(range(self.num_nodes)) - {node}
        ring_pos = (self._pos[node] + self._offsets) % self.num_nodes
        return frozenset(int(v) for v in self._ring[ring_pos])

    def adjacency(self) -> list[frozenset[int]]:
        return [self.neighbours(i) for i in range(self.num_nodes)]

