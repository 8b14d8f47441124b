"""``orchard client bundle`` and ``orchard edge infer``: a bundle of the Shakespeare LoRA
task, pulled from a live root, runs under ONNX Runtime without torch and agrees with
PyTorch on the same adapter."""

from __future__ import annotations

import asyncio
import json
import os
import socket
import stat
import subprocess
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from orchard import cli, wire
from orchard.config import CohortConfig, RunConfig
from orchard.edge_runtime.bundle import read_bundle, run_inference
from orchard.edge_runtime.bundle_task import read_bundle_task, read_tokenizer
from orchard.edge_runtime.infer import predict_text, summarize_array
from orchard.edge_runtime.lora import set_arrays
from orchard.edge_runtime.policy import DevicePolicy
from orchard.ops import ControlClient
from orchard.runs import latest_adapter
from orchard.server.app import start_root
from orchard.server.tls import init_certs
from orchard.tasks import get_task
from orchard.tasks.core import SupervisedTask

POLICY_TOML = """
[policy.eligibility]
min_battery_percent = 30.0
max_temperature_c = 42.0

[policy.budget]
time_s = 600.0
max_steps = 50

[policy.pacing]
throttle_band_c = 3.0
"""


@dataclass
class Bundled:
    path: Path
    task: SupervisedTask
    global_arrays: dict[str, np.ndarray]  # the root's global at bundling time
    output: str


def _nonzero_adapter(task: SupervisedTask) -> dict[str, np.ndarray]:
    # B = 0 would make the adapter a no-op and the parity check vacuous.
    rng = np.random.default_rng(3)
    return {k: (0.3 * rng.standard_normal(v.shape)).astype(np.float32) for k, v in task.initial_arrays(0).items()}


@pytest.fixture(scope="module")
def bundled(tmp_path_factory: pytest.TempPathFactory) -> Bundled:
    tmp = tmp_path_factory.mktemp("edge-bundle")
    task = get_task("shakespeare")
    assert isinstance(task, SupervisedTask)
    arrays = _nonzero_adapter(task)
    (tmp / "policy.toml").write_text(POLICY_TOML)
    ca = init_certs(tmp / "tls").ca_cert
    out = tmp / "bundle"

    async def main() -> str:
        root = await start_root(tmp / "root", insecure=True)
        try:
            ctl = ControlClient(root.address, insecure=True)
            cfg = RunConfig(task="shakespeare", rounds=1, cohort=CohortConfig(target=1, min_fraction=1.0))
            try:
                await asyncio.to_thread(ctl.start_run, cfg, wire.arrays_to_blob(arrays))
            finally:
                ctl.close()
            # The CLI talks to the root synchronously: run it off the event loop that serves it.
            res = await asyncio.to_thread(
                CliRunner().invoke,
                cli.app,
                ["client", "bundle", "--server", root.address, "--out", str(out), "--task", "shakespeare",
                 "--insecure", "--token", "enroll-me", "--ca-cert", str(ca), "--policy", str(tmp / "policy.toml")],
            )
            assert res.exit_code == 0, res.output
            return res.output
        finally:
            await root.stop(0.1)

    output = asyncio.run(main())
    return Bundled(out, task, arrays, output)


def _torch_logits(b: Bundled, idx: np.ndarray) -> np.ndarray:
    model = b.task.build_model()
    set_arrays(model, b.global_arrays, b.task.trainable)
    model.eval()
    with torch.no_grad():
        return model(torch.from_numpy(idx)).numpy()


def test_bundle_holds_adapter_policy_ca_token_and_sidecars(bundled: Bundled) -> None:
    b = read_bundle(bundled.path)
    assert "adapter version 0" in bundled.output
    assert b.config.policy == DevicePolicy.model_validate(
        {
            "eligibility": {"min_battery_percent": 30.0, "max_temperature_c": 42.0},
            "budget": {"time_s": 600.0, "max_steps": 50},
            "pacing": {"throttle_band_c": 3.0},
        }
    )
    assert b.ca_cert_path is not None and b"BEGIN CERTIFICATE" in b.ca_cert_path.read_bytes()
    assert b.enrollment_token() == "enroll-me"
    assert stat.S_IMODE(os.stat(bundled.path / "enrollment.token").st_mode) == 0o600
    sidecar = read_bundle_task(bundled.path)
    assert sidecar is not None and sidecar.task == "shakespeare" and sidecar.context_len == 80
    assert get_task(sidecar.task, **sidecar.task_params).params == bundled.task.params
    assert read_tokenizer(bundled.path).chars == bundled.task.info["vocab"]
    # The adapter holds every LoRA matrix (A too) under the export's names; its B are
    # the global tensors the root had.
    adapter = b.adapter_arrays()
    assert len(adapter) == 2 * len(bundled.global_arrays)
    for name, value in bundled.global_arrays.items():
        np.testing.assert_array_equal(adapter[name.replace(".default", "")], value)


