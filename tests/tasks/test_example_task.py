"""examples/greenhouse, a user's own task in its own installed package, through every
path: registered by its entry point, simulated on worker processes, trained by a gRPC
federation (root, aggregator, 3 clients), and bundled for a device whose ONNX model
agrees with torch and whose ExecuTorch training program trains as torch does."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from orchard.errors import OrchardError

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "examples" / "greenhouse"


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory):
    """The example installed as a package (its entry point registered), into a folder of
    its own: on sys.path here, on PYTHONPATH for the commands run as processes."""
    site = tmp_path_factory.mktemp("site")
    # Built from a copy: setuptools writes build/ and *.egg-info next to the sources.
    source = tmp_path_factory.mktemp("src") / "greenhouse"
    shutil.copytree(EXAMPLE, source, ignore=shutil.ignore_patterns("build", "*.egg-info", "__pycache__"))
    res = subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation",
                          "--target", str(site), str(source)], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    sys.path.insert(0, str(site))
    env = dict(os.environ, PYTHONPATH=str(site), OMP_NUM_THREADS="1")
    try:
        yield env
    finally:
        sys.path.remove(str(site))
        for name in [m for m in sys.modules if m.split(".")[0] == "greenhouse_task"]:
            del sys.modules[name]


def orchard(env: dict[str, str], *args: str, cwd: Path, timeout: float = 600) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "orchard.cli", *args], env=env, cwd=cwd, capture_output=True,
                          text=True, timeout=timeout)


def test_the_installed_package_registers_its_task(installed, tmp_path: Path) -> None:
    from orchard.tasks import get_task
    from orchard.tasks.registry import registered_tasks

    assert registered_tasks()["greenhouse"] == "greenhouse_task:build"
    task = get_task("greenhouse")
    assert task.partition(6, 0).scheme == "natural(greenhouse)"
    assert task.info["clients"] == ["almeria", "hokkaido", "murcia", "ontario", "queensland", "westland"]
    res = orchard({**installed, "COLUMNS": "200"}, "tasks", "list", cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    assert "greenhouse" in res.stdout and "greenhouse-task" in res.stdout and "with_replacement=False" in res.stdout


def _simulate(env: dict[str, str], tmp_path: Path, *flags: str) -> list[dict]:
    out = tmp_path / "sim"
    res = orchard(env, "simulate", "--config", str(EXAMPLE / "sim.toml"), "--out", str(out), *flags, cwd=tmp_path,
                  timeout=900)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    return [json.loads(line) for line in (out / "rounds.jsonl").read_text().splitlines()]


def test_simulate_runs_the_task_on_worker_processes(installed, tmp_path: Path) -> None:
    rounds = _simulate(installed, tmp_path, "--rounds", "3")
    assert [r["participants"] for r in rounds] == [30, 30, 30]
    # The user's model learns: the global model's held-out accuracy rises round on round.
    assert rounds[-1]["accuracy"] > rounds[0]["accuracy"] + 0.1
    report = json.loads((tmp_path / "sim" / "report.json").read_text())
    assert report["backend"] == "process" and report["task"] == "greenhouse" and report["status"] == "completed"


@pytest.mark.slow
def test_simulate_ten_thousand_clients(installed, tmp_path: Path) -> None:
    rounds = _simulate(installed, tmp_path, "--clients", "10000", "--clients-per-round", "200", "--rounds", "3")
    assert [r["participants"] for r in rounds] == [200, 200, 200]
    assert rounds[-1]["accuracy"] > rounds[0]["accuracy"]


def test_a_grpc_federation_of_root_aggregator_and_three_clients(installed, tmp_path: Path) -> None:
    sys.path.insert(0, str(REPO / "tests" / "integration"))
    try:
        from fed_harness import BackgroundRoot, wait_joined
    finally:
        sys.path.remove(str(REPO / "tests" / "integration"))
    from orchard import wire
    from orchard.config import ServerConfig
    from orchard.ops import ControlClient
    from orchard.server.app import start_aggregator
    from orchard.tasks import get_task

    cfg = ServerConfig(heartbeat_s=1.0, node_timeout_s=60.0, long_poll_s=2.0)
    srv = BackgroundRoot(tmp_path / "root", cfg)
    agg = srv.call(start_aggregator(srv.root.address, insecure=True, server_cfg=cfg))
    procs = [subprocess.Popen([sys.executable, "-m", "orchard.cli", "client", "start", "--server", agg.address,
                               "--insecure", "--task", "greenhouse", "--partition", str(k), "--num-partitions", "3",
                               "--node-id", f"greenhouse-{k}", "--max-tasks", "3"],
                              env=installed, cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
             for k in range(3)]
    try:
        srv.call(wait_joined(agg, 3, timeout=180), timeout=200)
        # The operator's command, with the example's run config naming the task.
        started = orchard(installed, "run", "start", "--server", srv.root.address, "--insecure", "--config",
                          str(EXAMPLE / "run.toml"), cwd=tmp_path, timeout=400)
        assert started.returncode == 0, started.stdout[-2000:] + started.stderr[-2000:]
        with ControlClient(srv.root.address, insecure=True) as ctl:
            st = ctl.status()
            final = wire.blob_to_arrays(ctl.pull_global())
        task = get_task("greenhouse")
        initial = task.initial_arrays(0)
    finally:
        for p in procs:
            try:
                p.wait(60)
            except subprocess.TimeoutExpired:
                p.kill()
        srv.call(agg.stop(0.1))
        srv.stop()
    assert st["status"] == "completed", st
    assert [r["participants"] for r in st["rounds"]] == [3, 3, 3]
    # Three greenhouses' adapters, averaged: the global model beats the initial one.
    assert task.evaluate(final)["accuracy"] > task.evaluate(initial)["accuracy"] + 0.2
    assert all(p.returncode == 0 for p in procs), [p.stderr.read().decode()[-2000:] for p in procs if p.stderr]


def test_a_bundle_of_the_task_matches_torch(installed, tmp_path: Path) -> None:
    from orchard.edge_runtime.bundle import run_inference
    from orchard.edge_runtime.lora import set_arrays
    from orchard.edge_runtime.task_bundle import write_task_bundle
    from orchard.tasks import get_task

    task = get_task("greenhouse")
    rng = np.random.default_rng(5)  # a trained adapter, not B = 0: the parity check has teeth
    arrays = {k: (0.2 * rng.standard_normal(v.shape)).astype(np.float32) for k, v in task.initial_arrays(0).items()}
    bundle = write_task_bundle(tmp_path / "b1", task=task, task_ref="greenhouse", server_address="h:1",
                               global_arrays=arrays, training_program=False)
    x = task.test_data.x[:64].numpy()
    got = run_inference(bundle.path, x)
    model = task.build_model().eval()
    set_arrays(model, arrays, task.trainable)
    with torch.no_grad():
        want = model(torch.from_numpy(x)).numpy()
        bare = task.build_model().eval()(torch.from_numpy(x)).numpy()
    assert got.shape == want.shape == (64, 4)
    assert np.abs(got - want).max() <= 1e-5
    assert np.abs(bare - want).max() > 1e-2


@pytest.mark.slow  # two ExecuTorch exports, tens of seconds each on a shared host
@pytest.mark.parametrize("lora", [True, False])
def test_the_example_bundles_with_its_training_program(installed, tmp_path: Path, lora: bool) -> None:
    """`orchard client bundle` as docs/your-task.md runs it writes the task's classification
    program; a device's step through it (the Python ExecuTorch trainer) updates the model
    as the task's torch trainer does on the same batch: its LoRA adapter, or with
    lora=false all of its parameters."""
    pytest.importorskip("executorch")
    from orchard.edge_runtime.bundle import read_bundle
    from orchard.edge_runtime.bundle_task import read_bundle_task
    from orchard.edge_runtime.et_program import load_training_program, read_manifest
    from orchard.edge_runtime.et_trainer import DeviceData, ExecuTorchTrainer
    from orchard.tasks import get_task
    from orchard.trainer import TrainConfig

    out = tmp_path / "b"
    res = orchard(installed, "client", "bundle", "--server", "greenhouse.example:7070", "--out", str(out),
                  "--task", "greenhouse", "--task-params", json.dumps({"lora": lora}), cwd=tmp_path)
    assert res.returncode == 0, res.stdout + res.stderr
    assert read_bundle_task(out).task == "greenhouse"  # what a client from it builds
    m = read_manifest(out)
    task = get_task("greenhouse", lora=lora)
    assert (m.kind, m.lora_variant, m.inputs[0].shape) == ("classification", "full" if lora else None, (8, 7))
    assert sorted(p.name for p in m.parameters) == sorted(task.trainable)

    rng = np.random.default_rng(5)
    arrays = {k: (v + 0.1 * rng.standard_normal(v.shape)).astype(np.float32) for k, v in task.initial_arrays(0).items()}
    torch_trainer = task.client_trainer(2, 6, 0)
    inner = getattr(torch_trainer, "inner", torch_trainer)  # a LoRA task's trainer wraps the torch one
    data = DeviceData(inner.train_data.x.numpy(), inner.train_data.y.numpy())
    program = load_training_program(out, adapter=read_bundle(out).adapter_arrays())
    cfg = TrainConfig(steps=3, batch_size=len(data), learning_rate=0.1, momentum=0.9)  # one batch: the same rows
    got = ExecuTorchTrainer(program, data).train(arrays, cfg)
    want = torch_trainer.train(arrays, cfg)
    assert max(float(np.abs(got.arrays[k] - want.arrays[k]).max()) for k in want.arrays) <= 1e-5
    assert max(float(np.abs(want.arrays[k] - arrays[k]).max()) for k in want.arrays) > 1e-3
    assert got.metrics["train_accuracy"] == pytest.approx(want.metrics["train_accuracy"])


UNEXPORTABLE = '''
import numpy as np
import torch
from torch import nn
from orchard.tasks import IID, LoRA, make_task

@torch.library.custom_op("greenlab::wobble", mutates_args=())
def wobble(x: torch.Tensor) -> torch.Tensor:
    return x * 2

@wobble.register_fake
def _(x):
    return torch.empty_like(x)

class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(4, 8), nn.Linear(8, 2)

    def forward(self, x):
        return self.fc2(wobble(torch.relu(self.fc1(x))))

def build():
    x = np.random.default_rng(0).normal(size=(50, 4)).astype(np.float32)
    return make_task(name="wobbly", model=Net, data=(x, (x[:, 0] > 0).astype(np.int64)), partitioner=IID(),
                     trainable=LoRA(("fc1", "fc2")))
'''


def test_a_model_that_does_not_export_is_refused_naming_the_operator(tmp_path: Path) -> None:
    (tmp_path / "wobbly.py").write_text(UNEXPORTABLE)
    res = orchard(dict(os.environ), "client", "bundle", "--server", "h:1", "--out", str(tmp_path / "b"),
                  "--task", "wobbly:build", cwd=tmp_path)
    assert res.returncode == 2, res.stdout + res.stderr
    text = " ".join((res.stdout + res.stderr).split())
    assert "operator greenlab.wobble has no ONNX translation" in text, text[-2000:]
    assert not (tmp_path / "b" / "client.json").exists()


def test_a_task_that_is_not_installed_says_where_it_looked(tmp_path: Path) -> None:
    from orchard.tasks import get_task

    with pytest.raises(OrchardError, match="available: .*digits"):
        get_task("greenhouse_not_installed")
