"""Export a task's training program with ExecuTorch (what ``orchard client bundle``
ships for phone-class devices; the program and its manifest are described in
:mod:`orchard.edge_runtime.et_program`). A :class:`LossProgram` says what one kind of
program computes: :class:`_LossProgram` here for next-token text tasks, the row
programs of :mod:`orchard.edge_runtime.et_rows` for classification and regression.

Steps, all ExecuTorch's own:

1. ``torch.export`` of a module computing the kind's loss on a fixed
   micro-batch shape (the runtime plans memory for fixed shapes; batches of any size
   are split into micro-batches and padded with rows of weight 0).
2. ``run_decompositions()`` into the core ATen op set *before* the joint graph is
   built: the fused CPU attention kernel has a backward that is not a core ATen op (and
   that the runtime does not link), while matmuls and a softmax differentiate into ops
   it does. Attention is traced in its math form (:func:`_math_attention`), the same
   function, because the fused kernel's decomposition adds guards for fully masked
   rows (four full-size ``where`` ops per layer, a fifth of a step) that a causal mask
   never needs.
3. ``torch.export.experimental._export_forward_backward``: the joint graph, whose
   outputs are the loss, the user outputs, and the gradients of every parameter that
   requires grad (the adapter's trained tensors: ``B`` for FFA-LoRA, ``A`` and ``B`` for
   ``full``; or the named parameters of a task that trains its model). The base, a
   frozen ``A`` and every other frozen tensor become constants of the program.
4. ``to_edge_transform_and_lower``: every matrix product is rewritten as a batched one
   (:func:`_matmul_passes`; the runtime's portable ``addmm`` alone is a scalar loop,
   3.5 ms per call here), and the XNNPACK partitioner hands what it supports (batched
   matmuls, transposes, elementwise ops, softmax) to the XNNPACK delegate, which ships
   in the runtime. Together they make a step about 5x faster than the portable
   kernels alone.
   The trained tensors stay parameters of the program: updates written into them are
   seen by the next run (the trainer's tests check gradients after updates).
5. ``to_executorch()``: the ``.pte`` the runtime loads.

Needs torch, peft and executorch (the host that writes bundles, not the device).
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.metadata
import inspect
import json
import math
import os
import re
import shutil
import tempfile
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from orchard.errors import OrchardError

from .bundle import BundleFile, _write_atomic, file_sha256
from .et_program import (
    INPUT_NAMES,
    MANIFEST_FILE,
    METHOD,
    NEXT_TOKEN,
    PROGRAM_FILE,
    TensorDecl,
    TrainingManifest,
    TrainingProgramError,
    read_manifest,
)

LOSS_DESCRIPTION = (
    "sum over rows r and positions t of row_weight[r] * cross_entropy(logits[r, t], targets[r, t]); "
    "correct = argmax hits over rows with row_weight > 0"
)
_PREFIX = "model."  # the wrapped model's attribute in _LossProgram
# A directory of exported programs, by everything an export depends on (opt-in: an export
# takes tens of seconds whatever the model's size, and a simulator or bundler run twice
# on one task exports the same program twice).
PROGRAM_CACHE_ENV = "ORCHARD_PROGRAM_CACHE"


class ProgramExportError(OrchardError):
    """The task's model could not be exported as an ExecuTorch training program."""


class UnsupportedOperatorError(ProgramExportError):
    """The model's graph holds an operator a training program cannot hold (named in
    ``operator``): one without an ExecuTorch kernel or derivative, or a custom autograd
    Function whose own backward the exported joint graph would not run."""

    def __init__(self, operator: str, why: str) -> None:
        self.operator = operator
        super().__init__(
            f"operator {operator} cannot be part of an ExecuTorch training program: {why}. Replace it in the "
            "model's forward with standard torch operators, or bundle without a training program "
            "(--no-training-program) for devices that train with torch"
        )


@dataclass(frozen=True)
class LossProgram:
    """What one kind of training program computes: ``module`` (the model wrapped as its
    ``model`` attribute) maps ``example`` (one micro-batch, the manifest's ``inputs``) to
    ``(loss, correct)``; ``fields`` are the kind's own manifest fields."""

    kind: str
    module: nn.Module
    example: tuple[torch.Tensor, ...]
    inputs: tuple[TensorDecl, ...]
    loss: str
    fields: dict[str, object]


