"""A bundle's ExecuTorch training program: its manifest, and loading it for training.

``orchard client bundle`` (:mod:`orchard.edge_runtime.et_export`) writes two files next
to ``client.json``::

    train.pte            the task's training program (ExecuTorch): forward, loss and
                         backward of the trained tensors, everything frozen baked in
    train_program.json   this manifest: the program's kind, digest, inputs and outputs,
                         and the trained tensors' names and shapes

The manifest's ``kind`` says what the program computes (a manifest without one, as
written before kinds existed, is ``next_token``):

- ``next_token``: a next-token text task (below);
- ``classification``: rows of features to class logits, cross-entropy;
- ``regression``: rows of features to values, squared error
  (:mod:`orchard.edge_runtime.et_rows` exports both).

The trained tensors are a LoRA adapter's (``lora_variant``, ``lora_rank`` set) or, for
a task that trains the model itself, its named parameters (``lora_variant`` None).

A ``next_token`` program's method ``forward`` takes, for a micro-batch of ``M`` rows of
``T`` tokens,

- ``idx`` (M, T) int64: input token ids,
- ``targets`` (M, T) int64: next-token targets,
- ``row_weight`` (M,) float32: each row's weight in the loss (0 for padding rows),

and returns ``[loss, correct, grad_1 .. grad_P, param_1 .. param_P]``:
``loss = sum_r row_weight[r] * sum_t CE(logits[r, t], targets[r, t])`` (float32 scalar),
``correct`` the argmax hits over rows of positive weight (int64 scalar), then the
gradient of ``loss`` with respect to each trained tensor, then the trained tensors
themselves: those outputs are views of the program's own parameter storage, so writing
them sets the adapter the next run uses. With ``row_weight = 1 / (T * n)`` on the ``n``
real rows of a batch split into micro-batches, the micro-batch losses and gradients add
up to the batch's mean token cross-entropy and its gradient exactly (what the torch
trainer computes), whatever the batch size.

A ``classification`` or ``regression`` program takes ``features`` (M, *F) float32 or int64,
``labels`` (M,) int64 class indices or (M, *Y) float32 targets, and ``row_weight``
(M,) float32, and returns the same list: ``loss = sum_r row_weight[r] * l_r`` with
``l_r`` the row's cross-entropy, or its summed squared error over the ``K = prod(Y)``
values; ``correct`` counts argmax hits (always 0 for regression). With
``row_weight = 1 / (K * n)`` (``K = 1`` for classes) the micro-batches add up to the
batch's mean cross-entropy or mean squared error, as the torch trainer computes them.

The optimizer step is not in the program:
the device applies it to plain arrays (:mod:`orchard.edge_runtime.et_trainer`).

Everything here runs without torch: the program is loaded by the ExecuTorch runtime
through :mod:`orchard.edge_runtime.et_native`.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Final, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from .bundle import BundleError, BundleFile, file_sha256, read_json_object
from .et_native import NativeMethod, NativeProgram, NativeRuntimeError

PROGRAM_FILE = "train.pte"
MANIFEST_FILE = "train_program.json"
MANIFEST_FORMAT = 1
METHOD = "forward"
# Methods ExecuTorch's joint-graph export adds next to ``forward``: where the gradient
# and parameter outputs start.
GRADIENTS_INDEX_METHOD = f"__et_training_gradients_index_{METHOD}"
PARAMETERS_INDEX_METHOD = f"__et_training_parameters_index_{METHOD}"
INPUT_NAMES = ("idx", "targets", "row_weight")
ROW_INPUT_NAMES = ("features", "labels", "row_weight")
NEXT_TOKEN: Final = "next_token"
CLASSIFICATION: Final = "classification"
REGRESSION: Final = "regression"
# Each kind's inputs, in the program's order.
KIND_INPUTS: dict[str, tuple[str, ...]] = {
    NEXT_TOKEN: INPUT_NAMES, CLASSIFICATION: ROW_INPUT_NAMES, REGRESSION: ROW_INPUT_NAMES,
}
ProgramKind = Literal["next_token", "classification", "regression"]


class TrainingProgramError(BundleError):
    """A bundle's training program is missing, or does not match its manifest, the
    bundle's adapter or the run: the message names the file and what was expected."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class TensorDecl(_Strict):
    name: str
    dtype: str
    shape: tuple[int, ...]


