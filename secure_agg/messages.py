"""Protocol messages: frozen dataclasses with a compact binary form.

A transport carries ``msg.to_bytes()`` opaquely and rebuilds it with :func:`decode` (or
``Class.from_bytes``). Layout, all integers big-endian::

    b"OSA" | version u8 | tag u8 | session_id (16 bytes) | round u64 | node (str) | body

where ``node`` is the sender of a client message and the recipient of a broadcast, a str
is ``u16 length + UTF-8``, bytes are ``u32 length + raw``, lists are ``u32 count + items``,
and a vector is ``u8 word size + u64 length + raw little-endian words`` (read back without
a copy). Anything that does not parse exactly, including trailing bytes, is refused with
:class:`~orchard.secure_agg.errors.MalformedMessage`.

Stages and the messages that drive them (Bonawitz et al., 2017, Fig. 2 / §4; Bell et
al., 2020, Alg. 2)::

    stage           server -> client (broadcast_for)   client -> server (receive)
    ADVERTISE_KEYS  SessionSetup                        AdvertiseKeys
    SHARE_KEYS      KeysBroadcast                       ShareKeys
    MASKED_INPUT    SharesBroadcast                     MaskedInput
    UNMASKING       UnmaskRequest                       UnmaskShares
"""

from __future__ import annotations

import functools
import struct
from abc import ABC, abstractmethod
from dataclasses import dataclass
from enum import StrEnum
from typing import ClassVar, TypeVar

import numpy as np

# The framing (writer, reader, node ids, pair lists) is written once in _framing; the
# names tests and callers have imported from here stay importable.
from orchard.secure_agg._framing import (
    _check_key,
    _key,
    _pair_list,
    _read_pairs,
    _Reader,
    _write_pairs,
    _Writer,
    encoded_id,
)
from orchard.secure_agg.crypto import KEY_BYTES
from orchard.secure_agg.errors import MalformedMessage, SecAggConfigError
from orchard.secure_agg.prg import word_dtype

MAGIC = b"OSA"
VERSION = 1
SESSION_ID_BYTES = 16
GRAPH_SEED_BYTES = 32

__all__ = [
    "AdvertiseKeys",
    "KeysBroadcast",
    "MaskedInput",
    "Message",
    "PeerKeys",
    "SessionConfig",
    "SessionSetup",
    "ShareKeys",
    "SharesBroadcast",
    "Stage",
    "UnmaskRequest",
    "UnmaskShares",
    "decode",
]


class Stage(StrEnum):
    """Where a session is. Client messages of a stage are accepted only in that stage."""

    ADVERTISE_KEYS = "advertise_keys"
    SHARE_KEYS = "share_keys"
    MASKED_INPUT = "masked_input"
    UNMASKING = "unmasking"
    DONE = "done"
    ABORTED = "aborted"


_M = TypeVar("_M", bound="Message")
_REGISTRY: dict[int, type[Message]] = {}


class Message(ABC):
    """Base of every protocol message: header handling and the tag registry; each
    message says whose it is and writes and reads its own body."""

    TAG: ClassVar[int]
    STAGE: ClassVar[Stage]
    session_id: bytes
    round_number: int

    def __init_subclass__(cls, **kwargs: object) -> None:
        super().__init_subclass__(**kwargs)
        if "TAG" in cls.__dict__:
            _REGISTRY[cls.TAG] = cls

    @property
    @abstractmethod
    def node(self) -> str:
        """The sender of a client message, the recipient of a broadcast."""

    @abstractmethod
    def _write(self, w: _Writer) -> None:
        """Write the body (everything after the common header)."""

    @classmethod
    @abstractmethod
    def _read(cls: type[_M], r: _Reader, session_id: bytes, round_number: int,
              node: str) -> _M:
        """Read the body written by :meth:`_write`."""

    def to_bytes(self) -> bytes:
        w = _header(self.TAG, self.session_id, self.round_number, self.node)
        self._write(w)
        return w.getvalue()

    @classmethod
    def from_bytes(cls: type[_M], data: bytes | bytearray | memoryview) -> _M:
        msg = decode(data)
        if not isinstance(msg, cls):
            raise MalformedMessage(f"expected a {cls.__name__}, got a {type(msg).__name__}")
        return msg


