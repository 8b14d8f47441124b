"""A run's ``downlink_codec``: what a tier's delta is encoded with, what a client rebuilds
from, and which codecs validation refuses."""

from __future__ import annotations

import numpy as np

from orchard import wire
from orchard.client.runtime import apply_downlink_delta
from orchard.config import DOWNLINK_CODEC, CodecSpec, parse_run_config
from orchard.server.downlink import encode_delta_reply
from orchard.validation import data_problems

FOUR_BIT = CodecSpec(name="qsgd", params={"bits": 4, "block": 4096})
SPARSE = CodecSpec(name="pipeline", params={"stages": [{"name": "topk", "params": {"fraction": 0.25}},
                                                       {"name": "qsgd", "params": {"bits": 4}}]})


def _blobs() -> tuple[bytes, bytes]:
    rng = np.random.default_rng(0)
    base = {"a": rng.standard_normal((64, 8)).astype(np.float32), "b": rng.standard_normal(300).astype(np.float32)}
    target = {k: v + (0.01 * rng.standard_normal(v.shape)).astype(np.float32) for k, v in base.items()}
    return wire.arrays_to_blob(base), wire.arrays_to_blob(target)


def test_the_delta_goes_through_the_runs_codec_and_the_client_rebuilds_the_stated_model() -> None:
    base, target = _blobs()
    bh, th = wire.sha256_hex(base), wire.sha256_hex(target)
    sizes = {}
    for spec in (DOWNLINK_CODEC, FOUR_BIT, SPARSE):
        got = encode_delta_reply(base, bh, target, th, spec)
        assert got is not None
        reply, result = got
        assert CodecSpec.model_validate_json(reply.encoding) == spec
        rebuilt = apply_downlink_delta(base, reply.blob, bh, reply.encoding)
        assert rebuilt == result and wire.sha256_hex(rebuilt) == reply.result_sha256
        sizes[spec.model_dump_json()] = len(reply.blob)
    eight, four, sparse = sizes.values()
    assert four < 0.65 * eight and sparse < four, sizes


def test_validate_refuses_a_stateful_downlink_codec() -> None:
    ok = parse_run_config({"task": "digits", "downlink_delta": True, "downlink_codec": FOUR_BIT.model_dump()})
    assert data_problems({"run": ok.model_dump(mode="json")}) == []
    bad = {"task": "digits", "downlink_delta": True,
           "downlink_codec": {"name": "error_feedback", "params": {"codec": {"name": "topk"}}}}
    problems = data_problems({"run": bad})
    assert len(problems) == 1 and "downlink_codec 'error_feedback' is stateful" in problems[0], problems
    unknown = data_problems({"run": {"task": "digits", "downlink_codec": {"name": "nope"}}})
    assert len(unknown) == 1 and unknown[0].startswith("downlink_codec: "), unknown
