"""Export a peft LoRA model to ONNX with its LoRA matrices as graph inputs, so that ONNX
Runtime can swap federated adapter versions without a new base (see ``ort_runtime``).

How: the peft model is wrapped so that its forward takes the data input *and* a dict
of LoRA tensors, substituted for the LoRA parameters with ``torch.func.functional_call``.
The exporter therefore sees those tensors as graph inputs, never as constants it
could fold or transpose. Afterwards each LoRA input also gets an all-zero initializer
of the same name, which makes it optional: ``B = 0`` makes every LoRA branch
``scale * B A x`` vanish, so without an adapter the graph is exactly the base model.

Tensor names everywhere (ONNX inputs, ``.onnx_adapter`` files, safetensors, the
arrays a LoRA trainer uploads) are peft's state-dict keys, i.e.
``get_peft_model_state_dict`` names such as ``base_model.model.fc.lora_A.weight``.

A task that trains its model's own parameters (``trainable="all"`` or a list of names)
is exported the same way by :func:`export_trained_inputs`: each trained parameter is an
input under its own name, whose initializer holds the value the model was exported
with (so without an adapter the graph is that model), and the bundle's "adapter" is
those parameters.
"""

from __future__ import annotations

import contextlib
import io
import os
import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
import torch
from onnx import numpy_helper
from peft import PeftModel, get_peft_model_state_dict, set_peft_model_state_dict
from torch import nn
from torch.func import functional_call

from orchard.errors import OrchardError
from orchard.typing import NDArrays, TensorSpec


class ExportError(OrchardError):
    """The model cannot be exported with LoRA inputs (unsupported adapter layout or op)."""


@dataclass(frozen=True)
class LoraExportInfo:
    path: Path
    input_name: str
    output_name: str
    lora: tuple[TensorSpec, ...]  # the LoRA inputs, by state-dict key


def lora_parameter_map(model: PeftModel, adapter_name: str = "default") -> dict[str, str]:
    """State-dict key -> parameter name of every LoRA tensor of ``adapter_name``.

    peft names a parameter ``...lora_A.<adapter>.weight`` and its state-dict key
    ``...lora_A.weight``. Anything else the adapter saves (``modules_to_save``,
    non-LoRA tuners) is refused: it would not fit a LoRA-only adapter file.
    """
    keys = set(get_peft_model_state_dict(model, adapter_name=adapter_name))
    out: dict[str, str] = {}
    for name, _ in model.named_parameters():
        if f".{adapter_name}" not in name or "lora_" not in name:
            continue
        key = name.replace(f".{adapter_name}", "")
        if key in keys:
            out[key] = name
    leftover = sorted(keys - set(out))
    if leftover:
        raise ExportError(
            f"adapter {adapter_name!r} saves tensors that are not LoRA matrices: {leftover}; "
            "export supports LoRA on Linear/Embedding layers without modules_to_save"
        )
    if not out:
        raise ExportError(f"model has no LoRA parameters for adapter {adapter_name!r}")
    return dict(sorted(out.items()))


def adapter_arrays(model: PeftModel, adapter_name: str = "default") -> NDArrays:
    """The LoRA tensors of ``model`` as numpy arrays, keyed by state-dict key."""
    sd = get_peft_model_state_dict(model, adapter_name=adapter_name)
    return {k: sd[k].detach().cpu().numpy().copy() for k in lora_parameter_map(model, adapter_name)}


def load_adapter_arrays(
    model: PeftModel, arrays: Mapping[str, np.ndarray], adapter_name: str = "default"
) -> None:
    """Load LoRA tensors (state-dict keys) into ``model`` in place."""
    expected = set(lora_parameter_map(model, adapter_name))
    if set(arrays) != expected:
        raise ExportError(
            f"adapter tensors {sorted(arrays)} do not match the model's {sorted(expected)}"
        )
    set_peft_model_state_dict(
        model,
        {k: torch.from_numpy(np.asarray(v)) for k, v in arrays.items()},
        adapter_name=adapter_name,
    )


class _LoraAsInputs(nn.Module):
    """``forward(x, lora)`` = the model's forward with ``lora`` as the named parameters
    (a peft model's LoRA weights, or a plain model's trained parameters)."""

    def __init__(self, model: nn.Module, names: list[str]) -> None:
        super().__init__()
        self.model = model
        self.names = names  # parameter names, in input order

    def forward(self, x: torch.Tensor, lora: dict[str, torch.Tensor]) -> torch.Tensor:
        params = {n: lora[f"l{i}"] for i, n in enumerate(self.names)}
        out = functional_call(self.model, params, (x,), strict=False)
        # Models that return a ModelOutput or a tuple: the first tensor is the logits.
        if isinstance(out, tuple | list):
            out = out[0]
        elif hasattr(out, "logits"):
            out = out.logits
        return out


