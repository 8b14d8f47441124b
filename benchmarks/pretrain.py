"""Pretraining throughput: the recipe's training step against a minimal plain PyTorch loop.

    python benchmarks/pretrain.py --device cuda --json out.json  # GPT-2 small (124M), bf16, compiled
    python benchmarks/pretrain.py --device cpu --json out.json

Both loops train the same GPT from the same initial weights on the same batches with
the same AdamW, clipping and LR schedule, one process. They run interleaved in blocks
(recipe, plain, recipe, plain, ...) so machine noise hits both alike; the ratio of
their tokens/s is the recipe's overhead (target >= 0.95). Because the math is the same,
their losses must agree too, which the table reports.

With ``--profile N`` the recipe's step is also traced with ``torch.profiler`` for N steps
after the timed blocks: the table of the kernels that took the most device time, and how
the step's device time splits into matrix products, attention, fused elementwise work
and the optimizer, against the steps' wall time (the device's idle share is the host's
overhead), printed and written beside the JSON.

Then the resume check: an uninterrupted ``run()`` against one stopped half-way
(checkpointed through DCP) and resumed; the largest loss difference should be 0 on CPU.

On CPU the default model is small (4 layers, 256 wide, 256 tokens) so the benchmark
finishes in a couple of minutes; ``--model gpt2`` selects GPT-2 small on any device.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from rich.console import Console
from rich.table import Table

from orchard.gpt import GPT
from orchard.pretrain import distributed
from orchard.pretrain.config import PretrainConfig, parse_pretrain_config
from orchard.pretrain.data import Prefetcher
from orchard.pretrain.recipe import Components, build, lr_multiplier, run, train_step
from orchard.pretrain.throughput import mfu, peak_flops

MFU_TARGET = 0.45  # on one H100 or H200, GPT-2 small, sequence 1024, bf16

MODELS: dict[str, dict[str, Any]] = {
    # GPT-2 small: 124M parameters; vocab padded to 50304 (a multiple of 64).
    "gpt2": {"vocab_size": 50304, "seq_len": 1024, "n_layer": 12, "n_head": 12, "d_model": 768},
    "small": {"seq_len": 256, "n_layer": 4, "n_head": 4, "d_model": 256},
}


def make_config(args: argparse.Namespace, output_dir: Path, **extra: Any) -> PretrainConfig:
    data: dict[str, Any] = {
        "output_dir": str(output_dir),
        "device": args.device,
        "steps": args.steps,
        "batch_size": args.batch_size,
        "model": MODELS[args.model],
        "precision": args.precision,
        "compile": args.compile,
        "compile_scope": args.compile_scope,
        "optim": {"lr": 1e-3, "min_lr": 1e-4, "warmup_steps": 5},
        "progress": False,
        "export": False,
        "eval_batches": 0,
        "checkpoint_every": 0,
        "data": {"shard_dir": str(output_dir.parent / "shards")},
        **extra,
    }
    return parse_pretrain_config(data)


class PlainLoop:
    """What one would write by hand: no prefetch thread, no wrappers, no bookkeeping."""

    def __init__(self, c: Components) -> None:
        cfg = c.config
        torch.manual_seed(cfg.seed)
        self.model = GPT(c.gpt.config).to(c.env.device)
        if cfg.compile:  # compiled as the recipe's model is, so the ratio compares loops
            self.model.compile(scope=cfg.compile_scope)
        decay = [p for p in self.model.parameters() if p.dim() >= 2]
        other = [p for p in self.model.parameters() if p.dim() < 2]
        cuda = c.env.device.type == "cuda"
        self.opt = torch.optim.AdamW(
            [
                {"params": decay, "weight_decay": cfg.optim.weight_decay},
                {"params": other, "weight_decay": 0.0},
            ],
            lr=cfg.optim.lr,
            betas=(cfg.optim.beta1, cfg.optim.beta2),
            fused=True if cuda else None,
            foreach=None if cuda else True,
        )
        self.sched = torch.optim.lr_scheduler.LambdaLR(self.opt, lambda s: lr_multiplier(s, cfg))
        self.sampler, self.device, self.dtype = c.sampler, c.env.device, c.amp_dtype
        self.clip = cfg.optim.grad_clip

    def step(self, step: int) -> torch.Tensor:
        x, y = (t.to(self.device) for t in self.sampler.batch(step))
        with torch.autocast(self.device.type, dtype=self.dtype, enabled=self.dtype is not None):
            loss = self.model(x, y)  # nanoGPT's habit: the model returns the loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.clip)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        self.sched.step()
        return loss.detach()


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# Kernel names by kind, for the profile's summary (first match wins; the rest is "other").
KERNEL_KINDS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("attention", ("flash", "fmha", "attention", "cudnn")),
    ("matmul", ("gemm", "xmma", "cutlass", "nvjet", "matmul", "sm90_")),
    ("optimizer", ("adam", "multi_tensor")),
    ("fused (triton)", ("triton",)),
)


def kernel_kind(name: str) -> str:
    low = name.lower()
    for kind, keys in KERNEL_KINDS:
        if any(k in low for k in keys):
            return kind
    return "other"


def profile_steps(c: Components, loader: Any, steps: int) -> dict[str, Any]:
    """Trace ``steps`` recipe steps: device time per kernel kind, the busiest kernels, and
    the device's busy share of the steps' wall time."""
    from torch.profiler import ProfilerActivity, profile

    cuda = c.env.device.type == "cuda"
    activities = [ProfilerActivity.CPU, *([ProfilerActivity.CUDA] if cuda else [])]
    with profile(activities=activities) as prof:
        t = time.perf_counter()
        pending = [train_step(c, next(loader)) for _ in range(steps)]
        torch.stack(pending).cpu()
        _sync(c.env.device)
        wall = time.perf_counter() - t
    events = prof.key_averages()
    kinds: dict[str, float] = {}
    kernels = []
    for e in events:
        dev_us = float(getattr(e, "self_device_time_total", 0.0))
        if dev_us <= 0 or e.device_type != torch.autograd.DeviceType.CUDA or "#" in e.key:
            continue  # ("Optimizer.step#AdamW.step" and the like span kernels counted apart)
        kind = kernel_kind(e.key)
        kinds[kind] = kinds.get(kind, 0.0) + dev_us / 1e3 / steps
        kernels.append((dev_us / 1e3 / steps, e.count // steps, e.key))
    kernels.sort(reverse=True)
    busy_ms = sum(kinds.values())
    return {
        "profile_steps": steps,
        "profile_wall_ms_per_step": 1e3 * wall / steps,
        "profile_device_ms_per_step": busy_ms,
        "profile_device_busy": busy_ms / (1e3 * wall / steps) if wall else None,
        "profile_ms_per_step_by_kind": dict(sorted(kinds.items(), key=lambda kv: -kv[1])),
        "profile_top_kernels": [
            {"ms_per_step": round(ms, 3), "calls_per_step": n, "kernel": k[:160]}
            for ms, n, k in kernels[:25]
        ],
        "profile_table": events.table(
            sort_by="self_cuda_time_total" if cuda else "self_cpu_time_total", row_limit=30
        ),
    }


def compare_loops(args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    cfg = make_config(args, workdir / "loops", log_every=args.block)
    env = distributed.setup(cfg.device, need_group=False)
    c = build(cfg, env)
    plain = PlainLoop(c)
    total = args.warmup + args.rounds * args.block + args.profile
    loader = iter(Prefetcher(c.sampler, 0, total, 1, env.device, cfg.data.prefetch))
    recipe_losses: list[torch.Tensor] = []
    plain_losses: list[torch.Tensor] = []
    times = {"recipe": 0.0, "plain": 0.0}

    def recipe_block(first: int, n: int, timed: bool) -> None:
        t = time.perf_counter()
        pending = [train_step(c, next(loader)) for _ in range(n)]
        # As in the recipe's loop: losses are read once per log interval.
        recipe_losses.extend(torch.stack(pending).cpu())
        _sync(env.device)
        if timed:
            times["recipe"] += time.perf_counter() - t

    def plain_block(first: int, n: int, timed: bool) -> None:
        t = time.perf_counter()
        pending = [plain.step(s) for s in range(first, first + n)]
        plain_losses.extend(torch.stack(pending).cpu())
        _sync(env.device)
        if timed:
            times["plain"] += time.perf_counter() - t

    recipe_block(0, args.warmup, timed=False)
    plain_block(0, args.warmup, timed=False)
    for r in range(args.rounds):
        first = args.warmup + r * args.block
        # Alternate which goes first, so neither always runs on a warmer machine.
        order = (recipe_block, plain_block) if r % 2 == 0 else (plain_block, recipe_block)
        for block in order:
            block(first, args.block, timed=True)

    profiled = profile_steps(c, loader, args.profile) if args.profile else {}
    tokens = args.rounds * args.block * c.tokens_per_step
    peak = peak_flops(env.device, args.peak_flops)
    out = {
        "model": args.model,
        "params": c.gpt.num_params(),
        "tokens_per_step": c.tokens_per_step,
        "steps_timed": args.rounds * args.block,
        "recipe_tokens_per_s": tokens / times["recipe"],
        "plain_tokens_per_s": tokens / times["plain"],
        "max_abs_loss_diff_vs_plain": max(
            abs(float(a) - float(b)) for a, b in zip(recipe_losses, plain_losses, strict=True)
        ),
    }
    out["ratio_vs_plain_loop"] = out["recipe_tokens_per_s"] / out["plain_tokens_per_s"]
    out["recipe_mfu"] = mfu(out["recipe_tokens_per_s"], c.flops_per_token, peak)
    out["plain_mfu"] = mfu(out["plain_tokens_per_s"], c.flops_per_token, peak)
    out["flops_per_token"] = c.flops_per_token
    out["peak_flops"] = peak
    out["peak_memory_gib_both_loops"] = (
        torch.cuda.max_memory_allocated(env.device) / 2**30 if env.device.type == "cuda" else None
    )
    out.update(profiled)
    distributed.teardown(env)
    return out


def resume_check(args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    steps = args.resume_steps
    extra = {"steps": steps, "log_every": steps}  # losses are kept per step either way
    cuda = args.device == "cuda"
    if cuda:  # the recipe's own peak, one model resident
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    full = run(make_config(args, workdir / "full", **extra))
    peak_gib = torch.cuda.max_memory_allocated() / 2**30 if cuda else None
    first = run(make_config(args, workdir / "split", stop_after=steps // 2, **extra))
    second = run(make_config(args, workdir / "split", **extra))
    resumed = first.losses + second.losses
    return {
        "resume_steps": steps,
        "resume_stopped_at": first.step,
        "resume_max_abs_loss_diff": max(
            abs(a - b) for a, b in zip(full.losses, resumed, strict=True)
        ),
        "run_tokens_per_s": full.tokens_per_s,
        "run_mfu": full.mfu,
        "run_peak_memory_gib": peak_gib,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument(
        "--device", choices=["cpu", "cuda"], default="cuda" if torch.cuda.is_available() else "cpu"
    )
    p.add_argument("--model", choices=sorted(MODELS), default=None)
    p.add_argument("--batch-size", type=int, default=None)
    p.add_argument("--precision", default="auto", choices=["auto", "fp32", "bf16", "fp16"])
    p.add_argument(
        "--compile",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="torch.compile the model, as --compile-scope says (default: on for cuda, off for cpu)",
    )
    p.add_argument(
        "--compile-scope",
        choices=["blocks", "model"],
        default="blocks",
        help="compile each block and the loss head, or the whole forward as one graph",
    )
    p.add_argument("--warmup", type=int, default=3, help="untimed steps per loop first")
    p.add_argument("--rounds", type=int, default=None, help="interleaved rounds")
    p.add_argument("--block", type=int, default=5, help="steps per loop per round")
    p.add_argument("--resume-steps", type=int, default=10, help="0: no resume check")
    p.add_argument(
        "--profile", type=int, default=0, metavar="N",
        help="trace N more recipe steps with torch.profiler and summarise where device time went",
    )
    p.add_argument("--peak-flops", type=float, default=None, help="per device, for MFU on CPU")
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args()
    gpu = args.device == "cuda"
    args.model = args.model or ("gpt2" if gpu else "small")
    args.compile = gpu if args.compile is None else args.compile
    args.batch_size = args.batch_size or (16 if gpu else 8)
    args.rounds = args.rounds or (8 if gpu else 6)
    args.steps = args.warmup + args.rounds * args.block
    console = Console()
    if not gpu and args.model == "small":
        console.print(
            "CPU run: a small GPT (4 layers, d_model 256, seq 256, batch 8) stands in for "
            "GPT-2 small so this finishes in minutes; use --model gpt2 for the full size."
        )

    with tempfile.TemporaryDirectory() as tmp:
        try:
            loops = compare_loops(args, Path(tmp))
            resume = resume_check(args, Path(tmp)) if args.resume_steps else {}
        except torch.OutOfMemoryError:
            console.print(
                f"[red]out of device memory at batch size {args.batch_size}[/red] (two copies "
                "of the model and their optimizer states are resident): run again with a "
                "smaller --batch-size"
            )
            raise SystemExit(1) from None
    result = {
        "device": args.device,
        "precision": args.precision,
        "compile": args.compile,
        "compile_scope": args.compile_scope,
        "batch_size": args.batch_size,
        "torch": torch.__version__,
        **loops,
        **resume,
    }
    if gpu:
        result["device_name"] = torch.cuda.get_device_name()
        result["mfu_target"] = MFU_TARGET

    table = Table(
        title=f"pretrain benchmark ({args.model}, {loops['params'] / 1e6:.1f}M params, "
        f"{args.device}, batch {args.batch_size}"
        + (f", compiled: {args.compile_scope}" if args.compile else "")
        + ")"
    )
    table.add_column("measure")
    table.add_column("recipe", justify="right")
    table.add_column("plain loop", justify="right")

    def pct(v: float | None) -> str:
        return "-" if v is None else f"{100 * v:.1f}%"

    table.add_row(
        "tokens/s", f"{loops['recipe_tokens_per_s']:,.0f}", f"{loops['plain_tokens_per_s']:,.0f}"
    )
    table.add_row("MFU", pct(loops["recipe_mfu"]), pct(loops["plain_mfu"]))
    if gpu and loops["recipe_mfu"] is not None:
        met = "met" if loops["recipe_mfu"] >= MFU_TARGET else "NOT met"
        table.add_row(f"MFU target {100 * MFU_TARGET:.0f}%", met, "")
    table.add_row("ratio recipe / plain", f"{loops['ratio_vs_plain_loop']:.3f}", "")
    table.add_row(
        "max |loss diff| recipe vs plain", f"{loops['max_abs_loss_diff_vs_plain']:.2e}", ""
    )
    if resume:
        table.add_row(
            f"max |loss diff| resumed@{resume['resume_stopped_at']} vs uninterrupted",
            f"{resume['resume_max_abs_loss_diff']:.2e}",
            "",
        )
        table.add_row("run() tokens/s (end to end)", f"{resume['run_tokens_per_s']:,.0f}", "")
    if resume.get("run_peak_memory_gib") is not None:
        table.add_row("run() peak device memory", f"{resume['run_peak_memory_gib']:.1f} GiB", "")
    console.print(table)
    if args.profile:
        print(loops["profile_table"])
        busy = loops["profile_device_busy"] if gpu else None
        console.print(
            f"profile over {args.profile} recipe steps: {loops['profile_wall_ms_per_step']:.1f} ms "
            f"a step, device busy {loops['profile_device_ms_per_step']:.1f} ms"
            + (f" ({100 * busy:.0f}%)" if busy is not None else "")
        )
        for kind, ms in loops["profile_ms_per_step_by_kind"].items():
            console.print(f"  {kind:<16} {ms:8.2f} ms a step")
        if args.json:
            args.json.with_suffix(".profile.txt").write_text(loops["profile_table"])
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
