"""Test vectors for liborchard_device, written by the Python package itself.

The native tests (device/tests) replay these: the same inputs must give the same bytes
(codecs, SecAgg+ messages) and the same decisions (device policy) as Orchard's Python
code gives here. They are written fresh for every test run, so they follow the Python
code as it changes; nothing is copied by hand.

    python tests/device/device_vectors.py DIR
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
from safetensors.numpy import load_file, save_file

from orchard.client.update import upload_rng
from orchard.compression import build_codec
from orchard.compression.update import encode_packed
from orchard.edge_runtime import bundle as bundle_mod
from orchard.edge_runtime import et_program
from orchard.errors import AuthError, ConfigError, IntegrityError


def _hex_f32(x: np.ndarray) -> str:
    return np.ascontiguousarray(x, dtype="<f4").tobytes().hex()


def numpy_random_vectors() -> dict[str, Any]:
    """SeedSequence words and PCG64 draws, to pin the generator the quantiser uses."""
    cases = []
    for entropy in ([0], [1, 0xC0DEC], [2**31 - 2, 0xC0DEC], [123456789, 2**40 + 5]):
        rng = np.random.default_rng(entropy)
        words: list[int] = []
        for v in entropy:  # numpy's coercion of each int: 32-bit words, low first
            words += [0] if v == 0 else [(v >> (32 * i)) & 0xFFFFFFFF for i in range((v.bit_length() + 31) // 32)]
        state = np.random.SeedSequence(entropy).generate_state(8, np.uint32)
        cases.append({
            "entropy_words": words,
            "state_words": [int(w) for w in state],
            "next64": [int(v) for v in np.random.default_rng(entropy).bit_generator.random_raw(5)],
            "floats": _hex_f32(rng.random(7, dtype=np.float32)),
        })
    spawned = np.random.SeedSequence(entropy=99, spawn_key=(7,)).generate_state(2, np.uint32)
    return {"cases": cases, "spawn": {"entropy": 99, "key": [7], "state_words": [int(w) for w in spawned]}}


def codec_vectors() -> list[dict[str, Any]]:
    """Payloads of compression.encode_packed with upload_rng(seed), as the client sends them."""
    g = np.random.default_rng(20261128)
    out: list[dict[str, Any]] = []
    tiny = np.float32(2.0**-20)
    specials = np.array([0.0, -0.0, 1.0, -1.0, 65504.0, -65519.0, 2.0**-24, 2.0**-25, 3 * 2.0**-25,
                         2.0**-14 - 2.0**-25, 1.0 + 2.0**-11, 1.0 + 3 * 2.0**-11, 6.1e-5, 1e-8, 1e-30,
                         tiny], dtype=np.float32)
    specs: list[dict[str, Any]] = [
        {"name": "float32"},
        {"name": "float16"},
        {"name": "qsgd"},
        {"name": "qsgd", "params": {"bits": 8, "block": 64}},
        {"name": "qsgd", "params": {"bits": 4, "block": 7}},
        {"name": "qsgd", "params": {"bits": 2}},
        {"name": "qsgd", "params": {"bits": 1, "block": 3}},
        {"name": "qsgd", "params": {"bits": 8, "scale": 0.05}},
    ]
    for i, spec in enumerate(specs):
        tensors = {
            "layer.0.lora_A": (g.standard_normal((4, 33)) * 0.02).astype(np.float32),
            "layer.0.lora_B": (g.standard_normal((33, 4)) * 10.0 ** g.integers(-6, 1)).astype(np.float32),
            "bias": g.uniform(-1e-3, 1e-3, size=(5,)).astype(np.float32),
            "specials": specials.copy() if spec["name"] != "qsgd" else specials[:4].copy(),
            "empty": np.zeros((0, 3), np.float32),
            "scalar_blocks": np.full((2, 2, 3), 1e-37, np.float32),
        }
        names = list(tensors)
        seed = int(g.integers(0, 2**31 - 1))
        payload, sizes, _ = encode_packed(build_codec(spec), tensors, names, upload_rng(seed), None, 0)
        out.append({
            "case": i, "spec": spec, "seed": seed,
            "tensors": [{"name": n, "shape": list(tensors[n].shape), "values": _hex_f32(tensors[n])} for n in names],
            "payload": payload.hex(), "sizes": list(sizes),
        })
    return out


ADAPTER = {
    "h.0.attn.c_attn.lora_A.weight": np.full((4, 32), 0.01, np.float32),
    "h.0.attn.c_attn.lora_B.weight": np.zeros((96, 4), np.float32),
}


def _write_bundle(root: Path) -> None:
    """A bundle that passes every check the Python client makes before it loads the
    program (which is not an ExecuTorch program here: these cases are about refusals)."""
    root.mkdir(parents=True)
    (root / "model.onnx").write_bytes(b"not a model: only its digest is checked here")
    (root / "adapter.onnx_adapter").write_bytes(b"adapter in onnx runtime's format")
    save_file(ADAPTER, str(root / "adapter.safetensors"), metadata={"adapter_version": "0"})
    (root / "ca.pem").write_text("-----BEGIN CERTIFICATE-----\nMIIB\n-----END CERTIFICATE-----\n")
    (root / "enrollment.token").write_text("secret-token\n")
    os.chmod(root / "enrollment.token", 0o600)
    (root / et_program.PROGRAM_FILE).write_bytes(b"program bytes")
    manifest = et_program.TrainingManifest(
        program=bundle_mod.BundleFile(name=et_program.PROGRAM_FILE,
                                      sha256=bundle_mod.file_sha256(root / et_program.PROGRAM_FILE)),
        task="shakespeare", lora_variant="lora", lora_rank=4, micro_batch=2, seq_len=8, vocab_size=65,
        inputs=(et_program.TensorDecl(name="idx", dtype="int64", shape=(2, 8)),
                et_program.TensorDecl(name="targets", dtype="int64", shape=(2, 8)),
                et_program.TensorDecl(name="row_weight", dtype="float32", shape=(2,))),
        gradients_start=2, parameters_start=4,
        parameters=tuple(et_program.TensorDecl(name=k.replace("lora_A.", "lora_A.default.")
                                               .replace("lora_B.", "lora_B.default."),
                                               dtype="float32", shape=v.shape) for k, v in ADAPTER.items()),
        loss="mean token cross-entropy", executorch_version="test", base_sha256="0" * 64)
    (root / et_program.MANIFEST_FILE).write_text(manifest.model_dump_json(indent=2))
    _rewrite_config(root)


def _rewrite_config(root: Path, **changes: Any) -> None:
    """client.json naming the current digests of the bundle's files."""
    def named(name: str) -> bundle_mod.BundleFile:
        return bundle_mod.BundleFile(name=name, sha256=bundle_mod.file_sha256(root / name))

    config = bundle_mod.ClientBundleConfig(
        server_address="localhost:1", model=named("model.onnx"), input_name="idx", output_name="logits",
        adapter_onnx=named("adapter.onnx_adapter"), adapter_safetensors=named("adapter.safetensors"),
        adapter_version=0, ca_cert="ca.pem", enrollment_token="enrollment.token",
        training_program=named(et_program.MANIFEST_FILE))
    data = json.loads(config.model_dump_json())
    data.update(changes)
    (root / "client.json").write_text(json.dumps(data, indent=2))


