"""A small GPT-style decoder-only transformer (Radford et al., 2019; nanoGPT layout).

Shapes: ``idx`` is (B, T) int64 token ids with T <= ``seq_len``; ``GPT.forward(idx)``
returns logits (B, T, vocab_size), and ``GPT.forward(idx, targets)`` the mean
next-token cross-entropy against (B, T) ``targets`` (see :func:`lm_loss`). Blocks are
pre-LN::

    x = x + attn(ln_1(x))     # causal self-attention, scaled_dot_product_attention
    x = x + mlp(ln_2(x))      # d_model -> 4 d_model -> d_model, GELU

The LM head shares its weight with the token embedding (Press & Wolf, 2017). Every
projection is a plain ``nn.Linear`` with a stable name (``attn.qkv``, ``attn.proj``,
``mlp.fc``, ``mlp.proj``) so peft can wrap them by suffix: see :func:`lora_target_modules`.

A *base-model directory* (written by ``orchard pretrain``, read by :func:`read_base_model`)
holds ``model.safetensors`` (weights, the tied head stored once), ``config.json``
(``{"format": 1, "model": GPTConfig fields, "tokenizer": {...}}``), ``tokenizer.json`` and
``lora_targets.json`` (``{"target_modules": [...]}``). Reading it lives here, in the
core, so that tasks load a pretrained base without depending on the pretraining recipe.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from orchard.config import BASE_CONFIG, BASE_WEIGHTS
from orchard.errors import ConfigError, OrchardError
from orchard.text import CharTokenizer, TokenizerError

# Suffixes of the Linear modules LoRA adapts. peft matches a target name against a
# module name by equality or by ``name.endswith("." + target)``, so these select every
# block's projections and never the tied LM head.
LORA_TARGET_MODULES: tuple[str, ...] = ("attn.qkv", "attn.proj", "mlp.fc", "mlp.proj")

# The files of a base-model directory.
BASE_FORMAT_VERSION = 1
BASE_TOKENIZER = "tokenizer.json"
BASE_LORA_TARGETS = "lora_targets.json"


@dataclass(frozen=True)
class GPTConfig:
    """Architecture of a :class:`GPT`. Defaults are a tiny character-level model."""

    vocab_size: int = 65
    seq_len: int = 256
    n_layer: int = 4
    n_head: int = 4
    d_model: int = 128
    dropout: float = 0.0
    bias: bool = True

    def __post_init__(self) -> None:
        problems = []
        for name in ("vocab_size", "seq_len", "n_layer", "n_head", "d_model"):
            if getattr(self, name) < 1:
                problems.append(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.n_head >= 1 and self.d_model % self.n_head:
            problems.append(f"d_model ({self.d_model}) must be divisible by n_head ({self.n_head})")
        if not 0.0 <= self.dropout < 1.0:
            problems.append(f"dropout must be in [0, 1), got {self.dropout}")
        if problems:
            raise ConfigError(problems)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> GPTConfig:
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ConfigError(
                f"unknown GPTConfig fields {unknown}; expected a subset of {sorted(known)}"
            )
        return cls(**data)


def lm_loss(h: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy of the LM head's logits ``h @ weight.T`` against ``targets``.

    The logits are upcast to float32 for the softmax. Written as one function so that
    :meth:`GPT.compile` can compile it whole: the upcast, log-softmax and loss then fuse
    and the float32 (B, T, vocab) logits are never written out, which matters on a GPU,
    where that tensor is the largest one the step touches.
    """
    logits = F.linear(h, weight)
    return F.cross_entropy(logits.float().view(-1, logits.size(-1)), targets.reshape(-1))


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.n_head = cfg.n_head
        self.dropout = cfg.dropout
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model, bias=cfg.bias)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model, bias=cfg.bias)
        self.resid_drop = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.qkv(x).split(C, dim=2)
        # (B, T, C) -> (B, n_head, T, head_dim)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(
            q, k, v, dropout_p=self.dropout if self.training else 0.0, is_causal=True
        )
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        return self.resid_drop(self.proj(y))


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.fc = nn.Linear(cfg.d_model, 4 * cfg.d_model, bias=cfg.bias)
        self.proj = nn.Linear(4 * cfg.d_model, cfg.d_model, bias=cfg.bias)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(self.proj(F.gelu(self.fc(x))))


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.d_model, bias=cfg.bias)
        self.attn = CausalSelfAttention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.d_model, bias=cfg.bias)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    """Decoder-only transformer: ``forward(idx) -> logits``.

    ``activation_checkpointing`` (a training choice, not part of the architecture)
    recomputes each block in the backward pass instead of storing its activations.
    """

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.config = cfg
        self.activation_checkpointing = False
        self.wte = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.wpe = nn.Embedding(cfg.seq_len, cfg.d_model)
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.d_model, bias=cfg.bias)
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        self.lm_head.weight = self.wte.weight  # tied
        self._lm_loss = lm_loss  # replaced by its compiled form in compile()
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """GPT-2 init: N(0, 0.02), residual projections scaled by 1/sqrt(2 n_layer)
        so the residual stream's variance does not grow with depth."""
        for name, p in self.named_parameters():
            if p.dim() >= 2:
                std = 0.02
                if name.endswith("attn.proj.weight") or name.endswith("mlp.proj.weight"):
                    std = 0.02 / math.sqrt(2 * self.config.n_layer)
                nn.init.normal_(p, mean=0.0, std=std)
            elif name.endswith(".bias"):
                nn.init.zeros_(p)
            else:  # LayerNorm weight
                nn.init.ones_(p)

    def compile(self, *args: Any, scope: str = "blocks", **kwargs: Any) -> None:
        """Compile with ``torch.compile`` (``args`` and ``kwargs`` go to it).

        ``scope="blocks"`` (the default) compiles each block and the loss head: a block is
        the unit FSDP2 shards and activation checkpointing recomputes, and all blocks
        share one compiled graph; the embeddings and the final norm stay eager.
        ``scope="model"`` compiles the whole forward (embeddings, blocks, final norm and
        loss head) as one graph, so inductor can also fuse across block boundaries (one
        block's last residual add with the next block's LayerNorm); for one process or DDP.
        """
        if scope == "blocks":
            for block in self.blocks:
                block.compile(*args, **kwargs)
            self._lm_loss = torch.compile(lm_loss, *args, **kwargs)
        elif scope == "model":
            super().compile(*args, **kwargs)
        else:
            raise ConfigError(f"compile scope must be 'blocks' or 'model', got {scope!r}")

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        t = idx.shape[1]
        if t > self.config.seq_len:
            raise ValueError(f"sequence of length {t} exceeds seq_len {self.config.seq_len}")
        pos = torch.arange(t, device=idx.device)
        x = self.drop(self.wte(idx) + self.wpe(pos))
        for block in self.blocks:
            if self.activation_checkpointing and self.training:
                x = checkpoint(block, x, use_reentrant=False)
            else:
                x = block(x)
        h = self.ln_f(x)
        if targets is None:
            return self.lm_head(h)
        return self._lm_loss(h, self.lm_head.weight, targets)

    @classmethod
    def lora_target_modules(cls) -> list[str]:
        """Module-name suffixes LoRA should adapt; pass as peft ``target_modules``."""
        return list(LORA_TARGET_MODULES)

    def num_params(self, non_embedding: bool = True) -> int:
        """Parameter count (tied weights once). ``non_embedding`` drops the position
        embedding, which does no matmul; the token embedding stays because the LM
        head reuses it."""
        n = sum(p.numel() for p in self.parameters())
        if non_embedding:
            n -= self.wpe.weight.numel()
        return n

    def flops_per_token(self, seq_len: int | None = None) -> int:
        """Training FLOPs per token (forward + backward), PaLM appendix B:
        ``6 N + 12 L H Q T`` with N non-embedding parameters, L layers, H heads, Q the
        head dim and T the sequence length (attention scores and values)."""
        c = self.config
        t = seq_len or c.seq_len
        return 6 * self.num_params() + 12 * c.n_layer * c.n_head * (c.d_model // c.n_head) * t

    @torch.no_grad()
    def generate(
        self,
        idx: torch.Tensor,
        max_new_tokens: int,
        temperature: float = 1.0,
        generator: torch.Generator | None = None,
    ) -> torch.Tensor:
        """Sample ``max_new_tokens`` continuations of ``idx`` (B, T); greedy when temperature is 0."""
        for _ in range(max_new_tokens):
            logits = self(idx[:, -self.config.seq_len :])[:, -1, :]
            if temperature == 0:
                nxt = logits.argmax(dim=-1, keepdim=True)
            else:
                probs = F.softmax(logits / temperature, dim=-1)
                nxt = torch.multinomial(probs, 1, generator=generator)
            idx = torch.cat([idx, nxt], dim=1)
        return idx


def lora_target_modules() -> list[str]:
    """Module-name suffixes LoRA should adapt in a :class:`GPT`."""
    return GPT.lora_target_modules()


class BaseModelError(OrchardError):
    """A base-model directory is missing files or holds weights that do not fit its config."""


@dataclass(frozen=True)
class BaseModel:
    """A base-model directory, loaded: the GPT (eval mode, CPU), its tokenizer and the
    module-name suffixes LoRA adapts."""

    model: GPT
    tokenizer: CharTokenizer
    lora_targets: tuple[str, ...]
    directory: Path


def read_base_model(directory: str | Path) -> BaseModel:
    """Load the base-model directory that ``orchard pretrain`` wrote to ``directory``."""
    from safetensors.torch import load_model

    d = Path(directory)
    needed = (BASE_CONFIG, BASE_WEIGHTS, BASE_LORA_TARGETS)
    missing = [f for f in needed if not (d / f).is_file()]
    if missing:
        raise BaseModelError(
            f"{d} is not a base-model directory: missing {missing} "
            "(it is written by `orchard pretrain`)"
        )
    try:
        config = json.loads((d / BASE_CONFIG).read_text(encoding="utf-8"))
        targets = json.loads((d / BASE_LORA_TARGETS).read_text(encoding="utf-8"))["target_modules"]
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise BaseModelError(
            f"{d}: cannot read {BASE_CONFIG} or {BASE_LORA_TARGETS}: {err}"
        ) from err
    if config.get("format") != BASE_FORMAT_VERSION:
        raise BaseModelError(
            f"{d}/{BASE_CONFIG} has format {config.get('format')!r}; "
            f"this version reads {BASE_FORMAT_VERSION}"
        )
    try:
        tokenizer = CharTokenizer.from_dict(config["tokenizer"])
        model = GPT(GPTConfig.from_dict(config["model"]))
    except (KeyError, TypeError, ConfigError, TokenizerError) as err:
        raise BaseModelError(
            f"{d}/{BASE_CONFIG} does not describe a GPT and tokenizer: {err}"
        ) from err
    if tokenizer.vocab_size > model.config.vocab_size:
        raise BaseModelError(
            f"{d}: the tokenizer has {tokenizer.vocab_size} tokens, the model only "
            f"{model.config.vocab_size}"
        )
    names = [n for n, m in model.named_modules() if isinstance(m, nn.Linear)]
    if (
        not isinstance(targets, list)
        or not targets
        or not all(
            isinstance(t, str) and any(n == t or n.endswith("." + t) for n in names)
            for t in targets
        )
    ):
        raise BaseModelError(
            f"{d}/{BASE_LORA_TARGETS} lists {targets!r}: expected a non-empty list of suffixes "
            "of the model's Linear modules, e.g. " + json.dumps(list(LORA_TARGET_MODULES))
        )
    try:
        # load_model restores the tie of lm_head.weight to wte.weight (stored once).
        load_model(model, str(d / BASE_WEIGHTS), strict=True, device="cpu")
    except RuntimeError as err:
        raise BaseModelError(f"{d}/{BASE_WEIGHTS} does not fit its {BASE_CONFIG}: {err}") from err
    return BaseModel(model.eval(), tokenizer, tuple(targets), d)
