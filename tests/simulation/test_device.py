"""The simulator's vectorised path on a chosen device: cpu everywhere, cuda when one is present."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from orchard.simulation import SimulationConfig, run_simulation, simulation_problems

RUN = {"task": "digits", "task_params": {"with_replacement": True, "samples_per_client": 20},
       "train": {"epochs": 1, "batch_size": 10, "learning_rate": 0.1}}


def _cfg(device: str) -> dict:
    return {"simulation": dict(clients=200, clients_per_round=40, rounds=2, aggregators=2, progress=False,
                               device=device, run=RUN)}


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU: cuda is accepted here")
def test_cuda_without_a_gpu_is_refused_with_what_to_do() -> None:
    problems = simulation_problems(_cfg("cuda"))
    assert any("simulation.device" in p and "device = 'cpu'" in p for p in problems), problems


def test_cuda_is_refused_where_the_vectorised_path_does_not_run() -> None:
    cfg = _cfg("cuda")
    cfg["simulation"].update(backend="ray")
    assert any("backend = 'local' or 'process'" in p for p in simulation_problems(cfg))


@pytest.mark.gpu
def test_the_cuda_path_gives_the_cpu_model_within_float_tolerance() -> None:
    # tests/conftest.py skips gpu-marked tests, with the reason, where there is no CUDA device.
    cpu = run_simulation(SimulationConfig.model_validate(_cfg("cpu")["simulation"]))
    gpu = run_simulation(SimulationConfig.model_validate(_cfg("cuda")["simulation"]))
    for k, v in cpu.final_arrays.items():
        np.testing.assert_allclose(gpu.final_arrays[k], v, rtol=1e-4, atol=1e-5)


def test_device_benchmark_measures_the_headline_and_checks_at_a_smaller_size(tmp_path) -> None:
    # benchmarks/simulation.py --device: the headline size on the device, and the device
    # against the CPU at --check-per-round (here both on the CPU, so the models agree exactly).
    out = tmp_path / "device.json"
    script = Path(__file__).resolve().parents[2] / "benchmarks" / "simulation.py"
    args = ["--device", "cpu", "--tasks", "digits", "--per-round", "60", "--check-per-round", "30",
            "--rounds", "1", "--population", "200", "--backend", "local", "--json", str(out)]
    proc = subprocess.run([sys.executable, str(script), *args], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    # Each case says round by round how far it got, so one stopped by a time limit still reports.
    assert proc.stderr.count("round 1 (warm-up)") == 3 and proc.stderr.count("round 2 (measured)") == 3
    got = json.loads(out.read_text())
    assert (got["per_round"], got["check_per_round"]) == (60, 30)
    sizes = [(c["device"], c["clients_per_round"]) for c in got["cases"]]
    assert sizes == [("cpu", 60), ("cpu", 30), ("cpu", 30)]
    assert got["cases"][1]["max_abs_diff_vs_cpu"] == 0.0 and got["cases"][2]["x_cpu"] == 1.0
    # A round fills: the population is at least three times the round's size.
    assert all(c["population"] >= 3 * c["clients_per_round"] for c in got["cases"])


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU: the benchmark would run")
def test_device_benchmark_without_a_gpu_says_so() -> None:
    script = Path(__file__).resolve().parents[2] / "benchmarks" / "simulation.py"
    proc = subprocess.run([sys.executable, str(script), "--device", "cuda"], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 1 and "needs a CUDA GPU" in proc.stderr and "Traceback" not in proc.stderr
