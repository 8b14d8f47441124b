"""Protocol messages: frozen dataclasses with a compact binary form.

A transport carries ``msg.to_bytes()`` opaquely and rebuilds it with :func:`decode` (or
``Class.from_bytes``). Layout, all integers big-endian::

    b"OSA" | version u8 | tag u8 | session_id (16 bytes) | round u64 | node (str) | body

Version 1 is the semi-honest protocol; version 2 marks the messages of a session run
against an active adversary (``SessionConfig.active``): a session setup that says so,
signed keys with their certificates and commitments, the consistency round
(:mod:`~orchard.secure_agg.consistency`) and an unmask request that carries the signed
survivor view. The other messages have one form, version 1, in both.

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
from typing import Any, ClassVar, TypeVar

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
from orchard.secure_agg.errors import MalformedMessage
from orchard.secure_agg.prg import word_dtype

MAGIC = b"OSA"
VERSION = 1  # the semi-honest protocol's messages
ACTIVE_VERSION = 2  # the messages that differ in a session against an active adversary
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
    CONSISTENCY = "consistency"  # between MASKED_INPUT and UNMASKING, active sessions only
    DONE = "done"
    ABORTED = "aborted"


_M = TypeVar("_M", bound="Message")
_REGISTRY: dict[int, type[Message]] = {}


class Message(ABC):
    """Base of every protocol message: header handling and the tag registry; each
    message says whose it is and writes and reads its own body."""

    TAG: ClassVar[int]
    STAGE: ClassVar[Stage]
    VERSIONS: ClassVar[tuple[int, ...]] = (VERSION,)  # the header versions it has a form in
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

    @property
    def version(self) -> int:
        """The header version this message is written with (2: its active-session form);
        a message with one form is written in it, one with two says which."""
        return self.VERSIONS[0]

    def to_bytes(self) -> bytes:
        w = _header(self.TAG, self.session_id, self.round_number, self.node, self.version)
        self._write(w)
        return w.getvalue()

    @classmethod
    def from_bytes(cls: type[_M], data: bytes | bytearray | memoryview) -> _M:
        msg = decode(data)
        if not isinstance(msg, cls):
            raise MalformedMessage(f"expected a {cls.__name__}, got a {type(msg).__name__}")
        return msg


@dataclass(frozen=True)
class ClientMessage(Message):
    """A client -> server message: the common header with its sender."""

    session_id: bytes
    round_number: int
    sender: str

    @property
    def node(self) -> str:
        return self.sender


@dataclass(frozen=True)
class Broadcast(Message):
    """A server -> client message: the common header with its recipient."""

    session_id: bytes
    round_number: int
    recipient: str

    @property
    def node(self) -> str:
        return self.recipient


class _OnePairList:
    """The body of a message that is one (node, blob) list, ``ciphertexts``: ShareKeys and
    SharesBroadcast, whose bodies have one layout (listed before the header base, so its
    ``_write``/``_read`` are the ones a subclass gets)."""

    ciphertexts: tuple[tuple[str, bytes], ...]

    def _write(self, w: _Writer) -> None:
        _write_pairs(w, self.ciphertexts)

    @classmethod
    def _read(cls, r: _Reader, session_id: bytes, round_number: int, node: str) -> Any:
        return cls(session_id, round_number, node, _read_pairs(r))  # type: ignore[call-arg]


def _header(tag: int, session_id: bytes, round_number: int, node: str, version: int = VERSION) -> _Writer:
    w = _Writer()
    w.raw(MAGIC)
    w.u8(version)
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
    if version not in (VERSION, ACTIVE_VERSION):
        raise MalformedMessage(f"message version {version}, this code speaks {VERSION} and {ACTIVE_VERSION}")
    cls = _REGISTRY.get(tag)
    if cls is None:
        raise MalformedMessage(f"unknown message tag {tag}")
    if version not in cls.VERSIONS:
        raise MalformedMessage(f"a {cls.__name__} has no version {version} form")
    r.version = version
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


COMMITMENT_BYTES = 32  # H(b_u), SHA-256
SIGNATURE_BYTES = 64  # Ed25519


def _check_keys(k: AdvertiseKeys | PeerKeys) -> None:
    """The two public keys and, when signed, the commitment, credential and signature:
    what AdvertiseKeys and the PeerKeys relaying it both carry."""
    _check_key("channel_pk", k.channel_pk)
    _check_key("mask_pk", k.mask_pk)
    if not (k.signature or k.credential or k.seed_commitment):
        return
    if len(k.seed_commitment) != COMMITMENT_BYTES or len(k.signature) != SIGNATURE_BYTES:
        raise MalformedMessage(f"signed keys carry a {COMMITMENT_BYTES}-byte commitment and a "
                               f"{SIGNATURE_BYTES}-byte signature")
    if not 0 < len(k.credential) <= 0xFFFF:
        raise MalformedMessage("signed keys carry their owner's credential (certificate or key)")


def _write_keys(w: _Writer, k: AdvertiseKeys | PeerKeys) -> None:
    w.raw(k.channel_pk)
    w.raw(k.mask_pk)
    if not k.signature:
        return
    w.raw(k.seed_commitment)
    w.u16(len(k.credential))
    w.raw(k.credential)
    w.raw(k.signature)


def _read_signed(r: _Reader) -> tuple[bytes, bytes, bytes]:
    commitment = r.fixed(COMMITMENT_BYTES)
    credential = r.fixed(r.u16())
    return commitment, credential, r.fixed(SIGNATURE_BYTES)


@dataclass(frozen=True)
class AdvertiseKeys(ClientMessage):
    """Client -> server, stage ADVERTISE_KEYS: the two public keys (§4, round 0). In an
    active session (§6) also H(b_u), the sender's identity credential (the root's
    certificate of its Ed25519 key) and its signature over all of it
    (:func:`~orchard.secure_agg.identity.advertise_message`)."""

    TAG: ClassVar[int] = 2
    STAGE: ClassVar[Stage] = Stage.ADVERTISE_KEYS
    VERSIONS: ClassVar[tuple[int, ...]] = (VERSION, ACTIVE_VERSION)
    channel_pk: bytes
    mask_pk: bytes
    seed_commitment: bytes = b""
    credential: bytes = b""
    signature: bytes = b""

    def __post_init__(self) -> None:
        _check_keys(self)

    @property
    def version(self) -> int:
        return ACTIVE_VERSION if self.signature else VERSION

    def _write(self, w: _Writer) -> None:
        _write_keys(w, self)

    @classmethod
    def _read(cls, r: _Reader, session_id: bytes, round_number: int, node: str) -> AdvertiseKeys:
        keys = _key(r), _key(r)
        if r.version == VERSION:
            return cls(session_id, round_number, node, *keys)
        return cls(session_id, round_number, node, *keys, *_read_signed(r))


@dataclass(frozen=True)
class PeerKeys:
    """A neighbour's AdvertiseKeys as the server passes it on (signed, in an active session:
    the client checks the signature, so a relay cannot substitute the keys)."""

    node: str
    channel_pk: bytes
    mask_pk: bytes
    seed_commitment: bytes = b""
    credential: bytes = b""
    signature: bytes = b""

    def __post_init__(self) -> None:
        # Checked here, once per peer: a server sends the same PeerKeys to k neighbours.
        _check_keys(self)

    @functools.cached_property
    def encoded(self) -> bytes:
        """This entry in wire form, encoded once: a server puts the same PeerKeys into k
        broadcasts (n k entries a session, each otherwise three writes)."""
        w = _Writer()
        w.string(self.node)
        _write_keys(w, self)
        return w.getvalue()


@dataclass(frozen=True)
class KeysBroadcast(Broadcast):
    """Server -> client, stage SHARE_KEYS: public keys of the neighbours that advertised."""

    TAG: ClassVar[int] = 3
    STAGE: ClassVar[Stage] = Stage.SHARE_KEYS
    VERSIONS: ClassVar[tuple[int, ...]] = (VERSION, ACTIVE_VERSION)
    keys: tuple[PeerKeys, ...]  # each checked when it was made (frozen since)
    active: bool = False  # the signed form: every entry carries commitment, credential, signature

    def __post_init__(self) -> None:
        if any(bool(k.signature) != self.active for k in self.keys):
            raise MalformedMessage("a keys broadcast mixes signed and unsigned keys")

    @property
    def version(self) -> int:
        return ACTIVE_VERSION if self.active else VERSION

    def _write(self, w: _Writer) -> None:
        w.u32(len(self.keys))
        w.raw(b"".join([k.encoded for k in self.keys]))

    @classmethod
    def _read(cls, r: _Reader, session_id: bytes, round_number: int, node: str) -> KeysBroadcast:
        n = r.count(2 + 2 * KEY_BYTES)
        if r.version == VERSION:
            return cls(session_id, round_number, node, tuple(PeerKeys(r.string(), _key(r), _key(r))
                                                             for _ in range(n)))
        keys = tuple(PeerKeys(r.string(), _key(r), _key(r), *_read_signed(r)) for _ in range(n))
        return cls(session_id, round_number, node, keys, active=True)


@dataclass(frozen=True)
class ShareKeys(_OnePairList, ClientMessage):
    """Client -> server, stage SHARE_KEYS: (recipient, AES-GCM ciphertext of the shares)."""

    TAG: ClassVar[int] = 4
    STAGE: ClassVar[Stage] = Stage.SHARE_KEYS
    ciphertexts: tuple[tuple[str, bytes], ...]


@dataclass(frozen=True)
class SharesBroadcast(_OnePairList, Broadcast):
    """Server -> client, stage MASKED_INPUT: (sender, ciphertext) addressed to the recipient."""

    TAG: ClassVar[int] = 5
    STAGE: ClassVar[Stage] = Stage.MASKED_INPUT
    ciphertexts: tuple[tuple[str, bytes], ...]


@dataclass(frozen=True, eq=False)
class MaskedInput(ClientMessage):
    """Client -> server, stage MASKED_INPUT: y_u = x_u + PRG(b_u) + sum_v +-PRG(s_uv) mod 2^b."""

    TAG: ClassVar[int] = 6
    STAGE: ClassVar[Stage] = Stage.MASKED_INPUT
    vector: np.ndarray

    def __post_init__(self) -> None:
        v = self.vector
        if v.ndim != 1 or v.dtype.kind != "u" or v.dtype.itemsize not in (4, 8):
            raise MalformedMessage(f"a masked input is a 1-d uint32/uint64 vector, got "
                                   f"{v.dtype} with shape {v.shape}")

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
class UnmaskRequest(Broadcast):
    """Server -> client, stage UNMASKING: which neighbours survived and which dropped.

    The client reveals its share of b_u for each survivor u and its share of s_sk_u for
    each dropped u, never both for the same u (§4, round 4).
    """

    TAG: ClassVar[int] = 7
    STAGE: ClassVar[Stage] = Stage.UNMASKING
    VERSIONS: ClassVar[tuple[int, ...]] = (VERSION, ACTIVE_VERSION)
    survivors: tuple[str, ...]
    dropped: tuple[str, ...]
    # Active sessions: no lists (the client derives them), but the survivor view it
    # signed (``consistency.View`` bytes) and its neighbours' signatures over that view.
    view: bytes = b""
    signatures: tuple[tuple[str, bytes], ...] = ()

    @property
    def version(self) -> int:
        return ACTIVE_VERSION if self.view else VERSION

    def _write(self, w: _Writer) -> None:
        if self.view:
            w.u32(len(self.view))
            w.raw(self.view)
            _write_pairs(w, self.signatures)
            return
        for group in (self.survivors, self.dropped):
            w.u32(len(group))
            w.raw(b"".join([encoded_id(s) for s in group]))

    @classmethod
    def _read(cls, r: _Reader, session_id: bytes, round_number: int, node: str) -> UnmaskRequest:
        if r.version == ACTIVE_VERSION:
            view = r.fixed(r.count(1))
            if not view:
                raise MalformedMessage("an active unmask request carries the survivor view")
            return cls(session_id, round_number, node, (), (), view, _read_pairs(r))
        survivors = tuple(r.strings(r.count(2)))
        dropped = tuple(r.strings(r.count(2)))
        return cls(session_id, round_number, node, survivors, dropped)


@dataclass(frozen=True)
class UnmaskShares(ClientMessage):
    """Client -> server, stage UNMASKING: (owner, share) of self-mask seeds and mask keys."""

    TAG: ClassVar[int] = 8
    STAGE: ClassVar[Stage] = Stage.UNMASKING
    self_mask_shares: tuple[tuple[str, bytes], ...]
    mask_key_shares: tuple[tuple[str, bytes], ...]

    def _write(self, w: _Writer) -> None:
        _write_pairs(w, self.self_mask_shares)
        _write_pairs(w, self.mask_key_shares)

    @classmethod
    def _read(cls, r: _Reader, session_id: bytes, round_number: int, node: str) -> UnmaskShares:
        return cls(session_id, round_number, node, _read_pairs(r), _read_pairs(r))


# The session's config and its setup message live in session.py (one concern per file);
# importing them here keeps ``messages`` the one place every message is reachable from.
from orchard.secure_agg.session import SessionConfig, SessionSetup  # noqa: E402
