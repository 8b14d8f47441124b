"""build_codec and secure-aggregation validation: every problem at once, with the options."""

from __future__ import annotations

import pytest

from orchard.compression import available_codecs, build_codec, validate_codec_for_secure_aggregation
from orchard.config import CodecSpec
from orchard.errors import ConfigError


def problems(spec: object) -> list[str]:
    with pytest.raises(ConfigError) as err:
        build_codec(spec)  # type: ignore[arg-type]
    return err.value.problems


def test_available_codecs() -> None:
    assert available_codecs() == (
        "float32", "float16", "bfloat16", "qsgd", "sign", "topk", "randk", "powersgd",
        "pipeline", "error_feedback",
    )  # fmt: skip


def test_unknown_codec_lists_the_valid_ones() -> None:
    (msg,) = problems(CodecSpec(name="zstd"))
    assert "unknown codec 'zstd'" in msg and "qsgd" in msg and "powersgd" in msg


def test_every_parameter_problem_is_reported_at_once() -> None:
    found = problems(CodecSpec(name="qsgd", params={"bits": 3, "block": 0, "colour": "red"}))
    assert len(found) == 3
    assert any("qsgd has no parameter 'colour'; valid: bits" in p for p in found)
    assert any("bits: expected one of (1, 2, 4, 8), got 3" in p for p in found)
    assert any("block: expected an int >= 1, got 0" in p for p in found)


@pytest.mark.parametrize(
    ("spec", "fragment"),
    [
        ({"name": "topk", "params": {"k": 3, "fraction": 0.1}}, "give k or fraction, not both"),
        ({"name": "topk", "params": {"fraction": 1.5}}, "expected a float in (0, 1], got 1.5"),
        ({"name": "randk", "params": {"unbiased": "yes"}}, "expected true or false"),
        ({"name": "powersgd", "params": {"rank": 0}}, "rank: expected an int >= 1, got 0"),
        ({"name": "qsgd", "params": {"scale": -1}}, "scale: expected a float > 0"),
        (
            {"name": "qsgd", "params": {"scale": 1.0, "block": 8}},
            "give block (per-block scales) or scale",
        ),
        ({"name": "pipeline", "params": {}}, "stages: expected a non-empty list"),
        (
            {"name": "pipeline", "params": {"stages": [{"name": "qsgd"}, {"name": "float16"}]}},
            "only topk or randk may come before the last stage, got 'qsgd'",
        ),
        (
            {"name": "pipeline", "params": {"stages": [{"name": "topk"}, {"name": "powersgd"}]}},
            "the value codec must be stateless, got 'powersgd'",
        ),
        (
            {
                "name": "pipeline",
                "params": {"stages": [{"name": "topk", "params": {"q": 1}}, {"name": "qsgd"}]},
            },
            "topk has no parameter 'q'",
        ),
        ({"name": "error_feedback", "params": {}}, "needs the codec spec it wraps"),
        (
            {"name": "error_feedback", "params": {"codec": {"name": "error_feedback"}}},
            "error_feedback cannot wrap error_feedback",
        ),
        (
            {"name": "float32", "params": {"bits": 8}},
            "float32 has no parameter 'bits'; valid: none",
        ),
    ],
)
def test_invalid_specs_are_refused_with_the_reason(spec: dict, fragment: str) -> None:
    found = problems(spec)
    assert any(fragment in p for p in found), found


def test_specs_may_be_plain_dicts_and_pipelines_nest() -> None:
    codec = build_codec(
        {"name": "error_feedback", "params": {"codec": {"name": "pipeline", "params": {
            "stages": [{"name": "topk", "params": {"fraction": 0.5}},
                       {"name": "randk", "params": {"k": 2}}, {"name": "qsgd", "params": {"bits": 4}}]}}}}
    )  # fmt: skip
    assert codec.name == "error_feedback(topk+randk+qsgd)"
    assert codec.algebra.stateful and not codec.algebra.linear


@pytest.mark.parametrize(
    "spec",
    [
        CodecSpec(name="float32"),
        CodecSpec(name="randk", params={"fraction": 0.1}),
        CodecSpec(name="qsgd", params={"bits": 8, "scale": 0.5}),
        CodecSpec(
            name="pipeline",
            params={"stages": [{"name": "randk"}, {"name": "qsgd", "params": {"scale": 1.0}}]},
        ),
        CodecSpec(name="error_feedback", params={"codec": {"name": "randk"}}),
    ],
)
def test_field_linear_codecs_pass_secure_aggregation_validation(spec: CodecSpec) -> None:
    validate_codec_for_secure_aggregation(spec)


@pytest.mark.parametrize(
    ("name", "params", "reason"),
    [
        ("topk", {}, "top-k keeps data-dependent coordinates"),
        ("qsgd", {}, "set params.scale to a fixed scale"),
        ("powersgd", {}, "factors add by concatenation"),
        ("sign", {}, "own mean |x|"),
        ("float16", {}, "do not add exactly"),
        (
            "pipeline",
            {"stages": [{"name": "randk"}, {"name": "qsgd"}]},
            "each client scales by its own max",
        ),
    ],
)
def test_other_codecs_are_refused_under_secure_aggregation_with_what_works(
    name: str, params: dict, reason: str
) -> None:
    with pytest.raises(ConfigError) as err:
        validate_codec_for_secure_aggregation(CodecSpec(name=name, params=params))
    msg = str(err.value)
    assert reason in msg and "cannot run under secure aggregation" in msg
    assert "Codecs that can: float32, qsgd with params.scale set, randk" in msg
