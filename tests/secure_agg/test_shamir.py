"""Shamir sharing: every t-subset reconstructs, t - 1 shares do not."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from orchard.secure_agg.errors import MalformedMessage, NotEnoughShares
from orchard.secure_agg.prg import ByteStream
from orchard.secure_agg.shamir import (
    PRIME,
    reconstruct_bytes,
    reconstruct_limbs,
    reconstruct_many_bytes,
    share_bytes,
    share_limbs,
)


def _stream(i: int = 0) -> ByteStream:
    return ByteStream(i.to_bytes(32, "big"))


@pytest.mark.parametrize(("m", "t"), [(1, 1), (3, 2), (5, 3), (6, 6), (7, 4)])
def test_every_threshold_subset_reconstructs(m: int, t: int) -> None:
    secret = bytes(range(7, 39))  # 32 bytes, like an X25519 key
    xs = [3 * i + 5 for i in range(m)]
    shares = dict(zip(xs, share_bytes(secret, t, xs, _stream(m * 10 + t)), strict=True))
    for size in range(t, m + 1):
        for subset in itertools.combinations(xs, size):
            assert reconstruct_bytes({x: shares[x] for x in subset}, t, 32) == secret
    for subset in itertools.combinations(xs, t - 1):
        with pytest.raises(NotEnoughShares):
            reconstruct_bytes({x: shares[x] for x in subset}, t, 32)


@settings(max_examples=60, deadline=None)
@given(secret=st.binary(min_size=1, max_size=48), m=st.integers(1, 12), data=st.data())
def test_random_secrets_and_subsets(secret: bytes, m: int, data: st.DataObject) -> None:
    t = data.draw(st.integers(1, m))
    xs = data.draw(st.lists(st.integers(1, PRIME - 1), min_size=m, max_size=m, unique=True))
    shares = dict(zip(xs, share_bytes(secret, t, xs, _stream(len(secret))), strict=True))
    subset = data.draw(st.lists(st.sampled_from(xs), min_size=t, max_size=m, unique=True))
    assert reconstruct_bytes({x: shares[x] for x in subset}, t, len(secret)) == secret


def test_fewer_than_t_shares_say_nothing_about_the_secret() -> None:
    # Perfect hiding: with t - 1 shares fixed, every secret stays possible. Concretely, the
    # distribution of one share of a 2-of-n sharing does not depend on the secret.
    xs = [1, 2]
    a = np.array([share_limbs(np.array([0]), 2, xs, _stream(i))[0, 0] for i in range(400)])
    b = np.array([share_limbs(np.array([12345]), 2, xs, _stream(i))[0, 0] for i in range(400)])
    # Same coefficients, different secrets: shares are shifted, both spread over the field.
    assert np.all((b - a) % PRIME == 12345)
    assert a.min() < PRIME // 8 and a.max() > PRIME - PRIME // 8


def test_vectorised_limbs_match_scalar_lagrange() -> None:
    secret = np.arange(100, dtype=np.uint64) * 1_000_003 % PRIME
    xs = list(range(1, 10))
    rows = share_limbs(secret, 5, xs, _stream(1))
    got = reconstruct_limbs({x: rows[i] for i, x in enumerate(xs) if i % 2 == 0}, 5)
    assert np.array_equal(got, secret)


def test_tampered_share_is_detected_or_changes_the_secret() -> None:
    secret = b"\x01" * 16
    xs = [1, 2, 3]
    shares = dict(zip(xs, share_bytes(secret, 3, xs, _stream(3)), strict=True))
    bad = bytearray(shares[2])
    bad[0] ^= 0x40
    shares[2] = bytes(bad)
    try:
        out = reconstruct_bytes(shares, 3, 16)
    except MalformedMessage:
        return
    assert out != secret


def test_bad_arguments() -> None:
    with pytest.raises(ValueError):
        share_bytes(b"x", 3, [1, 2], _stream())
    with pytest.raises(ValueError):
        share_bytes(b"x", 1, [1, 1], _stream())
    with pytest.raises(ValueError):
        share_bytes(b"x", 1, [0], _stream())
    with pytest.raises(MalformedMessage):
        reconstruct_bytes({1: b"\x00" * 3}, 1, 2)


@settings(max_examples=40, deadline=None)
@given(count=st.integers(0, 6), m=st.integers(1, 9), secret_len=st.integers(1, 33),
       data=st.data())
def test_many_secrets_at_once_match_one_at_a_time(count: int, m: int, secret_len: int,
                                                  data: st.DataObject) -> None:
    # Each secret has its own holders and its own surviving subset (so its own Lagrange
    # coefficients), as the server sees when it recovers every survivor's seed at once.
    t = data.draw(st.integers(1, m))
    secrets, held = {}, {}
    for i in range(count):
        secret = data.draw(st.binary(min_size=secret_len, max_size=secret_len))
        xs = data.draw(st.lists(st.integers(1, 2000), min_size=m, max_size=m, unique=True))
        shares = dict(zip(xs, share_bytes(secret, t, xs, _stream(i)), strict=True))
        subset = data.draw(st.lists(st.sampled_from(xs), min_size=t, max_size=m, unique=True))
        secrets[f"node-{i}"] = secret
        held[f"node-{i}"] = {x: shares[x] for x in subset}
    got = reconstruct_many_bytes(held, t, secret_len)
    assert got == secrets
    assert got == {k: reconstruct_bytes(v, t, secret_len) for k, v in held.items()}


def test_many_secrets_name_the_one_that_fails() -> None:
    xs = [1, 2, 3]
    good = dict(zip(xs, share_bytes(b"\x01" * 16, 2, xs, _stream(1)), strict=True))
    with pytest.raises(NotEnoughShares, match="'b'"):
        reconstruct_many_bytes({"a": good, "b": {1: good[1]}}, 2, 16)
    with pytest.raises(MalformedMessage, match="'b'"):
        reconstruct_many_bytes({"a": good, "b": {1: good[1], 2: b"\x00" * 3}}, 2, 16)
    other = dict(zip(xs, share_bytes(b"\x02" * 16, 2, xs, _stream(2)), strict=True))
    mixed = {1: good[1], 2: other[2]}  # shares of two different secrets
    try:
        out = reconstruct_many_bytes({"a": good, "b": mixed}, 2, 16)
    except MalformedMessage as err:
        assert "'b'" in str(err)
    else:
        assert out["a"] == b"\x01" * 16 and out["b"] not in (b"\x01" * 16, b"\x02" * 16)
