import numpy as np
import pytest
import torch

from orchard.errors import ConfigError
from orchard.tasks import get_task
from orchard.tasks.torch_trainer import TensorData, TensorRows, TorchTrainer, stack_rows
from orchard.trainer import TrainConfig


@pytest.fixture(scope="module")
def task():  # type: ignore[no-untyped-def]
    return get_task("digits")


def _same(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> bool:
    return list(a) == list(b) and all(np.array_equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("optimizer", ["sgd", "adam", "adamw"])
def test_training_is_deterministic_under_a_seed(task, optimizer: str) -> None:  # type: ignore[no-untyped-def]
    cfg = TrainConfig(
        epochs=2,
        batch_size=8,
        learning_rate=0.01,
        optimizer=optimizer,
        momentum=0.9 if optimizer == "sgd" else 0.0,
        seed=3,
    )
    init = task.initial_arrays(0)
    r1 = task.client_trainer(1, 5, seed=0).train(init, cfg)
    r2 = task.client_trainer(1, 5, seed=0).train(init, cfg)
    assert _same(r1.arrays, r2.arrays)
    assert r1.metrics == r2.metrics
    r3 = task.client_trainer(1, 5, seed=0).train(init, TrainConfig(**{**cfg.__dict__, "seed": 4}))
    assert not _same(r1.arrays, r3.arrays)  # the round seed changes the batch order


def test_reusing_a_trainer_across_rounds_matches_a_fresh_one(task) -> None:  # type: ignore[no-untyped-def]
    cfg = TrainConfig(epochs=1, batch_size=16)
    trainer = task.client_trainer(2, 5, seed=0)
    trainer.train(task.initial_arrays(7), cfg)  # leaves other values in the module
    init = task.initial_arrays(0)
    assert _same(
        trainer.train(init, cfg).arrays, task.client_trainer(2, 5, seed=0).train(init, cfg).arrays
    )


def test_steps_override_epochs_and_are_reported(task) -> None:  # type: ignore[no-untyped-def]
    trainer = task.client_trainer(0, 5, seed=0)
    n = len(trainer.train_data)
    r = trainer.train(task.initial_arrays(0), TrainConfig(epochs=50, steps=7, batch_size=4))
    assert r.num_steps == 7 and r.num_examples == n and r.weight == float(n)
    r = trainer.train(task.initial_arrays(0), TrainConfig(epochs=2, batch_size=10))
    assert r.num_steps == 2 * -(-n // 10)
    assert 0.0 <= r.metrics["train_accuracy"] <= 1.0 and r.metrics["train_loss"] > 0


def test_input_arrays_are_not_mutated(task) -> None:  # type: ignore[no-untyped-def]
    init = task.initial_arrays(0)
    copy = {k: v.copy() for k, v in init.items()}
    task.client_trainer(0, 5, seed=0).train(init, TrainConfig(epochs=1))
    assert _same(init, copy)


def test_fedprox_keeps_the_update_closer_to_the_global_model(task) -> None:  # type: ignore[no-untyped-def]
    init = task.initial_arrays(0)

    def drift(mu: float) -> float:
        r = task.client_trainer(0, 5, seed=0).train(
            init, TrainConfig(epochs=5, learning_rate=0.1, proximal_mu=mu)
        )
        return sum(float(np.sum((r.arrays[k] - init[k]) ** 2)) for k in init)

    assert drift(1.0) < 0.8 * drift(0.0)


def test_partial_training_only_changes_named_tensors() -> None:
    torch.manual_seed(0)
    data = TensorData(torch.randn(30, 4), torch.randint(0, 3, (30,)))

    def factory() -> torch.nn.Module:
        g = torch.Generator().manual_seed(0)
        m = torch.nn.Sequential(torch.nn.Linear(4, 5), torch.nn.Linear(5, 3))
        with torch.no_grad():
            for p in m.parameters():
                p.copy_(torch.randn(p.shape, generator=g))
        return m

    trainer = TorchTrainer(factory, data, data, trainable=["1.weight", "1.bias"])
    head = {
        k: v.detach().numpy().copy()
        for k, v in factory().state_dict().items()
        if k.startswith("1.")
    }
    result = trainer.train(head, TrainConfig(epochs=3, learning_rate=0.5))
    assert list(result.arrays) == ["1.weight", "1.bias"]
    assert torch.equal(trainer.model[0].weight, factory()[0].weight)  # frozen layer untouched
    assert not np.array_equal(result.arrays["1.weight"], head["1.weight"])


def test_unknown_optimizer_is_a_config_error(task) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(ConfigError, match="optimizer"):
        task.client_trainer(0, 5, seed=0).train(
            task.initial_arrays(0), TrainConfig(optimizer="lbfgs")
        )


def test_evaluate_reports_local_test_split(task) -> None:  # type: ignore[no-untyped-def]
    trainer = task.client_trainer(0, 5, seed=0)
    res = trainer.evaluate(task.initial_arrays(0), TrainConfig())
    assert res.num_examples == len(trainer.test_data) > 0
    assert set(res.metrics) == {"accuracy", "loss"}


def test_a_clients_trainer_holds_its_own_train_and_test_split(task) -> None:  # type: ignore[no-untyped-def]
    # The test split is gathered lazily (on first use), and is the client's own.
    for pid in (0, 3, 4):
        trainer = task.client_trainer(pid, 5, seed=1)
        train, test = task.client_data(pid, 5, seed=1)
        assert torch.equal(trainer.train_data.x, train.x) and torch.equal(trainer.train_data.y, train.y)
        assert torch.equal(trainer.test_data.x, test.x) and torch.equal(trainer.test_data.y, test.y)
    with pytest.raises(ConfigError, match="partition_id"):
        task.client_trainer(5, 5, seed=1)


def test_rows_of_a_pool_read_and_stack_as_their_gathered_copies() -> None:
    rng = np.random.default_rng(4)
    pool = TensorData.from_numpy(rng.random((50, 3, 2), dtype=np.float32), rng.integers(0, 9, 50))
    idx = [rng.integers(0, 50, 6) for _ in range(5)]
    rows = [TensorRows(pool, i) for i in idx]
    eager = [pool.subset(i) for i in idx]
    assert len(rows[0]) == 6 and rows[0]._data is None  # nothing gathered yet
    _ = rows[2].x  # one of them gathered on its own first: the same rows either way
    for got in (stack_rows(rows), stack_rows(eager), stack_rows([rows[0], *eager[1:]])):
        assert torch.equal(got[0], torch.stack([d.x for d in eager]))
        assert torch.equal(got[1], torch.stack([d.y for d in eager]))
    assert torch.equal(rows[1].subset(np.array([5, 0])).x, eager[1].x[[5, 0]])
    other = TensorData.from_numpy(pool.x.numpy() + 1, pool.y.numpy())
    mixed = stack_rows([rows[0], TensorRows(other, idx[1])])  # two pools: each read from its own
    assert torch.equal(mixed[0][1], other.x[torch.from_numpy(idx[1])])
