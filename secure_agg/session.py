"""What all parties agree on before a session's first stage (:class:`SessionConfig`) and
the message that hands it out (:class:`SessionSetup`, stage ADVERTISE_KEYS)."""

from __future__ import annotations

import functools
import hashlib
from dataclasses import dataclass
from typing import ClassVar

from orchard.secure_agg._framing import _Reader, _Writer
from orchard.secure_agg.errors import MalformedMessage, SecAggConfigError
from orchard.secure_agg.messages import (
    ACTIVE_VERSION,
    GRAPH_SEED_BYTES,
    MAGIC,
    SESSION_ID_BYTES,
    VERSION,
    Message,
    Stage,
)

__all__ = ["SessionConfig", "SessionSetup"]



@dataclass(frozen=True)
class SessionConfig:
    """Everything all parties must agree on before the first stage.

    ``participants`` is sorted; a node's index in it is its graph vertex and its Shamir
    evaluation point is index + 1. The coordinator draws ``session_id`` and
    ``graph_seed`` fresh for every session (see :meth:`create`).
    """

    session_id: bytes
    round_number: int
    participants: tuple[str, ...]
    neighbours: int
    threshold: int
    graph_seed: bytes
    vector_length: int
    modulus_bits: int = 32
    # Run against an active adversary (Bonawitz et al., 2017, §6): signed keys, the
    # consistency round, verified shares. False: the semi-honest protocol (version 1).
    active: bool = True

    def __post_init__(self) -> None:
        problems = []
        n = len(self.participants)
        if len(self.session_id) != SESSION_ID_BYTES:
            problems.append(f"session_id must be {SESSION_ID_BYTES} bytes, got {len(self.session_id)}")
        if len(self.graph_seed) != GRAPH_SEED_BYTES:
            problems.append(f"graph_seed must be {GRAPH_SEED_BYTES} bytes, got {len(self.graph_seed)}")
        if tuple(sorted(set(self.participants))) != self.participants:
            problems.append("participants must be sorted and distinct")
        if n < 2:
            problems.append(f"need at least 2 participants, got {n}")
        elif not 1 <= self.neighbours <= n - 1:
            problems.append(f"neighbours must be in 1..{n - 1}, got {self.neighbours}")
        elif not self.neighbours // 2 < self.threshold <= self.neighbours:
            problems.append(f"threshold must be in {self.neighbours // 2 + 1}..{self.neighbours} "
                            f"(a strict majority of the neighbours), got {self.threshold}")
        if self.vector_length < 0:
            problems.append(f"vector_length must be >= 0, got {self.vector_length}")
        if not 1 <= self.modulus_bits <= 64:
            problems.append(f"modulus_bits must be in 1..64, got {self.modulus_bits}")
        if self.round_number < 0:
            problems.append(f"round_number must be >= 0, got {self.round_number}")
        if problems:
            raise SecAggConfigError(problems)

    @functools.cached_property
    def encoded_participants(self) -> bytes:
        """The participant list in wire form, encoded once (it goes to every client)."""
        w = _Writer()
        w.u32(len(self.participants))
        for p in self.participants:
            w.string(p)
        return w.getvalue()

    @functools.cached_property
    def digest(self) -> bytes:
        """SHA-256 of everything in the config: what a client signs its keys and its
        survivor view under, so a signature made for one session binds nowhere else."""
        return hashlib.sha256(SessionSetup("", self).to_bytes()[len(MAGIC):]).digest()

    @classmethod
    def create(cls, participants: list[str] | tuple[str, ...], vector_length: int, *,
               neighbours: int, threshold: int, round_number: int, entropy: bytes,
               modulus_bits: int = 32, active: bool = True) -> SessionConfig:
        """A config with session id and graph seed derived from ``entropy`` (>= 32 bytes).

        ``entropy`` must be fresh and unpredictable per session (e.g. ``secrets.token_bytes``):
        session ids keep keys and ciphertexts of different sessions apart.
        """
        from orchard.secure_agg.crypto import hkdf

        if len(entropy) < 32:
            raise SecAggConfigError(f"entropy must be at least 32 bytes, got {len(entropy)}")
        return cls(
            session_id=hkdf(entropy, b"session-id", SESSION_ID_BYTES),
            round_number=round_number,
            participants=tuple(sorted(participants)),
            neighbours=neighbours,
            threshold=threshold,
            graph_seed=hkdf(entropy, b"graph-seed", GRAPH_SEED_BYTES),
            vector_length=vector_length,
            modulus_bits=modulus_bits,
            active=active,
        )


@dataclass(frozen=True)
class SessionSetup(Message):
    """Server -> client, stage ADVERTISE_KEYS: the session parameters."""

    TAG: ClassVar[int] = 1
    STAGE: ClassVar[Stage] = Stage.ADVERTISE_KEYS
    VERSIONS: ClassVar[tuple[int, ...]] = (VERSION, ACTIVE_VERSION)
    recipient: str
    config: SessionConfig

    @property
    def version(self) -> int:
        return ACTIVE_VERSION if self.config.active else VERSION

    @property
    def session_id(self) -> bytes:  # type: ignore[override]
        return self.config.session_id

    @property
    def round_number(self) -> int:  # type: ignore[override]
        return self.config.round_number

    @property
    def node(self) -> str:
        return self.recipient

    def _write(self, w: _Writer) -> None:
        c = self.config
        w.raw(c.encoded_participants)
        w.u32(c.neighbours)
        w.u32(c.threshold)
        w.raw(c.graph_seed)
        w.u64(c.vector_length)
        w.u8(c.modulus_bits)

    @classmethod
    def _read(cls, r: _Reader, session_id: bytes, round_number: int, node: str) -> SessionSetup:
        participants = tuple(r.strings(r.count(2)))
        neighbours, threshold = r.u32(), r.u32()
        seed = r.fixed(GRAPH_SEED_BYTES)
        length, bits = r.u64(), r.u8()
        try:
            config = SessionConfig(session_id, round_number, participants, neighbours, threshold,
                                   seed, length, bits, r.version == ACTIVE_VERSION)
        except SecAggConfigError as err:
            raise MalformedMessage(f"session setup is invalid: {'; '.join(err.problems)}") from None
        return cls(recipient=node, config=config)