def export_lora_model(
    model: PeftModel,
    example_input: torch.Tensor,
    path: str | os.PathLike[str],
    *,
    adapter_name: str = "default",
    input_name: str = "input",
    output_name: str = "logits",
    dynamic_axes: Mapping[int, str] | None = None,
    opset_version: int | None = None,
) -> LoraExportInfo:
    """Export ``model`` (eval mode) to ``path``; LoRA matrices become optional inputs.

    ``dynamic_axes`` maps axes of the input to names (default ``{0: "batch"}``); a
    sequence model adds ``{1: "seq"}``. The output's axes follow from the graph.
    """
    return _export(model, lora_parameter_map(model, adapter_name), example_input, path, zero_defaults=True,
                   what=type(model.base_model.model).__name__, input_name=input_name, output_name=output_name,
                   dynamic_axes=dynamic_axes, opset_version=opset_version)


def export_trained_inputs(
    model: nn.Module,
    trained: list[str],
    example_input: torch.Tensor,
    path: str | os.PathLike[str],
    *,
    input_name: str = "input",
    output_name: str = "logits",
    dynamic_axes: Mapping[int, str] | None = None,
    opset_version: int | None = None,
) -> LoraExportInfo:
    """Export a plain ``model`` (eval mode) with the parameters named in ``trained`` as
    optional inputs under their own names, defaulting to their current values."""
    params = dict(model.named_parameters())
    unknown = [n for n in trained if n not in params]
    if unknown or not trained:
        raise ExportError(f"trained tensors {unknown or 'none'} are not parameters of the model; "
                          f"its parameters: {sorted(params)[:10]}")
    return _export(model, {n: n for n in trained}, example_input, path, zero_defaults=False,
                   what=type(model).__name__, input_name=input_name, output_name=output_name,
                   dynamic_axes=dynamic_axes, opset_version=opset_version)


def trained_arrays(model: nn.Module, trained: list[str]) -> NDArrays:
    """The named parameters of a plain model as numpy arrays (copies): the inputs of
    :func:`export_trained_inputs`."""
    params = dict(model.named_parameters())
    return {n: params[n].detach().cpu().numpy().copy() for n in trained}


def _export(
    model: nn.Module,
    pmap: Mapping[str, str],
    example_input: torch.Tensor,
    path: str | os.PathLike[str],
    *,
    zero_defaults: bool,
    what: str,
    input_name: str,
    output_name: str,
    dynamic_axes: Mapping[int, str] | None,
    opset_version: int | None,
) -> LoraExportInfo:
    """Export with the parameters ``pmap`` names (input name -> parameter name) as
    graph inputs, each with an initializer of zeros or of the parameter's value."""
    if dynamic_axes is None:
        dynamic_axes = {0: "batch"}
    keys, pnames = list(pmap), list(pmap.values())
    params = dict(model.named_parameters())
    was_training = model.training
    model.eval()
    try:
        wrapper = _LoraAsInputs(model, pnames).eval()
        lora = {f"l{i}": params[n].detach().clone() for i, n in enumerate(pnames)}
        dims = {ax: torch.export.Dim.DYNAMIC for ax in dynamic_axes}
        # The exporter narrates its progress on stdout and warns about its own
        # internals (pytree deprecations); neither is actionable for the caller.
        with contextlib.redirect_stdout(io.StringIO()), warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            program = torch.onnx.export(
                wrapper,
                (example_input,),
                kwargs={"lora": lora},
                input_names=[input_name, *keys],
                output_names=[output_name],
                dynamic_shapes={"x": dims, "lora": {k: None for k in lora}},
                opset_version=opset_version,
                dynamo=True,
                verbose=False,
            )
    except Exception as err:  # the exporter raises many unrelated types
        raise ExportError(f"torch.onnx.export failed for {what}: {err}") from err
    finally:
        model.train(was_training)
    if program is None:  # pragma: no cover - dynamo=True always returns a program
        raise ExportError("torch.onnx.export returned no program")
    proto = program.model_proto

    graph_inputs = {i.name: i for i in proto.graph.input}
    specs = []
    for key, pname in pmap.items():
        if key not in graph_inputs:
            raise ExportError(
                f"trained tensor {key} did not become a graph input; inputs are {sorted(graph_inputs)}"
            )
        p = params[pname]
        shape = tuple(int(d.dim_value) for d in graph_inputs[key].type.tensor_type.shape.dim)
        if shape != tuple(p.shape):
            raise ExportError(
                f"graph input {key} has shape {shape}, the parameter has {tuple(p.shape)}"
            )
        value = p.detach().cpu().numpy()
        default = np.zeros(tuple(p.shape), dtype=value.dtype) if zero_defaults else value.copy()
        proto.graph.initializer.append(numpy_helper.from_array(default, key))
        specs.append(TensorSpec(key, tuple(p.shape), str(default.dtype)))
    out = Path(path)
    onnx.save(proto, str(out))
    return LoraExportInfo(out, input_name, output_name, tuple(specs))