def _header(tag: int, session_id: bytes, round_number: int, node: str) -> _Writer:
    w = _Writer()
    w.raw(MAGIC)
    w.u8(VERSION)
    w.u8(tag)
    if len(session_id) != SESSION_ID_BYTES:
        raise MalformedMessage(f"session id is {SESSION_ID_BYTES} bytes, got {len(session_id)}")
    w.raw(session_id)
    w.u64(round_number)
    w.string(node)
    return w


_FIXED_HEADER = struct.Struct(f">3sBB{SESSION_ID_BYTES}sQ")  # magic, version, tag, session, round


def _read_header(r: _Reader) -> tuple[type[Message], bytes, int, str]:
    if len(r.buf) - r.pos < _FIXED_HEADER.size:
        if len(r.buf) - r.pos >= 3 and bytes(r.buf[r.pos:r.pos + 3]) != MAGIC:
            raise MalformedMessage("not a secure-aggregation message (bad magic)")
        r.take(_FIXED_HEADER.size)  # raises: message truncated
    magic, version, tag, session_id, round_number = _FIXED_HEADER.unpack_from(r.buf, r.pos)
    if magic != MAGIC:
        raise MalformedMessage("not a secure-aggregation message (bad magic)")
    if version != VERSION:
        raise MalformedMessage(f"message version {version}, this code speaks {VERSION}")
    cls = _REGISTRY.get(tag)
    if cls is None:
        raise MalformedMessage(f"unknown message tag {tag}")
    r.pos += _FIXED_HEADER.size
    return cls, session_id, round_number, r.string()


def decode(data: bytes | bytearray | memoryview) -> Message:
    """Parse any message (the tag says which)."""
    r = _Reader(data)
    cls, session_id, round_number, node = _read_header(r)
    msg = cls._read(r, session_id, round_number, node)
    r.end()
    return msg


@dataclass(frozen=True)
class PairColumns:
    """A ShareKeys or UnmaskShares message read without a tuple per pair (see
    :func:`decode_columns`): ``lists`` holds one (ids, blobs) per pair list of the message."""

    cls: type[Message]
    session_id: bytes
    round_number: int
    node: str
    lists: tuple[tuple[list[str], list[bytes]], ...]


def decode_columns(data: bytes | bytearray | memoryview) -> Message | PairColumns:
    """:func:`decode`, except that a ShareKeys or UnmaskShares message comes back as its
    pair lists in columns (what a server needs of the n k pairs of a stage). Refuses
    exactly what :func:`decode` refuses."""
    r = _Reader(data)
    cls, session_id, round_number, node = _read_header(r)
    if cls is ShareKeys or cls is UnmaskShares:
        lists = tuple(r.pair_columns(r.count(6)) for _ in range(1 if cls is ShareKeys else 2))
        r.end()
        return PairColumns(cls, session_id, round_number, node, lists)
    msg = cls._read(r, session_id, round_number, node)
    r.end()
    return msg


def as_columns(msg: Message) -> Message | PairColumns:
    """A message object in the form :func:`decode_columns` gives its bytes: ShareKeys and
    UnmaskShares as :class:`PairColumns`, any other message as it is."""
    if isinstance(msg, ShareKeys):
        lists: tuple[tuple[tuple[str, bytes], ...], ...] = (msg.ciphertexts,)
    elif isinstance(msg, UnmaskShares):
        lists = (msg.self_mask_shares, msg.mask_key_shares)
    else:
        return msg
    return PairColumns(type(msg), msg.session_id, msg.round_number, msg.node,
                       tuple(([a for a, _ in p], [b for _, b in p]) for p in lists))


def shares_broadcast_bytes(session_id: bytes, round_number: int, recipient: str,
                           sender_ids: list[bytes], ciphertexts: list[bytes]) -> bytes:
    """``SharesBroadcast(session_id, round_number, recipient, pairs).to_bytes()`` written
    straight from its columns: ``sender_ids`` are the senders in wire form (:func:`encoded_id`,
    made once per sender, not once per pair)."""
    w = _header(SharesBroadcast.TAG, session_id, round_number, recipient)
    w.raw(_pair_list(sender_ids, ciphertexts))
    return w.getvalue()


