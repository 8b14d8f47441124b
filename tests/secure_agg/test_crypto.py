"""Key derivation: Orchard's HKDF is RFC 5869's, byte for byte."""

from __future__ import annotations

import pytest
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey
from cryptography.hazmat.primitives.kdf.hkdf import HKDF
from hypothesis import given, settings
from hypothesis import strategies as st

from orchard.secure_agg import crypto
from orchard.secure_agg.errors import MalformedMessage


def _reference(ikm: bytes, info: bytes, length: int) -> bytes:
    return HKDF(algorithm=hashes.SHA256(), length=length, salt=None,
                info=b"orchard-secagg/v1" + info).derive(ikm)


@settings(max_examples=200, deadline=None)
@given(ikm=st.binary(max_size=80), info=st.binary(max_size=120),
       length=st.integers(min_value=1, max_value=200))
def test_hkdf_matches_cryptography(ikm: bytes, info: bytes, length: int) -> None:
    assert crypto.hkdf(ikm, info, length) == _reference(ikm, info, length)


def test_hkdf_rfc5869_vector_and_limits() -> None:
    # RFC 5869, test case 3 (no salt, no info), with Orchard's label prepended to info
    # on both sides: the label is part of info, so the RFC's own vector checks the core.
    ikm = bytes.fromhex("0b" * 22)
    okm = bytes.fromhex("8da4e775a563c18f715f802a063c5a31b8a11f5c5ee1879ec3454e5f3c738d2d"
                        "9d201395faa4b61a96c8")
    from hmac import digest
    prk = digest(bytes(32), ikm, "sha256")
    assert prk.hex() == "19ef24a32c717b167f33a91d6f648bdf96596776afdb6377ac434c1c293ccb04"
    assert _reference(ikm, b"", 42) != okm  # the label changes the output ...
    assert HKDF(algorithm=hashes.SHA256(), length=42, salt=None, info=b"").derive(ikm) == okm
    assert crypto.hkdf(ikm, b"", 42) == _reference(ikm, b"", 42)  # ... the same way in both
    for bad in (0, 255 * 32 + 1):
        with pytest.raises(ValueError, match="HKDF-SHA256 output"):
            crypto.hkdf(ikm, b"", bad)


def test_pairwise_seed_takes_raw_or_loaded_keys_and_is_symmetric() -> None:
    a, b = X25519PrivateKey.generate(), X25519PrivateKey.generate()
    pa, pb = crypto.public_bytes(a), crypto.public_bytes(b)
    sid = bytes(16)
    s1 = crypto.pairwise_seed(a, pb, sid, 3, "x", "y")
    assert s1 == crypto.pairwise_seed(a, crypto.load_public(pb), sid, 3, "x", "y")
    assert s1 == crypto.pairwise_seed(a, bytearray(pb), sid, 3, "y", "x")
    assert s1 == crypto.pairwise_seed(b, pa, sid, 3, "y", "x")
    assert s1 != crypto.pairwise_seed(b, pa, sid, 4, "y", "x")
    with pytest.raises(MalformedMessage, match="public key"):
        crypto.pairwise_seed(a, bytes(31), sid, 3, "x", "y")
