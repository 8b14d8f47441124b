"""Section 4 of ``benchmarks/edge.py`` (``--runtime executorch``): the Shakespeare LoRA
task's ExecuTorch training program against torch -- gradients, the adapter after local
steps, step time, a device process's peak RSS with torch blocked, and the governor over
simulated devices training through the program. Run it through ``benchmarks/edge.py``;
its command line and JSON keys are that script's.
"""

from __future__ import annotations

import json
import math
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

# Peak RSS from /proc/self/status (VmHWM): ru_maxrss survives execve on Linux, so a
# child would report its parent's peak if that is higher.
_HWM = """
def peak_rss_mb():
    for line in open("/proc/self/status"):
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024.0
"""

_DEVICE_SCRIPT = _HWM + """
import json, sys, time
sys.modules["torch"] = None  # the device process must not need torch
import numpy as np
from orchard.edge_runtime.et_program import load_training_program
from orchard.edge_runtime.et_trainer import DeviceData, ExecuTorchTrainer
from orchard.trainer import TrainConfig
spec = json.loads(sys.argv[1])
z = np.load(spec["data"])
a = np.load(spec["arrays"])
rss0 = peak_rss_mb()
prog = load_training_program(spec["bundle"])
trainer = ExecuTorchTrainer(prog, DeviceData(z["x"], z["y"]), seed=spec["seed"])
arrays = {k: a[f"a{i}"] for i, k in enumerate(spec["names"])}
r = trainer.train(arrays, TrainConfig(**spec["config"]))
loaded = sorted(m for m, mod in sys.modules.items() if m.split(".")[0] in ("torch", "peft", "executorch") and mod is not None)
print(json.dumps({"peak_rss_mb": peak_rss_mb(),
                  "rss_before_program_mb": rss0, "steps": r.num_steps, "planned_bytes": prog.planned_bytes,
                  "torch_modules_loaded": loaded}))
"""

_TORCH_DEVICE_SCRIPT = _HWM + """
import json, sys
import numpy as np
import torch
from orchard.tasks import get_task
from orchard.tasks.torch_trainer import TensorData
from orchard.trainer import TrainConfig
spec = json.loads(sys.argv[1])
torch.set_num_threads(spec["threads"])
task = get_task("shakespeare", lora_variant=spec["variant"])
z = np.load(spec["data"])
a = np.load(spec["arrays"])
trainer = task.client_trainer(0, 1, 0)
trainer.inner.train_data = TensorData.from_numpy(z["x"], z["y"])
r = trainer.train({k: a[f"a{i}"] for i, k in enumerate(spec["names"])}, TrainConfig(**spec["config"]))
print(json.dumps({"peak_rss_mb": peak_rss_mb(), "steps": r.num_steps}))
"""


def _torch_grads(task: Any, model: Any, arrays: dict[str, np.ndarray], x: np.ndarray,
                 y: np.ndarray) -> dict[str, np.ndarray]:
    import torch

    from orchard.edge_runtime.lora import set_arrays

    set_arrays(model, arrays, task.trainable)
    model.zero_grad(set_to_none=True)
    logits = model(torch.from_numpy(x))
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), torch.from_numpy(y).reshape(-1))
    loss.backward()
    params = dict(model.named_parameters())
    return {k: params[k].grad.numpy().copy() for k in task.trainable}