class TrainingManifest(_Strict):
    """``train_program.json``."""

    format_version: int = MANIFEST_FORMAT
    # Absent in manifests written before kinds existed: those are all next-token programs.
    kind: ProgramKind = NEXT_TOKEN
    program: BundleFile
    method: str = METHOD
    task: str
    lora_variant: str | None  # None: the task trains its model's own parameters
    lora_rank: int | None = Field(default=None, ge=1)
    micro_batch: int = Field(ge=1)
    seq_len: int | None = Field(default=None, ge=1)  # next_token only
    vocab_size: int | None = Field(default=None, ge=1)  # next_token only
    inputs: tuple[TensorDecl, ...]
    loss_output: int = 0
    correct_output: int = 1
    gradients_start: int
    parameters_start: int
    parameters: tuple[TensorDecl, ...]  # trained tensors, in the program's output order
    loss: str  # the loss, in words (the formula in this module's docstring)
    executorch_version: str
    base_sha256: str  # the frozen base baked into the program (its safetensors)

    @model_validator(mode="after")
    def _fields_of_the_kind(self) -> TrainingManifest:
        if self.kind == NEXT_TOKEN and (self.seq_len is None or self.vocab_size is None):
            raise ValueError("a next_token program declares seq_len and vocab_size")
        if (self.lora_variant is None) != (self.lora_rank is None):
            raise ValueError("lora_variant and lora_rank are both set (a LoRA adapter) or both null")
        return self

    @property
    def trains(self) -> str:
        """What the trained tensors are, in words."""
        if self.lora_variant is None:
            return "the model's own parameters"
        return f"{self.lora_variant} LoRA, rank {self.lora_rank}"


def read_manifest(bundle_dir: str | os.PathLike[str]) -> TrainingManifest:
    path = Path(bundle_dir) / MANIFEST_FILE
    if not path.is_file():
        raise TrainingProgramError(
            f"{path} is missing: this bundle has no training program; re-create it with "
            "`orchard client bundle` (executorch installed) to train with --runtime executorch"
        )
    data = read_json_object(path, TrainingProgramError)
    if data.get("format_version") != MANIFEST_FORMAT:
        got = data.get("format_version")
        raise TrainingProgramError(
            f"{path} has format_version {got!r}; this client reads {MANIFEST_FORMAT}: re-create the bundle"
        )
    try:
        return TrainingManifest.model_validate(data)
    except ValidationError as err:
        problems = "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in err.errors()[:5])
        raise TrainingProgramError(f"{path} is not a training-program manifest: {problems}") from None


def peft_state_key(param_name: str) -> str:
    """peft's parameter name ``...lora_B.default.weight`` as its state-dict key
    ``...lora_B.weight`` (the names of the bundle's adapter files)."""
    return param_name.replace(".default.", ".")


def adapter_key(manifest: TrainingManifest, param_name: str) -> str:
    """The bundle adapter's key of a trained tensor: peft's state-dict key for a LoRA
    adapter, the parameter's own name for a task that trains its model's parameters."""
    return param_name if manifest.lora_variant is None else peft_state_key(param_name)