def _edit_manifest(root: Path, edit: Callable[[dict[str, Any]], None]) -> None:
    path = root / et_program.MANIFEST_FILE
    data = json.loads(path.read_text())
    edit(data)
    path.write_text(json.dumps(data))
    _rewrite_config(root)  # a consistent bundle whose manifest is wrong, not a swapped file


def python_refusal(root: Path) -> tuple[str, str]:
    """What the Python client says of the bundle at ``root`` before it loads the program:
    the error class ("" when it passes) and message."""
    try:
        b = bundle_mod.read_bundle(root)
        b.enrollment_token()
        if b.config.ca_cert is not None and b"BEGIN CERTIFICATE" not in (root / b.config.ca_cert).read_bytes():
            raise bundle_mod.BundleError(f"{root / b.config.ca_cert} is not a PEM certificate")
        manifest = et_program.read_manifest(root)
        program = root / manifest.program.name
        if not program.is_file():
            raise et_program.TrainingProgramError(f"{program} is missing")
        digest = bundle_mod.file_sha256(program)
        if digest != manifest.program.sha256:
            raise et_program.TrainingProgramError(
                f"{program} has sha256 {digest}, {et_program.MANIFEST_FILE} expects {manifest.program.sha256}")
        if [d.name for d in manifest.inputs] != list(et_program.INPUT_NAMES):
            raise et_program.TrainingProgramError(f"{root / et_program.MANIFEST_FILE} declares other inputs")
        et_program._check_adapter(manifest, root / et_program.MANIFEST_FILE, load_file(str(root / "adapter.safetensors")))
    except (bundle_mod.BundleError, IntegrityError, AuthError, ConfigError) as err:
        return type(err).__name__, str(err)
    return "", ""


