"""Encode+decode throughput of every codec on one 10-million-element float32 tensor.

    python benchmarks/compression.py [--numel N] [--repeat R] [--json PATH]

MB/s counts 1e6 bytes of float32 input per second of encode plus decode (best of
``--repeat`` runs each). ``compression_ratio`` is the dense float32 payload's size
over the codec's, both measured in this run. The tensor is a 2-D matrix (so PowerSGD
factorises it) of Gaussian values, seeded.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import TypeVar

import numpy as np

from orchard.compression import build_codec
from orchard.config import CodecSpec

T = TypeVar("T")

# Targets from the issue, MB/s of encode + decode.
TARGETS = {"qsgd": 200.0, "sign": 200.0, "topk": 50.0}

CASES: list[tuple[str, CodecSpec]] = [
    ("float32", CodecSpec(name="float32")),
    ("float16", CodecSpec(name="float16")),
    ("bfloat16", CodecSpec(name="bfloat16")),
    ("qsgd-8bit", CodecSpec(name="qsgd", params={"bits": 8})),
    ("qsgd-4bit-block4096", CodecSpec(name="qsgd", params={"bits": 4, "block": 4096})),
    ("qsgd-2bit", CodecSpec(name="qsgd", params={"bits": 2})),
    ("qsgd-1bit", CodecSpec(name="qsgd", params={"bits": 1})),
    ("sign", CodecSpec(name="sign")),
    ("topk-1%", CodecSpec(name="topk", params={"fraction": 0.01})),
    ("randk-1%", CodecSpec(name="randk", params={"fraction": 0.01})),
    ("powersgd-r4", CodecSpec(name="powersgd", params={"rank": 4})),
    (
        "topk-1%+qsgd-8bit",
        CodecSpec(
            name="pipeline",
            params={"stages": [{"name": "topk", "params": {"fraction": 0.01}}, {"name": "qsgd"}]},
        ),
    ),
    (
        "error_feedback(topk-1%)",
        CodecSpec(name="error_feedback", params={"codec": {"name": "topk"}}),
    ),
]


@dataclass
class Row:
    codec: str
    mb_per_s: float
    encode_ms: float
    decode_ms: float
    bytes: int
    compression_ratio: float
    speed_vs_float32: float  # this codec's MB/s over float32's, same run: robust to load
    target_mb_per_s: float | None
    meets_target: bool | None


def _shape(numel: int) -> tuple[int, int]:
    rows = int(math.sqrt(numel))
    while numel % rows:
        rows -= 1
    return rows, numel // rows


def _best(fn: Callable[[], T], repeat: int) -> tuple[float, T]:
    best, out = math.inf, fn()  # one warm-up call: first-touch page faults are not the codec
    for _ in range(repeat):
        t0 = time.perf_counter()
        out = fn()
        best = min(best, time.perf_counter() - t0)
    return best, out


def measure(label: str, spec: CodecSpec, x: np.ndarray, repeat: int) -> tuple[float, float, int]:
    codec = build_codec(spec)
    rng = np.random.default_rng(1)
    t_enc, (payload, _) = _best(lambda: codec.encode(x, rng, None, 7), repeat)
    t_dec, _ = _best(lambda: codec.decode(payload, x.shape, 1, 7), repeat)
    return t_enc, t_dec, len(payload)


def run(numel: int, repeat: int) -> list[Row]:
    x = np.random.default_rng(0).standard_normal(_shape(numel), dtype=np.float32)
    mb = x.nbytes / 1e6
    rows: list[Row] = []
    dense_bytes, dense_speed = 0, 0.0
    for label, spec in CASES:
        t_enc, t_dec, size = measure(label, spec, x, repeat)
        speed = mb / (t_enc + t_dec)
        if not rows:  # the first case is float32: the in-run baseline
            dense_bytes, dense_speed = size, speed
        target = next((v for k, v in TARGETS.items() if label.startswith(k)), None)
        rows.append(
            Row(
                codec=label,
                mb_per_s=round(speed, 1),
                encode_ms=round(t_enc * 1e3, 1),
                decode_ms=round(t_dec * 1e3, 1),
                bytes=size,
                compression_ratio=round(dense_bytes / size, 2),
                speed_vs_float32=round(speed / dense_speed, 3),
                target_mb_per_s=target,
                meets_target=None if target is None else speed >= target,
            )
        )
    return rows


def print_table(rows: list[Row], numel: int) -> None:
    print(f"encode+decode of {numel:,} float32 elements ({numel * 4 / 1e6:.0f} MB), best of runs")
    head = (
        f"{'codec':<26}{'MB/s':>9}{'vs f32':>8}{'enc ms':>9}{'dec ms':>9}{'bytes':>13}"
        f"{'ratio':>9}  target"
    )
    print(head)
    print("-" * len(head))
    for r in rows:
        target = (
            ""
            if r.target_mb_per_s is None
            else (f">= {r.target_mb_per_s:.0f} {'ok' if r.meets_target else 'MISSED'}")
        )
        print(
            f"{r.codec:<26}{r.mb_per_s:>9.1f}{r.speed_vs_float32:>8.2f}{r.encode_ms:>9.1f}{r.decode_ms:>9.1f}"
            f"{r.bytes:>13,}{r.compression_ratio:>9.2f}  {target}"
        )


# The federated comparison's codec: top 10% of each adapter tensor, values in 8 bits,
# with the client keeping what it did not send (error feedback) for the next round.
FEDERATED_CODEC = {"name": "error_feedback", "params": {"codec": {"name": "pipeline", "params": {"stages": [
    {"name": "topk", "params": {"fraction": 0.1}}, {"name": "qsgd", "params": {"bits": 8}}]}}}}


def federated(rounds: int, per_round: int, seed: int) -> list[dict[str, object]]:
    """Federated Shakespeare (FFA-LoRA) through the simulator, uncompressed and compressed,
    in the same run: upload bytes per client per round against a dense float32 update of
    the whole model, and the accuracy each run ends with."""
    import sys
    from pathlib import Path

    import torch

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from quality import _sim  # the quality benchmark's always-available device population

    from orchard.simulation import run_simulation
    from orchard.tasks import get_task

    torch.set_num_threads(1)
    dense = 4 * sum(p.numel() for p in get_task("shakespeare").build_model(seed=0).parameters())
    out: list[dict[str, object]] = []
    for name, codec in (("float32", {"name": "float32"}), ("topk10%+qsgd8+ef", FEDERATED_CODEC)):
        run_cfg = {"task": "shakespeare", "seed": seed, "codec": codec,
                   "train": {"epochs": 1, "batch_size": 16, "learning_rate": 1e-2, "optimizer": "adam"}}
        rep = run_simulation(_sim(run_cfg, clients=1170, per_round=per_round, rounds=rounds, aggregators=0,
                                  evaluate_every=0))
        uploads = sum(r["participants"] for r in rep.rounds)
        per_client = sum(r["bytes_up"] for r in rep.rounds) / max(1, uploads)
        out.append({"codec": name, "bytes_per_client_round": round(per_client, 1),
                    "dense_float32_model_bytes": dense, "reduction_vs_dense_model": round(dense / per_client, 1),
                    "final_accuracy": rep.final_accuracy, "rounds": len(rep.rounds)})
    plain = out[0]["final_accuracy"]
    for r in out:
        r["accuracy_points_lost"] = None if plain is None or r["final_accuracy"] is None else round(
            100 * (float(plain) - float(r["final_accuracy"])), 3)  # type: ignore[arg-type]
    return out


def print_federated(rows: list[dict[str, object]]) -> None:
    print("federated Shakespeare (FFA-LoRA), same run; targets: >= 100x fewer bytes, <= 1 point lost")
    print(f"{'codec':<20}{'bytes/client/round':>20}{'x vs dense model':>18}{'accuracy':>10}{'pts lost':>10}")
    for r in rows:
        acc = r["final_accuracy"]
        print(f"{r['codec']!s:<20}{r['bytes_per_client_round']!s:>20}{r['reduction_vs_dense_model']!s:>18}"
              f"{(f'{acc:.4f}' if isinstance(acc, float) else '-'):>10}{r['accuracy_points_lost']!s:>10}")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--numel", type=int, default=10_000_000)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--json", metavar="PATH", help="write one JSON row per codec here")
    ap.add_argument("--federated", action="store_true",
                    help="also run federated Shakespeare uncompressed vs compressed through the simulator")
    ap.add_argument("--federated-rounds", type=int, default=20)
    ap.add_argument("--federated-per-round", type=int, default=10)
    args = ap.parse_args(argv)
    if args.federated:
        fed = federated(args.federated_rounds, args.federated_per_round, seed=0)
        print_federated(fed)
        if args.json:
            with open(args.json.replace(".json", "") + ".federated.json", "w") as fh:
                json.dump(fed, fh, indent=2)
    rows = run(args.numel, args.repeat)
    print_table(rows, args.numel)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump([asdict(r) for r in rows], fh, indent=2)


if __name__ == "__main__":
    main()