def bench_executorch(variant: str, clients: int, steps: int, repeat: int, devices: int, threads: int,
                     micro_batch: int) -> dict[str, Any]:
    """The ExecuTorch training program of the Shakespeare LoRA task against torch autograd
    and the torch trainer, from the same seed and batches; its device process's peak RSS
    (torch blocked there) against a torch device process's; and the governor over a
    population of simulated devices training through the program."""
    import torch

    from orchard.config import EligibilityConfig
    from orchard.edge_runtime.clock import VirtualClock
    from orchard.edge_runtime.device import SimulatedDevice, SimulatedDeviceParams, ThermalParams
    from orchard.edge_runtime.et_export import export_training_program
    from orchard.edge_runtime.et_program import load_training_program
    from orchard.edge_runtime.et_trainer import DeviceData, ExecuTorchTrainer
    from orchard.edge_runtime.governed import governed_train
    from orchard.edge_runtime.governor import Governor
    from orchard.edge_runtime.policy import DevicePolicy
    from orchard.tasks import get_task
    from orchard.tasks.shakespeare import SHIPPED_BASE
    from orchard.trainer import TrainConfig

    torch.set_num_threads(threads)
    task = get_task("shakespeare", lora_variant=variant)
    n_natural = int(task.info["num_natural_clients"])
    cfg = TrainConfig(steps=steps, batch_size=32, learning_rate=0.05, optimizer="sgd")
    out: dict[str, Any] = {"variant": variant, "micro_batch": micro_batch, "local_steps": steps}
    with tempfile.TemporaryDirectory(prefix="orchard-et-bench-") as tmp:
        bundle = Path(tmp) / "bundle"
        t0 = time.perf_counter()
        export_training_program(task.build_model(), task.trainable, bundle, task="shakespeare",
                                lora_variant=variant, lora_rank=int(task.params["lora_rank"]),
                                seq_len=int(task.params["seq_len"]), vocab_size=len(task.info["vocab"]),
                                micro_batch=micro_batch)
        out["export_s"] = time.perf_counter() - t0
        out["program_bytes"] = (bundle / "train.pte").stat().st_size
        out["base_safetensors_bytes"] = (SHIPPED_BASE / "model.safetensors").stat().st_size
        out["program_vs_base_size_ratio"] = out["program_bytes"] / out["base_safetensors_bytes"]
        program = load_training_program(bundle)
        out["memory_plan_bytes"] = program.planned_bytes

        rng = np.random.default_rng(0)
        picks = rng.choice(n_natural, size=clients, replace=False)
        grad_diff, adapter_diff, grad_scale = 0.0, 0.0, 0.0
        et_times: list[float] = []
        torch_times: list[float] = []
        torch1_times: list[float] = []
        for c in picks:
            torch_trainer = task.client_trainer(int(c), n_natural, 0)
            train = torch_trainer.inner.train_data
            data = DeviceData(train.x.numpy(), train.y.numpy())
            et = ExecuTorchTrainer(program, data, seed=torch_trainer.inner.seed)
            start = {k: (0.05 * rng.standard_normal(v.shape)).astype(np.float32)
                     for k, v in task.initial_arrays(0).items()}
            # Per-step gradients along a trajectory: both at the same point each step.
            arrays = dict(start)
            model = task.build_model()
            for _ in range(steps):
                _, g = et.gradients(arrays, data.x, data.y)
                want = _torch_grads(task, model, arrays, data.x, data.y)
                grad_diff = max(grad_diff, max(float(np.abs(g[k] - want[k]).max()) for k in want))
                grad_scale = max(grad_scale, max(float(np.abs(want[k]).max()) for k in want))
                arrays = {k: arrays[k] - np.float32(cfg.learning_rate) * g[k] for k in arrays}
            # Local training, same seed and batches (a natural client's data fit one batch).
            r_et = et.train(start, cfg)
            r_torch = torch_trainer.train(start, cfg)
            adapter_diff = max(adapter_diff, max(float(np.abs(r_et.arrays[k] - r_torch.arrays[k]).max())
                                                 for k in start))
            # Step time: interleaved repeats, medians (the host is shared and noisy). Torch
            # runs with `threads` and with one thread, and the faster is the baseline:
            # on a loaded 2-core host two torch threads can be many times slower.
            for _ in range(repeat):
                t = time.perf_counter()
                et.train(start, cfg)
                et_times.append((time.perf_counter() - t) / steps)
                for n_threads, bucket in ((threads, torch_times), (1, torch1_times)):
                    torch.set_num_threads(n_threads)
                    t = time.perf_counter()
                    torch_trainer.train(start, cfg)
                    bucket.append((time.perf_counter() - t) / steps)
                torch.set_num_threads(threads)
        out.update(
            clients=len(picks),
            grad_max_abs_diff=grad_diff,
            grad_max_abs=grad_scale,
            adapter_max_abs_diff_after_steps=adapter_diff,
            et_step_ms=statistics.median(et_times) * 1e3,
            torch_threads_step_ms=statistics.median(torch_times) * 1e3,
            torch_1_thread_step_ms=statistics.median(torch1_times) * 1e3,
        )
        out["torch_step_ms"] = min(out["torch_threads_step_ms"], out["torch_1_thread_step_ms"])
        out["et_vs_torch_speed_ratio"] = out["torch_step_ms"] / out["et_step_ms"]

        # Device processes: the ExecuTorch one (torch blocked) and a torch one, same work.
        torch_trainer = task.client_trainer(int(picks[0]), n_natural, 0)
        train = torch_trainer.inner.train_data
        np.savez(Path(tmp) / "data.npz", x=train.x.numpy(), y=train.y.numpy())
        start = task.initial_arrays(0)
        np.savez(Path(tmp) / "arrays.npz", **{f"a{i}": start[k] for i, k in enumerate(task.trainable)})
        spec = {"bundle": str(bundle), "data": str(Path(tmp) / "data.npz"), "arrays": str(Path(tmp) / "arrays.npz"),
                "names": task.trainable, "seed": 0, "variant": variant, "threads": threads,
                "config": {"steps": steps, "batch_size": 32, "learning_rate": 0.05}}
        for key, script in (("device", _DEVICE_SCRIPT), ("torch_device", _TORCH_DEVICE_SCRIPT)):
            res = subprocess.run([sys.executable, "-c", script, json.dumps(spec)], capture_output=True, text=True)
            if res.returncode != 0:
                raise RuntimeError(f"{key} process failed:\n{res.stderr[-3000:]}")
            got = json.loads(res.stdout.strip().splitlines()[-1])
            out[f"{key}_peak_rss_mb"] = got["peak_rss_mb"]
            if key == "device":
                out["device_torch_modules_loaded"] = got["torch_modules_loaded"]
                out["device_rss_before_program_mb"] = got["rss_before_program_mb"]
        out["device_vs_torch_device_peak_rss_ratio"] = out["device_peak_rss_mb"] / out["torch_device_peak_rss_mb"]

        # The governor over simulated devices training through the program.
        ceiling, floor = 45.0, 20.0
        policy = DevicePolicy(eligibility=EligibilityConfig(min_battery_percent=floor, max_temperature_c=ceiling))
        overshoot, violations, stops, steps_done = -math.inf, 0, {}, []
        long_cfg = TrainConfig(steps=40 * steps, batch_size=32, learning_rate=0.05)
        drng = np.random.default_rng(1)
        for i in range(devices):
            torch_trainer = task.client_trainer(int(picks[i % len(picks)]), n_natural, 0)
            train = torch_trainer.inner.train_data
            et = ExecuTorchTrainer(program, DeviceData(train.x.numpy(), train.y.numpy()), seed=i)
            params = SimulatedDeviceParams(
                capacity_wh=drng.uniform(0.05, 2.0),
                battery_percent=drng.uniform(floor + 2.0, 100.0),
                idle_power_w=drng.uniform(0.1, 0.5),
                active_power_w=drng.uniform(4.0, 12.0),
                seconds_per_unit=drng.uniform(0.02, 0.2),
                thermal=ThermalParams(drng.uniform(15.0, 32.0), drng.uniform(3.0, 8.0), drng.uniform(20.0, 200.0)),
            )
            clock = VirtualClock()
            dev = SimulatedDevice(params, clock)
            res_g = governed_train(et, task.initial_arrays(0), long_cfg, Governor(dev, policy, clock), load=dev)
            overshoot = max(overshoot, dev.max_temperature_c - ceiling)
            violations += int(dev.min_battery_percent < floor)
            key = res_g.report.stop_reason.value if res_g.report.stop_reason else "trainer_done"
            stops[key] = stops.get(key, 0) + 1
            steps_done.append(res_g.result.num_steps)
        out.update(governor_devices=devices, governor_closest_approach_to_ceiling_c=overshoot,
                   governor_thermal_overshoot_c=max(0.0, overshoot), governor_battery_floor_violations=violations,
                   governor_median_steps=float(np.median(steps_done)),
                   **{f"governor_stops_{k}": v for k, v in sorted(stops.items())})
    return out


