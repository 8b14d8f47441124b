"""Build codecs from :class:`orchard.config.CodecSpec` and check them against secure aggregation.

Every problem in a spec is reported at once, with the valid options.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from pydantic import ValidationError

from orchard.compression.base import BaseCodec, Codec
from orchard.compression.casts import bfloat16_codec, float16_codec, float32_codec
from orchard.compression.feedback import ErrorFeedback
from orchard.compression.powersgd import PowerSGDCodec
from orchard.compression.quantize import QUANT_BITS, qsgd_codec, sign_codec
from orchard.compression.sparse import RandK, SparsifiedCodec, TopK
from orchard.config import CodecSpec
from orchard.errors import ConfigError

Problems = list[str]

# name -> (accepted params with their meaning). The order is the order of the docs.
CODEC_PARAMS: dict[str, dict[str, str]] = {
    "float32": {},
    "float16": {},
    "bfloat16": {},
    "qsgd": {
        "bits": "bits per element, one of 1, 2, 4, 8 (default 8)",
        "block": "elements per scale (int >= 1); omit for one scale per tensor",
        "scale": "fixed scale (float > 0) shared by all clients; makes qsgd field-linear",
    },
    "sign": {},
    "topk": {
        "fraction": "fraction of elements kept, in (0, 1] (default 0.01)",
        "k": "number of elements kept (int >= 1); give k or fraction, not both",
    },
    "randk": {
        "fraction": "fraction of elements kept, in (0, 1] (default 0.01)",
        "k": "number of elements kept (int >= 1); give k or fraction, not both",
        "unbiased": "scale decoded values by d / k (bool, default true)",
    },
    "powersgd": {"rank": "rank r of the two factors (int >= 1, default 4)"},
    "pipeline": {
        "stages": "list of codec specs: topk/randk stages, then one stateless value codec",
    },
    "error_feedback": {"codec": "the codec spec to wrap (any codec but error_feedback)"},
}

SECAGG_REASONS = {
    "float16": "rounded float16 values do not add exactly",
    "bfloat16": "rounded bfloat16 values do not add exactly",
    "qsgd": "each client scales by its own max, so integer codes of two clients do not add "
    "(set params.scale to a fixed scale to make qsgd field-linear)",
    "sign": "each client scales by its own mean |x|, and sign is not linear",
    "topk": "top-k keeps data-dependent coordinates, different on every client",
    "powersgd": "PowerSGD factors add by concatenation, not element-wise in a field",
}

SECAGG_CODECS = (
    "float32",
    "qsgd with params.scale set",
    "randk (alone, or in a pipeline before float32 or qsgd with params.scale)",
    "error_feedback around any of these",
)


def available_codecs() -> tuple[str, ...]:
    """Names ``build_codec`` accepts."""
    return tuple(CODEC_PARAMS)


def build_codec(spec: CodecSpec | Mapping[str, Any]) -> Codec:
    """Build a codec; raise ConfigError listing every problem and the valid options."""
    problems: Problems = []
    codec = _build(_as_spec(spec, "codec"), problems, "codec")
    if problems or codec is None:
        raise ConfigError(problems or ["codec: could not be built"])
    return codec


def validate_codec_for_secure_aggregation(spec: CodecSpec | Mapping[str, Any]) -> None:
    """Refuse codecs whose payloads do not add modulo secure aggregation's field."""
    codec = build_codec(spec)
    if codec.algebra.field_linear:
        return
    reasons = [SECAGG_REASONS[n] for n in _base_names(codec.name) if n in SECAGG_REASONS]
    raise ConfigError(
        f"codec {codec.name!r} cannot run under secure aggregation: "
        f"{'; '.join(reasons) or 'it is not linear modulo the field'}. Codecs that can: "
        + ", ".join(SECAGG_CODECS)
    )


def _base_names(name: str) -> list[str]:
    for ch in "()+":
        name = name.replace(ch, " ")
    return name.split()


def _as_spec(spec: object, where: str) -> CodecSpec | None:
    if isinstance(spec, CodecSpec):
        return spec
    try:
        return CodecSpec.model_validate(spec)
    except ValidationError as err:
        msgs = "; ".join(
            f"{'.'.join(map(str, e['loc'])) or 'spec'}: {e['msg']}" for e in err.errors()
        )
        raise ConfigError(f"{where}: not a codec spec ({msgs})") from None


def _build(spec: CodecSpec | None, problems: Problems, where: str) -> BaseCodec | None:
    if spec is None:
        return None
    if spec.name not in CODEC_PARAMS:
        problems.append(
            f"{where}.name: unknown codec {spec.name!r}; valid codecs: " + ", ".join(CODEC_PARAMS)
        )
        return None
    start = len(problems)
    _check_keys(spec, problems, where)
    codec = _BUILDERS[spec.name](dict(spec.params), problems, f"{where}.params")
    return codec if len(problems) == start else None


def _check_keys(spec: CodecSpec, problems: Problems, where: str) -> None:
    allowed = CODEC_PARAMS[spec.name]
    for key in spec.params:
        if key not in allowed:
            valid = ", ".join(f"{k} ({v})" for k, v in allowed.items()) or "none"
            problems.append(f"{where}.params: {spec.name} has no parameter {key!r}; valid: {valid}")