class _LossProgram(nn.Module):
    """``forward(idx, targets, row_weight) -> (loss, correct)`` for a next-token model:
    ``loss = sum_r row_weight[r] * sum_t CE(logits[r, t], targets[r, t])``."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(
        self, idx: torch.Tensor, targets: torch.Tensor, row_weight: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        logits = self.model(idx)
        rows, steps, vocab = logits.shape
        ce = F.cross_entropy(logits.reshape(rows * steps, vocab), targets.reshape(-1), reduction="none")
        loss = (ce.reshape(rows, steps).sum(dim=1) * row_weight).sum()
        hits = (logits.detach().argmax(dim=-1) == targets) & (row_weight > 0).unsqueeze(1)
        return loss, hits.sum()


def _sdpa_math(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_mask: torch.Tensor | None = None,
               dropout_p: float = 0.0, is_causal: bool = False, scale: float | None = None,
               enable_gqa: bool = False) -> torch.Tensor:
    """``softmax(q k^T * scale + causal mask) v``: scaled dot-product attention without
    dropout or an explicit mask, in plain ops."""
    if attn_mask is not None or dropout_p != 0.0 or enable_gqa:
        raise ProgramExportError(
            "the training program traces attention without masks, dropout or grouped queries; "
            f"got attn_mask={attn_mask is not None}, dropout_p={dropout_p}, enable_gqa={enable_gqa}"
        )
    att = (q @ k.transpose(-2, -1)) * (scale if scale is not None else 1.0 / math.sqrt(q.size(-1)))
    if is_causal:
        n, m = q.size(-2), k.size(-2)
        att = att + torch.full((n, m), float("-inf"), dtype=att.dtype).triu(1)
    return torch.softmax(att, dim=-1) @ v


@contextlib.contextmanager
def _math_attention() -> Iterator[None]:
    """Trace ``F.scaled_dot_product_attention`` as :func:`_sdpa_math` (restored after)."""
    original = F.scaled_dot_product_attention
    F.scaled_dot_product_attention = _sdpa_math  # type: ignore[assignment]
    try:
        yield
    finally:
        F.scaled_dot_product_attention = original  # type: ignore[assignment]


def _matmul_passes() -> list[object]:
    """Edge-dialect passes that route every matrix product to XNNPACK:
    ``addmm(bias, a, b)`` (beta = alpha = 1) -> ``add(mm(a, b), bias)``, then
    ``mm(a, b)`` -> ``view(bmm(view(a, [1, m, k]), view(b, [1, k, n])), [m, n])``.
    XNNPACK's partitioner takes ``mm`` only with a constant right operand, and most
    products of the backward pass have two computed operands; as a batch of one
    it takes them all."""
    from executorch.exir.dialects._ops import ops as exir_ops
    from executorch.exir.pass_base import ExportPass

    aten = exir_ops.edge.aten

    class AddmmAsMmAdd(ExportPass):
        def call_operator(self, op, args, kwargs, meta):  # type: ignore[no-untyped-def]
            if op != aten.addmm.default or kwargs.get("beta", 1) != 1 or kwargs.get("alpha", 1) != 1:
                return super().call_operator(op, args, kwargs, meta)
            bias, a, b = args
            mm = super().call_operator(aten.mm.default, (a, b), {}, meta)
            return super().call_operator(aten.add.Tensor, (mm, bias), {}, meta)

    class MmAsBmm(ExportPass):
        def call_operator(self, op, args, kwargs, meta):  # type: ignore[no-untyped-def]
            if op != aten.mm.default:
                return super().call_operator(op, args, kwargs, meta)
            a, b = args
            (m, k), n = a.to_tensor().shape, b.to_tensor().shape[1]
            a3 = super().call_operator(aten.view_copy.default, (a, [1, m, k]), {}, meta)
            b3 = super().call_operator(aten.view_copy.default, (b, [1, k, n]), {}, meta)
            c3 = super().call_operator(aten.bmm.default, (a3, b3), {}, meta)
            return super().call_operator(aten.view_copy.default, (c3, [m, n]), {}, meta)

    return [AddmmAsMmAdd(), MmAsBmm()]


def frozen_digest(model: nn.Module, trainable: Sequence[str]) -> str:
    """sha256 over the names and float32 bytes of every frozen parameter and buffer:
    which base (and frozen ``A``) a program has baked in."""
    skip = set(trainable)
    h = hashlib.sha256()
    for name, t in sorted(model.state_dict().items()):
        if name in skip:
            continue
        h.update(name.encode())
        h.update(t.detach().to(torch.float32).contiguous().numpy().tobytes())
    return h.hexdigest()


def export_training_program(
    model: nn.Module,
    trainable: Sequence[str],
    out_dir: str | os.PathLike[str],
    *,
    task: str,
    lora_variant: str | None,
    lora_rank: int | None,
    seq_len: int,
    vocab_size: int,
    micro_batch: int = 8,
) -> TrainingManifest:
    """Write ``train.pte`` and ``train_program.json`` of a next-token text task's
    program for ``model`` (a peft LoRA model whose parameters require grad exactly when
    named in ``trainable``) into ``out_dir`` and return the manifest (see
    :func:`export_program`)."""
    example = (
        torch.zeros(micro_batch, seq_len, dtype=torch.int64),
        torch.zeros(micro_batch, seq_len, dtype=torch.int64),
        torch.full((micro_batch,), 1.0 / (micro_batch * seq_len), dtype=torch.float32),
    )
    spec = LossProgram(
        kind=NEXT_TOKEN,
        module=_LossProgram(model),
        example=example,
        inputs=(
            TensorDecl(name=INPUT_NAMES[0], dtype="int64", shape=(micro_batch, seq_len)),
            TensorDecl(name=INPUT_NAMES[1], dtype="int64", shape=(micro_batch, seq_len)),
            TensorDecl(name=INPUT_NAMES[2], dtype="float32", shape=(micro_batch,)),
        ),
        loss=LOSS_DESCRIPTION,
        fields={"seq_len": seq_len, "vocab_size": vocab_size},
    )
    return export_program(model, trainable, out_dir, spec, task=task, lora_variant=lora_variant,
                          lora_rank=lora_rank, micro_batch=micro_batch)


def export_program(
    model: nn.Module,
    trainable: Sequence[str],
    out_dir: str | os.PathLike[str],
    spec: LossProgram,
    *,
    task: str,
    lora_variant: str | None,
    lora_rank: int | None,
    micro_batch: int,
) -> TrainingManifest:
    """Export ``spec`` (whose module wraps ``model``: its parameters require grad exactly
    when named in ``trainable``) into ``out_dir`` and return the manifest. Files are
    written atomically, the manifest last.

    Refused before ExecuTorch runs (:class:`UnsupportedOperatorError`, naming the
    operator): a custom autograd Function (the joint graph would differentiate its
    forward, not run its backward), an operator outside ATen (no ExecuTorch kernel),
    and an operator with complex outputs (the runtime has no complex dtype).

    With ``$ORCHARD_PROGRAM_CACHE`` set to a directory, a program exported before from
    the same inputs is copied from there instead (and a new one is kept there). The key
    covers every tensor of the model (names, shapes, bytes), its modules' classes and
    their source files, the arguments, this exporter's source and the torch and
    executorch versions; an entry whose program does not match its manifest's digest is
    exported afresh."""
    _check_inputs(model, trainable, micro_batch)
    root = Path(out_dir)
    cache = os.environ.get(PROGRAM_CACHE_ENV, "").strip()
    entry = None
    if cache:
        entry = Path(cache) / _cache_key(spec.module, trainable, dict(
            task=task, kind=spec.kind, lora_variant=lora_variant, lora_rank=lora_rank, micro_batch=micro_batch,
            inputs=[d.model_dump(mode="json") for d in spec.inputs], loss=spec.loss, **spec.fields))
        hit = _from_cache(entry, root)
        if hit is not None:
            return hit
    try:
        from executorch.backends.xnnpack.partition.xnnpack_partitioner import XnnpackPartitioner
        from executorch.exir import ExecutorchBackendConfig, to_edge_transform_and_lower
        from torch.export import export
        from torch.export.experimental import _export_forward_backward
    except ImportError as err:
        raise ProgramExportError(
            f"exporting a training program needs executorch ({err}): pip install 'orchard-fl[executorch]'"
        ) from None
    wanted = set(trainable)
    was_training = model.training
    model.eval()  # no dropout in the traced graph; LoRA dropout is refused by the spec anyway
    try:
        _refuse_custom_functions(spec)
        try:
            with _math_attention():
                ep = export(spec.module, spec.example, strict=False)
        except Exception as err:  # torch.export raises many types
            raise _export_failure(err) from err
        _refuse_unsupported_operators(ep.graph)
        try:
            joint = _export_forward_backward(ep.run_decompositions())
            # remove_view_copy=False: the view-elision pass mis-handles some views of the
            # joint graph; a copy per view is cheap next to the matmuls.
            edge = to_edge_transform_and_lower(
                joint, transform_passes=_matmul_passes(), partitioner=[XnnpackPartitioner()]
            )
            et = edge.to_executorch(ExecutorchBackendConfig(remove_view_copy=False))
        except Exception as err:  # torch.export / executorch raise many types
            raise _export_failure(err) from err
    finally:
        model.train(was_training)
    order = [
        s.target for s in joint.graph_signature.output_specs if s.kind.name == "GRADIENT_TO_PARAMETER"
    ]
    names = [t[len(_PREFIX):] if t and t.startswith(_PREFIX) else t for t in order]
    if set(names) != wanted or len(names) != len(wanted):
        raise ProgramExportError(
            f"the exported program's gradients are for {sorted(map(str, names))[:3]}..., expected the trained "
            f"tensors {sorted(wanted)[:3]}..."
        )
    params = dict(model.named_parameters())
    n_user = sum(1 for s in joint.graph_signature.output_specs if s.kind.name in ("LOSS_OUTPUT", "USER_OUTPUT"))

    root.mkdir(parents=True, exist_ok=True)
    _write_atomic(root / PROGRAM_FILE, et.buffer)
    manifest = TrainingManifest(
        kind=spec.kind,  # type: ignore[arg-type]
        program=BundleFile(name=PROGRAM_FILE, sha256=file_sha256(root / PROGRAM_FILE)),
        method=METHOD,
        task=task,
        lora_variant=lora_variant,
        lora_rank=lora_rank,
        micro_batch=micro_batch,
        inputs=spec.inputs,
        loss_output=0,
        correct_output=1,
        gradients_start=n_user,
        parameters_start=n_user + len(names),
        parameters=tuple(
            TensorDecl(name=str(n), dtype="float32", shape=tuple(params[str(n)].shape)) for n in names
        ),
        loss=spec.loss,
        executorch_version=importlib.metadata.version("executorch"),
        base_sha256=frozen_digest(model, trainable),
        **spec.fields,  # type: ignore[arg-type]
    )
    _write_atomic(root / MANIFEST_FILE, (manifest.model_dump_json(indent=2) + "\n").encode())
    if entry is not None:
        _to_cache(entry, root)
    return manifest


def _refuse_custom_functions(spec: LossProgram) -> None:
    """Run the loss once in eager torch and refuse a custom ``torch.autograd.Function``
    on the loss's autograd graph: torch.export traces its forward, and the joint graph
    would differentiate that instead of running the Function's own backward."""
    with torch.enable_grad():
        loss = spec.module(*spec.example)[0]
    seen: set[int] = set()
    stack = [loss.grad_fn]
    while stack:
        node = stack.pop()
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        if isinstance(node, torch.autograd.function.BackwardCFunction):
            name = type(node).__name__.removesuffix("Backward")
            raise UnsupportedOperatorError(
                f"{name} (a custom torch.autograd.Function)",
                "the exported program would differentiate its forward instead of running its own backward",
            )
        stack.extend(fn for fn, _ in node.next_functions)