@dataclass
class TrainingProgram:
    """A bundle's program, loaded and checked: ``step`` is one forward/backward run."""

    manifest: TrainingManifest
    path: Path
    program: NativeProgram
    method: NativeMethod

    @property
    def names(self) -> list[str]:
        return [p.name for p in self.manifest.parameters]

    @property
    def micro_batch(self) -> int:
        return self.manifest.micro_batch

    @property
    def seq_len(self) -> int | None:
        return self.manifest.seq_len

    @property
    def example_shapes(self) -> tuple[tuple[tuple[int, ...], str], tuple[tuple[int, ...], str]]:
        """``((row shape, dtype) of an input, (row shape, dtype) of its target)``: the
        program's first two inputs without their micro-batch axis."""
        x, y = self.manifest.inputs[0], self.manifest.inputs[1]
        return (tuple(x.shape[1:]), x.dtype), (tuple(y.shape[1:]), y.dtype)

    @property
    def targets_per_row(self) -> int:
        """How many loss terms one row adds (tokens, or a regression row's values): a
        row of a batch of ``n`` weighs ``1 / (n * targets_per_row)``."""
        return int(np.prod(self.manifest.inputs[1].shape[1:], dtype=np.int64))

    @property
    def planned_bytes(self) -> int:
        """Memory the program's plan asks for (activations, inputs, gradients)."""
        return self.method.planned_bytes

    def parameters(self) -> dict[str, np.ndarray]:
        """The trained tensors, as views of the program's own storage (write to set)."""
        outs = self.method.outputs
        start = self.manifest.parameters_start
        return {p.name: outs[start + j] for j, p in enumerate(self.manifest.parameters)}  # type: ignore[misc]

    def step(self, idx: np.ndarray, targets: np.ndarray, row_weight: np.ndarray) -> tuple[float, int, list[np.ndarray]]:
        # (idx, targets) are a next_token program's; a row program's are (features, labels).
        """``(loss, correct, gradients)`` of one micro-batch (rows beyond ``len(idx)`` are
        padding of weight 0). The gradients are views, overwritten by the next step."""
        n = len(idx)
        m = self.manifest.micro_batch
        if not 1 <= n <= m:
            raise ValueError(f"a micro-batch holds 1 to {m} rows, got {n}")
        x_in, y_in, w_in = self.method.inputs
        x_in[:n] = idx  # type: ignore[index]
        y_in[:n] = targets  # type: ignore[index]
        w_in[:n] = row_weight  # type: ignore[index]
        if n < m:
            x_in[n:] = 0  # type: ignore[index]
            y_in[n:] = 0  # type: ignore[index]
            w_in[n:] = 0.0  # type: ignore[index]
        outs = self.method.execute()
        g0, p0 = self.manifest.gradients_start, self.manifest.parameters_start
        return float(outs[self.manifest.loss_output]), int(outs[self.manifest.correct_output]), outs[g0:p0]  # type: ignore[arg-type, return-value]


def _index(program: NativeProgram, path: Path, name: str) -> int:
    out = program.method(name).execute()
    if len(out) != 1:
        raise TrainingProgramError(f"{path}: method {name} returns {len(out)} values, expected one index")
    value = out[0]
    return int(value if isinstance(value, int) else np.asarray(value).reshape(-1)[0])


