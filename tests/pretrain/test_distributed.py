"""Two gloo processes (world size 2) on one machine, rendezvous on 127.0.0.1 at a free port.

One spawn runs several recipes in sequence (process start-up dominates the cost):
an uninterrupted DDP run, the same run stopped and resumed, and FSDP2's first steps,
eager and compiled.
"""

from __future__ import annotations

import json
import os
import socket
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from orchard.pretrain import distributed
from orchard.pretrain.config import parse_pretrain_config
from orchard.pretrain.recipe import run

STEPS = 30


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _configs(root: Path) -> dict[str, dict]:
    base = {
        "steps": STEPS,
        "batch_size": 8,
        "device": "cpu",
        "model": {"seq_len": 32, "n_layer": 2, "n_head": 2, "d_model": 32},
        "optim": {"lr": 3e-3, "min_lr": 3e-4, "warmup_steps": 5},
        "data": {"shards": 4, "shard_dir": str(root / "shards"), "prefetch": 2},
        "checkpoint_every": 0,
        "log_every": 5,
        "eval_batches": 0,
        "progress": False,
        "export": False,
    }
    return {
        "ddp_full": {**base, "output_dir": str(root / "full")},
        "ddp_stop": {**base, "output_dir": str(root / "split"), "stop_after": 12},
        "ddp_resume": {**base, "output_dir": str(root / "split")},
        "ddp_accum": {
            **base,
            "output_dir": str(root / "accum"),
            "batch_size": 4,
            "grad_accum": 2,
            "stop_after": 5,
        },
        "fsdp_head": {
            **base,
            "output_dir": str(root / "fsdp"),
            "strategy": "fsdp",
            "stop_after": 5,
        },
        # FSDP2 over compiled blocks and loss head, with activation checkpointing.
        "fsdp_compiled": {
            **base,
            "output_dir": str(root / "fsdp_compiled"),
            "strategy": "fsdp",
            "compile": True,
            "activation_checkpointing": True,
            "stop_after": 5,
        },
    }


def _worker(rank: int, world: int, port: int, root: str) -> None:
    os.environ.update(
        RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world),
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
    )  # fmt: skip
    torch.set_num_threads(1)
    env = distributed.setup("cpu", need_group=True)  # from the env, as under torchrun
    results = {}
    for name, data in _configs(Path(root)).items():
        r = run(parse_pretrain_config(data))
        results[name] = {"losses": r.losses, "start": r.start_step, "step": r.step}
    if rank == 0:
        (Path(root) / "results.json").write_text(json.dumps(results))
    distributed.teardown(env)


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("dist")
    mp.spawn(_worker, args=(2, _free_port(), str(root)), nprocs=2, join=True)
    return json.loads((root / "results.json").read_text())


def test_loss_decreases_on_the_shipped_corpus(results) -> None:
    losses = results["ddp_full"]["losses"]
    assert len(losses) == STEPS
    assert sum(losses[-5:]) / 5 < losses[0] - 0.7, losses


def test_stopped_and_resumed_matches_uninterrupted(results) -> None:
    stop, resume = results["ddp_stop"], results["ddp_resume"]
    assert (stop["step"], resume["start"], resume["step"]) == (12, 12, STEPS)
    got = stop["losses"] + resume["losses"]
    want = results["ddp_full"]["losses"]
    assert max(abs(a - b) for a, b in zip(got, want, strict=True)) <= 1e-6


def test_gradient_accumulation_matches_one_big_batch(results) -> None:
    accum = results["ddp_accum"]["losses"]
    ddp = results["ddp_full"]["losses"][: len(accum)]
    torch.testing.assert_close(torch.tensor(accum), torch.tensor(ddp), atol=1e-5, rtol=0)


@pytest.mark.parametrize("name", ["fsdp_head", "fsdp_compiled"])
def test_fsdp2_matches_ddp_first_steps(results, name) -> None:
    fsdp = results[name]["losses"]
    ddp = results["ddp_full"]["losses"][: len(fsdp)]
    assert len(fsdp) == 5
    torch.testing.assert_close(torch.tensor(fsdp), torch.tensor(ddp), atol=1e-4, rtol=0)
