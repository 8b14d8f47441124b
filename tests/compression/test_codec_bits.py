"""Bit packing at every width, and the packed sizes the wire format relies on."""

from __future__ import annotations

import numpy as np
from hypothesis import given
from hypothesis import strategies as st

from orchard.compression.bits import pack_uint, packed_nbytes, unpack_uint


@given(width=st.integers(1, 32), data=st.data())
def test_pack_then_unpack_is_identity(width: int, data: st.DataObject) -> None:
    values = np.array(
        data.draw(st.lists(st.integers(0, 2**width - 1), max_size=200)), dtype=np.uint64
    )
    packed = pack_uint(values, width)
    assert len(packed) == packed_nbytes(values.size, width)
    np.testing.assert_array_equal(unpack_uint(packed, width, values.size), values)


def test_bit_order_is_little_endian_within_bytes() -> None:
    assert pack_uint(np.array([1, 0, 0, 0, 0, 0, 0, 1]), 1) == b"\x81"
    assert pack_uint(np.array([0x3, 0x0, 0x1, 0x2]), 2) == bytes([0b10010011])
    assert pack_uint(np.array([0xA, 0x5]), 4) == b"\x5a"
    assert pack_uint(np.array([0x1FF]), 9) == b"\xff\x01"
