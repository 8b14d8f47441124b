"""Causal attention at the pretraining GPT's shape, per PyTorch SDPA backend, on one GPU.

    python benchmarks/attention.py [--batch 16] [--heads 12] [--seq 1024] [--head-dim 64] [--json PATH]

For each backend that runs here (flash, cuDNN, memory-efficient; "default" is whatever
``F.scaled_dot_product_attention`` picks when nothing is forced): forward and forward +
backward time (CUDA events, median of repeats after warm-up, fresh random bf16 inputs),
the achieved TFLOP/s counting the causal half of the score and value products, and the
largest difference from the math backend in float32 on the same inputs. The baseline
ratio is each backend's forward + backward time against the default's, same run.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import statistics
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

BACKENDS = {
    "default": None,
    "flash": SDPBackend.FLASH_ATTENTION,
    "cudnn": SDPBackend.CUDNN_ATTENTION,
    "efficient": SDPBackend.EFFICIENT_ATTENTION,
}


def _time_ms(fn, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--heads", type=int, default=12)
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--repeat", type=int, default=20)
    p.add_argument("--json", type=Path, default=None)
    a = p.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("benchmarks/attention.py needs a CUDA GPU (torch.cuda.is_available() is False)")
    shape = (a.batch, a.heads, a.seq, a.head_dim)
    # Causal: half the T x T products. Forward: QK^T and PV, 2 FLOPs a multiply-add each;
    # backward: 2.5x the forward (dQ, dK, dV and the recomputed scores).
    fwd_flops = 2 * 2 * a.batch * a.heads * a.seq * a.seq * a.head_dim / 2
    sets = [
        [torch.randn(shape, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3)]
        for _ in range(4)
    ]  # rotated, so repeats do not time one cached input
    grad = torch.randn(shape, device="cuda", dtype=torch.bfloat16)
    q, k, v = sets[0]
    with sdpa_kernel(SDPBackend.MATH):
        ref = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), is_causal=True)
    rows = []
    for name, backend in BACKENDS.items():
        row: dict = {"backend": name}
        try:
            with sdpa_kernel(backend) if backend is not None else contextlib.nullcontext():
                out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
                row["max_abs_diff_vs_math"] = float((out.float() - ref).abs().max())
                turn = itertools.cycle(sets)

                def fwd(turn: itertools.cycle = turn) -> None:
                    x = next(turn)
                    with torch.no_grad():
                        F.scaled_dot_product_attention(*x, is_causal=True)

                def fwd_bwd(turn: itertools.cycle = turn) -> None:
                    x = next(turn)
                    F.scaled_dot_product_attention(*x, is_causal=True).backward(grad)

                for fn in (fwd, fwd_bwd):
                    for _ in range(3):
                        fn()
                torch.cuda.synchronize()
                row["fwd_ms"] = _time_ms(fwd, a.repeat)
                row["fwd_bwd_ms"] = _time_ms(fwd_bwd, a.repeat)
                row["fwd_tflops"] = fwd_flops / row["fwd_ms"] / 1e9
                row["fwd_bwd_tflops"] = 3.5 * fwd_flops / row["fwd_bwd_ms"] / 1e9
        except RuntimeError as err:  # this backend does not run here (build, GPU or shape)
            row["error"] = str(err).splitlines()[0][:200]
        rows.append(row)
    base = next((r["fwd_bwd_ms"] for r in rows if r["backend"] == "default" and "fwd_bwd_ms" in r), None)
    for r in rows:
        if "fwd_bwd_ms" in r:
            r["speedup_vs_default"] = base / r["fwd_bwd_ms"] if base else None
    print(f"causal SDPA, bf16, shape {shape}, {torch.cuda.get_device_name()}, torch {torch.__version__}")
    print(f"{'backend':<10} {'fwd ms':>8} {'fwd TF/s':>9} {'f+b ms':>8} {'f+b TF/s':>9} {'x default':>9} {'|diff|':>9}")
    for r in rows:
        if "error" in r:
            print(f"{r['backend']:<10} does not run here: {r['error']}")
            continue
        print(f"{r['backend']:<10} {r['fwd_ms']:>8.3f} {r['fwd_tflops']:>9.0f} {r['fwd_bwd_ms']:>8.3f} "
              f"{r['fwd_bwd_tflops']:>9.0f} {r['speedup_vs_default'] or 0:>9.2f} {r['max_abs_diff_vs_math']:>9.1e}")
    if a.json:
        a.json.write_text(json.dumps({"shape": shape, "device": torch.cuda.get_device_name(),
                                      "torch": torch.__version__, "backends": rows}, indent=2))


if __name__ == "__main__":
    main()