def _int(p: dict, key: str, default: int | None, lo: int, problems: Problems, where: str) -> Any:
    v = p.get(key, default)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int) or v < lo:
        problems.append(f"{where}.{key}: expected an int >= {lo}, got {v!r}")
    return v


def _qsgd(p: dict, problems: Problems, where: str) -> BaseCodec | None:
    start = len(problems)
    bits = p.get("bits", 8)
    if bits not in QUANT_BITS or isinstance(bits, bool):
        problems.append(f"{where}.bits: expected one of {QUANT_BITS}, got {bits!r}")
    block = _int(p, "block", None, 1, problems, where)
    scale = p.get("scale")
    if scale is not None and (
        isinstance(scale, bool) or not isinstance(scale, int | float) or not scale > 0
    ):
        problems.append(f"{where}.scale: expected a float > 0, got {scale!r}")
    if scale is not None and block is not None:
        problems.append(f"{where}: give block (per-block scales) or scale (fixed), not both")
    return qsgd_codec(bits, block, scale) if len(problems) == start else None


def _keep(p: dict, problems: Problems, where: str) -> tuple[int | None, float | None]:
    k = _int(p, "k", None, 1, problems, where)
    fraction = p.get("fraction")
    if k is not None and fraction is not None:
        problems.append(f"{where}: give k or fraction, not both")
    if fraction is not None and (
        isinstance(fraction, bool) or not isinstance(fraction, int | float) or not 0 < fraction <= 1
    ):
        problems.append(f"{where}.fraction: expected a float in (0, 1], got {fraction!r}")
    if k is None and fraction is None:
        fraction = 0.01
    return k, fraction


def _topk_selector(p: dict, problems: Problems, where: str) -> TopK:
    return TopK(*_keep(p, problems, where))


def _randk_selector(p: dict, problems: Problems, where: str) -> RandK:
    unbiased = p.get("unbiased", True)
    if not isinstance(unbiased, bool):
        problems.append(f"{where}.unbiased: expected true or false, got {unbiased!r}")
    k, fraction = _keep(p, problems, where)
    return RandK(k, fraction, bool(unbiased))


_SELECTORS: dict[str, Callable[[dict, Problems, str], TopK | RandK]] = {
    "topk": _topk_selector,
    "randk": _randk_selector,
}


def _sparse(name: str) -> Callable[[dict, Problems, str], BaseCodec]:
    def build(p: dict, problems: Problems, where: str) -> BaseCodec:
        return SparsifiedCodec(_SELECTORS[name](p, problems, where), float32_codec(), name)

    return build


def _powersgd(p: dict, problems: Problems, where: str) -> BaseCodec:
    return PowerSGDCodec(_int(p, "rank", 4, 1, problems, where))


def _pipeline(p: dict, problems: Problems, where: str) -> BaseCodec | None:
    stages = p.get("stages")
    if not isinstance(stages, list | tuple) or not stages:
        problems.append(f"{where}.stages: expected a non-empty list of codec specs, got {stages!r}")
        return None
    specs = [_as_spec(s, f"{where}.stages[{i}]") for i, s in enumerate(stages)]
    *sparse, last = specs
    for i, s in enumerate(sparse):
        if s is not None and s.name not in _SELECTORS:
            problems.append(
                f"{where}.stages[{i}]: only topk or randk may come before the last stage, "
                f"got {s.name!r}"
            )
    codec = _build(last, problems, f"{where}.stages[{len(specs) - 1}]")
    if codec is not None and codec.algebra.stateful:
        problems.append(
            f"{where}.stages[{len(specs) - 1}]: the value codec must be stateless, got "
            f"{codec.name!r}; wrap the whole pipeline in error_feedback instead"
        )
    for i, s in reversed(list(enumerate(sparse))):
        if s is None or s.name not in _SELECTORS or codec is None or codec.algebra.stateful:
            continue
        _check_keys(s, problems, f"{where}.stages[{i}]")
        selector = _SELECTORS[s.name](dict(s.params), problems, f"{where}.stages[{i}].params")
        codec = SparsifiedCodec(selector, codec, f"{s.name}+{codec.name}")
    return codec


def _error_feedback(p: dict, problems: Problems, where: str) -> Any:
    if "codec" not in p:
        problems.append(f"{where}.codec: error_feedback needs the codec spec it wraps")
        return None
    inner_spec = _as_spec(p["codec"], f"{where}.codec")
    if inner_spec is not None and inner_spec.name == "error_feedback":
        problems.append(f"{where}.codec: error_feedback cannot wrap error_feedback")
        return None
    inner = _build(inner_spec, problems, f"{where}.codec")
    return ErrorFeedback(inner) if inner is not None else None


_BUILDERS: dict[str, Callable[[dict, Problems, str], Any]] = {
    "float32": lambda p, problems, where: float32_codec(),
    "float16": lambda p, problems, where: float16_codec(),
    "bfloat16": lambda p, problems, where: bfloat16_codec(),
    "qsgd": _qsgd,
    "sign": lambda p, problems, where: sign_codec(),
    "topk": _sparse("topk"),
    "randk": _sparse("randk"),
    "powersgd": _powersgd,
    "pipeline": _pipeline,
    "error_feedback": _error_feedback,
}
