"""The base-model directory a federation starts from, and loading it back.

Files written by :func:`export_base_model`:

``model.safetensors``  weights (the tied LM head stored once, as ``wte.weight``)
``config.json``        ``{"model": GPTConfig fields, "tokenizer": {...}, "format": 1}``
``tokenizer.json``     the character tokenizer alone (what a device needs to encode text)
``lora_targets.json``  ``{"target_modules": [...]}``, ready for peft's ``LoraConfig``
``model.onnx``         the base model for ONNX Runtime, input ``input_ids`` (batch, seq)
                       int64, output ``logits`` (batch, seq, vocab) float32; checked
                       against torch to 1e-4 before it is kept
"""

from __future__ import annotations

import json
import logging
import tempfile
import warnings
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_model, save_model

from orchard.errors import OrchardError
from orchard.gpt import GPT, GPTConfig
from orchard.text import CharTokenizer

FORMAT_VERSION = 1
ONNX_TOLERANCE = 1e-4


class ExportError(OrchardError):
    """A base model could not be written, or its ONNX export disagrees with torch."""


class BaseModelError(OrchardError):
    """A base-model directory is missing files or holds weights that do not fit its config."""


def export_base_model(
    model: GPT, tokenizer: CharTokenizer, out_dir: Path, onnx: bool = True
) -> dict[str, float]:
    """Write the base-model files; returns measurements (``onnx_max_abs_diff``)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    model = model.eval()
    # save_model drops the tied duplicate (lm_head.weight) and load_model restores the tie.
    save_model(model, str(out_dir / "model.safetensors"), metadata={"format": str(FORMAT_VERSION)})
    config = {
        "format": FORMAT_VERSION,
        "model": model.config.to_dict(),
        "tokenizer": tokenizer.to_dict(),
    }
    (out_dir / "config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False))
    tokenizer.save(out_dir / "tokenizer.json")
    (out_dir / "lora_targets.json").write_text(
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
    d = Path(directory)
    missing = [f for f in ("config.json", "model.safetensors") if not (d / f).is_file()]
    if missing:
        raise BaseModelError(
            f"{d} is not a base-model directory: missing {missing} "
            "(it is written by `orchard pretrain`)"
        )
    config = json.loads((d / "config.json").read_text())
    if config.get("format") != FORMAT_VERSION:
        raise BaseModelError(
            f"{d}/config.json has format {config.get('format')!r}; this version reads {FORMAT_VERSION}"
        )
    tokenizer = CharTokenizer.from_dict(config["tokenizer"])
    model = GPT(GPTConfig.from_dict(config["model"]))
    try:
        load_model(model, str(d / "model.safetensors"), strict=True, device="cpu")
    except RuntimeError as err:
        raise BaseModelError(f"{d}/model.safetensors does not fit its config.json: {err}") from err
    return model.eval(), tokenizer
