"""Shared strategies and codec specs for the compression tests (imported by name: test
folders here have no __init__.py, so module names must be unique across tests/)."""

from __future__ import annotations

import hypothesis.extra.numpy as hnp
import numpy as np
from hypothesis import settings
from hypothesis import strategies as st

from orchard.config import CodecSpec

settings.register_profile("compression", max_examples=30, deadline=None, derandomize=True)

TOPK_QSGD = CodecSpec(
    name="pipeline",
    params={"stages": [{"name": "topk", "params": {"fraction": 0.25}}, {"name": "qsgd"}]},
)
RANDK_QSGD_FIXED = CodecSpec(
    name="pipeline",
    params={
        "stages": [
            {"name": "randk", "params": {"fraction": 0.5}},
            {"name": "qsgd", "params": {"bits": 8, "scale": 2000.0}},
        ]
    },
)

# Every codec, and the pipelines and wrappers the platform uses, by a readable id.
SPECS: dict[str, CodecSpec] = {
    "float32": CodecSpec(name="float32"),
    "float16": CodecSpec(name="float16"),
    "bfloat16": CodecSpec(name="bfloat16"),
    "qsgd8": CodecSpec(name="qsgd", params={"bits": 8}),
    "qsgd4-block16": CodecSpec(name="qsgd", params={"bits": 4, "block": 16}),
    "qsgd2": CodecSpec(name="qsgd", params={"bits": 2}),
    "qsgd1-block7": CodecSpec(name="qsgd", params={"bits": 1, "block": 7}),
    "qsgd8-fixed": CodecSpec(name="qsgd", params={"bits": 8, "scale": 2000.0}),
    "sign": CodecSpec(name="sign"),
    "topk": CodecSpec(name="topk", params={"fraction": 0.3}),
    "topk-k3": CodecSpec(name="topk", params={"k": 3}),
    "randk": CodecSpec(name="randk", params={"fraction": 0.4}),
    "randk-biased": CodecSpec(name="randk", params={"k": 5, "unbiased": False}),
    "powersgd": CodecSpec(name="powersgd", params={"rank": 2}),
    "topk+qsgd": TOPK_QSGD,
    "randk+qsgd-fixed": RANDK_QSGD_FIXED,
    "ef-topk": CodecSpec(name="error_feedback", params={"codec": {"name": "topk"}}),
    "ef-sign": CodecSpec(name="error_feedback", params={"codec": {"name": "sign"}}),
    "ef-powersgd": CodecSpec(name="error_feedback", params={"codec": {"name": "powersgd"}}),
    "ef-topk+qsgd": CodecSpec(name="error_feedback", params={"codec": TOPK_QSGD.model_dump()}),
}

DTYPES = [np.float16, np.float32, np.float64, np.int32]

shapes = hnp.array_shapes(min_dims=0, max_dims=3, min_side=0, max_side=9)


@st.composite
def tensors(
    draw: st.DrawFn, shape: st.SearchStrategy = shapes, bound: float = 1000.0
) -> np.ndarray:
    """Finite arrays of a random shape and dtype, |x| <= bound (float16's range covers it)."""
    dtype = draw(st.sampled_from(DTYPES))
    elements = (
        st.integers(-int(bound), int(bound))
        if dtype == np.int32
        else st.floats(-bound, bound, allow_nan=False, width=16 if dtype == np.float16 else 32)
    )
    return draw(hnp.arrays(dtype, draw(shape), elements=elements))


@st.composite
def matrices(draw: st.DrawFn, min_side: int = 1, max_side: int = 12) -> np.ndarray:
    shape = draw(hnp.array_shapes(min_dims=2, max_dims=3, min_side=min_side, max_side=max_side))
    return draw(hnp.arrays(np.float32, shape, elements=st.floats(-100, 100, width=32)))


settings.load_profile("compression")
