"""The core wire parsers (``orchard.updates``, ``orchard.wire``) fed bytes no Orchard
node writes: each is refused with a named error. The inputs are the fuzzer's finds
(``fuzz/``), byte for byte."""

from __future__ import annotations

import pytest

from orchard.errors import UpdateSchemaError
from orchard.typing import TensorSpec
from orchard.updates import decode_partial

SCHEMA = (TensorSpec("w", (4, 3), "float32"), TensorSpec("b", (5,), "float32"))


@pytest.mark.parametrize("sizes", [(), (0,), (96, 40, 0)])
def test_a_partial_sum_with_another_count_of_sizes_than_its_schema_is_refused(sizes: tuple[int, ...]) -> None:
    # fuzz target partial_sum, input b"\xec": no sizes for a schema of two tensors (zip raised ValueError)
    with pytest.raises(UpdateSchemaError, match="payload sizes for a schema of 2 tensors"):
        decode_partial(b"\x00" * sum(sizes), SCHEMA, sizes)
