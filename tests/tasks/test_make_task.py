"""make_task: a user's model and data as a Task, every source, every partitioner, and the
errors that name the argument at fault."""

import numpy as np
import pytest
import torch
from torch import nn

from orchard.tasks import (
    IID,
    Arrays,
    ByColumn,
    Csv,
    Dirichlet,
    ImageFolder,
    LoRA,
    Npz,
    Shards,
    Task,
    TaskSpecError,
    Text,
    make_task,
)
from orchard.tasks.data import load_data as load
from orchard.trainer import TrainConfig

CFG = TrainConfig(epochs=3, batch_size=8, learning_rate=0.2)


def _data(n: int = 400, seed: int = 0) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, 6)).astype(np.float32)
    y = (x[:, 0] > 0).astype(np.int64) + (x[:, 1] > 0.5).astype(np.int64)
    site = rng.choice(["north", "south", "east", "west"], size=n)
    return x, y, site


def _mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 3))


def test_a_task_from_arrays_trains_and_evaluates() -> None:
    x, y, _ = _data()
    task = make_task(name="toy", model=_mlp, data=(x, y), partitioner=IID())
    assert isinstance(task, Task)
    start = task.initial_arrays(seed=0)
    before = task.evaluate(start)
    arrays = start
    for _ in range(3):
        arrays = task.pooled_trainer(0).train(arrays, CFG).arrays
    after = task.evaluate(arrays)
    assert after["accuracy"] > before["accuracy"] + 0.2 and after["loss"] < before["loss"]
    # the held-out fifth is stratified and never partitioned
    part = task.partition(8, seed=0)
    assert sum(len(i) for i in part.indices) == 320 and len(task.test_data) == 80


def test_every_partitioner_covers_the_training_pool() -> None:
    x, y, site = _data()
    for spec in (IID(), Dirichlet(alpha=0.3), Shards(per_client=2)):
        task = make_task(name="toy", model=_mlp, data=(x, y), partitioner=spec)
        part = task.partition(10, seed=1)
        assert np.array_equal(np.sort(np.concatenate(list(part.indices))), np.arange(320)), spec
    sampled = make_task(name="toy", model=_mlp, data=(x, y), partitioner=Dirichlet(samples_per_client=20))
    assert (sampled.partition(5000, seed=0).sizes == 20).all()


def test_natural_clients_from_a_column_keep_their_rows() -> None:
    x, y, site = _data()
    task = make_task(name="toy", model=_mlp, data=Arrays(x, y, {"site": site}), partitioner=ByColumn("site"))
    part = task.partition(4, seed=0)
    assert part.scheme == "natural(site)"
    assert task.info["clients"] == ["east", "north", "south", "west"]
    # every client's training rows come from one site: its rows' features match that site's
    for k, name in enumerate(task.info["clients"]):
        assert len(part.indices[k]) == round((site == name).sum() * 0.8)
    with pytest.raises(Exception, match="4 natural clients"):
        task.partition(5, seed=0)
    assert task.partition(2, seed=0).num_partitions == 2


def test_files_load_as_the_same_rows(tmp_path) -> None:
    x, y, site = _data(60)
    header = ",".join([f"f{i}" for i in range(6)] + ["site", "label"])
    rows = [",".join([*(f"{v:.6f}" for v in x[i]), site[i], ["low", "mid", "top"][y[i]]]) for i in range(60)]
    (tmp_path / "d.csv").write_text(header + "\n" + "\n".join(rows) + "\n")
    got = load(Csv(tmp_path / "d.csv", label="label", columns=["site"]))
    assert got.x.shape == (60, 6) and np.allclose(got.x, x, atol=1e-6)
    assert got.classes == ("low", "mid", "top") and np.array_equal(got.y, y)
    assert np.array_equal(got.columns["site"], site)

    np.savez(tmp_path / "d.npz", x=x, y=y, site=site)
    got = load(Npz(tmp_path / "d.npz", columns=["site"]))
    assert np.array_equal(got.x, x) and np.array_equal(got.y, y)

    (tmp_path / "t.txt").write_text("to be or not to be, that is the question\n" * 5)
    got = load(Text(tmp_path / "t.txt", seq_len=10))
    assert got.x.shape[1] == 10 and np.array_equal(got.x[0, 1:], got.y[0, :-1])

    from PIL import Image

    for c in ("cat", "dog"):
        (tmp_path / "img" / c).mkdir(parents=True)
        for i in range(3):
            Image.fromarray(np.full((10, 12), 40 * i, np.uint8)).save(tmp_path / "img" / c / f"{i}.png")
    got = load(ImageFolder(tmp_path / "img", size=(8, 8)))
    assert got.x.shape == (6, 1, 8, 8) and got.classes == ("cat", "dog") and list(got.y) == [0, 0, 0, 1, 1, 1]

    class Pairs(torch.utils.data.Dataset):
        def __len__(self) -> int:
            return 5

        def __getitem__(self, i: int):
            return torch.full((3,), float(i)), i % 2

    got = load(Pairs())
    assert got.x.shape == (5, 3) and list(got.y) == [0, 1, 0, 1, 0]


