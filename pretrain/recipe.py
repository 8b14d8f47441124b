"""The pretraining recipe: ``run(config) -> PretrainResult``.

Works the same as one process (``python -m orchard.pretrain``), under
``torchrun --nproc-per-node N -m orchard.pretrain`` and across nodes through torchrun's
rendezvous. The order of things:

1. join the process group; build token shards (rank 0) and the GPT
2. wrap it (DDP or FSDP2), build AdamW + warmup/cosine LambdaLR
3. resume from the newest checkpoint under ``<output_dir>/checkpoints`` if any
4. train: grad accumulation, autocast, clipping; log loss, tokens/s, MFU; checkpoint
   every ``checkpoint_every`` steps and when SIGTERM (or ``stop_after``) asks to stop.
   A pending SIGTERM is looked at after every optimizer step: ranks agree on it through
   one 1-element all-reduce per step on a CPU (gloo) group, which never waits on the
   accelerator; a single process checks a flag.
5. at the last step: validation loss, then rank 0 exports the base-model directory
   (to ``export_dir``, default ``output_dir``)
"""

from __future__ import annotations

import contextlib
import json
import math
import signal
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.fsdp import FSDPModule
from torch.nn.parallel import DistributedDataParallel as DDP

from orchard.errors import ConfigError
from orchard.gpt import GPT, GPTConfig
from orchard.pretrain import checkpoint, distributed
from orchard.pretrain.config import PretrainConfig
from orchard.pretrain.data import (
    Batch,
    Prefetcher,
    ShardIndex,
    WindowSampler,
    build_shards,
    resolve_select,
    shipped_corpus,
)
from orchard.pretrain.distributed import DistEnv
from orchard.pretrain.export import export_base_model
from orchard.pretrain.throughput import mfu, peak_flops

METRICS_FILE = "metrics.jsonl"


@dataclass
class PretrainResult:
    """What a run did. ``losses[i]`` is the rank-mean training loss of step
    ``start_step + i + 1``; ``finished`` means ``config.steps`` was reached (and, with
    ``config.export``, the base model written to ``output_dir``)."""

    output_dir: Path
    start_step: int
    step: int
    losses: list[float]
    finished: bool
    stopped_by: str | None  # "signal" | "stop_after" | None
    checkpoint: Path | None
    tokens_per_s: float  # global, over this run's steps after its first (compile, warm-up)
    mfu: float | None
    val_loss: float | None = None
    export: dict[str, float] = field(default_factory=dict)


def lr_multiplier(step: int, cfg: PretrainConfig) -> float:
    """Linear warmup over ``warmup_steps``, then cosine from ``lr`` to ``min_lr`` at ``steps``."""
    o = cfg.optim
    if step < o.warmup_steps:
        return (step + 1) / o.warmup_steps
    progress = (step - o.warmup_steps) / max(1, cfg.steps - o.warmup_steps)
    cosine = 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))
    return (o.min_lr + cosine * (o.lr - o.min_lr)) / o.lr


def autocast_dtype(cfg: PretrainConfig, device: torch.device) -> torch.dtype | None:
    """None means plain fp32. "auto": bf16 on CUDA; fp32 on CPU, where bf16 matmuls are
    often slower than fp32 and only worth it when asked for."""
    p = cfg.precision
    if p == "auto":
        p = "bf16" if device.type == "cuda" else "fp32"
    return {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}[p]


@dataclass
class Components:
    """Everything a training step needs, built once from the config."""

    config: PretrainConfig
    env: DistEnv
    index: ShardIndex
    gpt: GPT  # the unwrapped model (FSDP2 shards it in place; DDP keeps it as .module)
    model: nn.Module  # what forward/backward go through
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LambdaLR
    scaler: torch.amp.GradScaler
    sampler: WindowSampler
    amp_dtype: torch.dtype | None
    flops_per_token: int
    tokens_per_step: int  # global