def _refuse_unsupported_operators(graph: torch.fx.Graph) -> None:
    """Refuse what ExecuTorch cannot run, by the operator, before it fails on it less
    clearly: operators outside ATen and prims (a custom op has no kernel in the runtime)
    and operators with complex outputs (an FFT: the runtime has no complex dtype)."""
    for node in graph.nodes:
        if node.op != "call_function" or not isinstance(node.target, torch._ops.OpOverload):
            continue
        name = f"{node.target.namespace}.{node.target._opname}"
        if node.target.namespace not in ("aten", "prims"):
            raise UnsupportedOperatorError(name, "it is not an ATen operator, and the ExecuTorch runtime has no "
                                                 "kernel for it")
        vals = node.meta.get("val")
        for v in vals if isinstance(vals, list | tuple) else [vals]:
            if isinstance(v, torch.Tensor) and v.dtype.is_complex:
                raise UnsupportedOperatorError(name, f"it computes a {v.dtype} tensor, and the ExecuTorch runtime "
                                                     "has no complex dtype")


# How torch.export and ExecuTorch name an operator in their errors.
_OPERATOR = re.compile(r"torch\.ops\.(\w+\.\w+)|\b(aten(?:\.|::)\w+)")


def _export_failure(err: Exception) -> ProgramExportError:
    """The export's error, naming the operator when the report names one."""
    text = f"{type(err).__name__}: {err}"
    m = _OPERATOR.search(text)
    if m:
        return UnsupportedOperatorError((m.group(1) or m.group(2)).replace("::", "."),
                                        text.strip().splitlines()[0][:300])
    return ProgramExportError(f"ExecuTorch could not export the training program: {text.strip()[:600]}")


