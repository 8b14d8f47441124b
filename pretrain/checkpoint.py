"""Resumable checkpoints through torch.distributed.checkpoint (DCP).

Layout under ``<output_dir>/checkpoints``::

    step_000120/            DCP files: model, optimizer, scheduler, step (every rank writes its shards)
    step_000120/rng_rank{r}.pt   that rank's CPU (and CUDA) generator state
    step_000120/done        written last by rank 0 after a barrier: the checkpoint is whole
    latest                  name of the newest whole checkpoint (replaced atomically)

DCP saves sharded (FSDP2) and replicated (DDP) state alike and can reload into a
different world size. The data position is the step: batches are a function of it.
RNG state is per rank, so it sits next to the DCP files rather than in them (DCP keeps
one copy of a non-tensor value that every rank holds under the same key).
"""

from __future__ import annotations

import contextlib
import shutil
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from orchard.errors import OrchardError
from orchard.pretrain.distributed import DistEnv, barrier


class CheckpointError(OrchardError):
    """A checkpoint is missing, incomplete, or does not fit the model and optimizer."""


def _rng_state() -> dict[str, Any]:
    state: dict[str, Any] = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["cpu"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


@contextlib.contextmanager
def _quiet_single_process() -> Iterator[None]:
    """DCP warns on every call without a process group; one process is a supported mode here."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is .*single process")
        yield


def latest(root: Path) -> Path | None:
    """The newest whole checkpoint under ``root``, or None."""
    pointer = root / "latest"
    if not pointer.is_file():
        return None
    path = root / pointer.read_text().strip()
    if not (path / "done").is_file():
        raise CheckpointError(
            f"{pointer} names {path}, which is incomplete; delete it to start over"
        )
    return path


def save(
    root: Path,
    step: int,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    env: DistEnv,
    keep: int,
) -> Path:
    """Collective: every rank calls it at the same step."""
    path = root / f"step_{step:08d}"
    if env.is_main and path.exists():  # a leftover from a run that died mid-save
        shutil.rmtree(path)
    barrier(env)
    model_sd, optim_sd = get_state_dict(model, optimizer)
    with _quiet_single_process():
        dcp.save(
            {
                "model": model_sd,
                "optim": optim_sd,
                "scheduler": scheduler.state_dict(),
                "step": step,
            },
            checkpoint_id=path,
            no_dist=not env.distributed,
        )
    torch.save(_rng_state(), path / f"rng_rank{env.rank}.pt")
    barrier(env)
    if env.is_main:
        (path / "done").write_text(str(step))
        tmp = root / "latest.tmp"
        tmp.write_text(path.name)
        tmp.replace(root / "latest")
        whole = sorted(p for p in root.glob("step_*") if (p / "done").is_file())
        for old in whole[:-keep]:
            shutil.rmtree(old, ignore_errors=True)
    barrier(env)
    return path


def load(
    path: Path,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    env: DistEnv,
) -> int:
    """Restore state in place (collective); returns the step to continue from."""
    model_sd, optim_sd = get_state_dict(model, optimizer)
    state: dict[str, Any] = {
        "model": model_sd,
        "optim": optim_sd,
        "scheduler": scheduler.state_dict(),
        "step": 0,
    }
    try:
        with _quiet_single_process():
            dcp.load(state, checkpoint_id=path, no_dist=not env.distributed)
    except Exception as err:  # DCP raises a plain CheckpointException / RuntimeError
        raise CheckpointError(
            f"cannot load {path} into this model and optimizer ({err}); "
            "was it written with a different model config? Use a fresh output_dir or resume = false"
        ) from err
    set_state_dict(
        model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"]
    )
    scheduler.load_state_dict(state["scheduler"])
    rng = path / f"rng_rank{env.rank}.pt"
    if rng.is_file():  # absent when resuming on more ranks than wrote the checkpoint
        _set_rng_state(torch.load(rng, weights_only=True))
    return int(state["step"])