def build(cfg: PretrainConfig, env: DistEnv) -> Components:
    shard_dir = cfg.data.shard_dir or cfg.output_dir / "data"
    if env.is_main:
        corpus = list(cfg.data.corpus) or [shipped_corpus()]
        select = resolve_select(cfg.data.select) if cfg.data.select else None
        build_shards(corpus, shard_dir, cfg.data.shards, cfg.data.val_fraction, select)
    distributed.barrier(env)
    index = ShardIndex.load(shard_dir)

    shape = cfg.model.model_dump()
    vocab = shape.pop("vocab_size") or index.tokenizer.vocab_size
    if vocab < index.tokenizer.vocab_size:
        raise ConfigError(
            f"model.vocab_size = {vocab} is smaller than the tokenizer's "
            f"{index.tokenizer.vocab_size} tokens; leave it unset to use the tokenizer's"
        )
    gpt_cfg = GPTConfig(vocab_size=vocab, **shape)
    torch.manual_seed(cfg.seed)  # identical initial weights on every rank
    gpt = GPT(gpt_cfg).to(env.device)
    gpt.activation_checkpointing = cfg.activation_checkpointing
    flops = gpt.flops_per_token()
    if cfg.compile:
        gpt.compile(scope=cfg.compile_scope)
    model = distributed.wrap(gpt, cfg.strategy, env)
    # Dropout draws differ per rank; a resumed run restores this state from its checkpoint.
    torch.manual_seed(cfg.seed + 1 + env.rank)

    # Weight decay on matrices only (not biases, norms): the usual AdamW recipe for GPTs.
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": cfg.optim.weight_decay},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]
    cuda = env.device.type == "cuda"
    optimizer = torch.optim.AdamW(
        groups,
        lr=cfg.optim.lr,
        betas=(cfg.optim.beta1, cfg.optim.beta2),
        fused=True if cuda else None,
        foreach=None if cuda else True,
    )
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: lr_multiplier(s, cfg))
    amp_dtype = autocast_dtype(cfg, env.device)
    scaler = torch.amp.GradScaler(env.device.type, enabled=amp_dtype is torch.float16)
    per_step = cfg.batch_size * cfg.grad_accum  # the Prefetcher cuts it into micro-batches
    sampler = WindowSampler(
        index, "train", cfg.model.seq_len, per_step, cfg.seed, env.rank, env.world_size
    )
    tokens = cfg.batch_size * cfg.grad_accum * cfg.model.seq_len * env.world_size
    return Components(
        cfg, env, index, gpt, model, optimizer, scheduler, scaler, sampler, amp_dtype, flops, tokens
    )


def _grad_sync(model: nn.Module, enabled: bool) -> contextlib.AbstractContextManager[Any]:
    """Skip the gradient all-reduce on all but the last micro-batch of a step."""
    if isinstance(model, FSDPModule):
        model.set_requires_gradient_sync(enabled)
    elif isinstance(model, DDP) and not enabled:
        return model.no_sync()
    return contextlib.nullcontext()