def print_executorch(res: dict[str, Any], threads: int) -> None:
    rows = [
        ("gradients: max |ET - autograd| (max |grad|)", f"{res['grad_max_abs_diff']:.2e}", f"{res['grad_max_abs']:.2e}", "≤ 1e-4"),
        (f"{res['local_steps']} local steps: max |adapter ET - torch|", f"{res['adapter_max_abs_diff_after_steps']:.2e}", "", "≤ 1e-3"),
        ("step ms ET | torch eager (faster of below) | speed", f"{res['et_step_ms']:.2f}",
         f"{res['torch_step_ms']:.2f}", f"{res['et_vs_torch_speed_ratio']:.2f}"),
        (f"step ms torch eager {threads} threads | 1 thread", f"{res['torch_threads_step_ms']:.2f}",
         f"{res['torch_1_thread_step_ms']:.2f}", ""),
        ("device peak RSS MB ET | torch | ratio", f"{res['device_peak_rss_mb']:.0f}", f"{res['torch_device_peak_rss_mb']:.0f}",
         f"{res['device_vs_torch_device_peak_rss_ratio']:.2f}"),
        ("program .pte KB | base safetensors KB", f"{res['program_bytes'] / 1024:.0f}", f"{res['base_safetensors_bytes'] / 1024:.0f}",
         f"{res['program_vs_base_size_ratio']:.2f}"),
        ("program memory plan KB", f"{res['memory_plan_bytes'] / 1024:.0f}", "", ""),
        ("governor: max T - ceiling (C) | floor violations", f"{res['governor_closest_approach_to_ceiling_c']:.2f}",
         f"{res['governor_battery_floor_violations']:.0f}", f"of {res['governor_devices']}"),
    ]
    print(f"ExecuTorch device runtime, Shakespeare LoRA ({res['variant']}), CPU, torch {threads} threads, "
          f"{res['clients']} clients, micro-batch {res['micro_batch']}")
    print(f"{'measure':<52}{'a':>12}{'b':>12}{'a/b':>10}")
    print("-" * 86)
    for name, a, b, r in rows:
        print(f"{name:<52}{a:>12}{b:>12}{r:>10}")
    stops = {k[len('governor_stops_'):]: v for k, v in res.items() if k.startswith("governor_stops_")}
    print(f"governor stop reasons: {stops}; torch modules in the device process: {res['device_torch_modules_loaded']}")
