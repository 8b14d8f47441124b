"""Typed, validated configuration of the pretraining recipe.

A TOML file holds the fields at its top level or under ``[pretrain]``; command-line
overrides are dotted keys (``optim.lr=3e-4``) applied on top before validation, so every
problem, from the file or the flags, is reported at once.
"""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from orchard.config import load_toml
from orchard.errors import ConfigError


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class ModelSection(_Strict):
    """The GPT's shape. ``vocab_size`` None takes the tokenizer's; a larger value pads
    the embedding (a multiple of 64, e.g. 50304 for GPT-2, keeps matmuls on fast paths)."""

    vocab_size: int | None = Field(None, ge=1)
    seq_len: int = Field(128, ge=2)
    n_layer: int = Field(4, ge=1)
    n_head: int = Field(4, ge=1)
    d_model: int = Field(128, ge=1)
    dropout: float = Field(0.0, ge=0.0, lt=1.0)
    bias: bool = True


class DataSection(_Strict):
    """Text corpus and token shards.

    ``corpus`` lists UTF-8 text files; empty means the tinyshakespeare text shipped with
    ``orchard.tasks``. ``select`` (``"module:function"``, a function from a file's text to
    the text to use) keeps part of each file, e.g. the Shakespeare task's public roles
    (``"orchard.tasks.shakespeare:public_text"``); the vocabulary still covers every
    character of the whole files, so ids agree with a tokenizer built from them.
    ``shard_dir`` defaults to ``<output_dir>/data``. The last ``val_fraction`` of each
    (selected) text is held out. Training tokens are cut into ``shards`` equal shards
    that ranks split between them.
    """

    corpus: list[Path] = Field(default_factory=list)
    select: str | None = Field(None, pattern=r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$")
    shard_dir: Path | None = None
    shards: int = Field(8, ge=1)
    val_fraction: float = Field(0.1, gt=0.0, lt=0.5)
    prefetch: int = Field(4, ge=1)  # batches queued ahead by the loader thread


class OptimSection(_Strict):
    """AdamW with linear warmup then cosine decay to ``min_lr``; global-norm clipping."""

    lr: float = Field(1e-3, gt=0.0)
    min_lr: float = Field(1e-4, ge=0.0)
    warmup_steps: int = Field(10, ge=0)
    weight_decay: float = Field(0.1, ge=0.0)
    beta1: float = Field(0.9, ge=0.0, lt=1.0)
    beta2: float = Field(0.95, ge=0.0, lt=1.0)
    grad_clip: float = Field(1.0, ge=0.0)  # 0: no clipping


class PretrainConfig(_Strict):
    """One pretraining run.

    ``batch_size`` is the micro-batch per rank; one optimizer step sees
    ``batch_size * grad_accum * world_size`` sequences of ``model.seq_len`` tokens.
    ``precision`` "auto" is bf16 autocast on CUDA and fp32 on CPU. ``stop_after`` ends
    this invocation after that many steps with a checkpoint (as SIGTERM would);
    a later run with ``resume`` continues from it. SIGTERM is noticed at the next
    optimizer step. The base model is exported to ``export_dir`` (default ``output_dir``,
    which also holds checkpoints, metrics and, by default, token shards).
    """

    output_dir: Path = Path("pretrain-out")
    export_dir: Path | None = None
    seed: int = 0
    steps: int = Field(200, ge=1)
    batch_size: int = Field(16, ge=1)
    grad_accum: int = Field(1, ge=1)
    model: ModelSection = ModelSection()
    data: DataSection = DataSection()
    optim: OptimSection = OptimSection()

    device: Literal["auto", "cpu", "cuda"] = "auto"
    strategy: Literal["ddp", "fsdp"] = "ddp"
    precision: Literal["auto", "fp32", "bf16", "fp16"] = "auto"
    activation_checkpointing: bool = False
    compile: bool = False
    # What torch.compile covers: each block and the loss head ("blocks"), or the whole
    # forward as one graph ("model": fuses across blocks; one process or DDP only).
    compile_scope: Literal["blocks", "model"] = "blocks"

    checkpoint_every: int = Field(100, ge=0)  # 0: only on stop and at the end
    keep_checkpoints: int = Field(2, ge=1)
    resume: bool = True
    stop_after: int | None = Field(None, ge=1)

    log_every: int = Field(10, ge=1)
    eval_batches: int = Field(8, ge=0)  # validation batches at the end; 0: skip
    peak_flops: float | None = Field(None, gt=0.0)  # per device; overrides the GPU table
    progress: bool = True  # a rich progress bar on rank 0; log lines are printed either way
    export: bool = True
    export_onnx: bool = True

    @model_validator(mode="after")
    def _check(self) -> PretrainConfig:
        problems = []
        m = self.model
        if m.d_model % m.n_head:
            problems.append(
                f"model.d_model ({m.d_model}) must be divisible by model.n_head ({m.n_head})"
            )
        if self.optim.min_lr > self.optim.lr:
            problems.append(
                f"optim.min_lr ({self.optim.min_lr}) must not exceed optim.lr ({self.optim.lr})"
            )
        if self.precision == "fp16" and self.strategy == "fsdp":
            problems.append(
                "precision fp16 needs a GradScaler that understands sharded gradients; "
                "use precision bf16 with strategy fsdp, or strategy ddp with fp16"
            )
        if self.precision == "fp16" and self.device == "cpu":
            problems.append("precision fp16 is CUDA-only; on CPU use fp32 or bf16")
        if self.compile_scope == "model" and self.strategy == "fsdp":
            problems.append(
                "compile_scope 'model' compiles across FSDP2's per-block units; "
                "use compile_scope 'blocks' with strategy fsdp"
            )
        if problems:
            raise ValueError("; ".join(problems))
        return self


def _parse_value(text: str) -> Any:
    """A flag value as a TOML literal (numbers, booleans, arrays), else a plain string."""
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text


def apply_overrides(data: dict[str, Any], overrides: dict[str, Any] | list[str]) -> dict[str, Any]:
    """Set dotted keys (``"optim.lr=3e-4"`` strings or a ``{"optim.lr": 3e-4}`` dict)."""
    if isinstance(overrides, list):
        pairs: dict[str, Any] = {}
        for item in overrides:
            key, sep, value = item.partition("=")
            if not sep:
                raise ConfigError(f"override {item!r} is not KEY=VALUE (e.g. optim.lr=3e-4)")
            pairs[key] = _parse_value(value)
        overrides = pairs
    out = dict(data)
    for dotted, value in overrides.items():
        *parents, leaf = dotted.replace("-", "_").split(".")
        node = out
        for p in parents:
            child = dict(node.get(p) or {})
            node[p] = child
            node = child
        node[leaf] = value
    return out


def parse_pretrain_config(
    data: dict[str, Any], overrides: dict[str, Any] | list[str] | None = None
) -> PretrainConfig:
    """Validate a dict (plus overrides) into a PretrainConfig, reporting every problem."""
    data = apply_overrides(data, overrides or {})
    try:
        return PretrainConfig.model_validate(data)
    except ValidationError as err:
        problems = []
        for e in err.errors():
            loc = ".".join(str(p) for p in e["loc"]) or "(top level)"
            problems.append(f"{loc}: {e['msg']}")
        raise ConfigError(problems) from None


def load_pretrain_config(
    path: str | Path, overrides: dict[str, Any] | list[str] | None = None
) -> PretrainConfig:
    data = load_toml(path)
    return parse_pretrain_config(data.get("pretrain", data), overrides)