# --------------------------------------------------------------------------- session


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

    @classmethod
    def create(cls, participants: list[str] | tuple[str, ...], vector_length: int, *,
               neighbours: int, threshold: int, round_number: int, entropy: bytes,
               modulus_bits: int = 32) -> SessionConfig:
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
        )


@dataclass(frozen=True)
class SessionSetup(Message):
    """Server -> client, stage ADVERTISE_KEYS: the session parameters."""

    TAG: ClassVar[int] = 1
    STAGE: ClassVar[Stage] = Stage.ADVERTISE_KEYS
    recipient: str
    config: SessionConfig

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
                                   seed, length, bits)
        except SecAggConfigError as err:
            raise MalformedMessage(f"session setup is invalid: {'; '.join(err.problems)}") from None
        return cls(recipient=node, config=config)


@dataclass(frozen=True)
class AdvertiseKeys(Message):
    """Client -> server, stage ADVERTISE_KEYS: the two public keys (§4, round 0)."""

    TAG: ClassVar[int] = 2
    STAGE: ClassVar[Stage] = Stage.ADVERTISE_KEYS
    session_id: bytes
    round_number: int
    sender: str
    channel_pk: bytes
    mask_pk: bytes

    def __post_init__(self) -> None:
        _check_key("channel_pk", self.channel_pk)
        _check_key("mask_pk", self.mask_pk)

    @property
    def node(self) -> str:
        return self.sender

    def _write(self, w: _Writer) -> None:
        w.raw(self.channel_pk)
        w.raw(self.mask_pk)

    @classmethod
    def _read(cls, r: _Reader, session_id: bytes, round_number: int, node: str) -> AdvertiseKeys:
        return cls(session_id, round_number, node, _key(r), _key(r))


@dataclass(frozen=True)
class PeerKeys:
    node: str
    channel_pk: bytes
    mask_pk: bytes

    def __post_init__(self) -> None:
        # Checked here, once per peer: a server sends the same PeerKeys to k neighbours.
        _check_key("channel_pk", self.channel_pk)
        _check_key("mask_pk", self.mask_pk)

    @functools.cached_property
    def encoded(self) -> bytes:
        """This entry in wire form, encoded once: a server puts the same PeerKeys into k
        broadcasts (n k entries a session, each otherwise three writes)."""
        w = _Writer()
        w.string(self.node)
        w.raw(self.channel_pk)
        w.raw(self.mask_pk)
        return w.getvalue()


@dataclass(frozen=True)
class KeysBroadcast(Message):
    """Server -> client, stage SHARE_KEYS: public keys of the neighbours that advertised."""

    TAG: ClassVar[int] = 3
    STAGE: ClassVar[Stage] = Stage.SHARE_KEYS
    session_id: bytes
    round_number: int
    recipient: str
    keys: tuple[PeerKeys, ...]  # each checked when it was made (frozen since)

    @property
    def node(self) -> str:
        return self.recipient

    def _write(self, w: _Writer) -> None:
        w.u32(len(self.keys))
        w.raw(b"".join([k.encoded for k in self.keys]))

    @classmethod
    def _read(cls, r: _Reader, session_id: bytes, round_number: int, node: str) -> KeysBroadcast:
        n = r.count(2 + 2 * KEY_BYTES)
        keys = tuple(PeerKeys(r.string(), _key(r), _key(r)) for _ in range(n))
        return cls(session_id, round_number, node, keys)


@dataclass(frozen=True)
class ShareKeys(Message):
    """Client -> server, stage SHARE_KEYS: (recipient, AES-GCM ciphertext of the shares)."""

    TAG: ClassVar[int] = 4
    STAGE: ClassVar[Stage] = Stage.SHARE_KEYS
    session_id: bytes
    round_number: int
    sender: str
    ciphertexts: tuple[tuple[str, bytes], ...]

    @property
    def node(self) -> str:
        return self.sender

    def _write(self, w: _Writer) -> None:
        _write_pairs(w, self.ciphertexts)

    @classmethod
    def _read(cls, r: _Reader, session_id: bytes, round_number: int, node: str) -> ShareKeys:
        return cls(session_id, round_number, node, _read_pairs(r))