def test_a_csv_task_with_natural_clients_runs(tmp_path) -> None:
    x, y, site = _data(200)
    header = ",".join([f"f{i}" for i in range(6)] + ["site", "label"])
    rows = [",".join([*(f"{v:.6f}" for v in x[i]), site[i], str(y[i])]) for i in range(200)]
    (tmp_path / "d.csv").write_text(header + "\n" + "\n".join(rows) + "\n")
    task = make_task(name="csv", model=_mlp, data=Csv(tmp_path / "d.csv", label="label", columns=["site"]),
                     partitioner=ByColumn("site"))
    result = task.client_trainer(0, 4, seed=0).train(task.initial_arrays(0), CFG)
    assert result.num_examples == len(task.partition(4, 0).indices[0])


def test_lora_trains_only_the_adapter_of_named_modules() -> None:
    x, y, _ = _data()
    task = make_task(name="toy", model=_mlp, data=(x, y), trainable=LoRA(target_modules=("0",), rank=2))
    start = task.initial_arrays(0)
    assert list(start) == ["base_model.model.0.lora_B.default.weight"]
    result = task.client_trainer(0, 4, seed=0).train(start, CFG)
    assert not np.allclose(result.arrays["base_model.model.0.lora_B.default.weight"], 0)


def test_a_custom_loss_and_metrics_are_used() -> None:
    x, _, _ = _data()
    target = (x[:, :1] * 3.0 - 1.0).astype(np.float32)
    task = make_task(name="reg", model=lambda: nn.Linear(6, 1), data=(x, target), loss="mse",
                     metrics={"mae": lambda out, y: float((out - y).abs().mean())})
    start = task.initial_arrays(0)
    arrays = start
    for _ in range(5):
        result = task.pooled_trainer(0).train(arrays, CFG)
        arrays = result.arrays
    assert "train_accuracy" not in result.metrics
    before, after = task.evaluate(start), task.evaluate(arrays)
    assert set(after) == {"loss", "mae"} and after["mae"] < 0.2 < before["mae"]


@pytest.mark.parametrize(
    ("change", "says"),
    [
        ({"model": nn.Linear(6, 3)}, "model: expected a function of no arguments"),
        ({"model": lambda: "not a module"}, "model: the factory returned a str"),
        ({"model": lambda: nn.Linear(5, 3)}, "model: a forward pass and the loss on two rows"),
        ({"data": "rows.csv"}, "data: expected Arrays, Csv"),
        ({"partitioner": "dirichlet"}, "partitioner: expected IID()"),
        ({"partitioner": ByColumn("hospital")}, "ByColumn('hospital') needs a per-row column"),
        ({"loss": "hinge"}, "loss: expected 'cross_entropy', 'mse'"),
        ({"trainable": LoRA(("fc9",))}, "trainable: LoRA target modules ['fc9'] name no module"),
        ({"trainable": ["0.weight", "head.bias"]}, "trainable: ['head.bias']"),
        ({"test": 1.5}, "test: a held-out fraction must be in (0, 1)"),
    ],
)
def test_what_is_wrong_is_named(change, says) -> None:
    x, y, _ = _data()
    kwargs = {"name": "toy", "model": _mlp, "data": (x, y), **change}
    if "trainable" in change and isinstance(change["trainable"], list):
        kwargs["model"] = lambda: nn.Sequential(nn.Linear(6, 3))
    with pytest.raises(TaskSpecError) as err:
        make_task(**kwargs)
    assert says in str(err.value)


def test_dirichlet_on_regression_targets_says_what_would_work() -> None:
    x, _, _ = _data()
    with pytest.raises(Exception, match="use IID"):
        make_task(name="reg", model=lambda: nn.Linear(6, 1), data=(x, x[:, :1]), loss="mse", partitioner=Dirichlet())
