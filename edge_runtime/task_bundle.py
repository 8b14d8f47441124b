"""A client bundle for a task: what ``orchard client bundle`` writes.

:func:`~orchard.edge_runtime.bundle.write_bundle` takes an exported base and an
"adapter": the tensors that train and travel, keyed by the base's inputs for them.

- A LoRA task (``trainable=LoRA(...)``): a federated run's global model holds only the
  trained tensors (``B`` for FFA-LoRA), under peft's *parameter* names
  (``...lora_B.default.weight``), while the ONNX graph takes every LoRA matrix (``A``
  too) under peft's *state-dict* keys (``...lora_B.weight``). So the global tensors are
  loaded into the task's adapted model (whose frozen ``A`` comes from the run's shared
  seed) and read back by state-dict key (:func:`onnx_adapter_of`).
- A task that trains its model's own parameters (``trainable="all"`` or a list of
  names): the graph takes each trained parameter as an input under its own name
  (:func:`~orchard.edge_runtime.onnx_export.export_trained_inputs`), and the adapter is
  the global model itself.

Besides the files ``bundle.py`` describes, a task bundle holds the sidecars of
:mod:`orchard.edge_runtime.bundle_task` (the task, the tokenizer of a text task) and,
unless asked not to, the task's ExecuTorch training program: a ``next_token`` program
for a text task (:mod:`orchard.edge_runtime.et_export`), a ``classification`` or
``regression`` one for rows of features (:mod:`orchard.edge_runtime.et_rows`), all
written before ``client.json`` so that a bundle with a config is complete. The ONNX
export runs first: a model that does not export is refused, naming the operator,
before anything is written.
"""

from __future__ import annotations

import json
import os
import re
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch
from peft import PeftModel
from torch import nn

from orchard.errors import OrchardError
from orchard.text import CharTokenizer
from orchard.typing import NDArrays

from .bundle import CONFIG_FILE, BundleError, ClientBundle, _write_atomic, write_bundle
from .bundle_task import TASK_FILE, TOKENIZER_FILE, BundleTask
from .lora import set_arrays
from .onnx_export import (
    ExportError,
    LoraExportInfo,
    adapter_arrays,
    export_lora_model,
    export_trained_inputs,
    trained_arrays,
)
from .policy import DevicePolicy


class _Examples(Protocol):
    x: torch.Tensor
    y: torch.Tensor


class LoRATask(Protocol):
    """What a bundle needs of a task (``orchard.tasks.SupervisedTask`` has it all; its
    ``loss``, "cross_entropy" when a task has none, picks a row program's kind).

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
        raise BundleError(f"task {task.name!r} trains a plain model, not a LoRA adapter")
    model.eval()
    return model


def onnx_adapter_of(task: LoRATask, global_arrays: Mapping[str, np.ndarray]) -> NDArrays:
    """A run's global tensors (the task's trainable names) as the ONNX base's LoRA inputs."""
    model = _lora_model(task)
    set_arrays(model, dict(global_arrays), task.trainable)
    return adapter_arrays(model)


@dataclass(frozen=True)
class _Trained:
    """How a task's trained tensors travel in a bundle: the adapter (by the base's input
    names), the ONNX export, the model a training program is exported from (its
    parameters require grad exactly when trained) and the adapter's LoRA facts."""

    adapter: NDArrays
    export: Any  # (example, path, axes) -> LoraExportInfo
    program_model: nn.Module
    lora_variant: str | None
    lora_rank: int | None


def _lora_trained(task: LoRATask, arrays: Mapping[str, np.ndarray]) -> _Trained:
    model = _lora_model(task)

    def export(example: torch.Tensor, path: Path, axes: dict[int, str]) -> LoraExportInfo:
        return export_lora_model(model, example, path, dynamic_axes=axes)

    facts = {**task.params, **task.info}  # make_task records them in info, shakespeare in params
    return _Trained(onnx_adapter_of(task, arrays), export, _lora_model(task),
                    str(facts.get("lora_variant", "ffa")), int(facts.get("lora_rank", 8)))


