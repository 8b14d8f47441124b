"""Training programs for tasks over rows of features: classification (class logits,
cross-entropy) and regression (values, squared error). The sibling of the next-token
program of :mod:`orchard.edge_runtime.et_export`, exported the same way; the program's
inputs, outputs and loss are described in :mod:`orchard.edge_runtime.et_program`.

Only the two losses a task names (``make_task(loss="cross_entropy" | "mse")``) are
exported: the program splits a batch into fixed micro-batches, so the loss must be a
weighted sum over rows, and a task's own loss function need not be one.

Needs torch and executorch (the host that writes bundles, not the device).
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from .et_export import LossProgram, ProgramExportError, export_program
from .et_program import CLASSIFICATION, REGRESSION, ROW_INPUT_NAMES, TensorDecl, TrainingManifest

# A task's loss by name -> the kind of program that computes it.
ROW_LOSSES = {"cross_entropy": CLASSIFICATION, "mse": REGRESSION}
LOSS_DESCRIPTIONS = {
    CLASSIFICATION: "sum over rows r of row_weight[r] * cross_entropy(logits[r], labels[r]); "
                    "correct = argmax hits over rows with row_weight > 0",
    REGRESSION: "sum over rows r of row_weight[r] * sum over the row's values k of (outputs[r, k] - labels[r, k])^2; "
                "correct = 0",
}


class _RowsLoss(nn.Module):
    """A loss program over rows: the wrapped model is its ``model`` attribute."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model


class _ClassificationLoss(_RowsLoss):
    """``forward(features, labels, row_weight) -> (loss, correct)``:
    ``loss = sum_r row_weight[r] * CE(logits[r], labels[r])``, ``correct`` the argmax
    hits of rows with positive weight."""

    def forward(
        self, features: torch.Tensor, labels: torch.Tensor, row_weight: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        logits = self.model(features).reshape(features.shape[0], -1)
        loss = (F.cross_entropy(logits, labels, reduction="none") * row_weight).sum()
        hits = (logits.detach().argmax(dim=-1) == labels) & (row_weight > 0)
        return loss, hits.sum()


class _RegressionLoss(_RowsLoss):
    """``forward(features, labels, row_weight) -> (loss, correct)``:
    ``loss = sum_r row_weight[r] * sum_k (outputs[r, k] - labels[r, k])^2``, ``correct`` 0."""

    def forward(
        self, features: torch.Tensor, labels: torch.Tensor, row_weight: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        err = (self.model(features).reshape(labels.shape) - labels) ** 2
        loss = (err.reshape(features.shape[0], -1).sum(dim=1) * row_weight).sum()
        return loss, (row_weight < 0).sum()  # no classes, no hits: 0, computed so that it is an output


_PROGRAMS: dict[str, type[nn.Module]] = {CLASSIFICATION: _ClassificationLoss, REGRESSION: _RegressionLoss}


def row_program_kind(task_name: str, loss: object) -> str:
    """The kind of program for a task's loss, or :class:`ProgramExportError` saying which
    losses a program can compute."""
    if isinstance(loss, str) and loss in ROW_LOSSES:
        return ROW_LOSSES[loss]
    what = f"{loss!r}" if isinstance(loss, str) else "a function of its own"
    raise ProgramExportError(
        f"task {task_name!r} trains with loss {what}; an ExecuTorch training program computes "
        f"{' or '.join(repr(k) for k in ROW_LOSSES)} (a sum over rows, split into micro-batches): name one "
        "of those in make_task(loss=...), or bundle without a training program (--no-training-program)"
    )


def export_rows_program(
    model: nn.Module,
    trainable: Sequence[str],
    out_dir: str | os.PathLike[str],
    *,
    task: str,
    kind: str,
    features: tuple[tuple[int, ...], str],
    labels: tuple[int, ...],
    lora_variant: str | None,
    lora_rank: int | None,
    micro_batch: int = 8,
) -> TrainingManifest:
    """Write ``train.pte`` and ``train_program.json`` of a ``classification`` or
    ``regression`` program for ``model`` into ``out_dir`` and return the manifest.

    ``features`` is one row's input (shape, dtype: "float32" or "int64"); ``labels`` one
    row's target shape (``()`` for a class index; regression targets are float32).
    ``model``'s parameters require grad exactly when named in ``trainable`` (a LoRA
    adapter's tensors, or the parameters a task trains)."""
    if kind not in LOSS_DESCRIPTIONS:
        raise ProgramExportError(f"a row program is {CLASSIFICATION!r} or {REGRESSION!r}, got {kind!r}")
    shape, dtype = tuple(int(d) for d in features[0]), features[1]
    if dtype not in ("float32", "int64"):
        raise ProgramExportError(f"the program takes float32 or int64 features, the task's are {dtype}")
    label_shape = () if kind == CLASSIFICATION else tuple(int(d) for d in labels)
    label_dtype = "int64" if kind == CLASSIFICATION else "float32"
    per_row = int(np.prod(label_shape, dtype=np.int64))
    example = (
        torch.zeros((micro_batch, *shape), dtype=getattr(torch, dtype)),
        torch.zeros((micro_batch, *label_shape), dtype=getattr(torch, label_dtype)),
        torch.full((micro_batch,), 1.0 / (micro_batch * per_row), dtype=torch.float32),
    )
    spec = LossProgram(
        kind=kind,
        module=_PROGRAMS[kind](model),
        example=example,
        inputs=(
            TensorDecl(name=ROW_INPUT_NAMES[0], dtype=dtype, shape=(micro_batch, *shape)),
            TensorDecl(name=ROW_INPUT_NAMES[1], dtype=label_dtype, shape=(micro_batch, *label_shape)),
            TensorDecl(name=ROW_INPUT_NAMES[2], dtype="float32", shape=(micro_batch,)),
        ),
        loss=LOSS_DESCRIPTIONS[kind],
        fields={},
    )
    return export_program(model, trainable, out_dir, spec, task=task, lora_variant=lora_variant,
                          lora_rank=lora_rank, micro_batch=micro_batch)
