"""On-device inference through ONNX Runtime, with LoRA adapters switched per run.

The base model (``onnx_export.export_lora_model``) takes every LoRA matrix as a graph
input that also has an all-zero initializer: run without an adapter it is the plain
base model; run with ``RunOptions.add_active_adapter`` (onnxruntime >= 1.20) the
adapter's tensors are fed to those inputs. A device therefore downloads each new
federated adapter version as a small ``.onnx_adapter`` file and keeps one base.

This module imports numpy and onnxruntime only (no torch): it is what runs on the
device.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnxruntime as ort

from orchard.errors import OrchardError, UpdateSchemaError
from orchard.typing import NDArrays, TensorSpec

# ONNX tensor type strings for the dtypes adapters use.
_ORT_DTYPES = {
    "tensor(float)": "float32",
    "tensor(float16)": "float16",
    "tensor(double)": "float64",
    "tensor(bfloat16)": "bfloat16",
}


class AdapterMismatchError(UpdateSchemaError):
    """An adapter's tensor names, shapes or dtypes do not fit the base model's LoRA inputs."""


class InferenceError(OrchardError):
    """The base model cannot be run with the inputs given (wrong names, shapes or dtypes)."""


@dataclass(frozen=True)
class AdapterFile:
    arrays: NDArrays
    adapter_version: int
    model_version: int


def write_onnx_adapter(
    arrays: Mapping[str, np.ndarray],
    path: str | os.PathLike[str],
    *,
    adapter_version: int = 0,
    model_version: int = 0,
) -> Path:
    """Write LoRA tensors in ONNX Runtime's adapter format (``.onnx_adapter``).

    ``arrays`` are keyed by the base model's LoRA input names. ``adapter_version`` is
    the federated adapter version (the round that produced it); ``model_version``
    identifies the base it belongs to.
    """
    if not arrays:
        raise AdapterMismatchError("an adapter needs at least one tensor")
    # OrtValues alias the numpy buffers: keep contiguous copies alive until written.
    keep = {k: np.ascontiguousarray(v) for k, v in arrays.items()}
    fmt = ort.AdapterFormat()
    fmt.set_adapter_version(int(adapter_version))
    fmt.set_model_version(int(model_version))
    fmt.set_parameters({k: ort.OrtValue.ortvalue_from_numpy(v) for k, v in keep.items()})
    out = Path(path)
    fmt.export_adapter(str(out))
    return out


def read_onnx_adapter(path: str | os.PathLike[str]) -> AdapterFile:
    """Read an ``.onnx_adapter`` file back into numpy arrays (copies)."""
    fmt = ort.AdapterFormat.read_adapter(str(path))
    arrays = {k: np.array(v.numpy(), copy=True) for k, v in sorted(fmt.get_parameters().items())}
    return AdapterFile(arrays, fmt.get_adapter_version(), fmt.get_model_version())


def _spec(name: str, shape: list[object], type_str: str) -> TensorSpec:
    dims = tuple(int(d) if isinstance(d, int) else -1 for d in shape)
    return TensorSpec(name, dims, _ORT_DTYPES.get(type_str, type_str))


@dataclass(frozen=True)
class LoadedAdapter:
    """An adapter ready to activate: the memory-mapped file and its run options."""

    path: Path
    adapter_version: int
    run_options: ort.RunOptions
    handle: ort.LoraAdapter  # held so the mapped file outlives every run that uses it


class OrtLoraModel:
    """A base model in an ONNX Runtime session, plus the adapters it can switch between.

    ``run(x, adapter)`` runs the base with ``adapter``'s LoRA tensors; ``adapter=None``
    runs the bare base. Adapters are checked against the model's LoRA inputs when
    loaded, so a mismatched version fails on load, not mid-inference.
    """

    def __init__(
        self,
        model_path: str | os.PathLike[str],
        *,
        intra_op_threads: int | None = None,
        providers: list[str] | None = None,
    ) -> None:
        opts = ort.SessionOptions()
        # The LoRA inputs deliberately shadow initializers (that is what makes them
        # optional); silence ORT's warning about exactly that.
        opts.log_severity_level = 3
        if intra_op_threads is not None:
            opts.intra_op_num_threads = intra_op_threads
        self.session = ort.InferenceSession(
            str(model_path), sess_options=opts, providers=providers or ["CPUExecutionProvider"]
        )
        required = self.session.get_inputs()
        if len(required) != 1:
            raise InferenceError(
                f"expected a base model with one data input, got {[i.name for i in required]}"
            )
        self.input_name = required[0].name
        self.input_spec = _spec(required[0].name, required[0].shape, required[0].type)
        self.output_name = self.session.get_outputs()[0].name
        self.lora_specs: dict[str, TensorSpec] = {
            i.name: _spec(i.name, i.shape, i.type)
            for i in self.session.get_overridable_initializers()
        }

    def check_adapter(self, arrays: Mapping[str, np.ndarray]) -> None:
        """Raise :class:`AdapterMismatchError` unless ``arrays`` fit the LoRA inputs exactly."""
        problems = []
        missing = sorted(set(self.lora_specs) - set(arrays))
        extra = sorted(set(arrays) - set(self.lora_specs))
        if missing:
            problems.append(f"missing tensors {missing}")
        if extra:
            problems.append(f"unknown tensors {extra}")
        for name, a in arrays.items():
            spec = self.lora_specs.get(name)
            if spec is None:
                continue
            if tuple(a.shape) != spec.shape or str(a.dtype) != spec.dtype:
                problems.append(
                    f"{name}: got {tuple(a.shape)} {a.dtype}, the base expects {spec.shape} {spec.dtype}"
                )
        if problems:
            raise AdapterMismatchError(
                "adapter does not fit this base model: "
                + "; ".join(problems)
                + " (was it trained for another base or LoRA rank?)"
            )

    def load_adapter(self, path: str | os.PathLike[str]) -> LoadedAdapter:
        meta = read_onnx_adapter(path)
        self.check_adapter(meta.arrays)
        adapter = ort.LoraAdapter()
        adapter.Load(str(path))
        ro = ort.RunOptions()
        ro.add_active_adapter(adapter)
        return LoadedAdapter(Path(path), meta.adapter_version, ro, adapter)

    def run(
        self, inputs: np.ndarray | Mapping[str, np.ndarray], adapter: LoadedAdapter | None = None
    ) -> np.ndarray:
        feeds = dict(inputs) if isinstance(inputs, Mapping) else {self.input_name: inputs}
        unknown = sorted(set(feeds) - {self.input_name})
        if unknown:
            raise InferenceError(
                f"unknown inputs {unknown}; this model takes {self.input_name!r} "
                "(LoRA tensors come from an adapter, not from the feeds)"
            )
        try:
            out = self.session.run(
                [self.output_name], feeds, None if adapter is None else adapter.run_options
            )
        except (ort.capi.onnxruntime_pybind11_state.InvalidArgument, RuntimeError) as err:
            raise InferenceError(
                f"cannot run the base model on {[(k, v.shape, str(v.dtype)) for k, v in feeds.items()]}: "
                f"it expects {self.input_spec}: {err}"
            ) from err
        return out[0]