def load_training_program(
    bundle_dir: str | os.PathLike[str],
    *,
    adapter: Mapping[str, np.ndarray] | None = None,
    expect: Mapping[str, object] | None = None,
) -> TrainingProgram:
    """Read, verify and load a bundle's training program.

    Refused, each with a :class:`TrainingProgramError` naming the file and what was
    expected: a missing or malformed manifest; a missing program or one whose sha256
    is not the manifest's; a program the runtime cannot load; a program whose inputs,
    outputs or trained-tensor shapes differ from the manifest's; a manifest whose
    tensors are not the bundle's ``adapter`` (its LoRA tensors by state-dict key: a
    program exported for another rank or variant); and manifest fields that differ
    from ``expect`` (for example the run's task and LoRA variant).
    """
    root = Path(bundle_dir)
    manifest = read_manifest(root)
    mpath = root / MANIFEST_FILE
    path = root / manifest.program.name
    if not path.is_file():
        raise TrainingProgramError(
            f"{path} is missing: {MANIFEST_FILE} names it as the training program; re-create the bundle"
        )
    digest = file_sha256(path)
    if digest != manifest.program.sha256:
        raise TrainingProgramError(
            f"{path} has sha256 {digest}, {MANIFEST_FILE} expects {manifest.program.sha256}: "
            "the program was swapped or truncated; re-create the bundle"
        )
    for key, want in (expect or {}).items():
        got = getattr(manifest, key)
        if got != want:
            raise TrainingProgramError(
                f"{mpath} was exported for {key} {got!r}, this run needs {want!r}: "
                "re-create the bundle for this run's task"
            )
    want_inputs = list(KIND_INPUTS[manifest.kind])
    if [d.name for d in manifest.inputs] != want_inputs:
        raise TrainingProgramError(
            f"{mpath} declares inputs {[d.name for d in manifest.inputs]}, a {manifest.kind} program takes "
            f"{want_inputs}"
        )
    if adapter is not None:
        _check_adapter(manifest, mpath, adapter)
    try:
        program = NativeProgram(path)
        missing = [m for m in (manifest.method, GRADIENTS_INDEX_METHOD, PARAMETERS_INDEX_METHOD)
                   if m not in program.method_names]
        if missing:
            raise TrainingProgramError(
                f"{path} lacks methods {missing}: expected a training program exported with "
                "ExecuTorch's joint forward/backward graph (orchard client bundle)"
            )
        method = program.method(manifest.method)
        g0 = _index(program, path, GRADIENTS_INDEX_METHOD)
        p0 = _index(program, path, PARAMETERS_INDEX_METHOD)
    except NativeRuntimeError as err:
        raise TrainingProgramError(f"{path} cannot be loaded by the ExecuTorch runtime: {err}") from None
    if (g0, p0) != (manifest.gradients_start, manifest.parameters_start):
        raise TrainingProgramError(
            f"{path} puts gradients at output {g0} and parameters at {p0}; {MANIFEST_FILE} says "
            f"{manifest.gradients_start} and {manifest.parameters_start}: the manifest is not this program's"
        )
    _check_layout(manifest, path, method)
    return TrainingProgram(manifest, path, program, method)


def _check_adapter(manifest: TrainingManifest, mpath: Path, adapter: Mapping[str, np.ndarray]) -> None:
    shapes = {k: tuple(np.shape(v)) for k, v in adapter.items()}
    for p in manifest.parameters:
        key = adapter_key(manifest, p.name)
        if key not in shapes:
            raise TrainingProgramError(
                f"{mpath} trains {p.name!r}, which the bundle's adapter does not hold (expected key {key!r}): "
                "the program was exported for another model"
            )
        if shapes[key] != p.shape:
            raise TrainingProgramError(
                f"{mpath} trains {p.name!r} with shape {list(p.shape)}, the bundle's adapter has "
                f"{list(shapes[key])}: the program was exported for another adapter shape (LoRA rank); "
                "re-create the bundle"
            )


def _check_layout(manifest: TrainingManifest, path: Path, method: NativeMethod) -> None:
    def described(a: object) -> tuple[str, tuple[int, ...]]:
        if isinstance(a, np.ndarray):
            return a.dtype.name, tuple(a.shape)
        return type(a).__name__, ()

    got_in = [described(a) for a in method.inputs]
    want_in = [(d.dtype, d.shape) for d in manifest.inputs]
    if got_in != want_in:
        raise TrainingProgramError(
            f"{path} takes inputs {got_in}, {MANIFEST_FILE} declares {want_in}: the manifest is not this program's"
        )
    outs = method.outputs
    n = len(manifest.parameters)
    if len(outs) != manifest.parameters_start + n or manifest.parameters_start - manifest.gradients_start != n:
        raise TrainingProgramError(
            f"{path} returns {len(outs)} outputs, {MANIFEST_FILE} declares {n} trained tensors "
            f"(expected {manifest.gradients_start} + 2 x {n} outputs)"
        )
    for j, p in enumerate(manifest.parameters):
        for what, k in (("gradient", manifest.gradients_start + j), ("parameter", manifest.parameters_start + j)):
            if described(outs[k]) != ("float32", p.shape):
                raise TrainingProgramError(
                    f"{path} returns a {what} of {described(outs[k])} for {p.name!r}, {MANIFEST_FILE} "
                    f"declares float32 {list(p.shape)}: the program was exported for another adapter shape"
                )