def loss_fn(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    # Through the wrapper's forward (DDP and FSDP2 hook it), with the GPT's own loss head.
    return model(x, y)


def train_step(c: Components, batch: Batch) -> torch.Tensor:
    """One optimizer step over ``grad_accum`` micro-batches; returns the mean loss (detached,
    not synchronised: reading it would stall the device)."""
    total = torch.zeros((), device=c.env.device)
    n = len(batch)
    for i, (x, y) in enumerate(batch):
        with (
            _grad_sync(c.model, i == n - 1),
            torch.autocast(c.env.device.type, dtype=c.amp_dtype, enabled=c.amp_dtype is not None),
        ):
            loss = loss_fn(c.model, x, y) / n
        c.scaler.scale(loss).backward()
        total += loss.detach()
    if c.config.optim.grad_clip > 0:
        c.scaler.unscale_(c.optimizer)
        torch.nn.utils.clip_grad_norm_(c.model.parameters(), c.config.optim.grad_clip)
    c.scaler.step(c.optimizer)
    c.scaler.update()
    c.optimizer.zero_grad(set_to_none=True)
    c.scheduler.step()
    return total


@torch.no_grad()
def evaluate(c: Components) -> float | None:
    if c.config.eval_batches == 0:
        return None
    # A fixed set of validation windows (seeded apart from training), the same at every call.
    sampler = WindowSampler(
        c.index,
        "val",
        c.config.model.seq_len,
        c.config.batch_size,
        c.config.seed + 1,
        c.env.rank,
        1,
    )
    c.model.eval()
    losses = []
    for i in range(c.config.eval_batches):
        x, y = (t.to(c.env.device) for t in sampler.batch(i))
        with torch.autocast(c.env.device.type, dtype=c.amp_dtype, enabled=c.amp_dtype is not None):
            losses.append(loss_fn(c.model, x, y))
    c.model.train()
    return float(distributed.all_mean(torch.stack(losses).mean(), c.env).item())


class _StopFlag:
    """SIGTERM sets the flag; after the current optimizer step the loop logs, checkpoints
    and returns. (A handler can only be installed from the main thread; elsewhere the
    flag stays off.)"""

    def __init__(self) -> None:
        self.set = False
        self._previous: Any = None

    def __enter__(self) -> _StopFlag:
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGTERM, self._handle)
        return self

    def _handle(self, signum: int, frame: Any) -> None:
        self.set = True

    def __exit__(self, *exc: object) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGTERM, self._previous)


