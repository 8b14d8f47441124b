"""`orchard server start --base-model DIR`: runs of a LoRA task adapt the server's base
unless they name their own; other tasks ignore it; a directory that is not a base is
refused at start."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
from fed_harness import BackgroundRoot
from typer.testing import CliRunner

from orchard.cli import app
from orchard.errors import ConfigError
from orchard.ops import ControlClient
from orchard.pretrain import parse_pretrain_config, run
from orchard.server.app import start_root
from orchard.server.store import SQLiteStore


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("pretrained")
    out = root / "base"
    run(parse_pretrain_config({
        "output_dir": str(root / "work"), "export_dir": str(out), "steps": 2, "batch_size": 2, "seed": 0,
        "progress": False, "export_onnx": False, "eval_batches": 0, "checkpoint_every": 0,
        "model": {"seq_len": 32, "n_layer": 1, "n_head": 2, "d_model": 32},
        "data": {"shard_dir": str(root / "shards")},
    }))
    return out


def _latest_task_params(data_dir: Path) -> dict:
    store = SQLiteStore(data_dir / "orchard.db")
    try:
        row = store.latest_run()
        assert row is not None
        return json.loads(row.config_json)["task_params"]
    finally:
        store.close()


def _start(address: str, task: str) -> None:
    res = CliRunner().invoke(app, ["run", "start", "--server", address, "--insecure", "--task", task,
                                   "--rounds", "1", "--detach"])
    assert res.exit_code == 0, res.output


@pytest.mark.parametrize("task", ["shakespeare", "digits"])
def test_runs_of_a_lora_task_adapt_the_servers_base(pretrained: Path, tmp_path: Path, task: str) -> None:
    srv = BackgroundRoot(tmp_path / "root", base_model=pretrained)
    try:
        ctl = ControlClient(srv.root.address, insecure=True)
        try:
            assert ctl.status()["base_model"] == str(pretrained.resolve())
        finally:
            ctl.close()
        _start(srv.root.address, task)
        params = _latest_task_params(tmp_path / "root")
        if task == "shakespeare":  # a LoRA task: this base (d_model 32), not the shipped one
            assert Path(params["base"]).parent == pretrained.resolve() and params["d_model"] == 32
        else:  # a task without a base ignores the server's
            assert "base" not in params
    finally:
        srv.stop()


def test_a_directory_that_is_not_a_base_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="lacks config.json, model.safetensors"):
        asyncio.run(start_root(tmp_path / "root", insecure=True, base_model=tmp_path))
