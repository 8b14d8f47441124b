"""The pretraining output is the base a federated LoRA run adapts: `orchard run start
--base-model DIR` turns it into task parameters, and the task's model carries exactly the
pretrained weights, with the architecture, tokenizer and LoRA targets of DIR."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from orchard.errors import ConfigError, OrchardError
from orchard.pretrain import load_base_model, parse_pretrain_config, run
from orchard.tasks import get_task
from orchard.tasks.params import base_model_params


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("pretrained")
    out = root / "base"
    cfg = parse_pretrain_config({
        "output_dir": str(root / "work"), "export_dir": str(out), "steps": 2, "batch_size": 2, "seed": 0,
        "progress": False, "export_onnx": False, "eval_batches": 0, "checkpoint_every": 0,
        "model": {"seq_len": 32, "n_layer": 1, "n_head": 2, "d_model": 32},
        "data": {"shard_dir": str(root / "shards")},
    })
    run(cfg)
    return out


def _plain_names(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k.replace("base_model.model.", "").replace(".base_layer", ""): v for k, v in model.state_dict().items()}


def test_pretrained_base_flows_into_the_lora_task(pretrained: Path) -> None:
    params = base_model_params("shakespeare", pretrained)
    assert params["n_layer"] == 1 and params["d_model"] == 32
    task = get_task("shakespeare", **params, max_chars_per_client=200)
    base, _ = load_base_model(pretrained)
    got = _plain_names(task.build_model(seed=0))
    for name, w in base.state_dict().items():
        assert torch.equal(got[name], w), name
    with pytest.raises(OrchardError, match="cannot take a pretrained base"):
        base_model_params("digits", pretrained)


def test_the_task_takes_sizes_tokenizer_and_lora_targets_from_the_directory(pretrained: Path, tmp_path: Path) -> None:
    task = get_task("shakespeare", base=str(pretrained), max_chars_per_client=200)
    assert {k: task.params[k] for k in ("seq_len", "n_layer", "n_head", "d_model")} == {
        "seq_len": 32, "n_layer": 1, "n_head": 2, "d_model": 32}
    assert task.info["vocab"] == json.loads((pretrained / "tokenizer.json").read_text())["chars"]
    targets = json.loads((pretrained / "lora_targets.json").read_text())["target_modules"]
    assert {t for t in targets if any(f".{t}.lora_B" in n for n in task.trainable)} == set(targets)
    # Another LoRA target list in the directory: the task adapts exactly those modules.
    custom = tmp_path / "custom"
    custom.mkdir()
    for f in ("model.safetensors", "config.json", "tokenizer.json"):
        (custom / f).write_bytes((pretrained / f).read_bytes())
    (custom / "lora_targets.json").write_text(json.dumps({"target_modules": ["attn.qkv"]}))
    only_qkv = get_task("shakespeare", base=str(custom), max_chars_per_client=200)
    assert only_qkv.trainable and all(".attn.qkv.lora_B" in n for n in only_qkv.trainable)
    # Sizes that contradict the base, or a directory that is not a base, are refused.
    with pytest.raises(ConfigError, match="d_model 32, the task asks for d_model 64"):
        get_task("shakespeare", base=str(pretrained), d_model=64)
    (custom / "lora_targets.json").unlink()
    with pytest.raises(ConfigError, match="lora_targets.json"):
        get_task("shakespeare", base=str(custom))


def test_simulate_takes_the_base_directly(pretrained: Path, tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from orchard.cli import app

    out = tmp_path / "sim"
    res = CliRunner().invoke(app, ["simulate", "--task", "shakespeare", "--base-model", str(pretrained),
                                   "--clients", "6", "--clients-per-round", "2", "--rounds", "1",
                                   "--aggregators", "0", "--out", str(out)])
    assert res.exit_code == 0, res.output
    report = json.loads((out / "report.json").read_text())
    assert report["rounds"][0]["participants"] == 2
    # The run adapted this base (d_model 32), not the shipped one: its uploads are the
    # size of this base's adapter.
    small = sum(v.nbytes for v in get_task("shakespeare", base=str(pretrained)).initial_arrays(0).values())
    shipped = sum(v.nbytes for v in get_task("shakespeare").initial_arrays(0).values())
    assert small < shipped
    assert 2 * small <= report["rounds"][0]["bytes_up"] < 2 * shipped
    bad = CliRunner().invoke(app, ["simulate", "--task", "digits", "--base-model", str(pretrained),
                                   "--rounds", "1", "--out", str(tmp_path / "bad")])
    assert bad.exit_code == 2 and "cannot take a pretrained base" in bad.output
