"""Client bundles: layout, secrets, integrity, adapter updates, torch-free inference
and the systemd unit."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from orchard.config import EligibilityConfig
from orchard.edge_runtime.bundle import (
    BundleError,
    read_bundle,
    run_inference,
    systemd_unit,
    update_adapter,
    write_bundle,
)
from orchard.edge_runtime.ort_runtime import AdapterMismatchError
from orchard.edge_runtime.policy import DailyWindow, DevicePolicy, RoundBudget
from orchard.errors import AuthError, IntegrityError

PEM = b"-----BEGIN CERTIFICATE-----\nMIIBfake\n-----END CERTIFICATE-----\n"
POLICY = DevicePolicy(
    eligibility=EligibilityConfig(min_battery_percent=40, require_unmetered=True),
    window=DailyWindow(start="01:00", end="06:00", tz="UTC"),
    budget=RoundBudget(energy_j=500.0, time_s=600.0, max_steps=50),
)


def _bundle(exported_gpt, path: Path, **kw: object):
    args = dict(
        model_path=exported_gpt.onnx_path,
        adapter=exported_gpt.adapters[0],
        adapter_version=3,
        server_address="agg.example.org:7443",
        policy=POLICY,
        ca_cert=PEM,
        enrollment_token="tok-123",
    )
    args.update(kw)
    return write_bundle(path, **args)  # type: ignore[arg-type]


def _torch_logits(exported_gpt, adapter, idx: np.ndarray) -> np.ndarray:
    import torch

    from orchard.edge_runtime.onnx_export import load_adapter_arrays

    load_adapter_arrays(exported_gpt.peft_model, adapter)
    with torch.no_grad():
        return exported_gpt.peft_model(torch.from_numpy(idx)).numpy()


def test_write_and_read(exported_gpt, tmp_path: Path) -> None:
    b = _bundle(exported_gpt, tmp_path / "b")
    names = sorted(p.name for p in b.path.iterdir())
    assert names == [
        "adapter.onnx_adapter",
        "adapter.safetensors",
        "ca.pem",
        "client.json",
        "enrollment.token",
        "model.onnx",
    ]
    assert stat.S_IMODE((b.path / "enrollment.token").stat().st_mode) == 0o600
    assert stat.S_IMODE(b.path.stat().st_mode) == 0o700
    again = read_bundle(b.path)
    assert again.config == b.config
    assert again.config.policy == POLICY and again.config.adapter_version == 3
    assert again.config.server_address == "agg.example.org:7443"
    assert again.enrollment_token() == "tok-123"
    assert again.ca_cert_path is not None and again.ca_cert_path.read_bytes() == PEM
    for k, v in exported_gpt.adapters[0].items():
        np.testing.assert_array_equal(again.adapter_arrays()[k], v)
    cfg = json.loads((b.path / "client.json").read_text())
    assert "tok-123" not in json.dumps(cfg)  # the secret lives only in its 0600 file


def test_run_inference_matches_torch_and_follows_updates(exported_gpt, tmp_path: Path) -> None:
    b = _bundle(exported_gpt, tmp_path / "b")
    idx = np.random.default_rng(0).integers(0, exported_gpt.vocab_size, (2, 7), dtype=np.int64)
    out = run_inference(b.path, idx)
    assert np.abs(out - _torch_logits(exported_gpt, exported_gpt.adapters[0], idx)).max() <= 1e-4
    model_digest = b.config.model.sha256
    nb = update_adapter(b.path, exported_gpt.adapters[1], 4)
    assert nb.config.adapter_version == 4 and nb.config.model.sha256 == model_digest
    out2 = run_inference(b.path, {"input": idx})
    assert np.abs(out2 - _torch_logits(exported_gpt, exported_gpt.adapters[1], idx)).max() <= 1e-4
    with pytest.raises(BundleError, match="older"):
        update_adapter(b.path, exported_gpt.adapters[0], 2)


def test_inference_imports_no_torch(exported_gpt, tmp_path: Path) -> None:
    b = _bundle(exported_gpt, tmp_path / "b")
    idx = np.random.default_rng(2).integers(0, exported_gpt.vocab_size, (1, 9), dtype=np.int64)
    np.save(tmp_path / "idx.npy", idx)
    np.save(tmp_path / "ref.npy", _torch_logits(exported_gpt, exported_gpt.adapters[0], idx))
    script = textwrap.dedent(
        f"""
        import sys
        sys.modules["torch"] = None  # any `import torch` now raises ImportError
        import numpy as np
        from orchard.edge_runtime.bundle import run_inference
        out = run_inference({str(b.path)!r}, np.load({str(tmp_path / "idx.npy")!r}))
        ref = np.load({str(tmp_path / "ref.npy")!r})
        loaded = sorted(m for m, mod in sys.modules.items() if m.split(".")[0] in ("torch", "peft") and mod is not None)
        print(float(np.abs(out - ref).max()), loaded)
        """
    )
    res = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120
    )
    assert res.returncode == 0, res.stderr
    diff, loaded = res.stdout.strip().split(" ", 1)
    assert float(diff) <= 1e-4
    assert loaded == "[]"


def test_tampering_and_loose_token_are_caught(exported_gpt, tmp_path: Path) -> None:
    b = _bundle(exported_gpt, tmp_path / "b")
    os.chmod(b.path / "enrollment.token", 0o644)
    with pytest.raises(AuthError, match="chmod 600"):
        read_bundle(b.path).enrollment_token()
    with (b.path / "adapter.onnx_adapter").open("ab") as f:
        f.write(b"\0")
    with pytest.raises(IntegrityError, match="adapter.onnx_adapter"):
        read_bundle(b.path)
    assert read_bundle(b.path, verify=False).config.adapter_version == 3


def test_bad_inputs_are_refused_before_writing(exported_gpt, tmp_path: Path) -> None:
    k = sorted(exported_gpt.adapters[0])[0]
    bad = dict(exported_gpt.adapters[0])
    bad[k] = bad[k][:1]
    with pytest.raises(AdapterMismatchError):
        _bundle(exported_gpt, tmp_path / "x", adapter=bad)
    assert not (tmp_path / "x").exists()
    with pytest.raises(BundleError, match="PEM"):
        _bundle(exported_gpt, tmp_path / "y", ca_cert=b"not a cert")
    _bundle(exported_gpt, tmp_path / "z", ca_cert=None, enrollment_token=None)
    with pytest.raises(BundleError, match="overwrite"):
        _bundle(exported_gpt, tmp_path / "z")
    assert read_bundle(tmp_path / "z").enrollment_token() is None
    with pytest.raises(BundleError, match="not a client bundle"):
        read_bundle(tmp_path)


def test_systemd_unit(tmp_path: Path) -> None:
    d = tmp_path / "my bundle"
    unit = systemd_unit(d, "/opt/orchard/bin/orchard", user="orchard")
    lines = unit.splitlines()
    assert f'ExecStart=/opt/orchard/bin/orchard client start --bundle "{d.resolve()}"' in lines
    assert "User=orchard" in lines and "[Install]" in lines and "Restart=on-failure" in lines
    assert systemd_unit("rel", "orchard").count("ExecStart=orchard client start --bundle /") == 1
