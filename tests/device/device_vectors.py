"""Test vectors for liborchard_device, written by the Python package itself.

The native tests (device/tests) replay these: the same inputs must give the same bytes
(codecs, SecAgg+ messages) and the same decisions (device policy) as Orchard's Python
code gives here. They are written fresh for every test run, so they follow the Python
code as it changes; nothing is copied by hand.

    python tests/device/device_vectors.py DIR
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import numpy as np

from orchard.client.update import upload_rng
from orchard.compression import build_codec
from orchard.compression.update import encode_packed


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


def write_all(directory: str | Path) -> Path:
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    (d / "numpy_random.json").write_text(json.dumps(numpy_random_vectors()))
    (d / "codec.json").write_text(json.dumps(codec_vectors()))
    return d


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    print(write_all(sys.argv[1]))
