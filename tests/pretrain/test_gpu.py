"""CUDA paths: bf16 autocast, fp16 with GradScaler, fused AdamW, torch.compile, MFU."""

from __future__ import annotations

import math

import pytest
import torch

from orchard.pretrain.recipe import run
from orchard.pretrain.throughput import PEAK_BF16_FLOPS, peak_flops

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


@pytest.mark.parametrize(
    "extra",
    [
        {"precision": "bf16"},
        {"precision": "fp16"},
        {"precision": "bf16", "activation_checkpointing": True, "grad_accum": 2},
        {"precision": "bf16", "compile": True},
        {"precision": "bf16", "compile": True, "compile_scope": "model"},
        {"precision": "bf16", "strategy": "fsdp"},
    ],
    ids=["bf16", "fp16", "ckpt-accum", "compile", "compile-model", "fsdp"],
)
def test_cuda_training_learns(tmp_path, tiny_config, extra) -> None:
    result = run(tiny_config(tmp_path, device="cuda", steps=30, **extra))
    assert result.finished and all(math.isfinite(x) for x in result.losses)
    assert sum(result.losses[-5:]) / 5 < result.losses[0] - 0.5
    assert result.tokens_per_s > 0


def test_cuda_export_round_trips(tmp_path, tiny_config) -> None:
    result = run(tiny_config(tmp_path, device="cuda", steps=5, export=True))
    assert result.export["onnx_max_abs_diff"] <= 1e-4


def test_known_gpus_have_a_peak() -> None:
    name = torch.cuda.get_device_name()
    if any(key in name for key, _ in PEAK_BF16_FLOPS):
        assert peak_flops(torch.device("cuda")) is not None


def test_cuda_resume_from_a_checkpoint_follows_the_uninterrupted_losses(tmp_path, tiny_config) -> None:
    # The DCP checkpoint is written from the GPU mid-run and read back by a new run, which
    # must continue the uninterrupted run's losses. Same kernels on the same inputs give the
    # same floats; the tolerance is for attention kernels that accumulate in any order.
    full = run(tiny_config(tmp_path / "full", device="cuda", steps=12, log_every=1))
    first = run(tiny_config(tmp_path / "split", device="cuda", steps=12, log_every=1, stop_after=5))
    assert (first.step, first.stopped_by) == (5, "stop_after")
    second = run(tiny_config(tmp_path / "split", device="cuda", steps=12, log_every=1))
    assert second.start_step == 5 and second.finished
    resumed = first.losses + second.losses
    assert len(resumed) == len(full.losses) == 12
    assert max(abs(a - b) for a, b in zip(full.losses, resumed, strict=True)) <= 1e-3
