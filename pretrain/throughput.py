"""Tokens per second and model FLOPs utilisation (MFU, PaLM appendix B).

MFU = achieved model FLOP/s / peak FLOP/s, with model FLOPs from
:meth:`orchard.gpt.GPT.flops_per_token` (recomputation from activation checkpointing
is not counted: that is what makes it *model* FLOPs rather than hardware FLOPs).
"""

from __future__ import annotations

import torch

# Dense bf16 tensor-core peak per device, FLOP/s (vendor datasheets, without sparsity).
# Matched against torch.cuda.get_device_name() in order: the first key it contains wins.
PEAK_BF16_FLOPS: tuple[tuple[str, float], ...] = (
    ("H200", 989.4e12),
    ("H100 NVL", 835.0e12),
    ("H100 PCIe", 756.0e12),
    ("H100", 989.4e12),  # SXM
    ("A100", 312.0e12),
)


def peak_flops(device: torch.device, configured: float | None = None) -> float | None:
    """Peak FLOP/s of one device: the configured value, else the table for known GPUs.

    None (no MFU reported) on CPU and unknown GPUs unless configured: a guessed peak
    would make the ratio meaningless.
    """
    if configured is not None:
        return configured
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    for key, value in PEAK_BF16_FLOPS:
        if key in name:
            return value
    return None


def mfu(tokens_per_s_per_device: float, flops_per_token: float, peak: float | None) -> float | None:
    if peak is None:
        return None
    return tokens_per_s_per_device * flops_per_token / peak
