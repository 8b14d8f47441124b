"""A mixed federation over real gRPC: two clients train through the ExecuTorch training
program of a bundle (no torch autograd), two through the torch trainer, all four under
one aggregator below the root, as one cohort, for three rounds; the loss falls. A
device started with ``orchard client start --runtime executorch`` in its own process
(torch blocked there) takes part in a round the same way."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
from fed_harness import FAST, BackgroundRoot, Federation, start_run, wait_status

pytest.importorskip("executorch")

from orchard import wire  # noqa: E402
from orchard.client.runtime import ClientRuntime  # noqa: E402
from orchard.config import CohortConfig, RunConfig  # noqa: E402
from orchard.edge_runtime.et_trainer import DeviceData, executorch_trainer_factory  # noqa: E402
from orchard.edge_runtime.task_bundle import write_task_bundle  # noqa: E402
from orchard.link import FleetLink, LinkConfig  # noqa: E402
from orchard.ops import ControlClient  # noqa: E402
from orchard.server.app import start_aggregator, start_root  # noqa: E402
from orchard.tasks import get_task  # noqa: E402
from orchard.trainer import TrainConfig  # noqa: E402
from orchard.typing import Role  # noqa: E402

# A small random base with full LoRA keeps the export to seconds and still learns
# (character frequencies) within three rounds.
PARAMS = dict(base="random", seq_len=16, n_layer=1, n_head=2, d_model=16, lora_rank=4, lora_alpha=8,
              lora_variant="full")
NUM_PARTITIONS = 40
TRAIN = TrainConfig(steps=8, batch_size=16, learning_rate=0.5, optimizer="sgd")


@pytest.fixture(scope="module")
def task():
    return get_task("shakespeare", **PARAMS)


@pytest.fixture(scope="module")
def bundle(task, tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("mixed") / "bundle"
    write_task_bundle(path, task=task, server_address="unused:1", micro_batch=8)
    return path


def _device_data(task, k: int) -> tuple[DeviceData, DeviceData]:
    train, test = task.client_data(k, NUM_PARTITIONS, 0)
    return DeviceData(train.x.numpy(), train.y.numpy()), DeviceData(test.x.numpy(), test.y.numpy())


async def _mixed(tmp: Path, task, bundle: Path) -> tuple[dict, dict[str, np.ndarray]]:
    root = await start_root(tmp / "root", insecure=True, server_cfg=FAST, start_grace_s=0.5, seed=1)
    fed = Federation(root)
    try:
        agg = await start_aggregator(root.address, insecure=True, server_cfg=FAST, seed=1)
        fed.aggregators.append(agg)
        for k in range(4):
            link = FleetLink(LinkConfig(target=agg.address, role=Role.CLIENT, insecure=True, node_id=f"phone-{k}"))
            if k < 2:  # phone-class: the bundle's ExecuTorch program, this partition's data
                train, test = _device_data(task, k)
                factory = executorch_trainer_factory(bundle, train, test, seed=k)
            else:
                factory = (lambda p: lambda cfg: task.client_trainer(p, NUM_PARTITIONS, cfg.seed))(k)
            rt = ClientRuntime(link, factory, partition_id=k)
            fed.clients.append(rt)
            fed.client_tasks.append(asyncio.create_task(rt.run()))
        cfg = RunConfig(task="shakespeare", task_params=PARAMS, rounds=3, seed=1, train=TRAIN,
                        cohort=CohortConfig(target=4, over_selection=1.0, min_fraction=1.0, deadline_s=90.0))
        await start_run(root, cfg)
        st = await wait_status(root, lambda s: s.get("status") in ("completed", "failed"), 240)
        ctl = ControlClient(root.address, insecure=True)
        try:
            arrays = wire.blob_to_arrays(await asyncio.to_thread(ctl.pull_global))
        finally:
            ctl.close()
        reports = {c.link.cfg.node_id: c.reports for c in fed.clients}
        return {"status": st, "reports": reports}, arrays
    finally:
        await fed.stop()


def test_executorch_and_torch_clients_aggregate_as_one_cohort(tmp_path: Path, task, bundle: Path) -> None:
    out, final = asyncio.run(_mixed(tmp_path, task, bundle))
    st = out["status"]
    assert st["status"] == "completed" and st["completed_rounds"] == 3, st
    for r in st["rounds"]:
        assert r["participants"] == 4, r
    for node in ("phone-0", "phone-1", "phone-2", "phone-3"):
        done = [rep for rep in out["reports"][node] if rep.accepted]
        assert len(done) == 3 and all(rep.num_steps == TRAIN.steps for rep in done), (node, out["reports"][node])
    losses = [r["metrics"]["train_loss"] for r in st["rounds"]]
    assert losses[2] < losses[0], losses
    initial = task.initial_arrays(1)
    before, after = task.evaluate(initial), task.evaluate(final)
    assert after["loss"] < before["loss"] - 0.05, (before, after)


def test_cli_device_process_trains_a_round_without_torch(tmp_path: Path, task, bundle: Path) -> None:
    train, test = _device_data(task, 5)
    np.savez(tmp_path / "mine.npz", x=train.x, y=train.y, test_x=test.x, test_y=test.y)
    bg = BackgroundRoot(tmp_path / "root", cfg=FAST)
    try:
        cfg = RunConfig(task="shakespeare", task_params=PARAMS, rounds=1, seed=2, train=TRAIN,
                        cohort=CohortConfig(target=1, over_selection=1.0, min_fraction=1.0, deadline_s=90.0))
        bg.call(start_run(bg.root, cfg))
        script = textwrap.dedent(
            f"""
            import atexit, json, sys
            sys.modules["torch"] = None  # any `import torch` now raises ImportError

            def report():
                loaded = sorted(m for m, mod in sys.modules.items()
                                if m.split(".")[0] in ("torch", "peft", "executorch") and mod is not None)
                print("LOADED " + json.dumps(loaded), flush=True)

            atexit.register(report)
            from orchard.cli import main
            sys.argv = ["orchard", "client", "start", "--bundle", {str(bundle)!r}, "--server", {bg.root.address!r},
                        "--insecure", "--runtime", "executorch", "--data", {str(tmp_path / "mine.npz")!r},
                        "--max-tasks", "1", "--node-id", "phone-cli"]
            main()
            """
        )
        res = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=180)
        assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-4000:]
        loaded = json.loads(res.stdout.split("LOADED ", 1)[1].splitlines()[0])
        assert loaded == []
        st = bg.call(wait_status(bg.root, lambda s: s.get("status") in ("completed", "failed"), 60))
        assert st["status"] == "completed" and st["rounds"][0]["participants"] == 1, st
        assert st["rounds"][0]["metrics"]["train_loss"] > 0
    finally:
        bg.stop()


def test_cli_refuses_a_bundle_without_a_program(tmp_path: Path, bundle: Path) -> None:
    import shutil

    from typer.testing import CliRunner

    from orchard import cli

    copy = tmp_path / "b"
    shutil.copytree(bundle, copy)
    (copy / "train.pte").unlink()
    res = CliRunner().invoke(cli.app, ["client", "start", "--bundle", str(copy), "--runtime", "executorch",
                                       "--data", str(tmp_path / "none.npz"), "--insecure"])
    assert res.exit_code == 2, res.output
    said = " ".join(res.output.split())  # rich wraps long lines
    assert "train.pte is missing" in said and "re-create the bundle" in said