def _check_inputs(model: nn.Module, trainable: Sequence[str], micro_batch: int) -> None:
    if micro_batch < 1:
        raise ProgramExportError(f"micro_batch must be >= 1, got {micro_batch}")
    wanted = set(trainable)
    grads = {n for n, p in model.named_parameters() if p.requires_grad}
    if grads != wanted:
        raise ProgramExportError(
            f"the model's parameters that require grad ({sorted(grads)[:3]}...) are not the trained "
            f"tensors ({sorted(wanted)[:3]}...): set requires_grad on exactly the trained tensors "
            "(orchard.edge_runtime.lora.apply_lora does for an adapter)"
        )


def _cache_key(model: nn.Module, trainable: Sequence[str], args: dict[str, object]) -> str:
    h = hashlib.sha256()
    h.update(Path(__file__).read_bytes())
    for dist in ("torch", "executorch"):
        try:
            h.update(f"{dist}={importlib.metadata.version(dist)};".encode())
        except importlib.metadata.PackageNotFoundError:
            h.update(f"{dist}=none;".encode())
    h.update(json.dumps({"args": args, "trainable": sorted(trainable)}, sort_keys=True).encode())
    h.update(repr(model).encode())
    sources = set()
    for m in model.modules():
        with contextlib.suppress(TypeError, OSError):
            sources.add(inspect.getsourcefile(type(m)))
    for src in sorted(filter(None, sources)):
        if os.path.isfile(src):
            h.update(src.encode())
            h.update(Path(src).read_bytes())
    # Every tensor's values (frozen_digest over nothing trained: all of them), dtype and shape.
    h.update(frozen_digest(model, ()).encode())
    h.update(json.dumps({n: [str(t.dtype), list(t.shape)] for n, t in model.state_dict().items()},
                        sort_keys=True).encode())
    return h.hexdigest()[:32]


def _from_cache(entry: Path, root: Path) -> TrainingManifest | None:
    program, manifest = entry / PROGRAM_FILE, entry / MANIFEST_FILE
    if not (program.is_file() and manifest.is_file()):
        return None
    try:
        m = read_manifest(entry)
    except TrainingProgramError:
        return None
    if file_sha256(program) != m.program.sha256:
        return None  # a damaged entry: export afresh (and replace it)
    root.mkdir(parents=True, exist_ok=True)
    _write_atomic(root / PROGRAM_FILE, program.read_bytes())
    _write_atomic(root / MANIFEST_FILE, manifest.read_bytes())
    return m


def _to_cache(entry: Path, root: Path) -> None:
    """Keep the export under ``entry``; a cache that cannot be written is no error."""
    with contextlib.suppress(OSError):
        entry.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(dir=entry.parent, prefix=".export-"))
        try:
            for f in (PROGRAM_FILE, MANIFEST_FILE):
                shutil.copyfile(root / f, tmp / f)
            if entry.exists():
                shutil.rmtree(entry, ignore_errors=True)
            os.replace(tmp, entry)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