def _plain_trained(task: LoRATask, arrays: Mapping[str, np.ndarray]) -> _Trained:
    """The model with the run's global tensors loaded: the base's trained inputs default
    to them, and the adapter is them."""
    model = task.build_model().eval()
    params = dict(model.named_parameters())
    missing = sorted(set(task.trainable) - set(params))
    if missing or set(arrays) != set(task.trainable):
        raise BundleError(
            f"task {task.name!r}: the global model's tensors {sorted(arrays)[:3]}... are not the task's trained "
            f"parameters {task.trainable[:3]}... (missing from the model: {missing[:3]})"
        )
    with torch.no_grad():
        for n in task.trainable:
            params[n].copy_(torch.from_numpy(np.ascontiguousarray(arrays[n])))
    program_model = task.build_model()
    keep = set(task.trainable)
    for n, p in program_model.named_parameters():
        p.requires_grad_(n in keep)

    def export(example: torch.Tensor, path: Path, axes: dict[int, str]) -> LoraExportInfo:
        return export_trained_inputs(model, list(task.trainable), example, path, dynamic_axes=axes)

    return _Trained(trained_arrays(model, list(task.trainable)), export, program_model, None, None)


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
    """Export ``task``'s model with its trained tensors as inputs and write a bundle.

    ``global_arrays`` is the run's current global model (from the root); None ships the
    task's initial one (for LoRA, ``B = 0``: the bare base), version 0. With
    ``training_program`` the bundle also holds the task's ExecuTorch training program
    (``micro_batch`` rows per run of the program), for ``--runtime executorch``.
    ``task_ref`` is how the task was named (a registered name or ``module:build``), what a
    client started from the bundle builds its task from; the task's own name otherwise.
    """
    root = Path(bundle_dir)
    if (root / CONFIG_FILE).exists() and not overwrite:
        raise BundleError(f"{root} already holds a bundle: pass overwrite to replace it")
    arrays = dict(global_arrays) if global_arrays is not None else task.initial_arrays(0)
    lora = isinstance(task.build_model(), PeftModel)
    trained = _lora_trained(task, arrays) if lora else _plain_trained(task, arrays)

    # Two rows: an exported axis of size 1 would be specialised to 1.
    example = task.train_data.x[:2]
    # Token inputs (batch, seq) get a dynamic sequence axis so the device can feed any
    # prompt length up to the context; feature inputs keep their fixed width.
    sequence = example.ndim == 2 and not torch.is_floating_point(example)
    axes = {0: "batch", 1: "seq"} if sequence else {0: "batch"}
    context = int(task.params["seq_len"]) if sequence and "seq_len" in task.params else None
    vocab = task.info.get("vocab")

    with tempfile.TemporaryDirectory(prefix="orchard-export-") as tmp:
        try:
            info = trained.export(example, Path(tmp) / "model.onnx", axes)
        except ExportError as err:
            raise BundleError(_export_refusal(task.name, err)) from err
        root.mkdir(parents=True, exist_ok=True)
        os.chmod(root, 0o700)
        _write_atomic(root / TASK_FILE,
                      BundleTask(task_ref or task.name, dict(task.params), context).to_json().encode())
        if vocab is not None:
            tok = CharTokenizer(vocab)
            _write_atomic(root / TOKENIZER_FILE, json.dumps(tok.to_dict(), ensure_ascii=False).encode())
        program_manifest = None
        if training_program:
            _export_program(task, trained, root, micro_batch=micro_batch,
                            next_token=sequence and context is not None and vocab is not None)
            from .et_program import MANIFEST_FILE

            program_manifest = MANIFEST_FILE
        return write_bundle(
            root,
            model_path=info.path,
            adapter=trained.adapter,
            adapter_version=adapter_version,
            server_address=server_address,
            policy=policy,
            ca_cert=ca_cert,
            enrollment_token=enrollment_token,
            training_program=program_manifest,
            overwrite=overwrite,
        )


def _export_program(task: LoRATask, trained: _Trained, root: Path, *, micro_batch: int, next_token: bool) -> None:
    """The task's training program into ``root``: a next-token program for a text task,
    a row program (by the task's loss) otherwise. An export refused is a
    :class:`BundleError` that names the task and, where it can, the operator."""
    from .et_export import export_training_program
    from .et_rows import export_rows_program, row_program_kind

    model, names = trained.program_model, list(task.trainable)
    try:
        if next_token:
            export_training_program(
                model, names, root, task=task.name, lora_variant=trained.lora_variant,
                lora_rank=trained.lora_rank, seq_len=int(task.params["seq_len"]),
                vocab_size=len(task.info["vocab"]), micro_batch=micro_batch,
            )
            return
        kind = row_program_kind(task.name, getattr(task, "loss", "cross_entropy"))
        x, y = task.train_data.x, task.train_data.y
        if kind == "classification" and y.ndim != 1:
            raise BundleError(
                f"task {task.name!r}: its targets are {tuple(y.shape[1:])} per row; a classification program "
                "takes one class label per row: bundle with --no-training-program"
            )
        export_rows_program(
            model, names, root, task=task.name, kind=kind,
            features=(tuple(x.shape[1:]), str(x.dtype).removeprefix("torch.")), labels=tuple(y.shape[1:]),
            lora_variant=trained.lora_variant, lora_rank=trained.lora_rank, micro_batch=micro_batch,
        )
    except BundleError:
        raise
    except OrchardError as err:
        raise BundleError(f"task {task.name!r}: no ExecuTorch training program: {err}") from err


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