@contextlib.contextmanager
def _progress(enabled: bool, total: int, start: int) -> Iterator[tuple[Progress | None, Any]]:
    if not enabled:
        yield None, None
        return
    progress = Progress(
        TextColumn("[bold]pretrain"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("{task.fields[status]}"),
        TimeRemainingColumn(),
        console=Console(stderr=True),
    )
    with progress:
        yield progress, progress.add_task("train", total=total, completed=start, status="")


def _append_metrics(
    out: Path, step: int, losses: list[float], rate: float, util: float | None
) -> None:
    """One JSON line per step in ``metrics.jsonl`` (a resumed run appends), with
    throughput on the last step of each log interval."""
    out.mkdir(parents=True, exist_ok=True)
    first = step - len(losses) + 1
    with (out / METRICS_FILE).open("a") as f:
        for i, loss in enumerate(losses):
            row: dict[str, Any] = {"step": first + i, "loss": loss}
            if first + i == step:
                row.update(tokens_per_s=rate, mfu=util)
            f.write(json.dumps(row) + "\n")


class _Meter:
    """Training throughput: tokens over wall time of the intervals between laps."""

    def __init__(self, device: torch.device, tokens_per_step: int) -> None:
        self.device, self.tokens_per_step = device, tokens_per_step
        self.tokens, self.seconds = 0, 0.0
        self._t: float | None = None
        self._step = 0

    def _now(self) -> float:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter()

    def start(self, step: int) -> None:
        self._t, self._step = self._now(), step

    def lap(self, step: int) -> None:
        if self._t is None:
            return
        now = self._now()
        self.tokens += (step - self._step) * self.tokens_per_step
        self.seconds += now - self._t
        self._t, self._step = now, step

    @property
    def rate(self) -> float:
        return self.tokens / self.seconds if self.seconds else 0.0


def run(cfg: PretrainConfig) -> PretrainResult:
    env = distributed.setup(cfg.device, need_group=cfg.strategy == "fsdp")
    try:
        return _run(cfg, env)
    finally:
        distributed.teardown(env)


def _run(cfg: PretrainConfig, env: DistEnv) -> PretrainResult:
    c = build(cfg, env)
    ckpt_root = cfg.output_dir / "checkpoints"
    start = 0
    resume_from = checkpoint.latest(ckpt_root) if cfg.resume else None
    if resume_from is not None:
        start = checkpoint.load(resume_from, c.model, c.optimizer, c.scheduler, env)
    end = min(cfg.steps, start + cfg.stop_after) if cfg.stop_after else cfg.steps
    peak = peak_flops(env.device, cfg.peak_flops)
    main_progress = cfg.progress and env.is_main
    console = Console(stderr=True)

    losses: list[float] = []
    pending: list[torch.Tensor] = []
    stopped_by: str | None = None
    meter = _Meter(env.device, c.tokens_per_step)
    step = start
    vote = distributed.StopVote(env)
    loader = Prefetcher(c.sampler, start, end, cfg.grad_accum, env.device, cfg.data.prefetch)
    c.model.train()

    def log(bar: Progress | None, task: Any) -> None:
        # The loop's only device sync: this interval's losses are read at once.
        means = distributed.all_mean(torch.stack(pending), env).tolist()
        losses.extend(means)
        pending.clear()
        meter.lap(step)
        util = mfu(meter.rate / env.world_size, c.flops_per_token, peak)
        status = f"loss {means[-1]:.4f}"
        if meter.rate:  # nothing timed yet on the run's first step
            status += f"  {meter.rate:,.0f} tok/s"
        if util is not None:
            status += f"  MFU {100 * util:.1f}%"
        if env.is_main:
            _append_metrics(cfg.output_dir, step, means, meter.rate, util)
        if bar is not None:
            bar.update(task, completed=step, status=status)
            bar.console.print(f"step {step}/{cfg.steps}  {status}")
        elif env.is_main:
            console.print(f"step {step}/{cfg.steps}  {status}")

    try:
        with _StopFlag() as stop, _progress(main_progress, cfg.steps, start) as (bar, task):
            for batch in loader:
                pending.append(train_step(c, batch))
                step += 1
                if step == start + 1:  # compilation and allocator warm-up: not timed
                    meter.start(step)
                # Every step, and on every rank at the same step: a CPU-side vote.
                stopping = vote.any(stop.set)
                if stopping or step % cfg.log_every == 0 or step == end:
                    log(bar, task)
                if stopping:
                    stopped_by = "signal"
                    if env.is_main:
                        console.print(f"SIGTERM: stopping at step {step}, writing a checkpoint")
                    break
                if cfg.checkpoint_every and step % cfg.checkpoint_every == 0 and step < end:
                    meter.lap(step)
                    checkpoint.save(
                        ckpt_root,
                        step,
                        c.model,
                        c.optimizer,
                        c.scheduler,
                        env,
                        cfg.keep_checkpoints,
                    )
                    meter.start(step)  # checkpoint time is not training throughput
    finally:
        loader.close()
        vote.close()

    if step < cfg.steps and stopped_by is None:
        stopped_by = "stop_after"
    saved = None
    if step > start or resume_from is None:
        saved = checkpoint.save(
            ckpt_root, step, c.model, c.optimizer, c.scheduler, env, cfg.keep_checkpoints
        )
    rate = meter.rate
    result = PretrainResult(
        output_dir=cfg.output_dir,
        start_step=start,
        step=step,
        losses=losses,
        finished=step >= cfg.steps,
        stopped_by=stopped_by,
        checkpoint=saved or resume_from,
        tokens_per_s=rate,
        mfu=mfu(rate / env.world_size, c.flops_per_token, peak),
    )
    if not result.finished:
        return result
    result.val_loss = evaluate(c)
    export_dir = cfg.export_dir or cfg.output_dir
    if cfg.export:
        # Collective: gathers FSDP2 shards; only rank 0 receives the full tensors.
        full = get_model_state_dict(
            c.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
        )
        if env.is_main:
            plain = GPT(c.gpt.config)
            plain.load_state_dict(full)  # holds wte.weight and lm_head.weight: one tensor
            result.export = export_base_model(
                plain, c.index.tokenizer, export_dir, onnx=cfg.export_onnx
            )
        distributed.barrier(env)
    if env.is_main:
        val = f"{result.val_loss:.4f}" if result.val_loss is not None else "-"
        console.print(
            f"done: step {step}, train loss {losses[-1] if losses else float('nan'):.4f}, "
            f"val loss {val}, {rate:,.0f} tok/s -> {export_dir if cfg.export else cfg.output_dir}"
        )
    return result
