"""The pretraining output is the base a federated LoRA run adapts: `orchard run start
--base-model DIR` turns it into task parameters, and the task's model carries exactly the
pretrained weights."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from orchard.cli import base_model_params
from orchard.errors import OrchardError
from orchard.pretrain import load_base_model, parse_pretrain_config, run
from orchard.tasks import get_task


def test_pretrained_base_flows_into_the_lora_task(tmp_path: Path) -> None:
    out = tmp_path / "base"
    cfg = parse_pretrain_config({
        "output_dir": str(out), "steps": 2, "batch_size": 2, "seed": 0, "progress": False, "export_onnx": False,
        "eval_batches": 0, "checkpoint_every": 0,
        "model": {"seq_len": 32, "n_layer": 1, "n_head": 2, "d_model": 32},
        "data": {"shard_dir": str(tmp_path / "shards")},
    })
    run(cfg)
    params = base_model_params("shakespeare", out)
    assert params["n_layer"] == 1 and params["d_model"] == 32
    task = get_task("shakespeare", **params, max_chars_per_client=200)
    base, _ = load_base_model(out)
    model = task.build_model(seed=0)
    got = {k.replace("base_model.model.", "").replace(".base_layer", ""): v for k, v in model.state_dict().items()}
    for name, w in base.state_dict().items():
        assert torch.equal(got[name], w), name
    with pytest.raises(OrchardError, match="cannot take a pretrained base"):
        base_model_params("digits", out)
