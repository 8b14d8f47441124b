"""Bundles and training programs of tasks over rows of features, and of tasks that train
their model's own parameters (``trainable="all"`` or a list of names): the ONNX model
takes the trained parameters as inputs and agrees with torch; a classification or
regression program's gradients and local training equal torch's; manifests written
before program kinds existed still read as next-token programs; and a model or loss a
program cannot hold is refused naming the operator (or the losses it can compute)."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

pytest.importorskip("executorch")

from orchard.edge_runtime.bundle import BundleError, read_bundle, run_inference  # noqa: E402
from orchard.edge_runtime.et_export import ProgramExportError, UnsupportedOperatorError  # noqa: E402
from orchard.edge_runtime.et_program import (  # noqa: E402
    MANIFEST_FILE,
    TrainingManifest,
    TrainingProgramError,
    load_training_program,
    read_manifest,
)
from orchard.edge_runtime.et_rows import export_rows_program, row_program_kind  # noqa: E402
from orchard.edge_runtime.et_trainer import (  # noqa: E402
    DeviceData,
    ExecuTorchTrainer,
    executorch_trainer_factory,
)
from orchard.edge_runtime.task_bundle import write_task_bundle  # noqa: E402
from orchard.tasks import IID, make_task  # noqa: E402
from orchard.tasks.core import SupervisedTask  # noqa: E402
from orchard.tasks.torch_trainer import load_arrays  # noqa: E402
from orchard.trainer import TrainConfig  # noqa: E402


class Net(nn.Module):
    def __init__(self, out: int = 3) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(5, 8), nn.Linear(8, out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.fc1(x)))


def _task(trainable: object = "all", loss: object = "cross_entropy") -> SupervisedTask:
    rng = np.random.default_rng(0)
    x = rng.normal(size=(120, 5)).astype(np.float32)
    if loss == "mse":
        y = np.stack([x[:, 0] - x[:, 1], x[:, 2]], axis=1).astype(np.float32)
        model, name = (lambda: Net(2)), "rows-regression"
    else:
        y = (x[:, 0] > 0).astype(np.int64) + (x[:, 1] > 0.5).astype(np.int64)
        model, name = Net, "rows-classes"
    return make_task(name=name, model=model, data=(x, y), partitioner=IID(), trainable=trainable,  # type: ignore[arg-type]
                     loss=loss)  # type: ignore[arg-type]


def _shifted(task: SupervisedTask, seed: int = 1) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {k: (v + 0.3 * rng.standard_normal(v.shape)).astype(np.float32) for k, v in task.initial_arrays(0).items()}


def test_a_plain_task_bundles_its_trained_parameters_as_onnx_inputs(tmp_path: Path) -> None:
    task = _task(trainable=["fc2.weight", "fc2.bias"])
    arrays = _shifted(task)
    b = write_task_bundle(tmp_path / "b", task=task, server_address="h:1", global_arrays=arrays,
                          training_program=False)
    assert sorted(b.adapter_arrays()) == sorted(task.trainable)
    x = task.test_data.x[:16].numpy()
    model = task.build_model().eval()
    load_arrays(model, arrays, task.trainable)
    with torch.no_grad():
        want = model(torch.from_numpy(x)).numpy()
        bare = task.build_model().eval()(torch.from_numpy(x)).numpy()
    got = run_inference(b.path, x)
    assert np.abs(got - want).max() <= 1e-5 and np.abs(bare - want).max() > 1e-2


def _trainer(path: Path, data: DeviceData, seed: int = 0) -> ExecuTorchTrainer:
    return ExecuTorchTrainer(load_training_program(path, adapter=read_bundle(path).adapter_arrays()), data, seed=seed)


def _torch_loss_grads(task: SupervisedTask, arrays: dict[str, np.ndarray], x: np.ndarray, y: np.ndarray,
                      loss: str) -> tuple[float, dict[str, np.ndarray]]:
    model = task.build_model()
    load_arrays(model, arrays, task.trainable)
    out = model(torch.from_numpy(x))
    value = F.cross_entropy(out, torch.from_numpy(y)) if loss == "cross_entropy" else F.mse_loss(out, torch.from_numpy(y))
    value.backward()
    params = dict(model.named_parameters())
    return float(value.detach()), {k: params[k].grad.numpy() for k in task.trainable}  # type: ignore[union-attr]


@pytest.mark.slow  # one ExecuTorch export per case (tens of seconds on a shared host)
@pytest.mark.parametrize(("trainable", "loss", "kind"), [("all", "cross_entropy", "classification"),
                                                         (["fc1.weight", "fc2.bias"], "mse", "regression")])
def test_a_plain_task_trains_through_its_program_as_torch_does(tmp_path: Path, trainable: object, loss: str,
                                                               kind: str) -> None:
    task = _task(trainable=trainable, loss=loss)
    write_task_bundle(tmp_path / "b", task=task, server_address="h:1", micro_batch=4)
    m = read_manifest(tmp_path / "b")
    assert (m.kind, m.lora_variant, [d.name for d in m.inputs]) == (kind, None, ["features", "labels", "row_weight"])
    assert sorted(p.name for p in m.parameters) == sorted(task.trainable)

    arrays = _shifted(task)
    x, y = task.train_data.x[:9].numpy(), task.train_data.y[:9].numpy()  # 9 rows: two micro-batches and padding
    got_loss, got = _trainer(tmp_path / "b", DeviceData(x, y)).gradients(arrays, x, y)
    want_loss, want = _torch_loss_grads(task, arrays, x, y, loss)
    assert got_loss == pytest.approx(want_loss, abs=1e-5)
    assert max(float(np.abs(got[k] - want[k]).max()) for k in want) <= 1e-5
    assert max(float(np.abs(want[k]).max()) for k in want) > 1e-3

    torch_trainer = task.client_trainer(1, 4, 0)
    train = torch_trainer.train_data  # type: ignore[attr-defined]
    data = DeviceData(train.x.numpy(), train.y.numpy())
    cfg = TrainConfig(steps=5, batch_size=len(data), learning_rate=0.1, momentum=0.9, proximal_mu=0.1)
    got_r = _trainer(tmp_path / "b", data).train(arrays, cfg)
    want_r = torch_trainer.train(arrays, cfg)
    assert max(float(np.abs(got_r.arrays[k] - want_r.arrays[k]).max()) for k in want) <= 1e-5
    assert max(float(np.abs(want_r.arrays[k] - arrays[k]).max()) for k in want) > 1e-2
    assert sorted(got_r.metrics) == sorted(want_r.metrics)  # no accuracy for regression, as torch's
    assert got_r.metrics["train_loss"] == pytest.approx(want_r.metrics["train_loss"], abs=1e-5)

    # What `orchard client start --runtime executorch --data rows.npz` builds from the bundle.
    np.savez(tmp_path / "rows.npz", x=data.x, y=data.y, test_x=x, test_y=y)
    factory = executorch_trainer_factory(tmp_path / "b", data_path=tmp_path / "rows.npz")
    device = factory(SimpleNamespace(task=task.name))
    again = device.train(arrays, cfg)
    assert all(np.array_equal(again.arrays[k], got_r.arrays[k]) for k in want)
    assert ("accuracy" in device.evaluate(arrays, cfg).metrics) == (kind == "classification")


class _Clamp(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):  # type: ignore[no-untyped-def, override]
        return x.clamp(min=0)

    @staticmethod
    def backward(ctx, g):  # type: ignore[no-untyped-def, override]
        return g  # a straight-through estimator: not the derivative of the forward


class _FunctionNet(Net):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(_Clamp.apply(self.fc1(x)))


class _FftNet(Net):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.fft.rfft(self.fc1(x)).abs().repeat(1, 2)[:, :8])


def _export(model: nn.Module, tmp: Path) -> None:
    export_rows_program(model, [n for n, _ in model.named_parameters()], tmp, task="t", kind="classification",
                        features=((5,), "float32"), labels=(), lora_variant=None, lora_rank=None, micro_batch=2)


def test_a_custom_autograd_function_is_refused_by_name(tmp_path: Path) -> None:
    with pytest.raises(UnsupportedOperatorError, match=r"operator _Clamp \(a custom torch.autograd.Function\)"):
        _export(_FunctionNet(), tmp_path / "p")
    assert not (tmp_path / "p" / MANIFEST_FILE).exists()


def test_an_fft_is_refused_naming_the_operator(tmp_path: Path) -> None:
    with pytest.raises(UnsupportedOperatorError, match=r"operator aten\.fft_rfft .*no complex dtype") as err:
        _export(_FftNet(), tmp_path / "p")
    assert err.value.operator == "aten.fft_rfft"


def test_a_bundle_of_a_model_whose_program_does_not_export_is_refused(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    x = rng.normal(size=(40, 5)).astype(np.float32)
    task = make_task(name="clamped", model=_FunctionNet, data=(x, (x[:, 0] > 0).astype(np.int64)), partitioner=IID())
    with pytest.raises(BundleError, match=r"task 'clamped': no ExecuTorch training program: operator _Clamp"):
        write_task_bundle(tmp_path / "b", task=task, server_address="h:1")
    assert not (tmp_path / "b" / "client.json").exists()


def test_a_loss_of_the_tasks_own_is_refused_naming_the_losses_a_program_computes() -> None:
    assert row_program_kind("t", "cross_entropy") == "classification" and row_program_kind("t", "mse") == "regression"
    with pytest.raises(ProgramExportError, match="'cross_entropy' or 'mse'.*--no-training-program"):
        row_program_kind("t", lambda out, y: out.sum())


def _manifest(**kw: object) -> dict:
    base = dict(program={"name": "train.pte", "sha256": "0" * 64}, task="t", lora_variant="ffa", lora_rank=4,
                micro_batch=2, seq_len=8, vocab_size=65, inputs=[], gradients_start=2, parameters_start=3,
                parameters=[], loss="l", executorch_version="1.5.1", base_sha256="0" * 64)
    return {"format_version": 1, **base, **kw}


def test_a_manifest_without_a_kind_is_a_next_token_program(tmp_path: Path) -> None:
    (tmp_path / MANIFEST_FILE).write_text(json.dumps(_manifest()))
    assert read_manifest(tmp_path).kind == "next_token"
    plain = TrainingManifest.model_validate(_manifest(kind="classification", lora_variant=None, lora_rank=None,
                                                      seq_len=None, vocab_size=None))
    assert plain.trains == "the model's own parameters"
    (tmp_path / MANIFEST_FILE).write_text(json.dumps(_manifest(seq_len=None)))
    with pytest.raises(TrainingProgramError, match="a next_token program declares seq_len and vocab_size"):
        read_manifest(tmp_path)
    (tmp_path / MANIFEST_FILE).write_text(json.dumps(_manifest(kind="segmentation")))
    with pytest.raises(TrainingProgramError, match="kind"):
        read_manifest(tmp_path)
