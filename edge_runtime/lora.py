"""LoRA on a frozen base, through peft: the adapter is the federated model.

A LoRA layer replaces ``W x`` by ``W x + s B A x`` with ``A`` (r x k), ``B`` (d x r),
``s = alpha / r`` and ``B = 0`` at the start (Hu et al., 2021), so the initial
adapted model *is* the base. The base never trains and never travels; the adapter is
the global state of a LoRA run, saved in peft's own format (``adapter_config.json`` +
``adapter_model.safetensors``) so the federated result loads onto the base with
``peft.PeftModel.from_pretrained`` in a plain script, or merges into it.

Two variants, chosen by :attr:`LoRASpec.variant`:

``"ffa"`` (default): FFA-LoRA (Sun et al., ICLR 2024). ``A`` is drawn once from a seed
every client shares (:attr:`LoRASpec.init_seed`) and frozen; only ``B`` trains and is
sent. Cost: per adapted layer ``d * r`` floats up and down, half of what ``"full"``
moves when ``d == k``. Exactness: with ``A`` shared, the weighted mean of the clients'
updates ``sum_i w_i s B_i A = s (sum_i w_i B_i) A`` is exactly what averaging ``B``
gives, so FedAvg of the adapter equals FedAvg of the merged models (to float rounding),
and linear codecs and secure aggregation of ``B`` lose nothing.

``"full"``: ``A`` and ``B`` both train and are sent: ``(d + k) * r`` floats per layer.
Averaging ``A`` and ``B`` separately is *not* averaging the updates:
``mean(B_i) mean(A_i) != mean(B_i A_i)`` in general (the cross terms differ), so the
aggregate is an approximation whose error grows with client drift. It has twice the
trainable parameters per rank, which can matter when the rank is small.

Determinism: ``A`` is initialised with peft's default scheme (Kaiming-uniform,
``a = sqrt(5)``) from a ``torch.Generator`` seeded with ``init_seed``; peft's own
initialisation draws from torch's global RNG, whose state is saved and restored
around it so wrapping a model never disturbs the caller's RNG.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from peft import LoraConfig, PeftModel, get_peft_model
from torch import nn

from orchard.errors import ConfigError, UpdateSchemaError
from orchard.trainer import EvalResult, StepGate, TrainConfig, Trainer, TrainResult, train_gated
from orchard.typing import NDArrays

VARIANTS = ("ffa", "full")
ADAPTER_NAME = "default"  # peft's adapter slot; the one Orchard uses


class LoRAError(UpdateSchemaError):
    """Arrays handed to a LoRA model are not its adapter tensors (names or shapes)."""


@dataclass(frozen=True)
class LoRASpec:
    """Which layers get an adapter and how big it is.

    ``target_modules`` are peft targets: module-name suffixes the task model declares
    (for :class:`orchard.gpt.GPT`, :func:`orchard.gpt.lora_target_modules`).
    """

    target_modules: tuple[str, ...]
    rank: int = 8
    alpha: int = 16  # peft's lora_alpha; the update is scaled by alpha / rank
    variant: str = "ffa"
    init_seed: int = 0
    dropout: float = 0.0  # > 0 draws from torch's global RNG: not deterministic

    def __post_init__(self) -> None:
        problems = []
        if not self.target_modules:
            problems.append("target_modules must name at least one module")
        if self.rank < 1:
            problems.append(f"rank must be >= 1, got {self.rank}")
        if self.alpha <= 0:
            problems.append(f"alpha must be > 0, got {self.alpha}")
        if self.variant not in VARIANTS:
            problems.append(f"variant must be one of {VARIANTS}, got {self.variant!r}")
        if not 0.0 <= self.dropout < 1.0:
            problems.append(f"dropout must be in [0, 1), got {self.dropout}")
        if problems:
            raise ConfigError(problems)

    @property
    def scaling(self) -> float:
        return self.alpha / self.rank

    def peft_config(self) -> LoraConfig:
        return LoraConfig(
            r=self.rank,
            lora_alpha=self.alpha,
            target_modules=list(self.target_modules),
            lora_dropout=self.dropout,
            bias="none",
        )


def _is_lora_a(name: str) -> bool:
    return ".lora_A." in name


def _is_lora_b(name: str) -> bool:
    return ".lora_B." in name


def apply_lora(base: nn.Module, spec: LoRASpec) -> PeftModel:
    """Wrap ``base`` (in place, as peft does) with adapters: base frozen, ``A`` from
    ``spec.init_seed``, ``B = 0``; ``requires_grad`` set on the trained tensors only."""
    saved = torch.get_rng_state()
    try:
        model = get_peft_model(base, spec.peft_config())
    finally:
        torch.set_rng_state(saved)
    gen = torch.Generator().manual_seed(spec.init_seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if _is_lora_a(name):
                nn.init.kaiming_uniform_(p, a=math.sqrt(5), generator=gen)
            elif _is_lora_b(name):
                p.zero_()
    trained = set(trainable_names(model, spec))
    for name, p in model.named_parameters():
        p.requires_grad_(name in trained)
    return model


def adapter_names(model: nn.Module) -> list[str]:
    """Every adapter tensor (``A`` and ``B``), in module order."""
    return [n for n, _ in model.named_parameters() if _is_lora_a(n) or _is_lora_b(n)]


def trainable_names(model: nn.Module, spec: LoRASpec) -> list[str]:
    """The tensors that train and travel: ``B`` only for FFA-LoRA, ``A`` and ``B`` for "full"."""
    if spec.variant == "ffa":
        return [n for n in adapter_names(model) if _is_lora_b(n)]
    return adapter_names(model)


def lora_model_factory(
    base_factory: Callable[[], nn.Module], spec: LoRASpec
) -> Callable[[], PeftModel]:
    """A factory of adapted models: the same base and the same ``A`` every call."""
    return lambda: apply_lora(base_factory(), spec)


def get_arrays(model: nn.Module, names: Sequence[str]) -> NDArrays:
    params = dict(model.named_parameters())
    return {n: params[n].detach().to(torch.float32).cpu().numpy().copy() for n in names}


def set_arrays(model: nn.Module, arrays: NDArrays, names: Sequence[str]) -> None:
    """Copy ``arrays`` into the adapter tensors ``names`` (exactly those, same shapes)."""
    if set(arrays) != set(names):
        missing = sorted(set(names) - set(arrays))[:3]
        extra = sorted(set(arrays) - set(names))[:3]
        raise LoRAError(
            f"arrays are not this model's adapter tensors: missing e.g. {missing}, unexpected e.g. {extra}; "
            "a LoRA run's global state holds only adapter tensors (B only for the FFA variant)"
        )
    params = dict(model.named_parameters())
    with torch.no_grad():
        for n in names:
            src = np.asarray(arrays[n])
            if tuple(params[n].shape) != src.shape:
                raise LoRAError(
                    f"adapter tensor {n!r}: expected shape {tuple(params[n].shape)}, got {src.shape}"
                )
            params[n].copy_(torch.from_numpy(np.ascontiguousarray(src)))


def save_adapter(model: PeftModel, directory: str | os.PathLike[str]) -> Path:
    """Write ``model``'s adapter in peft's format (``adapter_config.json`` +
    ``adapter_model.safetensors``); load it with :func:`load_adapter` or
    ``PeftModel.from_pretrained(base, directory)``."""
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(out), safe_serialization=True)
    return out


def save_global_adapter(
    base: nn.Module, spec: LoRASpec, arrays: NDArrays, directory: str | os.PathLike[str]
) -> Path:
    """Save a run's global adapter: ``arrays`` (``B``, or ``A`` and ``B``) on ``base``
    with the run's shared ``A``. ``base`` is wrapped in place."""
    model = apply_lora(base, spec)
    set_arrays(model, arrays, trainable_names(model, spec))
    return save_adapter(model, directory)