@dataclass(frozen=True)
class SharesBroadcast(Message):
    """Server -> client, stage MASKED_INPUT: (sender, ciphertext) addressed to the recipient."""

    TAG: ClassVar[int] = 5
    STAGE: ClassVar[Stage] = Stage.MASKED_INPUT
    session_id: bytes
    round_number: int
    recipient: str
    ciphertexts: tuple[tuple[str, bytes], ...]

    @property
    def node(self) -> str:
        return self.recipient

    def _write(self, w: _Writer) -> None:
        _write_pairs(w, self.ciphertexts)

    @classmethod
    def _read(cls, r: _Reader, session_id: bytes, round_number: int, node: str) -> SharesBroadcast:
        return cls(session_id, round_number, node, _read_pairs(r))


@dataclass(frozen=True, eq=False)
class MaskedInput(Message):
    """Client -> server, stage MASKED_INPUT: y_u = x_u + PRG(b_u) + sum_v +-PRG(s_uv) mod 2^b."""

    TAG: ClassVar[int] = 6
    STAGE: ClassVar[Stage] = Stage.MASKED_INPUT
    session_id: bytes
    round_number: int
    sender: str
    vector: np.ndarray

    def __post_init__(self) -> None:
        v = self.vector
        if v.ndim != 1 or v.dtype.kind != "u" or v.dtype.itemsize not in (4, 8):
            raise MalformedMessage(f"a masked input is a 1-d uint32/uint64 vector, got "
                                   f"{v.dtype} with shape {v.shape}")

    @property
    def node(self) -> str:
        return self.sender

    def _write(self, w: _Writer) -> None:
        v = np.ascontiguousarray(self.vector, dtype=self.vector.dtype.newbyteorder("<"))
        w.u8(v.dtype.itemsize)
        w.u64(v.size)
        w.raw(v.data.cast("B"))

    @classmethod
    def _read(cls, r: _Reader, session_id: bytes, round_number: int, node: str) -> MaskedInput:
        itemsize = r.u8()
        if itemsize not in (4, 8):
            raise MalformedMessage(f"vector word size must be 4 or 8 bytes, got {itemsize}")
        n = r.u64()
        if n > (len(r.buf) - r.pos) // itemsize:
            raise MalformedMessage(f"vector of {n} words cannot fit in the remaining bytes")
        raw = r.take(n * itemsize)
        vec = np.frombuffer(raw, dtype=word_dtype(32 if itemsize == 4 else 64), count=n)
        return cls(session_id, round_number, node, vec)


@dataclass(frozen=True)
class UnmaskRequest(Message):
    """Server -> client, stage UNMASKING: which neighbours survived and which dropped.

    The client reveals its share of b_u for each survivor u and its share of s_sk_u for
    each dropped u, never both for the same u (§4, round 4).
    """

    TAG: ClassVar[int] = 7
    STAGE: ClassVar[Stage] = Stage.UNMASKING
    session_id: bytes
    round_number: int
    recipient: str
    survivors: tuple[str, ...]
    dropped: tuple[str, ...]

    @property
    def node(self) -> str:
        return self.recipient

    def _write(self, w: _Writer) -> None:
        for group in (self.survivors, self.dropped):
            w.u32(len(group))
            w.raw(b"".join([encoded_id(s) for s in group]))

    @classmethod
    def _read(cls, r: _Reader, session_id: bytes, round_number: int, node: str) -> UnmaskRequest:
        survivors = tuple(r.strings(r.count(2)))
        dropped = tuple(r.strings(r.count(2)))
        return cls(session_id, round_number, node, survivors, dropped)


@dataclass(frozen=True)
class UnmaskShares(Message):
    """Client -> server, stage UNMASKING: (owner, share) of self-mask seeds and mask keys."""

    TAG: ClassVar[int] = 8
    STAGE: ClassVar[Stage] = Stage.UNMASKING
    session_id: bytes
    round_number: int
    sender: str
    self_mask_shares: tuple[tuple[str, bytes], ...]
    mask_key_shares: tuple[tuple[str, bytes], ...]

    @property
    def node(self) -> str:
        return self.sender

    def _write(self, w: _Writer) -> None:
        _write_pairs(w, self.self_mask_shares)
        _write_pairs(w, self.mask_key_shares)

    @classmethod
    def _read(cls, r: _Reader, session_id: bytes, round_number: int, node: str) -> UnmaskShares:
        return cls(session_id, round_number, node, _read_pairs(r), _read_pairs(r))
