"""The base-model directory a federation starts from, and loading it back.

Files written by :func:`export_base_model`:

``model.safetensors``  weights (the tied LM head stored once, as ``wte.weight``)
``config.json``        ``{"model": GPTConfig fields, "tokenizer": {...}, "format": 1}``
``tokenizer.json``     the character tokenizer alone (what a device needs to encode text)
``lora_targets.json``  ``{"target_modules": [...]}``, ready for peft's ``LoraConfig``
``model.onnx``         the base model for ONNX Runtime, input ``input_ids`` (batch, seq)
                       int64, output ``logits`` (batch, seq, vocab) float32; checked
                       against torch to 1e-4 before it is kept (unless ``export_onnx``
                       is off)

Reading a directory back is :func:`orchard.gpt.read_base_model` (core, so that tasks can
load a base without importing the recipe); :func:`load_base_model` wraps it.
"""

from __future__ import annotations

import json
import logging
import tempfile
import warnings
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import save_file

from orchard.errors import OrchardError
from orchard.gpt import (
    BASE_CONFIG,
    BASE_FORMAT_VERSION,
    BASE_LORA_TARGETS,
    BASE_TOKENIZER,
    BASE_WEIGHTS,
    GPT,
    BaseModelError,
    read_base_model,
)
from orchard.text import CharTokenizer

FORMAT_VERSION = BASE_FORMAT_VERSION
ONNX_TOLERANCE = 1e-4

__all__ = ["BaseModelError", "ExportError", "export_base_model", "export_onnx", "load_base_model"]


class ExportError(OrchardError):
    """A base model could not be written, or its ONNX export disagrees with torch."""


def export_base_model(
    model: GPT, tokenizer: CharTokenizer, out_dir: Path, onnx: bool = True
) -> dict[str, float]:
    """Write the base-model files; returns measurements (``onnx_max_abs_diff``)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    model = model.eval()
    # The tied head is stored once, as wte.weight (safetensors' load_model restores the
    # tie). One metadata key, so the same weights always give the same bytes.
    if model.lm_head.weight is not model.wte.weight:
        raise ExportError("the GPT's LM head is not tied to its token embedding")
    state = {k: v.contiguous() for k, v in model.state_dict().items() if k != "lm_head.weight"}
    save_file(state, str(out_dir / BASE_WEIGHTS), metadata={"format": str(FORMAT_VERSION)})
    config = {
        "format": FORMAT_VERSION,
        "model": model.config.to_dict(),
        "tokenizer": tokenizer.to_dict(),
    }
    (out_dir / BASE_CONFIG).write_text(json.dumps(config, indent=2, ensure_ascii=False))
    tokenizer.save(out_dir / BASE_TOKENIZER)
    (out_dir / BASE_LORA_TARGETS).write_text(
        json.dumps({"target_modules": GPT.lora_target_modules()}, indent=2)
    )
    measurements: dict[str, float] = {}
    if onnx:
        measurements["onnx_max_abs_diff"] = export_onnx(model, out_dir / "model.onnx")
    return measurements


def export_onnx(model: GPT, path: Path, tolerance: float = ONNX_TOLERANCE) -> float:
    """Export with dynamic batch and sequence axes, then compare ONNX Runtime's logits
    with torch's on a fixed input; returns the max abs difference or raises ExportError."""
    import onnxruntime as ort

    cfg = model.config
    gen = torch.Generator().manual_seed(0)
    example = torch.randint(0, cfg.vocab_size, (2, cfg.seq_len), generator=gen)
    batch, seq = torch.export.Dim("batch"), torch.export.Dim("seq", max=cfg.seq_len)
    # The exporter logs each stage at INFO/WARNING; keep the recipe's output readable.
    logging.getLogger("torch.onnx").setLevel(logging.ERROR)
    with tempfile.TemporaryDirectory(dir=path.parent) as tmp:
        tmp_path = Path(tmp) / path.name
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", FutureWarning)  # raised inside the exporter
                torch.onnx.export(
                    model,
                    (example,),
                    str(tmp_path),
                    input_names=["input_ids"],
                    output_names=["logits"],
                    dynamic_shapes={"idx": {0: batch, 1: seq}},
                    dynamo=True,
                    external_data=False,
                    verbose=False,
                )
        except Exception as err:
            raise ExportError(
                f"torch.onnx.export failed for {type(model).__name__}: {err}"
            ) from err
        session = ort.InferenceSession(str(tmp_path), providers=["CPUExecutionProvider"])
        worst = 0.0
        # Two shapes: the traced one and a shorter odd one, to prove the axes are dynamic.
        for idx in (example, example[:1, : max(1, cfg.seq_len // 2 - 1)]):
            with torch.no_grad():
                ref = model(idx).float().cpu().numpy()
            got = session.run(["logits"], {"input_ids": idx.cpu().numpy()})[0]
            worst = max(worst, float(np.abs(got - ref).max()))
        if not worst <= tolerance:
            raise ExportError(
                f"ONNX Runtime logits differ from torch by {worst:.3g} > {tolerance:g}; "
                "the ONNX file was not written"
            )
        tmp_path.replace(path)
    return worst


def load_base_model(directory: str | Path) -> tuple[GPT, CharTokenizer]:
    """Load ``(GPT in eval mode on CPU, CharTokenizer)`` from an exported directory."""
    base = read_base_model(directory)
    return base.model, base.tokenizer
