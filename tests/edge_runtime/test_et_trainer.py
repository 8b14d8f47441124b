"""The ExecuTorch training program of a LoRA task and the device trainer that runs it:
gradients equal torch autograd's, local training equals the torch trainer's (FFA and
full LoRA, FedProx, momentum), the governor paces and stops it, partial work is
reported, the device process never imports torch, and bad bundles are refused at load
with the file and what was expected."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("executorch")

from orchard.config import EligibilityConfig  # noqa: E402
from orchard.edge_runtime.bundle import BundleError, read_bundle  # noqa: E402
from orchard.edge_runtime.clock import VirtualClock  # noqa: E402
from orchard.edge_runtime.device import SimulatedDevice, SimulatedDeviceParams, ThermalParams  # noqa: E402
from orchard.edge_runtime.et_program import (  # noqa: E402
    MANIFEST_FILE,
    PROGRAM_FILE,
    TrainingProgramError,
    load_training_program,
)
from orchard.edge_runtime.et_trainer import (  # noqa: E402
    DeviceData,
    ExecuTorchTrainer,
    executorch_trainer_factory,
    load_device_data,
)
from orchard.edge_runtime.governed import governed_train  # noqa: E402
from orchard.edge_runtime.governor import Governor, StopReason  # noqa: E402
from orchard.edge_runtime.lora import set_arrays  # noqa: E402
from orchard.edge_runtime.policy import DevicePolicy, PacingConfig  # noqa: E402
from orchard.edge_runtime.task_bundle import write_task_bundle  # noqa: E402
from orchard.errors import ConfigError, UpdateSchemaError  # noqa: E402
from orchard.tasks import get_task  # noqa: E402
from orchard.tasks.core import SupervisedTask  # noqa: E402
from orchard.trainer import TrainConfig  # noqa: E402

# A small random base keeps each export to seconds; the Shakespeare base itself is
# measured by benchmarks/edge.py.
SMALL = dict(base="random", seq_len=16, n_layer=1, n_head=2, d_model=16, lora_rank=4, lora_alpha=8)


@dataclass
class Bundled:
    task: SupervisedTask
    path: Path


def _bundle(tmp: Path, variant: str, **extra: object) -> Bundled:
    task = get_task("shakespeare", **{**SMALL, "lora_variant": variant, **extra})
    assert isinstance(task, SupervisedTask)
    path = tmp / f"bundle-{variant}-{extra.get('lora_rank', SMALL['lora_rank'])}"
    write_task_bundle(path, task=task, server_address="h:1", micro_batch=4)
    return Bundled(task, path)


@pytest.fixture(scope="module")
def ffa(tmp_path_factory: pytest.TempPathFactory) -> Bundled:
    return _bundle(tmp_path_factory.mktemp("et"), "ffa")


@pytest.fixture(scope="module")
def full(tmp_path_factory: pytest.TempPathFactory) -> Bundled:
    return _bundle(tmp_path_factory.mktemp("et"), "full")


def _nonzero(task: SupervisedTask, seed: int = 1) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {k: (0.2 * rng.standard_normal(v.shape)).astype(np.float32) for k, v in task.initial_arrays(0).items()}


def _data(task: SupervisedTask, rows: int, seed: int = 0) -> DeviceData:
    idx = np.random.default_rng(seed).permutation(len(task.train_data))[:rows]
    return DeviceData(task.train_data.x.numpy()[idx], task.train_data.y.numpy()[idx])


def _torch_grads(task: SupervisedTask, arrays: dict[str, np.ndarray], d: DeviceData) -> tuple[float, dict]:
    model = task.build_model()
    set_arrays(model, arrays, task.trainable)
    logits = model(torch.from_numpy(d.x))
    loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), torch.from_numpy(d.y).reshape(-1))
    loss.backward()
    params = dict(model.named_parameters())
    return float(loss.detach()), {k: params[k].grad.numpy() for k in task.trainable}


def _program_trainer(b: Bundled, data: DeviceData, seed: int = 0) -> ExecuTorchTrainer:
    bundle = read_bundle(b.path)
    return ExecuTorchTrainer(load_training_program(b.path, adapter=bundle.adapter_arrays()), data, seed=seed)


@pytest.mark.parametrize("rows", [3, 4, 9])  # under, at and over the micro-batch (padding rows)
def test_gradients_match_torch_autograd(ffa: Bundled, rows: int) -> None:
    data = _data(ffa.task, rows)
    arrays = _nonzero(ffa.task)
    loss, grads = _program_trainer(ffa, data).gradients(arrays, data.x, data.y)
    want_loss, want = _torch_grads(ffa.task, arrays, data)
    assert set(grads) == set(ffa.task.trainable) and all(".lora_B." in k for k in grads)
    assert loss == pytest.approx(want_loss, abs=1e-5)
    assert max(float(np.abs(grads[k] - want[k]).max()) for k in want) <= 1e-5
    assert max(float(np.abs(want[k]).max()) for k in want) > 1e-3  # the comparison has teeth


def test_full_variant_trains_a_and_b(full: Bundled) -> None:
    data = _data(full.task, 5)
    arrays = _nonzero(full.task)
    _, grads = _program_trainer(full, data).gradients(arrays, data.x, data.y)
    _, want = _torch_grads(full.task, arrays, data)
    assert any(".lora_A." in k for k in grads) and any(".lora_B." in k for k in grads)
    assert max(float(np.abs(grads[k] - want[k]).max()) for k in want) <= 1e-5


@pytest.mark.parametrize("variant", ["ffa", "full"])
@pytest.mark.parametrize("extra", [{}, {"proximal_mu": 0.5, "momentum": 0.9, "weight_decay": 1e-3}])
def test_local_training_matches_the_torch_trainer(ffa: Bundled, full: Bundled, variant: str, extra: dict) -> None:
    b = ffa if variant == "ffa" else full
    torch_trainer = b.task.client_trainer(3, 40, 0)
    train = torch_trainer.inner.train_data  # type: ignore[attr-defined]
    data = DeviceData(train.x.numpy(), train.y.numpy())
    # One batch holds the client's data: both trainers then see the same batches.
    cfg = TrainConfig(steps=20, batch_size=len(data), learning_rate=0.1, seed=4, **extra)
    arrays = _nonzero(b.task)
    got = _program_trainer(b, data, seed=torch_trainer.inner.seed).train(arrays, cfg)  # type: ignore[attr-defined]
    want = torch_trainer.train(arrays, cfg)
    assert got.num_steps == want.num_steps == 20 and got.weight == want.weight == len(data)
    diff = max(float(np.abs(got.arrays[k] - want.arrays[k]).max()) for k in want.arrays)
    moved = max(float(np.abs(want.arrays[k] - arrays[k]).max()) for k in want.arrays)
    assert diff <= 1e-4 and moved > 1e-2
    assert got.metrics["train_loss"] == pytest.approx(want.metrics["train_loss"], abs=1e-4)


def test_batches_over_epochs_and_evaluation(ffa: Bundled) -> None:
    data = _data(ffa.task, 11, seed=2)
    test = _data(ffa.task, 6, seed=3)
    t = ExecuTorchTrainer(_program_trainer(ffa, data).program, data, test, seed=5)
    cfg = TrainConfig(epochs=2, batch_size=4, learning_rate=0.2)
    arrays = _nonzero(ffa.task)
    r = t.train(arrays, cfg)
    assert r.num_steps == 6 and r.num_examples == 11 and not r.stopped_early
    again = t.train(arrays, cfg)  # same seed, same batches, same result
    for k in r.arrays:
        np.testing.assert_array_equal(r.arrays[k], again.arrays[k])
    ev = t.evaluate(r.arrays, cfg)
    model = ffa.task.build_model()
    set_arrays(model, r.arrays, ffa.task.trainable)
    with torch.no_grad():
        logits = model(torch.from_numpy(test.x))
    want_loss = float(F.cross_entropy(logits.reshape(-1, logits.shape[-1]), torch.from_numpy(test.y).reshape(-1)))
    want_acc = float((logits.argmax(-1).numpy() == test.y).mean())
    assert ev.num_examples == 6
    assert ev.metrics["loss"] == pytest.approx(want_loss, abs=1e-5)
    assert ev.metrics["accuracy"] == pytest.approx(want_acc)
    with pytest.raises(ConfigError, match="SGD"):
        t.train(arrays, TrainConfig(optimizer="adam"))
    with pytest.raises(UpdateSchemaError, match="re-create the bundle"):
        t.train({k: v[:, :2] for k, v in arrays.items()}, cfg)


def test_governor_paces_and_stops_it(ffa: Bundled) -> None:
    data = _data(ffa.task, 8)
    cfg = TrainConfig(steps=30, batch_size=4, learning_rate=0.1)
    clock = VirtualClock()
    device = SimulatedDevice(
        SimulatedDeviceParams(temperature_c=40.0, plugged=True, seconds_per_unit=0.1,
                              thermal=ThermalParams(ambient_c=25.0, r_th_c_per_w=10.0, tau_s=5.0)),
        clock,
    )
    policy = DevicePolicy(eligibility=EligibilityConfig(max_temperature_c=45.0),
                          pacing=PacingConfig(max_cooldown_s=0.0))
    out = governed_train(_program_trainer(ffa, data), _nonzero(ffa.task), cfg, Governor(device, policy, clock),
                         load=device)
    r = out.result
    assert out.report.stop_reason is StopReason.THERMAL_CEILING
    assert 1 <= r.num_steps < 30 and r.stopped_early
    assert r.weight == pytest.approx(len(data) * r.num_steps / 30) and r.planned_weight == len(data)
    assert device.max_temperature_c <= 45.0 + 1.0


def test_bundle_holds_program_and_manifest(ffa: Bundled) -> None:
    b = read_bundle(ffa.path)
    assert b.config.training_program is not None and b.config.training_program.name == MANIFEST_FILE
    manifest = json.loads((ffa.path / MANIFEST_FILE).read_text())
    assert manifest["program"]["name"] == PROGRAM_FILE and manifest["task"] == "shakespeare"
    assert [i["name"] for i in manifest["inputs"]] == ["idx", "targets", "row_weight"]
    assert sorted(p["name"] for p in manifest["parameters"]) == sorted(ffa.task.trainable)
    prog = load_training_program(ffa.path)
    assert prog.planned_bytes > 0 and prog.micro_batch == 4


def test_the_program_cache_serves_the_same_inputs_only(ffa: Bundled, tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """The ffa bundle's export went into the session's $ORCHARD_PROGRAM_CACHE
    (tests/conftest.py) under its key; from a copy of that cache, only the same model,
    tensors and arguments are served, and anything else, or a damaged entry, is exported
    (here: torch.export refuses, so an export shows as ProgramExportError)."""
    import os

    from orchard.edge_runtime import et_export
    from orchard.edge_runtime.task_bundle import _lora_model

    m = json.loads((ffa.path / MANIFEST_FILE).read_text())
    args = {k: m[k] for k in ("task", "lora_variant", "lora_rank", "seq_len", "vocab_size", "micro_batch")}
    model = _lora_model(ffa.task)
    first = (ffa.path / PROGRAM_FILE).read_bytes()
    kept = [e for e in Path(os.environ[et_export.PROGRAM_CACHE_ENV]).iterdir()
            if (e / PROGRAM_FILE).is_file() and (e / PROGRAM_FILE).read_bytes() == first]
    assert len(kept) == 1  # kept by the fixture's real export
    entry = kept[0]
    cache = tmp_path / "cache"
    shutil.copytree(entry, cache / entry.name)
    monkeypatch.setenv(et_export.PROGRAM_CACHE_ENV, str(cache))

    def no_export(*a: object, **k: object) -> None:
        raise RuntimeError("exported")

    monkeypatch.setattr(torch.export, "export", no_export)

    def export(out: str, mdl: torch.nn.Module = model, **kw: object) -> bytes:
        et_export.export_training_program(mdl, ffa.task.trainable, tmp_path / out, **{**args, **kw})  # type: ignore[arg-type]
        return (tmp_path / out / PROGRAM_FILE).read_bytes()

    assert export("a") == first  # served from the cache
    assert json.loads((tmp_path / "a" / MANIFEST_FILE).read_text()) == m
    with pytest.raises(et_export.ProgramExportError, match="exported"):
        export("b", micro_batch=args["micro_batch"] + 1)  # another argument
    other = _lora_model(ffa.task)
    with torch.no_grad():
        next(p for n, p in other.named_parameters() if n not in ffa.task.trainable).add_(1e-3)  # another base
    with pytest.raises(et_export.ProgramExportError, match="exported"):
        export("c", other)
    (cache / entry.name / PROGRAM_FILE).write_bytes(b"damaged")
    with pytest.raises(et_export.ProgramExportError, match="exported"):
        export("d")  # a damaged entry is exported afresh
    shutil.copyfile(ffa.path / PROGRAM_FILE, cache / entry.name / PROGRAM_FILE)
    assert export("e") == first
    monkeypatch.delenv(et_export.PROGRAM_CACHE_ENV)
    with pytest.raises(et_export.ProgramExportError, match="exported"):
        export("f")  # no cache: always exported


# ------------------------------------------------------------------ bad bundles


def _copy(b: Bundled, tmp: Path) -> Path:
    dst = tmp / "copy"
    shutil.copytree(b.path, dst)
    return dst


def _edit_manifest(path: Path, **changes: object) -> None:
    m = json.loads((path / MANIFEST_FILE).read_text())
    m.update(changes)
    (path / MANIFEST_FILE).write_text(json.dumps(m))


def test_missing_program_is_refused(ffa: Bundled, tmp_path: Path) -> None:
    p = _copy(ffa, tmp_path)
    (p / PROGRAM_FILE).unlink()
    with pytest.raises(TrainingProgramError, match=rf"{PROGRAM_FILE} is missing"):
        load_training_program(p)
    (p / MANIFEST_FILE).unlink()
    with pytest.raises(TrainingProgramError, match=rf"{MANIFEST_FILE} is missing"):
        load_training_program(p)
    with pytest.raises(BundleError, match=rf"{MANIFEST_FILE} is named in client.json but missing"):
        read_bundle(p)


def test_wrong_manifest_is_refused(ffa: Bundled, tmp_path: Path) -> None:
    p = _copy(ffa, tmp_path)
    (p / MANIFEST_FILE).write_text("{not json")
    with pytest.raises(TrainingProgramError, match="is not valid JSON"):
        load_training_program(p)
    p = _copy(ffa, tmp_path / "2")
    _edit_manifest(p, gradients_start=1)
    with pytest.raises(TrainingProgramError, match=r"puts gradients at output 2 .* says 1"):
        load_training_program(p)
    p = _copy(ffa, tmp_path / "3")
    m = json.loads((p / MANIFEST_FILE).read_text())
    _edit_manifest(p, inputs=[{**m["inputs"][0], "shape": [8, 16]}, *m["inputs"][1:]])
    with pytest.raises(TrainingProgramError, match="takes inputs"):
        load_training_program(p)
    p = _copy(ffa, tmp_path / "4")
    _edit_manifest(p, format_version=7)
    with pytest.raises(TrainingProgramError, match="format_version 7"):
        load_training_program(p)
    p = _copy(ffa, tmp_path / "5")
    (p / PROGRAM_FILE).write_bytes((p / PROGRAM_FILE).read_bytes()[:1000])
    with pytest.raises(TrainingProgramError, match="sha256"):
        load_training_program(p)


def test_program_for_another_adapter_shape_is_refused(ffa: Bundled, tmp_path: Path) -> None:
    other = _bundle(tmp_path, "ffa", lora_rank=2)
    # The rank-2 program (with its own manifest) in a rank-4 bundle: the manifest's
    # tensors are not the bundle's adapter.
    p = _copy(ffa, tmp_path / "a")
    for f in (PROGRAM_FILE, MANIFEST_FILE):
        shutil.copy(other.path / f, p / f)
    with pytest.raises(TrainingProgramError, match=r"shape \[\d+, 2\], the bundle's adapter has \[\d+, 4\]"):
        load_training_program(p, adapter=read_bundle(p, verify=False).adapter_arrays())
    # The rank-2 program under the rank-4 manifest (digest updated): its outputs are
    # not what the manifest declares.
    p = _copy(ffa, tmp_path / "b")
    shutil.copy(other.path / PROGRAM_FILE, p / PROGRAM_FILE)
    m = json.loads((p / MANIFEST_FILE).read_text())
    import hashlib

    m["program"]["sha256"] = hashlib.sha256((p / PROGRAM_FILE).read_bytes()).hexdigest()
    (p / MANIFEST_FILE).write_text(json.dumps(m))
    with pytest.raises(TrainingProgramError, match="exported for another adapter shape"):
        load_training_program(p)


def test_factory_refuses_bad_bundles_and_other_tasks(ffa: Bundled, tmp_path: Path) -> None:
    p = _copy(ffa, tmp_path)
    (p / PROGRAM_FILE).unlink()
    with pytest.raises(TrainingProgramError, match=PROGRAM_FILE):
        executorch_trainer_factory(p, _data(ffa.task, 4))
    with pytest.raises(ConfigError, match="--data"):
        executorch_trainer_factory(ffa.path)
    make = executorch_trainer_factory(ffa.path, _data(ffa.task, 4))

    class Cfg:
        task = "digits"

    with pytest.raises(ConfigError, match="for 'shakespeare'"):
        make(Cfg())


def test_device_data_from_text_and_npz(ffa: Bundled, tmp_path: Path) -> None:
    from orchard.edge_runtime.bundle_task import read_tokenizer

    tok = read_tokenizer(ffa.path)
    (tmp_path / "mine.txt").write_text("ROMEO:\nBut soft, what light through yonder window breaks?\n" * 4)
    train, test = load_device_data(tmp_path / "mine.txt", seq_len=16, tokenizer=tok)
    assert train.x.shape[1] == 16 and len(train) >= 8 and len(test) >= 1
    np.testing.assert_array_equal(train.x[0, 1:], train.y[0, :-1])
    np.savez(tmp_path / "d.npz", x=train.x, y=train.y)
    again, none = load_device_data(tmp_path / "d.npz", seq_len=16)
    np.testing.assert_array_equal(again.x, train.x)
    assert len(none) == 0
    np.savez(tmp_path / "bad.npz", x=train.x[:, :8], y=train.y[:, :8])
    with pytest.raises(ConfigError, match=r"expected x of shape \(N, 16\) int64"):
        load_device_data(tmp_path / "bad.npz", seq_len=16)


def test_device_process_imports_no_torch(ffa: Bundled, tmp_path: Path) -> None:
    data = _data(ffa.task, 6)
    np.savez(tmp_path / "d.npz", x=data.x, y=data.y)
    arrays = _nonzero(ffa.task)
    np.savez(tmp_path / "a.npz", **{f"a{i}": arrays[k] for i, k in enumerate(ffa.task.trainable)})
    names = json.dumps(ffa.task.trainable)
    script = textwrap.dedent(
        f"""
        import sys, json
        sys.modules["torch"] = None  # any `import torch` now raises ImportError
        import numpy as np
        from orchard.edge_runtime.et_trainer import executorch_trainer_factory
        from orchard.trainer import TrainConfig

        class Cfg:
            task = "shakespeare"

        trainer = executorch_trainer_factory({str(ffa.path)!r}, data_path={str(tmp_path / "d.npz")!r})(Cfg())
        a = np.load({str(tmp_path / "a.npz")!r})
        arrays = {{k: a[f"a{{i}}"] for i, k in enumerate(json.loads({names!r}))}}
        r = trainer.train(arrays, TrainConfig(steps=3, batch_size=6, learning_rate=0.1))
        np.savez({str(tmp_path / "out.npz")!r}, **{{f"a{{i}}": r.arrays[k] for i, k in enumerate(json.loads({names!r}))}})
        loaded = sorted(m for m, mod in sys.modules.items() if m.split(".")[0] in ("torch", "peft", "executorch")
                        and mod is not None)
        print(json.dumps({{"steps": r.num_steps, "loaded": loaded}}))
        """
    )
    res = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    got = json.loads(res.stdout.strip().splitlines()[-1])
    assert got == {"steps": 3, "loaded": []}
    want = ffa.task.client_trainer(0, 1, 0)  # any torch trainer of the task; its data are replaced below
    from orchard.tasks.torch_trainer import TensorData

    want.inner.train_data = TensorData.from_numpy(data.x, data.y)  # type: ignore[attr-defined]
    ref = want.train(arrays, TrainConfig(steps=3, batch_size=6, learning_rate=0.1))
    out = np.load(tmp_path / "out.npz")
    for i, k in enumerate(ffa.task.trainable):
        assert float(np.abs(out[f"a{i}"] - ref.arrays[k]).max()) <= 1e-5


@pytest.mark.slow
def test_benchmark_script_runs_and_meets_its_bars(tmp_path: Path) -> None:
    """``benchmarks/edge.py --runtime executorch --quick`` on the shipped Shakespeare base."""
    script = Path(__file__).resolve().parents[2] / "benchmarks" / "edge.py"
    out = tmp_path / "et.json"
    res = subprocess.run([sys.executable, str(script), "--runtime", "executorch", "--quick", "--json", str(out)],
                         capture_output=True, text=True, timeout=900)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-3000:]
    got = json.loads(out.read_text())
    assert got["grad_max_abs_diff"] <= 1e-4 and got["adapter_max_abs_diff_after_steps"] <= 1e-3
    assert got["governor_thermal_overshoot_c"] <= 1.0 and got["governor_battery_floor_violations"] == 0
    assert got["device_torch_modules_loaded"] == [] and got["device_peak_rss_mb"] > 0
    assert got["program_bytes"] > 0 and got["et_step_ms"] > 0 and got["torch_step_ms"] > 0
