import numpy as np
import pytest

from orchard.errors import ConfigError, UpdateSchemaError
from orchard.tasks import get_task
from orchard.tasks.digits import load_digits
from orchard.trainer import TrainConfig


@pytest.fixture(scope="module")
def task():  # type: ignore[no-untyped-def]
    return get_task("digits")


def test_loader_reads_the_shipped_file() -> None:
    x, y = load_digits()
    assert x.shape == (1797, 64) and x.dtype == np.float32
    assert x.min() >= 0.0 and x.max() <= 1.0
    assert np.bincount(y).tolist() == [178, 182, 177, 183, 181, 182, 181, 179, 174, 180]


def test_held_out_split_is_20_percent_and_disjoint(task) -> None:  # type: ignore[no-untyped-def]
    assert len(task.train_data) + len(task.test_data) == 1797
    assert abs(len(task.test_data) - 0.2 * 1797) <= 10


def test_initial_arrays_are_the_mlp_and_seeded(task) -> None:  # type: ignore[no-untyped-def]
    a, b, c = task.initial_arrays(0), task.initial_arrays(0), task.initial_arrays(1)
    assert {k: v.shape for k, v in a.items()} == {
        "0.weight": (64, 64),
        "0.bias": (64,),
        "2.weight": (10, 64),
        "2.bias": (10,),
    }
    assert all(np.array_equal(a[k], b[k]) for k in a)
    assert not np.array_equal(a["0.weight"], c["0.weight"])


def test_initial_arrays_leave_the_global_rng_alone(task) -> None:  # type: ignore[no-untyped-def]
    import torch

    torch.manual_seed(5)
    expected = torch.rand(3)
    torch.manual_seed(5)
    task.initial_arrays(9)
    task.client_trainer(0, 3, seed=0).train(task.initial_arrays(0), TrainConfig(steps=2))
    assert torch.equal(torch.rand(3), expected)


def test_partition_reports_sizes_and_skew(task) -> None:  # type: ignore[no-untyped-def]
    p = task.partition(10, seed=0)
    assert sum(p.sizes) == len(task.train_data)
    assert p.label_skew.histograms.shape == (10, 10)
    assert p.label_skew.mean_tv_distance > 0.2  # alpha=0.5 is far from IID


def test_with_replacement_population_of_10k() -> None:
    task = get_task("digits", with_replacement=True, samples_per_client=20)
    p = task.partition(10_000, seed=0)
    assert p.sizes.tolist() == [20] * 10_000
    trainer = task.client_trainer(9_999, 10_000, seed=0)
    result = trainer.train(task.initial_arrays(0), TrainConfig(epochs=1, batch_size=20))
    assert result.num_examples == 20 and result.num_steps == 1


def test_size_spread_is_a_task_parameter() -> None:
    task = get_task("digits", with_replacement=True, samples_per_client=20, size_spread=1.0)
    sizes = task.partition(1000, seed=0).sizes
    assert len(set(sizes.tolist())) > 20 and task.params["size_spread"] == 1.0
    assert len(task.client_trainer(3, 1000, seed=0).train_data) == sizes[3]
    with pytest.raises(ConfigError, match="with_replacement=True"):
        get_task("digits", size_spread=1.0)  # disjoint partitions have their own sizes


def test_bad_partition_id_is_refused(task) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(ConfigError):
        task.client_trainer(10, 10, seed=0)


def test_centralised_training_learns(task) -> None:  # type: ignore[no-untyped-def]
    trainer = task.client_trainer(0, 1, seed=0)
    arrays = task.initial_arrays(0)
    before = task.evaluate(arrays)["accuracy"]
    result = trainer.train(
        arrays, TrainConfig(epochs=10, batch_size=32, learning_rate=0.1, momentum=0.9)
    )
    after = task.evaluate(result.arrays)
    assert before < 0.3 and after["accuracy"] > 0.9


def test_wrong_arrays_are_a_schema_error(task) -> None:  # type: ignore[no-untyped-def]
    arrays = task.initial_arrays(0)
    with pytest.raises(UpdateSchemaError):
        task.evaluate({k: v for k, v in arrays.items() if k != "2.bias"})
    arrays["2.bias"] = np.zeros(11, np.float32)
    with pytest.raises(UpdateSchemaError, match="2.bias"):
        task.client_trainer(0, 2, seed=0).train(arrays, TrainConfig())
