"""Binary form of every message: round trips, a golden encoding, refusals."""

from __future__ import annotations

import hashlib

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from orchard.secure_agg import (
    AdvertiseKeys,
    KeysBroadcast,
    MalformedMessage,
    MaskedInput,
    PeerKeys,
    SessionConfig,
    SessionSetup,
    ShareKeys,
    SharesBroadcast,
    UnmaskRequest,
    UnmaskShares,
    decode,
)

SID = bytes(range(16))
ids = st.text(min_size=1, max_size=12)
keys = st.binary(min_size=32, max_size=32)
pairs = st.lists(st.tuples(ids, st.binary(max_size=80)), max_size=5).map(tuple)


@st.composite
def messages(draw: st.DrawFn):
    rnd = draw(st.integers(0, 2**63))
    node = draw(ids)
    kind = draw(st.integers(0, 7))
    if kind == 0:
        n = draw(st.integers(2, 8))
        parts = tuple(sorted({f"p{i}" for i in range(n)}))
        k = draw(st.integers(1, n - 1))
        return SessionSetup(node, SessionConfig(SID, rnd, parts, k, k // 2 + 1, b"s" * 32,
                                                draw(st.integers(0, 10**7)),
                                                draw(st.integers(1, 64))))
    if kind == 1:
        return AdvertiseKeys(SID, rnd, node, draw(keys), draw(keys))
    if kind == 2:
        peers = draw(st.lists(st.builds(PeerKeys, ids, keys, keys), max_size=4))
        return KeysBroadcast(SID, rnd, node, tuple(peers))
    if kind == 3:
        return ShareKeys(SID, rnd, node, draw(pairs))
    if kind == 4:
        return SharesBroadcast(SID, rnd, node, draw(pairs))
    if kind == 5:
        vals = draw(st.lists(st.integers(0, 2**32 - 1), max_size=50))
        return MaskedInput(SID, rnd, node, np.array(vals, dtype=np.uint32))
    if kind == 6:
        return UnmaskRequest(SID, rnd, node, tuple(draw(st.lists(ids, max_size=4))),
                             tuple(draw(st.lists(ids, max_size=4))))
    return UnmaskShares(SID, rnd, node, draw(pairs), draw(pairs))


@settings(max_examples=200, deadline=None)
@given(msg=messages())
def test_round_trip(msg) -> None:
    data = msg.to_bytes()
    back = decode(data)
    assert type(back) is type(msg)
    assert back.to_bytes() == data
    assert type(msg).from_bytes(data).to_bytes() == data
    if isinstance(msg, MaskedInput):
        assert np.array_equal(back.vector, msg.vector)
    else:
        assert back == msg


@settings(max_examples=100, deadline=None)
@given(msg=messages(), data=st.data())
def test_truncated_or_extended_bytes_are_refused(msg, data: st.DataObject) -> None:
    raw = msg.to_bytes()
    cut = data.draw(st.integers(0, len(raw) - 1))
    with pytest.raises(MalformedMessage):
        decode(raw[:cut])
    with pytest.raises(MalformedMessage, match="trailing"):
        decode(raw + b"\x00")


def test_masked_input_is_raw_words() -> None:
    v = np.arange(1000, dtype=np.uint32)
    raw = MaskedInput(SID, 1, "n", v).to_bytes()
    assert len(raw) - 4 * 1000 < 64  # header only: no per-element framing
    assert raw.endswith(v.astype("<u4").tobytes())


def test_golden_encoding() -> None:
    # Changing the wire format must be deliberate: update VERSION and this digest together.
    msg = AdvertiseKeys(SID, 7, "client-1", b"\x01" * 32, b"\x02" * 32)
    raw = msg.to_bytes()
    assert raw[:5] == b"OSA\x01\x02"
    assert hashlib.sha256(raw).hexdigest() == GOLDEN


GOLDEN = hashlib.sha256(
    b"OSA\x01\x02" + bytes(range(16)) + (7).to_bytes(8, "big") + b"\x00\x08client-1"
    + b"\x01" * 32 + b"\x02" * 32
).hexdigest()


def test_keys_broadcast_layout() -> None:
    # A server encodes each PeerKeys once and joins the encodings into every broadcast
    # that lists it: the entries must still be laid out field by field.
    peers = (PeerKeys("b", b"\x03" * 32, b"\x04" * 32), PeerKeys("cc", b"\x05" * 32, b"\x06" * 32))
    raw = KeysBroadcast(SID, 7, "a", peers).to_bytes()
    assert raw == (b"OSA\x01\x03" + SID + (7).to_bytes(8, "big") + b"\x00\x01a"
                   + (2).to_bytes(4, "big")
                   + b"\x00\x01b" + b"\x03" * 32 + b"\x04" * 32
                   + b"\x00\x02cc" + b"\x05" * 32 + b"\x06" * 32)
    # The same PeerKeys in a second broadcast (its encoding is reused) reads back equal.
    again = KeysBroadcast(SID, 8, "d", peers[::-1])
    assert decode(again.to_bytes()) == again


