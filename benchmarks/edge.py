"""Edge runtime on CPU: LoRA vs full fine-tuning, ONNX Runtime vs PyTorch eager, and the
governor against a thermal ceiling on simulated devices.

    python benchmarks/edge.py [--quick] [--json PATH]

1. LoRA vs full fine-tuning of the same GPT (``orchard.gpt``), AdamW, same batches.
   Each mode runs in its own fresh subprocess so its peak RSS (``ru_maxrss``) is its
   own; steps/s is the median step time after warm-up. Ratios are LoRA / full.
2. Inference latency of a LoRA GPT (adapter active) through ONNX Runtime vs PyTorch
   eager (peft, unmerged), same thread count, median of repeated runs; plus the max
   absolute logit difference between the two (parity).
3. The governor on a population of simulated devices whose full-load steady state is
   far above a 45 °C ceiling: steps per second of virtual time without and with the
   governor, the worst overshoot of the ceiling, and how many devices went below
   their battery floor.

    python benchmarks/edge.py --runtime executorch [--quick] [--variant ffa|full] [--json PATH]

4. The Shakespeare LoRA task's ExecuTorch training program (what ``orchard client
   bundle`` ships to phone-class devices) against torch: per-step gradients against
   autograd along a 20-step trajectory, the adapter after 20 local steps against the
   torch trainer's from the same seed and batches, the median step time against the
   torch trainer's (interleaved repeats), the peak RSS of a device process that trains
   through the program with torch blocked against a torch device process doing the
   same work, the program's size against the base's safetensors, and the governor
   over simulated devices that train through the program.

    python benchmarks/edge.py --stress [--devices 100] [--steps 300] [--seed 0] [--json PATH]

5. The governor over devices with a real device's physics and sensors, one stress
   model at a time and all at once (``benchmarks/edge_stress.py``).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

# Section 4 lives beside this script (its own workload and measures); imported as a
# sibling module, as benchmarks/_procs.py is, because benchmarks/ is not a package.
sys.path.insert(0, str(Path(__file__).resolve().parent))
from edge_executorch import bench_executorch, print_executorch  # noqa: E402
from edge_stress import bench_stress, print_stress  # noqa: E402

# --------------------------------------------------------------- 1. training worker


@dataclass(frozen=True)
class TrainCase:
    n_layer: int
    d_model: int
    n_head: int
    seq_len: int
    batch: int
    steps: int
    warmup: int
    rank: int


def _gpt_config(case: TrainCase) -> Any:
    from orchard.gpt import GPTConfig

    return GPTConfig(
        vocab_size=65,
        seq_len=case.seq_len,
        n_layer=case.n_layer,
        n_head=case.n_head,
        d_model=case.d_model,
    )


def train_worker(mode: str, case: TrainCase, threads: int) -> dict[str, float]:
    """Run in a fresh process: train ``case.steps`` steps, report speed and peak RSS."""
    import torch
    from peft import LoraConfig, get_peft_model

    from orchard.gpt import GPT, LORA_TARGET_MODULES

    torch.set_num_threads(threads)
    torch.manual_seed(0)
    model: torch.nn.Module = GPT(_gpt_config(case))
    if mode == "lora":
        model = get_peft_model(
            model,
            LoraConfig(
                r=case.rank, lora_alpha=2 * case.rank, target_modules=list(LORA_TARGET_MODULES)
            ),
        )
    trainable = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(trainable, lr=1e-3)
    gen = torch.Generator().manual_seed(1)
    rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    times = []
    for step in range(case.warmup + case.steps):
        idx = torch.randint(0, 65, (case.batch, case.seq_len + 1), generator=gen)
        t0 = time.perf_counter()
        logits = model(idx[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, 65), idx[:, 1:].reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if step >= case.warmup:
            times.append(time.perf_counter() - t0)
    return {
        "steps_per_s": 1.0 / statistics.median(times),
        "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0,  # KiB on Linux
        "rss_after_model_mb": rss_before / 1024.0,
        "trainable_params": float(sum(p.numel() for p in trainable)),
        "total_params": float(sum(p.numel() for p in model.parameters())),
    }


def bench_training(case: TrainCase, threads: int) -> dict[str, dict[str, float]]:
    out = {}
    for mode in ("lora", "full"):
        cmd = [
            sys.executable,
            __file__,
            "--worker",
            mode,
            "--case",
            json.dumps(case.__dict__),
            "--threads",
            str(threads),
        ]
        res = subprocess.run(cmd, capture_output=True, text=True, check=False)
        if res.returncode != 0:
            raise RuntimeError(f"{mode} worker failed:\n{res.stderr}")
        out[mode] = json.loads(res.stdout.strip().splitlines()[-1])
    return out


# ---------------------------------------------------------------- 2. inference


def bench_inference(case: TrainCase, threads: int, repeat: int) -> dict[str, float]:
    import torch
    from peft import LoraConfig, get_peft_model

    from orchard.edge_runtime.onnx_export import adapter_arrays, export_lora_model
    from orchard.edge_runtime.ort_runtime import OrtLoraModel, write_onnx_adapter
    from orchard.gpt import GPT, LORA_TARGET_MODULES

    torch.set_num_threads(threads)
    torch.manual_seed(0)
    model = get_peft_model(
        GPT(_gpt_config(case)),
        LoraConfig(r=case.rank, lora_alpha=2 * case.rank, target_modules=list(LORA_TARGET_MODULES)),
    ).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0.0, 0.02)  # a trained-looking adapter, not the B = 0 identity
    idx = torch.randint(0, 65, (1, case.seq_len), generator=torch.Generator().manual_seed(2))
    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        export_lora_model(model, idx, Path(tmp) / "m.onnx", dynamic_axes={0: "batch", 1: "seq"})
        export_s = time.perf_counter() - t0
        write_onnx_adapter(adapter_arrays(model), Path(tmp) / "a.onnx_adapter", adapter_version=1)
        ort_model = OrtLoraModel(Path(tmp) / "m.onnx", intra_op_threads=threads)
        adapter = ort_model.load_adapter(Path(tmp) / "a.onnx_adapter")
        x = idx.numpy()

        def run_torch() -> np.ndarray:
            with torch.no_grad():
                return model(idx).numpy()

        def run_ort() -> np.ndarray:
            return ort_model.run(x, adapter)

        parity = float(np.abs(run_torch() - run_ort()).max())
        lat = {}
        for name, fn in (("torch", run_torch), ("ort", run_ort)):
            for _ in range(3):
                fn()
            ts = []
            for _ in range(repeat):
                t = time.perf_counter()
                fn()
                ts.append(time.perf_counter() - t)
            lat[name] = statistics.median(ts) * 1e3
    return {
        "torch_ms": lat["torch"],
        "ort_ms": lat["ort"],
        "ort_vs_torch_latency_ratio": lat["ort"] / lat["torch"],
        "ort_parity_max_abs": parity,
        "export_s": export_s,
    }


# ------------------------------------------------------------------ 3. governor


def bench_governor(devices: int, steps: int, seed: int) -> dict[str, float]:
    from orchard.config import EligibilityConfig
    from orchard.edge_runtime.clock import VirtualClock
    from orchard.edge_runtime.device import SimulatedDevice, SimulatedDeviceParams, ThermalParams
    from orchard.edge_runtime.governor import Governor, run_governed
    from orchard.edge_runtime.policy import DevicePolicy, RoundBudget

    rng = np.random.default_rng(seed)
    ceiling, floor = 45.0, 20.0
    policy = DevicePolicy(
        eligibility=EligibilityConfig(min_battery_percent=floor, max_temperature_c=ceiling),
        budget=RoundBudget(max_steps=steps),
    )
    free_rate, gov_rate, free_max, overshoots, violations = [], [], [], [], 0
    stops: dict[str, int] = {}
    wall = time.perf_counter()
    for _ in range(devices):
        ambient = rng.uniform(15.0, 32.0)
        r_th = rng.uniform(3.0, 8.0)
        tau = rng.uniform(20.0, 200.0)
        active = rng.uniform(4.0, 12.0)  # full-load T_ss = ambient + active * r_th >> 45 °C
        step_s = rng.uniform(0.05, 0.5)
        params = SimulatedDeviceParams(
            capacity_wh=rng.uniform(2.0, 20.0),
            battery_percent=rng.uniform(floor + 2.0, 100.0),
            idle_power_w=rng.uniform(0.1, 0.5),
            active_power_w=active,
            seconds_per_unit=step_s,
            thermal=ThermalParams(ambient, r_th, tau),
        )
        # Without a governor: flat out for the same number of steps.
        clock = VirtualClock()
        dev = SimulatedDevice(params, clock)
        for _ in range(steps):
            dev.work(1.0)
        free_rate.append(steps / clock.monotonic())
        free_max.append(dev.max_temperature_c)
        # With the governor.
        clock = VirtualClock()
        dev = SimulatedDevice(params, clock)
        report = run_governed(Governor(dev, policy, clock), lambda d=dev: d.work(1.0) and 1.0)
        gov_rate.append(report.steps_done / max(clock.monotonic(), 1e-9))
        overshoots.append(dev.max_temperature_c - ceiling)
        violations += int(dev.min_battery_percent < floor)
        key = report.stop_reason.value if report.stop_reason else "trainer_done"
        stops[key] = stops.get(key, 0) + 1
    wall = time.perf_counter() - wall
    return {
        "devices": float(devices),
        "ungoverned_steps_per_s": float(np.median(free_rate)),
        "governed_steps_per_s": float(np.median(gov_rate)),
        "governed_vs_ungoverned_throughput_ratio": float(
            np.median(np.array(gov_rate) / np.array(free_rate))
        ),
        "ungoverned_max_temperature_c": float(np.max(free_max)),
        "thermal_overshoot_c": float(max(0.0, max(overshoots))),
        "closest_approach_to_ceiling_c": float(max(overshoots)),
        "battery_floor_violations": float(violations),
        "governor_wall_s_per_device": wall / devices,
        **{f"stops_{k}": float(v) for k, v in sorted(stops.items())},
    }


# ----------------------------------------------------------------------- main


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--json", type=Path, help="write the results here")
    ap.add_argument(
        "--quick", action="store_true", help="a small model and few devices (smoke run)"
    )
    ap.add_argument("--threads", type=int, default=min(2, os.cpu_count() or 1))
    ap.add_argument("--runtime", choices=["torch", "executorch"], default="torch",
                    help="executorch: benchmark the ExecuTorch device runtime (section 4) instead")
    ap.add_argument("--variant", choices=["ffa", "full"], default="ffa", help="LoRA variant (--runtime executorch)")
    ap.add_argument("--micro-batch", type=int, default=8, help="rows per program run (--runtime executorch)")
    ap.add_argument("--stress", action="store_true",
                    help="only section 5: the governor under each stress model (benchmarks/edge_stress.py)")
    ap.add_argument("--devices", type=int, default=100, help="devices a stress case (--stress)")
    ap.add_argument("--steps", type=int, default=300, help="steps a device (--stress)")
    ap.add_argument("--seed", type=int, default=0, help="the stressed population's seed (--stress)")
    ap.add_argument("--worker", choices=["lora", "full"], help=argparse.SUPPRESS)
    ap.add_argument("--case", help=argparse.SUPPRESS)
    args = ap.parse_args()

    if args.worker:
        print(
            json.dumps(train_worker(args.worker, TrainCase(**json.loads(args.case)), args.threads))
        )
        return

    if args.stress:
        res = bench_stress(args.devices, args.steps, args.seed)
        print_stress(res)
        if args.json:
            args.json.write_text(json.dumps(res, indent=2, sort_keys=True) + "\n")
            print(f"wrote {args.json}")
        sys.exit(0 if res["met"] else 1)

    if args.runtime == "executorch":
        clients, repeat, devices = (2, 2, 4) if args.quick else (8, 5, 20)
        res = bench_executorch(args.variant, clients, 20, repeat, devices, args.threads, args.micro_batch)
        res["threads"] = args.threads
        print_executorch(res, args.threads)
        if args.json:
            args.json.write_text(json.dumps(res, indent=2, sort_keys=True) + "\n")
            print(f"wrote {args.json}")
        ok = (res["grad_max_abs_diff"] <= 1e-4 and res["adapter_max_abs_diff_after_steps"] <= 1e-3
              and res["governor_thermal_overshoot_c"] <= 1.0 and res["governor_battery_floor_violations"] == 0
              and not res["device_torch_modules_loaded"])
        sys.exit(0 if ok else 1)

    if args.quick:
        train_case = TrainCase(
            n_layer=2, d_model=128, n_head=4, seq_len=32, batch=4, steps=5, warmup=2, rank=8
        )
        infer_case = TrainCase(
            n_layer=2, d_model=64, n_head=2, seq_len=32, batch=1, steps=0, warmup=0, rank=8
        )
        devices, gov_steps, repeat = 10, 500, 20
    else:
        train_case = TrainCase(
            n_layer=6, d_model=512, n_head=8, seq_len=64, batch=4, steps=12, warmup=3, rank=8
        )
        infer_case = TrainCase(
            n_layer=4, d_model=256, n_head=4, seq_len=64, batch=1, steps=0, warmup=0, rank=8
        )
        devices, gov_steps, repeat = 100, 3000, 100

    train = bench_training(train_case, args.threads)
    infer = bench_inference(infer_case, args.threads, repeat)
    gov = bench_governor(devices, gov_steps, seed=0)

    lo, fu = train["lora"], train["full"]
    results: dict[str, Any] = {
        "threads": args.threads,
        "train_case": train_case.__dict__,
        "infer_case": infer_case.__dict__,
        "lora": lo,
        "full": fu,
        "lora_vs_full_steps_per_s_ratio": lo["steps_per_s"] / fu["steps_per_s"],
        "lora_vs_full_peak_rss_ratio": lo["peak_rss_mb"] / fu["peak_rss_mb"],
        # Peak RSS minus RSS once the model and optimizer exist: what training itself
        # adds (gradients, optimizer state, activations), without the shared torch
        # runtime and base weights that dominate the absolute numbers.
        "lora_vs_full_training_rss_growth_ratio": (lo["peak_rss_mb"] - lo["rss_after_model_mb"])
        / (fu["peak_rss_mb"] - fu["rss_after_model_mb"]),
        **infer,
        **gov,
    }

    rows = [
        (
            "train: steps/s LoRA | full | ratio",
            f"{lo['steps_per_s']:.2f}",
            f"{fu['steps_per_s']:.2f}",
            f"{results['lora_vs_full_steps_per_s_ratio']:.2f}",
        ),
        (
            "train: peak RSS MB LoRA | full | ratio",
            f"{lo['peak_rss_mb']:.0f}",
            f"{fu['peak_rss_mb']:.0f}",
            f"{results['lora_vs_full_peak_rss_ratio']:.2f}",
        ),
        (
            "train: RSS growth in training MB LoRA | full",
            f"{lo['peak_rss_mb'] - lo['rss_after_model_mb']:.0f}",
            f"{fu['peak_rss_mb'] - fu['rss_after_model_mb']:.0f}",
            f"{results['lora_vs_full_training_rss_growth_ratio']:.2f}",
        ),
        (
            "train: trainable params LoRA | full",
            f"{lo['trainable_params']:.0f}",
            f"{fu['trainable_params']:.0f}",
            f"{lo['trainable_params'] / fu['trainable_params']:.4f}",
        ),
        (
            "infer: latency ms ORT | torch | ratio",
            f"{infer['ort_ms']:.2f}",
            f"{infer['torch_ms']:.2f}",
            f"{infer['ort_vs_torch_latency_ratio']:.2f}",
        ),
        ("infer: ORT parity max |dlogit|", f"{infer['ort_parity_max_abs']:.2e}", "", ""),
        (
            "governor: steps/s (virtual) gov | free | ratio",
            f"{gov['governed_steps_per_s']:.2f}",
            f"{gov['ungoverned_steps_per_s']:.2f}",
            f"{gov['governed_vs_ungoverned_throughput_ratio']:.2f}",
        ),
        (
            "governor: max T - ceiling (C) gov | free",
            f"{gov['closest_approach_to_ceiling_c']:.2f}",
            f"{gov['ungoverned_max_temperature_c'] - 45.0:.2f}",
            "",
        ),
        (
            "governor: battery floor violations",
            f"{gov['battery_floor_violations']:.0f}",
            f"of {gov['devices']:.0f}",
            "",
        ),
    ]
    print(f"edge runtime benchmark, CPU, {args.threads} threads")
    print(f"{'measure':<48}{'a':>12}{'b':>12}{'a/b':>10}")
    print("-" * 82)
    for name, a, b, r in rows:
        print(f"{name:<48}{a:>12}{b:>12}{r:>10}")
    stops = {k[6:]: int(v) for k, v in gov.items() if k.startswith("stops_")}
    print(f"governor stop reasons: {stops}")
    if args.json:
        args.json.write_text(json.dumps(results, indent=2, sort_keys=True) + "\n")
        print(f"wrote {args.json}")
    if not math.isfinite(results["ort_parity_max_abs"]):
        sys.exit(1)


if __name__ == "__main__":
    main()
