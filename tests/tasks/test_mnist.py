import numpy as np
import pytest

from orchard.errors import ConfigError
from orchard.tasks import get_task
from orchard.tasks.mnist import load_mnist
from orchard.trainer import TrainConfig


@pytest.fixture(scope="module")
def task():  # type: ignore[no-untyped-def]
    return get_task("mnist")


def test_loader_reads_the_shipped_idx_files() -> None:
    x_train, y_train, x_test, y_test = load_mnist()
    assert x_train.shape == (10_000, 1, 28, 28) and x_test.shape == (10_000, 1, 28, 28)
    assert (
        x_train.dtype == np.float32 and float(x_train.min()) >= 0.0 and float(x_train.max()) <= 1.0
    )
    assert np.bincount(y_test).tolist() == [980, 1135, 1032, 1010, 982, 892, 958, 1028, 974, 1009]
    assert np.bincount(y_train).tolist() == [1001, 1127, 991, 1032, 980, 863, 1014, 1070, 944, 978]


def test_dirichlet_and_shard_partitions(task) -> None:  # type: ignore[no-untyped-def]
    p = task.partition(100, seed=0)
    assert sum(p.sizes) == 10_000 and min(p.sizes) >= 10
    assert p.label_skew.mean_tv_distance > 0.3
    shards = get_task("mnist", partitioner="shards").partition(100, seed=0)
    assert shards.sizes.tolist() == [100] * 100
    assert shards.label_skew.mean_classes_per_client <= 2.5  # a shard may straddle two classes
    again = get_task("mnist", partitioner="shards").partition(100, seed=0)
    assert all(np.array_equal(a, b) for a, b in zip(shards.indices, again.indices, strict=True))


def test_unknown_partitioner_is_refused() -> None:
    with pytest.raises(ConfigError, match="partitioner"):
        get_task("mnist", partitioner="by-writer")


def test_cnn_trains_on_a_client(task) -> None:  # type: ignore[no-untyped-def]
    init = task.initial_arrays(0)
    trainer = task.client_trainer(0, 20, seed=0)
    before = trainer.evaluate(init, TrainConfig()).metrics["accuracy"]
    config = TrainConfig(steps=30, batch_size=32, learning_rate=3e-3, optimizer="adam")
    result = trainer.train(init, config)
    assert result.num_steps == 30 and result.num_examples == len(trainer.train_data)
    assert list(result.arrays) == list(init)
    after = trainer.evaluate(result.arrays, TrainConfig()).metrics["accuracy"]
    assert after > before + 0.3, (before, after)
