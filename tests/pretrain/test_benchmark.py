"""``benchmarks/pretrain.py`` on CPU, cut short: it runs, writes the JSON the issue names,
and its two loops (recipe and plain) compute the same losses."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "pretrain.py"


def test_cpu_benchmark_writes_ratio_and_resume_difference(tmp_path) -> None:
    out = tmp_path / "pretrain.json"
    args = ["--device", "cpu", "--warmup", "1", "--rounds", "2", "--block", "2"]
    args += ["--resume-steps", "4", "--profile", "1", "--json", str(out)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), *args], env=env, capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    got = json.loads(out.read_text())
    assert got["device"] == "cpu" and got["compile"] is False and got["steps_timed"] == 4
    assert got["ratio_vs_plain_loop"] > 0
    # Same weights, batches and optimizer: the recipe's step is the plain loop's, exactly.
    assert got["max_abs_loss_diff_vs_plain"] == 0.0
    assert got["resume_stopped_at"] == 2 and got["resume_max_abs_loss_diff"] == 0.0
    assert "ratio recipe / plain" in proc.stdout
    # The profiled step: on CPU a table of operators, and no device time to split.
    assert got["profile_steps"] == 1 and got["profile_wall_ms_per_step"] > 0
    assert "aten::" in got["profile_table"] and got["profile_ms_per_step_by_kind"] == {}
    assert (out.with_suffix(".profile.txt")).read_text() == got["profile_table"]


def test_profile_sorts_kernels_by_kind() -> None:
    spec = importlib.util.spec_from_file_location("pretrain_benchmark", SCRIPT)
    assert spec is not None and spec.loader is not None
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    # Names as the profiler reported them on an H100 (cuBLAS, cuDNN attention, Inductor, fused AdamW).
    assert bench.kernel_kind("nvjet_sm90_tst_256x128_64x4_1x2_h_bz_coopA_NNT") == "matmul"
    assert bench.kernel_kind("cudnn_generated_fort_native_sdpa_sm90_flash_bprop_wgmma_f16") == "attention"
    assert bench.kernel_kind("triton_per_fused__to_copy_add_native_layer_norm_view_5") == "fused (triton)"
    assert (
        bench.kernel_kind("void at::native::multi_tensor_apply_kernel<FusedOptimizerTensorListMetadata<4>>")
        == "optimizer"
    )
    assert bench.kernel_kind("void at::native::reduce_kernel<128, 4>") == "other"


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU: the script would run")
def test_gpu_script_stops_at_once_without_a_gpu(tmp_path) -> None:
    script = SCRIPT.parent / "gpu.sh"
    env = {**os.environ, "PYTHON": sys.executable}
    proc = subprocess.run(["bash", str(script), str(tmp_path / "out")], env=env, capture_output=True,
                          text=True, timeout=120, cwd=SCRIPT.parents[1])
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "torch sees no CUDA device" in proc.stderr
    assert not list((tmp_path / "out").iterdir())  # no step ran
