"""Process-group setup from torchrun's environment, and the parallel wrappers.

torchrun (single- or multi-node, through its rendezvous) sets RANK, WORLD_SIZE,
LOCAL_RANK, MASTER_ADDR and MASTER_PORT; a plain ``python -m orchard.pretrain`` sets none
of them and runs as a single process. NCCL on CUDA, gloo on CPU.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from orchard.errors import ConfigError


@dataclass(frozen=True)
class DistEnv:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    owns_group: bool  # this recipe created the process group and must destroy it

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return dist.is_available() and dist.is_initialized()


def _pick_device(pref: str, local_rank: int) -> torch.device:
    if pref == "cuda" or (pref == "auto" and torch.cuda.is_available()):
        if not torch.cuda.is_available():
            raise ConfigError("device = 'cuda' but no CUDA device is visible; use device = 'cpu'")
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


def setup(device_pref: str, need_group: bool) -> DistEnv:
    """Join (or create) the process group.

    A group that already exists (a caller set it up) is used as is and left alone at
    teardown. Without torchrun's variables and without ``need_group`` (FSDP2 needs a
    device mesh even on one rank) the run has no group at all, so a single process pays
    no collective overhead.
    """
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", str(rank)))
    device = _pick_device(device_pref, local_rank)
    if dist.is_initialized():
        return DistEnv(dist.get_rank(), dist.get_world_size(), local_rank, device, False)
    backend = "nccl" if device.type == "cuda" else "gloo"
    if "WORLD_SIZE" in os.environ:
        dist.init_process_group(backend, device_id=device if device.type == "cuda" else None)
        return DistEnv(dist.get_rank(), dist.get_world_size(), local_rank, device, True)
    if need_group:
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
        return DistEnv(0, 1, 0, device, True)
    return DistEnv(0, 1, 0, device, False)


def teardown(env: DistEnv) -> None:
    if env.owns_group and dist.is_initialized():
        dist.destroy_process_group()


def barrier(env: DistEnv) -> None:
    if env.distributed:
        dist.barrier()


def wrap(model: nn.Module, strategy: str, env: DistEnv) -> nn.Module:
    """DDP (replicated weights, all-reduced gradients) or FSDP2 (per-block sharding).

    FSDP2 shards each transformer block as its own unit so only one block's full
    weights exist at a time, then the root (embeddings, final norm, tied head).
    """
    if strategy == "fsdp":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh(env.device.type, (env.world_size,))
        for block in model.blocks:  # type: ignore[union-attr]
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        return model
    if env.distributed and env.world_size > 1:
        from torch.nn.parallel import DistributedDataParallel as DDP

        ids = [env.device.index] if env.device.type == "cuda" else None
        return DDP(model, device_ids=ids)
    return model


def all_mean(values: torch.Tensor, env: DistEnv) -> torch.Tensor:
    """Mean over ranks (identity without a group)."""
    if env.distributed and env.world_size > 1:
        values = values.clone()
        dist.all_reduce(values, op=dist.ReduceOp.SUM)
        values /= env.world_size
    return values


class StopVote:
    """Every rank's stop flag, combined at each optimizer step so all ranks stop at the
    same one.

    One process: the flag itself, no collective. Several: a MAX all-reduce of one CPU
    float over gloo (the default group when it is gloo; under NCCL a gloo group made for
    this), so the vote never synchronises with the accelerator. Measured with two ranks
    on a 2-core CPU machine: 0.1 to 0.3 ms a vote alone, up to about 1 ms inside the
    loop, where it also waits for the slower rank (several percent of a toy model's 8 ms
    step, within noise on the two-rank gloo tests' wall time). Every rank must call
    :meth:`any` at every step.
    """

    def __init__(self, env: DistEnv) -> None:
        self.active = env.distributed and env.world_size > 1
        self.group: dist.ProcessGroup | None = None
        self._own = False
        if self.active and dist.get_backend() != "gloo":
            self.group = dist.new_group(backend="gloo")  # collective: every rank makes it
            self._own = True
        self._buf = torch.zeros(1)

    def any(self, flag: bool) -> bool:
        if not self.active:
            return flag
        self._buf.fill_(1.0 if flag else 0.0)
        dist.all_reduce(self._buf, op=dist.ReduceOp.MAX, group=self.group)
        return bool(self._buf.item())

    def close(self) -> None:
        if self._own and self.group is not None and dist.is_initialized():
            dist.destroy_process_group(self.group)
        self.group = None
        self._own = False
