"""The vectorised training path: the same models and uploads as training each client
on its own (torch.func.vmap, the MLP step, slices), and refusing what it cannot reproduce."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from sim_cases import DIGITS, _run
from torch import nn

from orchard.client.update import train_seed
from orchard.compression import build_codec, decode_update
from orchard.config import CodecSpec
from orchard.messages import TaskAssignment
from orchard.simulation.clients import ClientJob, run_jobs
from orchard.simulation.vectorized import supports, train_many
from orchard.tasks import get_task
from orchard.tasks.torch_trainer import TensorData, TorchTrainer
from orchard.trainer import TrainConfig
from orchard.typing import schema_of
from orchard.updates import split

# ---------------------------------------------------------------------- vectorised path


def _trainers(n: int) -> tuple[list[TorchTrainer], dict[str, np.ndarray]]:
    task = get_task("digits", **DIGITS)
    return [task.client_trainer(i, 200, 0) for i in range(n)], task.initial_arrays(0)


@pytest.mark.parametrize("cfg", [
    TrainConfig(epochs=1, batch_size=10, learning_rate=0.1),
    TrainConfig(epochs=2, batch_size=8, learning_rate=0.05, weight_decay=1e-3, proximal_mu=0.1),
    TrainConfig(steps=3, batch_size=32, learning_rate=0.2),  # one batch holds all 20 examples
])
def test_vectorized_equals_per_client(cfg: TrainConfig) -> None:
    trainers, g = _trainers(24)
    cfgs = [dataclasses.replace(cfg, seed=train_seed(0, 1, i)) for i in range(24)]
    assert supports(trainers[0], cfg)
    fast = train_many(trainers, g, cfgs)
    slow_trainers, _ = _trainers(24)
    for t, c, f in zip(slow_trainers, cfgs, fast, strict=True):
        ref = t.train(g, c)
        assert f.num_steps == ref.num_steps and f.num_examples == ref.num_examples
        for k in g:
            np.testing.assert_allclose(f.arrays[k], ref.arrays[k], atol=1e-5, rtol=0)
        assert f.metrics["train_loss"] == pytest.approx(ref.metrics["train_loss"], abs=1e-5)
        assert f.metrics["train_accuracy"] == pytest.approx(ref.metrics["train_accuracy"])


def test_vmap_path_equals_per_client(monkeypatch: pytest.MonkeyPatch) -> None:
    # The digits MLP takes the written-out MLP step; with it turned off, the general vmap
    # step gives the per-client result too.
    import orchard.simulation.vectorized as vectorized

    trainers, g = _trainers(12)
    assert vectorized._mlp_plan(trainers[0].model, trainers[0].trainable) is not None
    monkeypatch.setattr(vectorized, "_mlp_plan", lambda model, names: None)
    cfg = TrainConfig(epochs=2, batch_size=8, learning_rate=0.05, weight_decay=1e-3, proximal_mu=0.1)
    cfgs = [dataclasses.replace(cfg, seed=train_seed(0, 1, i)) for i in range(12)]
    fast = train_many(trainers, g, cfgs)
    for t, c, f in zip(_trainers(12)[0], cfgs, fast, strict=True):
        ref = t.train(g, c)
        for k in g:
            np.testing.assert_allclose(f.arrays[k], ref.arrays[k], atol=1e-5, rtol=0)
        assert f.metrics["train_accuracy"] == pytest.approx(ref.metrics["train_accuracy"])


def _mlp_data(n: int, seed: int) -> TensorData:
    gen = torch.Generator().manual_seed(seed)
    return TensorData(torch.randn(n, 6, generator=gen), torch.randint(0, 3, (n,), generator=gen))


@pytest.mark.parametrize("build", [
    lambda: nn.Linear(6, 3),
    lambda: nn.Sequential(nn.Linear(6, 5, bias=False), nn.ReLU(), nn.Linear(5, 4), nn.ReLU(), nn.Linear(4, 3)),
    lambda: nn.Sequential(nn.Linear(6, 5), nn.ReLU(), nn.ReLU(), nn.Linear(5, 3, bias=False)),
])
def test_mlp_step_equals_per_client(build: object) -> None:
    import orchard.simulation.vectorized as vectorized

    def trainers() -> list[TorchTrainer]:
        return [TorchTrainer(build, _mlp_data(14, i), _mlp_data(4, 100 + i), seed=i)  # type: ignore[arg-type]
                for i in range(9)]

    ts = trainers()
    assert vectorized._mlp_plan(ts[0].model, ts[0].trainable) is not None
    g = {k: v.detach().numpy().copy() for k, v in ts[0].model.state_dict().items()}
    cfg = TrainConfig(epochs=2, batch_size=4, learning_rate=0.3, weight_decay=1e-2, proximal_mu=0.5)
    cfgs = [dataclasses.replace(cfg, seed=train_seed(3, 2, i)) for i in range(9)]
    fast = train_many(ts, g, cfgs)
    for t, c, f in zip(trainers(), cfgs, fast, strict=True):
        ref = t.train(g, c)
        assert f.num_steps == ref.num_steps == 8
        for k in g:
            np.testing.assert_allclose(f.arrays[k], ref.arrays[k], atol=1e-5, rtol=0)
        assert f.metrics["train_loss"] == pytest.approx(ref.metrics["train_loss"], abs=1e-5)
        assert f.metrics["train_accuracy"] == pytest.approx(ref.metrics["train_accuracy"])


def test_mlp_step_only_for_plain_mlps() -> None:
    from orchard.simulation.vectorized import _mlp_plan

    def plan(model: nn.Module, trainable: list[str] | None = None) -> object:
        return _mlp_plan(model, trainable or [n for n, _ in model.named_parameters()])

    assert plan(nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2))) == [
        ("linear", "0.weight", "0.bias"), ("relu", "", None), ("linear", "2.weight", "2.bias")]
    assert plan(nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))) is None  # another activation
    assert plan(nn.Sequential(nn.Linear(3, 4), nn.ReLU())) is None  # ends in an activation
    assert plan(nn.Sequential(nn.Flatten(), nn.Linear(3, 2))) is None
    assert plan(nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2)), ["2.weight", "2.bias"]) is None


def test_vectorized_slices_change_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    # On a CPU a group trains in slices (cache-sized); a client's result is the same
    # whatever slice it is trained in.
    import orchard.simulation.vectorized as vectorized

    cfg = TrainConfig(epochs=2, batch_size=4, learning_rate=0.1)
    trainers, g = _trainers(24)
    cfgs = [dataclasses.replace(cfg, seed=train_seed(0, 1, i)) for i in range(24)]
    whole = train_many(trainers, g, cfgs)
    monkeypatch.setattr(vectorized, "_CPU_CLIENTS", 5)
    sliced = train_many(trainers, g, cfgs)
    for a, b in zip(whole, sliced, strict=True):
        assert a.metrics == b.metrics
        for k in g:
            np.testing.assert_array_equal(a.arrays[k], b.arrays[k])


def test_cpu_slices_are_sized_by_activations(monkeypatch: pytest.MonkeyPatch) -> None:
    # A slice holds at most _CPU_SLICE_BYTES of forward activations: the digits MLP takes
    # the cap, the MNIST CNN (about 1.7 MiB a client at batch 10) far fewer; and a slice
    # cut by bytes changes no client's result either.
    import orchard.simulation.vectorized as vectorized

    digits = get_task("digits", **DIGITS).client_trainer(0, 100, 0)
    mnist = get_task("mnist", with_replacement=True, samples_per_client=20).client_trainer(0, 100, 0)
    cfg = TrainConfig(batch_size=10)
    assert vectorized.activation_bytes(mnist.model, mnist.train_data.x[0], 10) == 10 * 4 * (
        2 * 16 * 28 * 28 + 16 * 14 * 14 + 2 * 32 * 14 * 14 + 2 * 32 * 7 * 7 + 2 * 64 + 10)
    assert vectorized.cpu_slice(digits, cfg) == vectorized._CPU_CLIENTS
    assert 1 <= vectorized.cpu_slice(mnist, cfg) < 20
    trainers, g = _trainers(12)
    cfgs = [dataclasses.replace(TrainConfig(epochs=2, batch_size=4, learning_rate=0.1), seed=train_seed(0, 1, i))
            for i in range(12)]
    whole = train_many(trainers, g, cfgs)
    monkeypatch.setattr(vectorized, "_CPU_SLICE_BYTES", 3 * vectorized.activation_bytes(
        trainers[0].model, trainers[0].train_data.x[0], 4))
    assert vectorized.cpu_slice(trainers[0], cfgs[0]) == 3
    for a, b in zip(whole, train_many(trainers, g, cfgs), strict=True):
        assert a.metrics == b.metrics
        for k in g:
            np.testing.assert_array_equal(a.arrays[k], b.arrays[k])


def _assert_same_as_per_client(trainers: list[TorchTrainer], again: list[TorchTrainer], g: dict[str, np.ndarray],
                               cfgs: list[TrainConfig]) -> None:
    fast = train_many(trainers, g, cfgs)
    for t, c, f in zip(again, cfgs, fast, strict=True):
        ref = t.train(g, c)
        assert (f.num_steps, f.num_examples, f.weight) == (ref.num_steps, ref.num_examples, ref.weight)
        for k in g:
            np.testing.assert_allclose(f.arrays[k], ref.arrays[k], atol=2e-5, rtol=0)
        assert f.metrics["train_loss"] == pytest.approx(ref.metrics["train_loss"], abs=2e-5)
        assert f.metrics["train_accuracy"] == pytest.approx(ref.metrics["train_accuracy"])


@settings(max_examples=12, deadline=None)
@given(sizes=st.lists(st.integers(1, 23), min_size=2, max_size=9), batch=st.integers(1, 8),
       epochs=st.integers(1, 3), steps=st.one_of(st.none(), st.integers(0, 7)),
       wd=st.sampled_from([0.0, 1e-2]), mu=st.sampled_from([0.0, 0.5]), mlp=st.booleans())
def test_uneven_sizes_equal_per_client(sizes: list[int], batch: int, epochs: int, steps: int | None, wd: float,
                                       mu: float, mlp: bool) -> None:
    # Clients of different sizes train padded in one slice: each takes its own steps on
    # its own batches (short last batches, fewer steps than the largest), as on its own;
    # with the MLP step and with vmap's.
    import orchard.simulation.vectorized as vectorized

    def build() -> nn.Module:
        return nn.Sequential(nn.Linear(6, 5), nn.ReLU(), nn.Linear(5, 3))

    def trainers() -> list[TorchTrainer]:
        return [TorchTrainer(build, _mlp_data(n, i), _mlp_data(2, 50 + i), seed=i) for i, n in enumerate(sizes)]

    ts = trainers()
    g = {k: v.detach().numpy().copy() for k, v in ts[0].model.state_dict().items()}
    cfg = TrainConfig(epochs=epochs, steps=steps, batch_size=batch, learning_rate=0.3, weight_decay=wd,
                      proximal_mu=mu)
    cfgs = [dataclasses.replace(cfg, seed=train_seed(1, 2, i)) for i in range(len(sizes))]
    with pytest.MonkeyPatch.context() as mp:
        if not mlp:
            mp.setattr(vectorized, "_mlp_plan", lambda model, names: None)
        _assert_same_as_per_client(ts, trainers(), g, cfgs)


def test_uneven_digits_clients_equal_per_client(monkeypatch: pytest.MonkeyPatch) -> None:
    # The simulator's uneven workload (size_spread): sorted into slices of close sizes,
    # some slices of one size (unpadded), some padded.
    import orchard.simulation.vectorized as vectorized

    task = get_task("digits", with_replacement=True, samples_per_client=20, size_spread=1.0)
    monkeypatch.setattr(vectorized, "_CPU_CLIENTS", 7)
    cfg = TrainConfig(epochs=1, batch_size=10, learning_rate=0.1)
    cfgs = [dataclasses.replace(cfg, seed=train_seed(0, 1, i)) for i in range(40)]
    trainers = [task.client_trainer(i, 400, 0) for i in range(40)]
    assert len({len(t.train_data) for t in trainers}) > 10
    _assert_same_as_per_client(trainers, [task.client_trainer(i, 400, 0) for i in range(40)],
                               task.initial_arrays(0), cfgs)


def test_vectorized_uploads_equal_per_client_uploads() -> None:
    """Through build_upload and the codec: the decoded updates agree to float tolerance."""
    task = get_task("digits", **DIGITS)
    g = task.initial_arrays(0)
    cfg = _run(codec=CodecSpec(name="float32"))
    codec = build_codec(cfg.codec)
    schema = tuple(schema_of(g))
    t = TaskAssignment(run_id="r", round=3, attempt=0, task_id="t", model_hash="h", model_bytes=0,
                       config_json=cfg.model_dump_json(), schema=schema, deadline_unix=0.0, cohort_target=1,
                       shared_seed=7)
    jobs = [ClientJob(i, f"device-{i}", t) for i in range(0, 60, 3)]
    fast = run_jobs(task, 200, cfg, codec, g, jobs, vectorize=True)
    slow = run_jobs(task, 200, cfg, codec, g, jobs, vectorize=False)
    shapes = {s.name: s.shape for s in schema}
    for f, s in zip(fast, slow, strict=True):
        assert f.header is not None and s.header is not None
        assert f.header.weight == s.header.weight and f.header.num_steps == s.header.num_steps
        fd = decode_update(codec, dict(zip(shapes, split(f.payload, f.header.payload_sizes), strict=True)), shapes)
        sd = decode_update(codec, dict(zip(shapes, split(s.payload, s.header.payload_sizes), strict=True)), shapes)
        for k in shapes:
            np.testing.assert_allclose(fd[k], sd[k], atol=1e-5, rtol=0)


def test_vectorized_path_refuses_what_it_cannot_reproduce() -> None:
    trainers, _ = _trainers(1)
    assert not supports(trainers[0], TrainConfig(momentum=0.9))
    assert not supports(trainers[0], TrainConfig(optimizer="adam"))
    data = TensorData(torch.zeros(4, 3), torch.zeros(4, dtype=torch.int64))
    dropout = TorchTrainer(lambda: nn.Sequential(nn.Linear(3, 4), nn.Dropout(0.5), nn.Linear(4, 2)), data, data)
    assert not supports(dropout, TrainConfig())
    head_only = TorchTrainer(lambda: nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2)), data, data,
                             trainable=["1.weight", "1.bias"])
    assert not supports(head_only, TrainConfig())