def load_adapter(base: nn.Module, directory: str | os.PathLike[str]) -> PeftModel:
    """``base`` with the adapter saved in ``directory`` (peft format)."""
    path = Path(directory)
    if not (path / "adapter_config.json").is_file():
        raise ConfigError(f"{path} holds no adapter_config.json: not a peft adapter directory")
    return PeftModel.from_pretrained(base, str(path))


def merge(model: PeftModel) -> nn.Module:
    """Fold the adapter into the base weights (``W + s B A``) and return the plain base
    module; the result runs without peft (ONNX export, on-device inference)."""
    return model.merge_and_unload()


class LoRATrainer:
    """A :class:`~orchard.trainer.Trainer` whose arrays are the adapter.

    Wraps an inner trainer built by ``make_trainer(model_factory, trainable_names)``
    (the reference torch trainer, or any trainer that trains the named tensors of
    the model the factory builds): LoRA changes which model is trained and which
    tensors travel, not the training loop. The inner trainer's step and example
    counts are reported unchanged, and a ``gate`` (the governor) is handed to it.
    """

    def __init__(
        self,
        base_factory: Callable[[], nn.Module],
        spec: LoRASpec,
        make_trainer: Callable[[Callable[[], nn.Module], list[str]], Trainer],
        trainable: Sequence[str] | None = None,
    ) -> None:
        self.spec = spec
        self._factory = lora_model_factory(base_factory, spec)
        # ``trainable`` (the adapter names, when the caller knows them) saves building
        # a probe model per client.
        self.names = (
            list(trainable) if trainable is not None else trainable_names(self._factory(), spec)
        )
        self.inner = make_trainer(self._factory, list(self.names))

    def _check(self, arrays: NDArrays) -> None:
        if list(arrays) != self.names:
            if set(arrays) == set(self.names):
                return
            raise LoRAError(
                f"expected the {len(self.names)} {self.spec.variant} adapter tensors "
                f"(e.g. {self.names[:2]}), got {len(arrays)} tensors (e.g. {list(arrays)[:2]})"
            )

    def train(
        self, arrays: NDArrays, config: TrainConfig, *, gate: StepGate | None = None,
        anchor: NDArrays | None = None,
    ) -> TrainResult:
        self._check(arrays)
        if anchor is not None:  # a personal adapter's proximal pull (orchard.client.personal)
            self._check(anchor)
            result = self.inner.train(arrays, config, gate=gate, anchor=anchor)  # type: ignore[call-arg]
        else:
            result = train_gated(self.inner, arrays, config, gate)
        self._check(result.arrays)
        return result

    def evaluate(self, arrays: NDArrays, config: TrainConfig) -> EvalResult:
        self._check(arrays)
        return self.inner.evaluate(arrays, config)