def test_wrong_type_and_garbage() -> None:
    raw = AdvertiseKeys(SID, 1, "a", b"\x01" * 32, b"\x02" * 32).to_bytes()
    with pytest.raises(MalformedMessage, match="expected a ShareKeys"):
        ShareKeys.from_bytes(raw)
    with pytest.raises(MalformedMessage, match="magic"):
        decode(b"XXXX" + raw[4:])
    with pytest.raises(MalformedMessage, match="unknown message tag"):
        decode(raw[:4] + b"\x63" + raw[5:])
    with pytest.raises(MalformedMessage):
        AdvertiseKeys(SID, 1, "a", b"\x01" * 31, b"\x02" * 32)


def _walk_pairs(raw: bytes, n: int) -> list[tuple[str, bytes]] | str:
    """The plain record-by-record reading of ``n`` (str, blob) pairs: the reference for
    the reader's fixed-stride path. Returns the pairs, or "malformed"."""
    out, pos = [], 0
    for _ in range(n):
        if pos + 2 > len(raw):
            return "malformed"
        ln = int.from_bytes(raw[pos:pos + 2], "big")
        if pos + 2 + ln + 4 > len(raw):
            return "malformed"
        try:
            name = raw[pos + 2:pos + 2 + ln].decode()
        except UnicodeDecodeError:
            return "malformed"
        bl = int.from_bytes(raw[pos + 2 + ln:pos + 6 + ln], "big")
        if pos + 6 + ln + bl > len(raw):
            return "malformed"
        out.append((name, raw[pos + 6 + ln:pos + 6 + ln + bl]))
        pos += 6 + ln + bl
    return out


@st.composite
def pair_lists(draw: st.DrawFn) -> tuple[bytes, int]:
    """Encoded pair lists, mostly of one record size (the fast path), then damaged."""
    n = draw(st.integers(0, 12))
    name_len = draw(st.integers(0, 4))
    blob_len = draw(st.integers(0, 6))
    uniform = draw(st.booleans())
    raw = b""
    for _ in range(n):
        nl = name_len if uniform else draw(st.integers(0, 4))
        bl = blob_len if uniform else draw(st.integers(0, 6))
        name = draw(st.text(alphabet="abcé", min_size=nl, max_size=nl)).encode()[:nl].ljust(nl, b"x")
        raw += len(name).to_bytes(2, "big") + name + bl.to_bytes(4, "big") + draw(st.binary(min_size=bl, max_size=bl))
    for _ in range(draw(st.integers(0, 2))):  # damage: flip, cut or extend a byte
        if not raw:
            break
        at = draw(st.integers(0, len(raw) - 1))
        how = draw(st.sampled_from(["flip", "cut", "extend"]))
        if how == "flip":
            raw = raw[:at] + bytes([raw[at] ^ draw(st.integers(1, 255))]) + raw[at + 1:]
        elif how == "cut":
            raw = raw[:at]
        else:
            raw += b"\x00"
    return raw, draw(st.sampled_from([n, max(0, n - 1), n + 1]))


@settings(max_examples=500, deadline=None)
@given(case=pair_lists())
def test_pair_reader_matches_the_record_walk(case: tuple[bytes, int]) -> None:
    from orchard.secure_agg.messages import _Reader

    raw, n = case
    want = _walk_pairs(raw, n)
    reader = _Reader(raw)
    if want == "malformed":
        with pytest.raises(MalformedMessage):
            reader.pairs(n)
        return
    assert reader.pairs(n) == want
    assert reader.pos == sum(6 + len(a.encode()) + len(b) for a, b in want)


@settings(max_examples=200, deadline=None)
@given(msg=messages())
def test_columns_decode_agrees_with_decode(msg) -> None:
    from orchard.secure_agg.messages import PairColumns, as_columns, decode_columns

    data = msg.to_bytes()
    got = decode_columns(data)
    if not isinstance(got, PairColumns):
        assert got.to_bytes() == data
        assert as_columns(msg) is msg
        return
    assert as_columns(msg) == got  # a message object takes the same form as its bytes
    assert got.cls is type(msg)
    assert (got.session_id, got.round_number, got.node) == (msg.session_id, msg.round_number, msg.node)
    lists = (msg.ciphertexts,) if isinstance(msg, ShareKeys) else (msg.self_mask_shares, msg.mask_key_shares)
    assert got.lists == tuple(([a for a, _ in p], [b for _, b in p]) for p in lists)
    for cut in (1, len(data) // 2):  # refuses what decode refuses
        with pytest.raises(MalformedMessage):
            decode_columns(data[:-cut])
    with pytest.raises(MalformedMessage):
        decode_columns(data + b"\x00")


@settings(max_examples=100, deadline=None)
@given(node=ids, rnd=st.integers(0, 2**63), pairs=pairs)
def test_shares_broadcast_written_from_columns_is_the_message(node, rnd, pairs) -> None:
    from orchard.secure_agg.messages import encoded_id, shares_broadcast_bytes

    want = SharesBroadcast(SID, rnd, node, pairs).to_bytes()
    assert shares_broadcast_bytes(SID, rnd, node, [encoded_id(a) for a, _ in pairs], [b for _, b in pairs]) == want
