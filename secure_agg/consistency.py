"""The consistency round of an active session (Bonawitz et al., 2017, §6, "ConsistencyCheck").

After the masked inputs are in, the server shows every client in U3 one view: the set U2
of clients whose shares were routed and the set U3 of clients whose masked inputs
arrived, as two bitmaps over the participant list. A client signs the view only if it
fits what it saw itself: it is in U3; every neighbour whose signed keys it accepted is in
U2 exactly when its shares came (so a shares broadcast that leaves out a neighbour that
shared is refused here, before anything is revealed); no neighbour is in U2 without
having advertised keys to it. It then reveals shares only under that same view, and only
when it holds valid signatures on it from at least t of its neighbours; which shares it
reveals it derives from the view itself (seed shares of neighbours in U3, key shares of
those in U2 but not U3), never from a list the server writes.

Why that stops a server that lies about dropouts: to unmask client A it needs t shares
of b_A, from neighbours that saw A in U3, and t shares of s_sk_p for each neighbour p A
masked with, from neighbours of p that saw p outside U3. A neighbour r of A revealing
b_A needs t signatures on its view from N(r); p's key revealers need t signatures from
N(p) on a view without p. If p is itself one of A's seed revealers, N(p) holds t
signers of each of two different views; honest clients sign one view, so 2t <= k + c
with c colluding clients in N(p), which the threshold rules out (2t - k > c; the
client's floor and bound (2) of :mod:`~orchard.secure_agg.params`). So no seed revealer
of A may be a key revealer's owner: at least t of A's k neighbours reveal b_A and at
least t others are p's A masked with, and 2t > k.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from orchard.secure_agg._framing import _Reader, _Writer
from orchard.secure_agg.errors import MalformedMessage
from orchard.secure_agg.messages import (
    ACTIVE_VERSION,
    SIGNATURE_BYTES,
    Broadcast,
    ClientMessage,
    SessionConfig,
    Stage,
)

__all__ = ["ConsistencyRequest", "ConsistencySignature", "View", "consistency_message"]

CONSISTENCY_DOMAIN = b"orchard-secagg/consistency/v2\x00"


@dataclass(frozen=True)
class View:
    """U2 and U3 as index sets over the participants; ``to_bytes`` is the signed form."""

    num_nodes: int
    u2: frozenset[int]
    u3: frozenset[int]

    def to_bytes(self) -> bytes:
        return _bits(self.u2, self.num_nodes) + _bits(self.u3, self.num_nodes)

    @classmethod
    def from_bytes(cls, raw: bytes, num_nodes: int) -> View:
        width = (num_nodes + 7) // 8
        if len(raw) != 2 * width:
            raise MalformedMessage(f"a survivor view of {num_nodes} nodes is {2 * width} bytes, got {len(raw)}")
        sets = []
        for part in (raw[:width], raw[width:]):
            bits = np.unpackbits(np.frombuffer(part, dtype=np.uint8), bitorder="little")
            if bits[num_nodes:].any():
                raise MalformedMessage("a survivor view names nodes beyond the participant list")
            sets.append(frozenset(np.flatnonzero(bits[:num_nodes]).tolist()))
        u2, u3 = sets
        if not u3 <= u2:
            raise MalformedMessage("a survivor view puts a node in U3 that is not in U2")
        return cls(num_nodes, u2, u3)


def _bits(members: Iterable[int], n: int) -> bytes:
    b = np.zeros(((n + 7) // 8) * 8, dtype=np.uint8)
    b[list(members)] = 1
    return np.packbits(b, bitorder="little").tobytes()


def consistency_message(cfg: SessionConfig, view: bytes) -> bytes:
    """What a client signs in the consistency round (the view under this session's config)."""
    return CONSISTENCY_DOMAIN + cfg.digest + view


@dataclass(frozen=True)
class ConsistencyRequest(Broadcast):
    """Server -> client, stage CONSISTENCY: the view (U2, U3) to sign."""

    TAG: ClassVar[int] = 9
    STAGE: ClassVar[Stage] = Stage.CONSISTENCY
    VERSIONS: ClassVar[tuple[int, ...]] = (ACTIVE_VERSION,)
    view: bytes

    def _write(self, w: _Writer) -> None:
        w.u32(len(self.view))
        w.raw(self.view)

    @classmethod
    def _read(cls, r: _Reader, session_id: bytes, round_number: int, node: str) -> ConsistencyRequest:
        return cls(session_id, round_number, node, r.fixed(r.count(1)))


@dataclass(frozen=True)
class ConsistencySignature(ClientMessage):
    """Client -> server, stage CONSISTENCY: the sender's signature over the view it was shown."""

    TAG: ClassVar[int] = 10
    STAGE: ClassVar[Stage] = Stage.CONSISTENCY
    VERSIONS: ClassVar[tuple[int, ...]] = (ACTIVE_VERSION,)
    signature: bytes

    def __post_init__(self) -> None:
        if len(self.signature) != SIGNATURE_BYTES:
            raise MalformedMessage(f"a signature is {SIGNATURE_BYTES} bytes, got {len(self.signature)}")

    def _write(self, w: _Writer) -> None:
        w.raw(self.signature)

    @classmethod
    def _read(cls, r: _Reader, session_id: bytes, round_number: int, node: str) -> ConsistencySignature:
        return cls(session_id, round_number, node, r.fixed(SIGNATURE_BYTES))
