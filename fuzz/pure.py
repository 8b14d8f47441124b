"""Targets for the pure parsers: codecs, safetensors blobs, partial sums, upload parts,
SecAgg+ messages. Each takes the bytes as they come off the wire; the shapes, schemas
and codec specs around them are the server's own (from small tables below), as they
are in a round: a peer controls the bytes, never the tier's schema.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
from google.protobuf.message import DecodeError

from orchard import wire
from orchard.compression import PayloadSum, apply_model_delta, build_codec
from orchard.config import CodecSpec
from orchard.errors import CodecError, UpdateSchemaError
from orchard.secure_agg import _wire
from orchard.secure_agg import messages as m
from orchard.secure_agg.errors import MalformedMessage
from orchard.typing import TensorSpec
from orchard.updates import decode_partial
from orchard.v1 import orchard_pb2 as pb


class FuzzBug(AssertionError):
    """A parser accepted bytes and then broke a promise about them."""


_TOPK_QSGD = {"name": "pipeline", "params": {"stages": [{"name": "topk", "params": {"fraction": 0.25}},
                                                        {"name": "qsgd"}]}}
# Every codec, and the pipelines and wrappers a run may configure (the first input byte picks one).
CODEC_SPECS: tuple[CodecSpec, ...] = tuple(CodecSpec.model_validate(s) for s in (
    {"name": "float32"},
    {"name": "float16"},
    {"name": "bfloat16"},
    {"name": "qsgd", "params": {"bits": 8}},
    {"name": "qsgd", "params": {"bits": 4, "block": 16}},
    {"name": "qsgd", "params": {"bits": 2}},
    {"name": "qsgd", "params": {"bits": 1, "block": 7}},
    {"name": "qsgd", "params": {"bits": 8, "scale": 2000.0}},
    {"name": "sign"},
    {"name": "topk", "params": {"fraction": 0.3}},
    {"name": "topk", "params": {"k": 3}},
    {"name": "randk", "params": {"fraction": 0.4}},
    {"name": "randk", "params": {"k": 5, "unbiased": False}},
    {"name": "powersgd", "params": {"rank": 2}},
    _TOPK_QSGD,
    {"name": "pipeline", "params": {"stages": [{"name": "randk", "params": {"fraction": 0.5}},
                                              {"name": "qsgd", "params": {"bits": 8, "scale": 2000.0}}]}},
    {"name": "error_feedback", "params": {"codec": {"name": "topk"}}},
    {"name": "error_feedback", "params": {"codec": {"name": "powersgd"}}},
    {"name": "error_feedback", "params": {"codec": _TOPK_QSGD}},
    {"name": "qsgd", "params": {"bits": 8, "block": 4096}},  # the downlink's delta codec
))
# The tensor shapes a schema may hold (the second input byte picks one).
SHAPES: tuple[tuple[int, ...], ...] = ((), (0,), (1,), (7,), (64,), (3, 4), (2, 3, 5), (16, 16), (1, 0, 3))
SHARED_SEED = 7


def codec_input(data: bytes) -> tuple[int, int, int, bytes]:
    """(codec index, shape index, summands, payload) of a ``codec_decode`` input."""
    if len(data) < 3:
        return 0, 0, 1, b""
    return data[0] % len(CODEC_SPECS), data[1] % len(SHAPES), 1 + data[2] % 4, data[3:]


def codec_decode():
    codecs = [build_codec(s) for s in CODEC_SPECS]

    def one_input(data: bytes) -> None:
        ci, si, summands, payload = codec_input(data)
        codec, shape = codecs[ci], SHAPES[si]
        try:
            out = codec.decode(payload, shape, num_summands=summands, shared_seed=SHARED_SEED)
        except CodecError:
            return
        if out.shape != shape:
            raise FuzzBug(f"{codec.name} decoded shape {out.shape}, asked for {shape}")
        # A tier that sums in the compressed domain: check, fold twice, decode the sum.
        s = PayloadSum(codec, shape, SHARED_SEED)
        try:
            s.accumulate(payload, 1.0)
            s.accumulate(payload, 1.0)
        except CodecError:
            return
        if s.result().shape != shape:
            raise FuzzBug(f"{codec.name}: a sum of shape {shape} decoded to {s.result().shape}")

    return one_input


MODEL = {"b": np.zeros(5, np.float32), "w": np.arange(12, dtype=np.float32).reshape(4, 3)}


def model_delta():
    def one_input(data: bytes) -> None:
        try:
            new = apply_model_delta(MODEL, wire.blob_to_payloads(data), from_version=3)
        except (UpdateSchemaError, CodecError):
            return
        if {k: v.shape for k, v in new.items()} != {k: v.shape for k, v in MODEL.items()}:
            raise FuzzBug("a delta changed the model's schema")

    return one_input


def safetensors_blob():
    def one_input(data: bytes) -> None:
        try:
            arrays = wire.blob_to_arrays(data)
            wire.blob_to_payloads(data)
        except UpdateSchemaError:
            return
        if not all(isinstance(v, np.ndarray) for v in arrays.values()):
            raise FuzzBug("blob_to_arrays returned something other than arrays")

    return one_input


PARTIAL_SCHEMA = (TensorSpec("w", (4, 3), "float32"), TensorSpec("b", (5,), "float32"))


def partial_sum():
    """Input: u8 count of sizes, that many u16 sizes (the header's payload_sizes), the payload."""

    def one_input(data: bytes) -> None:
        if not data:
            return
        k = data[0] % 4
        head = 1 + 2 * k
        sizes = tuple(int.from_bytes(data[1 + 2 * i:3 + 2 * i], "big") for i in range(k))
        try:
            sums = decode_partial(data[head:], PARTIAL_SCHEMA, sizes)
        except UpdateSchemaError:
            return
        if [v.shape for v in sums.values()] != [s.shape for s in PARTIAL_SCHEMA]:
            raise FuzzBug("decode_partial returned another schema")

    return one_input


def _both_or_neither(data: bytes, reference: Callable[[bytes], Any], candidate: Callable[[bytes], Any],
                     refused: type[Exception], what: str) -> tuple[Any, Any] | None:
    """``(reference(data), candidate(data))``, or None when both refuse ``data`` (raise
    ``refused``); a FuzzBug when only one of them does."""
    try:
        want = reference(data)
    except refused:
        want = None
    try:
        got = candidate(data)
    except refused:
        if want is not None:
            raise FuzzBug(f"{what} refused what its reference accepts") from None
        return None
    if want is None:
        raise FuzzBug(f"{what} accepted what its reference refuses")
    return want, got


def upload_part():
    def one_input(data: bytes) -> None:
        both = _both_or_neither(data, pb.UploadPart.FromString, wire.parse_upload_part, DecodeError,
                                "parse_upload_part")
        if both is None:
            return
        reference, got = both
        if isinstance(got, memoryview):
            if reference.WhichOneof("part") != "data" or bytes(got) != reference.data:
                raise FuzzBug("the data-part fast path disagrees with protobuf")
        elif got != reference:
            raise FuzzBug("parse_upload_part's message differs from protobuf's")

    return one_input


def _columns(msg: m.Message | m.PairColumns) -> object:
    if isinstance(msg, m.PairColumns):
        return (msg.cls, msg.session_id, msg.round_number, msg.node, msg.lists)
    return msg


def secagg_message():
    def one_input(data: bytes) -> None:
        both = _both_or_neither(data, m.decode, m.decode_columns, MalformedMessage, "decode_columns")
        if both is None:
            return
        msg, cols = both
        want = _columns(m.as_columns(msg))
        if isinstance(msg, m.MaskedInput):
            if not (isinstance(cols, m.MaskedInput) and np.array_equal(cols.vector, msg.vector)):
                raise FuzzBug("decode_columns read another masked input")
        elif _columns(cols) != want:
            raise FuzzBug(f"decode_columns read another {type(msg).__name__}")
        if msg.to_bytes() != bytes(data):
            raise FuzzBug(f"a {type(msg).__name__} does not write back to the bytes it was read from")
        type(msg).from_bytes(data)

    return one_input


def secagg_shares():
    def one_input(data: bytes) -> None:
        try:
            sender, recipient, key_share, seed_share = _wire.unpack_shares(data)
        except MalformedMessage:
            return
        if _wire.pack_shares(sender, recipient, key_share, seed_share) != data:
            raise FuzzBug("unpack_shares read what pack_shares does not write")

    return one_input


CREDENTIAL_ROOT_SEED = bytes(range(32))  # the root whose key the credential corpus is made with


def secagg_credential():
    """A peer's credential (raw key, root certificate, roster credential) as a client and
    the server read it from signed keys: a verified key, or a named refusal."""
    from orchard.identity import CertificateError, SigningKey
    from orchard.secure_agg.active import identity_key
    from orchard.secure_agg.roster import RosterCache

    root = SigningKey.from_bytes(CREDENTIAL_ROOT_SEED).public_key

    def one_input(data: bytes) -> None:
        for key in (root, None):
            try:
                got = identity_key(data, "c0001", key, RosterCache(), 1)
            except CertificateError:
                continue
            if len(got) != 32:
                raise FuzzBug(f"a credential gave an identity key of {len(got)} bytes")

    return one_input