def test_bundle_inference_matches_pytorch(bundled: Bundled) -> None:
    idx = np.asarray([read_tokenizer(bundled.path).encode("ROMEO:\nWhat light through yonder")], np.int64)
    idx = np.concatenate([idx, idx[:, ::-1]])
    got = run_inference(bundled.path, idx)
    want = _torch_logits(bundled, idx)
    assert got.shape == want.shape
    assert np.abs(got - want).max() <= 1e-4
    # The adapter matters: the bare base differs (so the comparison above has teeth).
    bare = bundled.task.build_model().eval()
    with torch.no_grad():
        assert np.abs(bare(torch.from_numpy(idx)).numpy() - want).max() > 1e-2


def test_edge_infer_runs_without_torch(bundled: Bundled, tmp_path: Path) -> None:
    prompt = "ROMEO:"
    here = predict_text(bundled.path, prompt, top_k=3, generate=12)
    ids = np.asarray([read_tokenizer(bundled.path).encode(prompt)], np.int64)
    assert here.top[0].char == bundled.task.info["vocab"][int(_torch_logits(bundled, ids)[0, -1].argmax())]
    np.save(tmp_path / "x.npy", ids)
    script = textwrap.dedent(
        f"""
        import sys, json
        sys.modules["torch"] = None  # any `import torch` now raises ImportError
        import numpy as np
        from orchard.edge_runtime.infer import predict_text, summarize_array
        p = predict_text({str(bundled.path)!r}, {prompt!r}, top_k=3, generate=12)
        s = summarize_array({str(bundled.path)!r}, np.load({str(tmp_path / "x.npy")!r}))
        loaded = sorted(m for m, mod in sys.modules.items() if m.split(".")[0] in ("torch", "peft") and mod is not None)
        print(json.dumps({{"top": [c.char for c in p.top], "cont": p.continuation, "argmax": s.argmax_last,
                           "loaded": loaded}}))
        """
    )
    res = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    got = json.loads(res.stdout.strip().splitlines()[-1])
    assert got["loaded"] == []
    assert got["top"] == [c.char for c in here.top]
    assert got["cont"] == here.continuation and len(here.continuation) == 12
    assert got["argmax"] == summarize_array(bundled.path, ids).argmax_last


def test_edge_infer_cli(bundled: Bundled, tmp_path: Path) -> None:
    runner = CliRunner()
    res = runner.invoke(cli.app, ["edge", "infer", "--bundle", str(bundled.path), "--text", "ROMEO:", "--json"])
    assert res.exit_code == 0, res.output
    data = json.loads(res.output)
    assert data["adapter_version"] == 0 and len(data["top"]) == 5 and len(data["continuation"]) == 40
    np.save(tmp_path / "x.npy", np.zeros((2, 7), np.int64))
    res = runner.invoke(cli.app, ["edge", "infer", "--bundle", str(bundled.path), "--input", str(tmp_path / "x.npy")])
    assert res.exit_code == 0 and "(2, 7, 65)" in res.output, res.output
    res = runner.invoke(cli.app, ["edge", "infer", "--bundle", str(bundled.path)])
    assert res.exit_code == 2 and "exactly one" in res.output


def test_systemd_unit_of_a_bundle(bundled: Bundled) -> None:
    res = CliRunner().invoke(cli.app, ["client", "start", "--bundle", str(bundled.path), "--systemd"])
    assert res.exit_code == 0, res.output
    assert f"--bundle {bundled.path.resolve()}" in res.output and "client start" in res.output


def test_a_task_without_lora_bundles_its_parameters(tmp_path: Path) -> None:
    """digits trains its whole MLP: the bundle's ONNX model takes every parameter as an
    input, and its adapter is the initial model's parameters, by name."""
    res = CliRunner().invoke(cli.app, ["client", "bundle", "--server", "h:1", "--out", str(tmp_path / "b"),
                                       "--task", "digits", "--no-training-program"])
    assert res.exit_code == 0, res.output
    task = get_task("digits")
    b = read_bundle(tmp_path / "b")
    want = task.initial_arrays(0)
    got = b.adapter_arrays()
    assert sorted(got) == sorted(task.trainable) and all(np.array_equal(got[k], want[k]) for k in want)
    x = task.test_data.x[:8].numpy()
    with torch.no_grad():
        model = task.build_model(0).eval()
        expected = model(torch.from_numpy(x)).numpy()
    assert np.abs(run_inference(b.path, x) - expected).max() <= 1e-5


def test_unreachable_root_means_the_initial_adapter() -> None:
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = f"127.0.0.1:{port}"
    with ControlClient(server, insecure=True) as ctl:
        got = latest_adapter(ctl, "shakespeare", server=server)
    assert got.arrays is None and got.version == 0 and "not reachable (UNAVAILABLE)" in got.fallback
