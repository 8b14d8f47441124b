"""The recipe in one process: exact resume, SIGTERM, and the exported base model."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from orchard.pretrain import checkpoint
from orchard.pretrain.export import BaseModelError, load_base_model
from orchard.pretrain.recipe import run
from tests.pretrain.flags import cli_flags


def test_stopped_and_resumed_run_repeats_the_uninterrupted_losses(tmp_path, tiny_config) -> None:
    tiny = tiny_config
    full = run(tiny(tmp_path / "full", steps=12, log_every=1))
    first = run(tiny(tmp_path / "split", steps=12, log_every=1, stop_after=5))
    assert (first.step, first.finished, first.stopped_by) == (5, False, "stop_after")
    second = run(tiny(tmp_path / "split", steps=12, log_every=1))
    assert (second.start_step, second.step, second.finished) == (5, 12, True)
    # Same batches (a function of the step), same optimizer/scheduler/RNG state: same floats.
    assert first.losses + second.losses == full.losses
    assert second.val_loss == full.val_loss


def _wait_for(condition, timeout_s: float, proc: subprocess.Popen) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if proc.poll() is not None:
            raise AssertionError(f"process exited early: {proc.communicate()}")
        if time.monotonic() > deadline:
            proc.kill()
            raise AssertionError("condition not met in time")
        time.sleep(0.05)


def test_sigterm_stops_at_the_next_step_and_resumes_exactly(tmp_path, tiny_config) -> None:
    """SIGTERM mid-interval (log_every far away): the run stops after the step it was in,
    logs that step's losses, checkpoints it and exits 0; resuming repeats the
    uninterrupted run's losses."""
    tiny = tiny_config
    out = tmp_path / "run"
    base = {"steps": 100000, "checkpoint_every": 3, "log_every": 100000, "eval_batches": 0}
    args = [sys.executable, "-m", "orchard.pretrain"] + cli_flags(
        tiny(out, **base).model_dump(mode="json")
    )
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(
        args, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    # The first periodic checkpoint (step 3) says the loop, and its handler, are running.
    _wait_for(lambda: (out / "checkpoints" / "latest").is_file(), 120, proc)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    stopped = checkpoint.latest(out / "checkpoints")
    assert stopped is not None
    k = int((stopped / "done").read_text())
    # Well before the first log step, so the stop came from the per-step check.
    assert 3 <= k < 1000, k
    assert f"stopping at step {k}" in err
    # The stopped run logged exactly its k steps (flushed at the stop, not at a log step).
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, k + 1))

    resumed = run(tiny(out, stop_after=3, **base))
    assert (resumed.start_step, resumed.step) == (k, k + 3)
    straight = run(tiny(tmp_path / "straight", stop_after=k + 3, **base))
    assert straight.losses[:k] == [r["loss"] for r in rows]
    assert straight.losses[k:] == resumed.losses


def test_exported_base_model_loads_back_and_matches_onnx(tmp_path, tiny_config) -> None:
    tiny = tiny_config
    import onnxruntime as ort

    work, base = tmp_path / "work", tmp_path / "base"
    result = run(tiny(work, steps=6, export=True, export_dir=str(base)))
    assert result.finished and result.export["onnx_max_abs_diff"] <= 1e-4
    # The base-model files go to export_dir; the working files stay in output_dir.
    assert {p.name for p in base.iterdir()} == {
        "model.safetensors",
        "config.json",
        "tokenizer.json",
        "model.onnx",
        "lora_targets.json",
    }
    assert not (work / "model.safetensors").exists() and (work / "checkpoints").is_dir()

    model, tok = load_base_model(base)
    assert model.lm_head.weight is model.wte.weight
    assert tok.vocab_size == model.config.vocab_size == 65
    assert json.loads((base / "lora_targets.json").read_text())["target_modules"] == (
        model.lora_target_modules()
    )
    idx = torch.tensor([tok.encode("ROMEO:\nWhat light through yonder")])
    with torch.no_grad():
        ref = model(idx).numpy()
    session = ort.InferenceSession(str(base / "model.onnx"))
    got = session.run(["logits"], {"input_ids": idx.numpy()})[0]
    assert np.abs(got - ref).max() <= 1e-4
    # The weights are the trained ones, not a fresh init: they predict text better.
    torch.manual_seed(0)
    fresh = type(model)(model.config).eval()
    with torch.no_grad():

        def loss(m):
            return F.cross_entropy(m(idx[:, :-1])[0], idx[0, 1:]).item()

        assert loss(model) < loss(fresh)


def test_load_base_model_names_what_is_missing(tmp_path) -> None:
    with pytest.raises(BaseModelError, match="config.json"):
        load_base_model(tmp_path)


def test_gpt_loss_head_is_cross_entropy_of_its_logits() -> None:
    from orchard.gpt import GPT, GPTConfig

    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=11, seq_len=8, n_layer=1, n_head=2, d_model=16))
    x, y = torch.randint(0, 11, (3, 8)), torch.randint(0, 11, (3, 8))
    want = F.cross_entropy(model(x).view(-1, 11), y.view(-1))
    assert torch.equal(model(x, y), want)


@pytest.mark.parametrize(
    "extra",
    # One micro-batch shape for both, so the second case reuses the first's kernels.
    [
        {"batch_size": 4},
        {"activation_checkpointing": True, "grad_accum": 2, "batch_size": 4},
        {"batch_size": 4, "compile_scope": "model"},
    ],
    ids=["plain", "ckpt-accum", "whole-model"],
)
def test_compiled_run_follows_the_eager_losses(tmp_path, tiny_config, extra) -> None:
    """``compile = true`` (each block and the loss head through inductor, or the whole
    forward with ``compile_scope = "model"``) trains the same model as eager execution, to float rounding, and still exports and resumes."""
    eager = run(tiny_config(tmp_path / "eager", steps=10, log_every=1, **extra))
    compiled = run(tiny_config(tmp_path / "compiled", steps=10, log_every=1, compile=True, **extra))
    assert compiled.finished and len(compiled.losses) == 10
    torch.testing.assert_close(
        torch.tensor(compiled.losses), torch.tensor(eager.losses), atol=1e-4, rtol=0
    )
    assert compiled.val_loss == pytest.approx(eager.val_loss, abs=1e-4)