# Python's error class -> the status the library returns for the same bundle.
STATUS_OF = {"": "ORCHARD_OK", "IntegrityError": "ORCHARD_ERR_INTEGRITY", "BundleError": "ORCHARD_ERR_BUNDLE",
             "TrainingProgramError": "ORCHARD_ERR_PROGRAM", "AuthError": "ORCHARD_ERR_AUTH",
             "ConfigError": "ORCHARD_ERR_BUNDLE"}


def bundle_vectors(directory: Path) -> list[dict[str, Any]]:
    """A good bundle and damaged copies, each with the Python client's verdict and the
    file its message names (the native message must name it too)."""
    def flip_byte(name: str) -> Callable[[Path], None]:
        def damage(root: Path) -> None:
            data = bytearray((root / name).read_bytes())
            data[len(data) // 2] ^= 0x01
            (root / name).write_bytes(bytes(data))
        return damage

    def rank(m: dict[str, Any]) -> None:
        m["parameters"][0]["shape"] = [8, 32]

    def rename(m: dict[str, Any]) -> None:
        m["parameters"][1]["name"] = "h.0.mlp.c_fc.lora_B.default.weight"

    def inputs(m: dict[str, Any]) -> None:
        m["inputs"] = m["inputs"][:2]

    def version(m: dict[str, Any]) -> None:
        m["format_version"] = 7

    cases: dict[str, tuple[Callable[[Path], None], str]] = {
        "good": (lambda root: None, ""),
        "adapter_changed": (flip_byte("adapter.safetensors"), "adapter.safetensors"),
        "model_changed": (flip_byte("model.onnx"), "model.onnx"),
        "model_missing": (lambda root: (root / "model.onnx").unlink(), "model.onnx"),
        "program_truncated": (lambda root: (root / "train.pte").write_bytes(b"prog"), "train.pte"),
        "manifest_swapped": (flip_byte(et_program.MANIFEST_FILE), et_program.MANIFEST_FILE),
        "manifest_other_rank": (lambda root: _edit_manifest(root, rank), et_program.MANIFEST_FILE),
        "manifest_other_model": (lambda root: _edit_manifest(root, rename), et_program.MANIFEST_FILE),
        "manifest_inputs": (lambda root: _edit_manifest(root, inputs), et_program.MANIFEST_FILE),
        "manifest_format": (lambda root: _edit_manifest(root, version), et_program.MANIFEST_FILE),
        "token_readable": (lambda root: os.chmod(root / "enrollment.token", 0o644), "enrollment.token"),
        "ca_not_pem": (lambda root: ((root / "ca.pem").write_text("hello"), _rewrite_config(root)), "ca.pem"),
        "config_format": (lambda root: _rewrite_config(root, format_version=2), "client.json"),
        "config_not_json": (lambda root: (root / "client.json").write_text("{"), "client.json"),
        "no_config": (lambda root: (root / "client.json").unlink(), "client.json"),
    }
    out = []
    for name, (damage, names_file) in cases.items():
        root = directory / "bundles" / name
        shutil.rmtree(root, ignore_errors=True)
        _write_bundle(root)
        damage(root)
        error, message = python_refusal(root)
        if names_file and names_file not in message:
            raise AssertionError(f"{name}: the Python message does not name {names_file}: {message}")
        if (error == "") != (name == "good"):
            raise AssertionError(f"{name}: the Python client says {error or 'nothing'}: {message}")
        out.append({"case": name, "dir": str(root), "status": STATUS_OF[error], "python_error": error,
                    "python_message": message, "names_file": names_file})
    return out


def write_all(directory: str | Path) -> Path:
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    (d / "numpy_random.json").write_text(json.dumps(numpy_random_vectors()))
    (d / "codec.json").write_text(json.dumps(codec_vectors()))
    (d / "bundle.json").write_text(json.dumps(bundle_vectors(d)))
    return d


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    print(write_all(sys.argv[1]))
