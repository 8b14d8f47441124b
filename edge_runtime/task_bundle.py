"""A client bundle for a reference LoRA task: what ``orchard client bundle`` writes.

:func:`~orchard.edge_runtime.bundle.write_bundle` takes an exported base and an adapter
keyed by the base's LoRA input names. A federated LoRA run's global model is keyed
differently: it holds only the trained tensors (``B`` for FFA-LoRA), under peft's
*parameter* names (``...lora_B.default.weight``), while the ONNX graph takes every LoRA
matrix (``A`` too) under peft's *state-dict* keys (``...lora_B.weight``). So the global
tensors are loaded into the task's adapted model (whose frozen ``A`` comes from the
run's shared seed) and read back by state-dict key (:func:`onnx_adapter_of`).

Besides the files ``bundle.py`` describes, a task bundle holds the sidecars of
:mod:`orchard.edge_runtime.bundle_task` (the task, the tokenizer of a text task) and,
unless asked not to, the task's ExecuTorch training program
(:mod:`orchard.edge_runtime.et_export`), all written before ``client.json`` so that a
bundle with a config is complete.
"""

from __future__ import annotations

import json
import os
import re
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch
from peft import PeftModel
from torch import nn

from orchard.text import CharTokenizer
from orchard.typing import NDArrays

from .bundle import CONFIG_FILE, BundleError, ClientBundle, _write_atomic, write_bundle
from .bundle_task import TASK_FILE, TOKENIZER_FILE, BundleTask
from .lora import set_arrays
from .onnx_export import ExportError, adapter_arrays, export_lora_model
from .policy import DevicePolicy


class _Examples(Protocol):
    x: torch.Tensor


class LoRATask(Protocol):
    """What a bundle needs of a task (``orchard.tasks.SupervisedTask`` has it all).

    Taken as an argument, not looked up by name: the edge runtime sits below the
    reference tasks and does not import them.
    """

    name: str
    params: dict[str, Any]
    info: dict[str, Any]
    trainable: list[str]
    train_data: _Examples

    def build_model(self, seed: int | None = None) -> nn.Module: ...

    def initial_arrays(self, seed: int) -> NDArrays: ...


def _lora_model(task: LoRATask) -> PeftModel:
    model = task.build_model()
    if not isinstance(model, PeftModel):
        raise BundleError(
            f"task {task.name!r} trains a plain model, not a LoRA adapter: a bundle ships a base "
            "and an adapter (use a LoRA task, e.g. shakespeare with lora=true)"
        )
    model.eval()
    return model


def onnx_adapter_of(task: LoRATask, global_arrays: Mapping[str, np.ndarray]) -> NDArrays:
    """A run's global tensors (the task's trainable names) as the ONNX base's LoRA inputs."""
    model = _lora_model(task)
    set_arrays(model, dict(global_arrays), task.trainable)
    return adapter_arrays(model)


def write_task_bundle(
    bundle_dir: str | os.PathLike[str],
    *,
    task: LoRATask,
    server_address: str,
    global_arrays: Mapping[str, np.ndarray] | None = None,
    adapter_version: int = 0,
    policy: DevicePolicy | None = None,
    ca_cert: str | os.PathLike[str] | bytes | None = None,
    enrollment_token: str | None = None,
    training_program: bool = True,
    micro_batch: int = 8,
    overwrite: bool = False,
    task_ref: str | None = None,
) -> ClientBundle:
    """Export ``task``'s base with LoRA inputs and write a bundle for it.

    ``global_arrays`` is the run's current global adapter (from the root); None ships
    the task's initial adapter (``B = 0``: the bare base), version 0. With
    ``training_program`` the bundle also holds the task's ExecuTorch training program
    (``micro_batch`` rows per run of the program), for ``--runtime executorch``.
    ``task_ref`` is how the task was named (a registered name or ``module:build``), what a
    client started from the bundle builds its task from; the task's own name otherwise.
    """
    root = Path(bundle_dir)
    if (root / CONFIG_FILE).exists() and not overwrite:
        raise BundleError(f"{root} already holds a bundle: pass overwrite to replace it")
    arrays = dict(global_arrays) if global_arrays is not None else task.initial_arrays(0)
    adapter = onnx_adapter_of(task, arrays)

    model = _lora_model(task)
    # Two rows: an exported axis of size 1 would be specialised to 1.
    example = task.train_data.x[:2]
    # Token inputs (batch, seq) get a dynamic sequence axis so the device can feed any
    # prompt length up to the context; feature inputs keep their fixed width.
    sequence = example.ndim == 2 and not torch.is_floating_point(example)
    axes = {0: "batch", 1: "seq"} if sequence else {0: "batch"}
    context = int(task.params["seq_len"]) if sequence and "seq_len" in task.params else None

    root.mkdir(parents=True, exist_ok=True)
    os.chmod(root, 0o700)
    _write_atomic(root / TASK_FILE, BundleTask(task_ref or task.name, dict(task.params), context).to_json().encode())
    vocab = task.info.get("vocab")
    if vocab is not None:
        tok = CharTokenizer(vocab)
        _write_atomic(root / TOKENIZER_FILE, json.dumps(tok.to_dict(), ensure_ascii=False).encode())
    program_manifest = None
    if training_program:
        if not sequence or context is None or vocab is None:
            raise BundleError(
                f"task {task.name!r} is not a next-token text task: the training program is exported for "
                "those only; pass training_program=False (--no-training-program)"
            )
        from .et_export import export_training_program
        from .et_program import MANIFEST_FILE

        export_training_program(
            _lora_model(task), task.trainable, root, task=task.name,
            lora_variant=str(task.params.get("lora_variant", "ffa")), lora_rank=int(task.params.get("lora_rank", 8)),
            seq_len=context, vocab_size=len(vocab), micro_batch=micro_batch,
        )
        program_manifest = MANIFEST_FILE
    with tempfile.TemporaryDirectory(prefix="orchard-export-") as tmp:
        try:
            info = export_lora_model(model, example, Path(tmp) / "model.onnx", dynamic_axes=axes)
        except ExportError as err:
            raise BundleError(_export_refusal(task.name, err)) from err
        return write_bundle(
            root,
            model_path=info.path,
            adapter=adapter,
            adapter_version=adapter_version,
            server_address=server_address,
            policy=policy,
            ca_cert=ca_cert,
            enrollment_token=enrollment_token,
            training_program=program_manifest,
            overwrite=overwrite,
        )


# How torch's ONNX exporter names an operator it has no translation for.
_UNSUPPORTED_OP = (re.compile(r"No ONNX function found for <OpOverload\(op='([^']+)'"),
                   re.compile(r"target=torch\.ops\.([\w.]+?)(?:\.default)?\]"),
                   re.compile(r"[Uu]nsupported (?:operator|FX nodes)[^\n]*?'(aten[\w.:]+|[\w]+::[\w.]+)'"))


def _export_refusal(task_name: str, err: ExportError) -> str:
    """One line that names the operator the model's graph holds and ONNX cannot express,
    when the exporter's report says which; the exporter's first line otherwise."""
    text = str(err)
    for pattern in _UNSUPPORTED_OP:
        m = pattern.search(text)
        if m:
            return (f"task {task_name!r}: its model does not export to ONNX: operator {m.group(1)} has no ONNX "
                    "translation. Replace it in the model's forward with operators ONNX has, or register an "
                    "ONNX function for it (torch.onnx), and bundle again")
    first = text.strip().splitlines()[0] if text.strip() else type(err).__name__
    return f"task {task_name!r}: its model does not export to ONNX: {first}"
