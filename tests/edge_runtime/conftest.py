"""One exported base model shared by the ONNX Runtime and bundle tests (an export
takes seconds, so it is done once per session)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest


@dataclass
class ExportedGPT:
    peft_model: object  # peft.PeftModel wrapping orchard.gpt.GPT
    onnx_path: Path
    adapters: list[dict[str, np.ndarray]]  # two different federated adapter versions
    vocab_size: int


@pytest.fixture(scope="session")
def exported_gpt(tmp_path_factory: pytest.TempPathFactory) -> ExportedGPT:
    torch = pytest.importorskip("torch")
    from peft import LoraConfig, get_peft_model

    from orchard.edge_runtime.onnx_export import adapter_arrays, export_lora_model
    from orchard.gpt import GPT, LORA_TARGET_MODULES, GPTConfig

    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=65, seq_len=32, n_layer=2, n_head=2, d_model=32)
    model = get_peft_model(
        GPT(cfg), LoraConfig(r=4, lora_alpha=8, target_modules=list(LORA_TARGET_MODULES))
    )
    model.eval()
    gen = torch.Generator().manual_seed(1)
    adapters = []
    for _ in range(2):
        # Non-zero B (peft starts it at 0, which would make every adapter a no-op).
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "lora_" in name:
                    p.copy_(torch.randn(p.shape, generator=gen) * 0.2)
        adapters.append(adapter_arrays(model))
    path = tmp_path_factory.mktemp("onnx") / "gpt.onnx"
    export_lora_model(
        model, torch.zeros(2, 8, dtype=torch.long), path, dynamic_axes={0: "batch", 1: "seq"}
    )
    return ExportedGPT(model, path, adapters, cfg.vocab_size)
