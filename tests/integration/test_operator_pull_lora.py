"""A pulled LoRA model is a peft adapter that loads onto the base with peft alone."""

from __future__ import annotations

import json

import numpy as np
import torch
from peft import PeftModel

from orchard.gpt import read_base_model
from orchard.pull import _shipped_base, write_adapter
from orchard.tasks import get_task


def test_lora_pull_writes_a_peft_adapter(tmp_path) -> None:
    task = get_task("shakespeare")
    rng = np.random.default_rng(0)
    arrays = {k: (v + rng.normal(0, 0.1, v.shape)).astype(np.float32) for k, v in task.initial_arrays(0).items()}
    out = write_adapter("shakespeare", {}, 0, arrays, tmp_path)
    assert out == tmp_path / "adapter"
    assert json.loads((out / "adapter_config.json").read_text())["peft_type"] == "LORA"
    base_dir = _shipped_base("shakespeare", {})
    assert base_dir is not None
    model = PeftModel.from_pretrained(read_base_model(base_dir).model, str(out))
    params = dict(model.named_parameters())
    for k, v in arrays.items():
        np.testing.assert_array_equal(params[k].detach().numpy(), v)
    # The adapter changes the base's output: it is not the identity (B != 0).
    x = torch.zeros(1, 8, dtype=torch.long)
    with torch.no_grad():
        assert not torch.allclose(model(x), read_base_model(base_dir).model(x))


def test_a_plain_task_has_no_adapter(tmp_path) -> None:
    arrays = get_task("digits").initial_arrays(0)
    assert write_adapter("digits", {}, 0, arrays, tmp_path) is None
    assert not (tmp_path / "adapter").exists()
