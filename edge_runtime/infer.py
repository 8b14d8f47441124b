"""On-device inference from a client bundle: ``orchard edge infer``.

Imports numpy, onnxruntime and the bundle reader only, never torch: this is what a
device without a training stack runs. The base model runs through ONNX Runtime with
the bundle's active adapter (:func:`~orchard.edge_runtime.bundle.run_inference`).

- Text (``--text``): the prompt is encoded with the bundle's character tokenizer,
  cut to the model's context, and the next-character distribution at the last
  position is reported, with a greedy continuation.
- Arrays (``--input FILE.npy``): the logits for the array, summarised.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .bundle import BundleError, read_bundle
from .bundle_task import read_bundle_task, read_tokenizer
from .ort_runtime import OrtLoraModel


@dataclass(frozen=True)
class NextChar:
    char: str
    probability: float


@dataclass(frozen=True)
class TextPrediction:
    prompt: str
    adapter_version: int
    top: list[NextChar]  # most likely next characters, best first
    continuation: str  # greedy: the argmax character, fed back, ``generate`` times
    logits: np.ndarray  # (vocab,) at the prompt's last position


@dataclass(frozen=True)
class LogitsSummary:
    shape: tuple[int, ...]
    dtype: str
    min: float
    max: float
    mean: float
    argmax_last: list[int]  # per batch row: the argmax class at the last position


def _softmax(x: np.ndarray) -> np.ndarray:
    z = np.exp(x - x.max())
    return z / z.sum()


def predict_text(
    bundle_dir: str | os.PathLike[str], text: str, *, top_k: int = 5, generate: int = 40
) -> TextPrediction:
    """Next characters after ``text`` from the bundle's model and active adapter."""
    root = Path(bundle_dir)
    if not text:
        raise BundleError("the prompt is empty: a next character needs at least one character before it")
    tokenizer = read_tokenizer(root)
    bundle = read_bundle(root)
    model = OrtLoraModel(bundle.model_path)
    adapter = model.load_adapter(bundle.adapter_path)
    sidecar = read_bundle_task(root)
    context = sidecar.context_len if sidecar is not None else None
    ids = tokenizer.encode(text)

    def last_logits(seq: list[int]) -> np.ndarray:
        window = seq[-context:] if context else seq
        out = model.run(np.asarray([window], dtype=np.int64), adapter)
        return np.asarray(out[0, -1], dtype=np.float64)

    logits = last_logits(ids)
    probs = _softmax(logits)
    order = np.argsort(-probs, kind="stable")[: max(top_k, 1)]
    top = [NextChar(tokenizer.chars[int(i)], float(probs[i])) for i in order]
    seq, new = list(ids), []
    step_logits = logits
    for _ in range(max(generate, 0)):
        nxt = int(np.argmax(step_logits))
        new.append(nxt)
        seq.append(nxt)
        step_logits = last_logits(seq)
    return TextPrediction(text, bundle.config.adapter_version, top, tokenizer.decode(new), logits.astype(np.float32))


def summarize_array(bundle_dir: str | os.PathLike[str], inputs: np.ndarray) -> LogitsSummary:
    """Run the bundle's model on ``inputs`` and summarise the logits."""
    bundle = read_bundle(bundle_dir)
    model = OrtLoraModel(bundle.model_path)
    out = np.asarray(model.run(inputs, model.load_adapter(bundle.adapter_path)))
    last = out.reshape(out.shape[0], -1, out.shape[-1])[:, -1, :] if out.ndim >= 2 else out[None]
    return LogitsSummary(
        shape=tuple(int(d) for d in out.shape),
        dtype=str(out.dtype),
        min=float(out.min()),
        max=float(out.max()),
        mean=float(out.mean()),
        argmax_last=[int(i) for i in last.argmax(axis=-1)],
    )
