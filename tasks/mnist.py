"""``mnist``: 10,000 MNIST training images and the official 10,000 test images, a small
CNN.

Only the first 10,000 training images are shipped (see ``data/mnist/SOURCES.md``);
they pair with the first 10,000 training labels. Clients are made by label skew:
Dirichlet (default), McMahan et al.'s shards, IID, or sampling with replacement.
"""

from __future__ import annotations

import gzip
from pathlib import Path

import numpy as np
from torch import nn

from orchard.errors import ConfigError
from orchard.tasks.core import SupervisedTask, seeded_model
from orchard.tasks.partition import task_label_partitioner

DATA_DIR = Path(__file__).parent / "data" / "mnist"
NUM_CLASSES = 10
NUM_TRAIN = 10_000


def read_idx(path: Path) -> np.ndarray:
    """An IDX file (big-endian header ``0 0 dtype ndim``, ``ndim`` uint32 dims, uint8 data)."""
    raw = gzip.decompress(path.read_bytes())
    if raw[0] != 0 or raw[1] != 0 or raw[2] != 0x08:
        raise ConfigError(f"{path.name} is not a uint8 IDX file (magic {raw[:4].hex()})")
    ndim = raw[3]
    dims = [int.from_bytes(raw[4 + 4 * i : 8 + 4 * i], "big") for i in range(ndim)]
    return np.frombuffer(raw, np.uint8, offset=4 + 4 * ndim).reshape(dims)


def load_mnist() -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(x_train, y_train, x_test, y_test): x float32 (N, 1, 28, 28) in [0, 1], y int64."""
    x_train = read_idx(DATA_DIR / "train-images-idx3-ubyte.first10000.gz")
    y_train = read_idx(DATA_DIR / "train-labels-idx1-ubyte.gz")[:NUM_TRAIN]
    x_test = read_idx(DATA_DIR / "t10k-images-idx3-ubyte.gz")
    y_test = read_idx(DATA_DIR / "t10k-labels-idx1-ubyte.gz")

    def images(a: np.ndarray) -> np.ndarray:
        return (a.astype(np.float32) / 255.0)[:, None, :, :]

    return images(x_train), y_train.astype(np.int64), images(x_test), y_test.astype(np.int64)


def cnn(channels: int = 16, hidden: int = 64) -> nn.Module:
    """conv5-pool-conv5-pool-fc-fc: 28x28 -> 14x14 -> 7x7 -> ``hidden`` -> 10."""
    return nn.Sequential(
        nn.Conv2d(1, channels, 5, padding=2),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Conv2d(channels, 2 * channels, 5, padding=2),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Flatten(),
        nn.Linear(2 * channels * 7 * 7, hidden),
        nn.ReLU(),
        nn.Linear(hidden, NUM_CLASSES),
    )


def build(
    *,
    alpha: float = 0.5,
    partitioner: str = "dirichlet",
    shards_per_client: int = 2,
    with_replacement: bool = False,
    samples_per_client: int = 50,
    test_samples_per_client: int = 50,
    size_spread: float = 0.0,
    min_partition_size: int = 10,
    channels: int = 16,
    hidden: int = 64,
) -> SupervisedTask:
    """Build the MNIST task. ``partitioner``: "dirichlet" (per-class shares ~ Dir(alpha)),
    "shards" (``shards_per_client`` label-sorted shards each) or "iid"; ``size_spread`` with
    ``with_replacement``: uneven training sizes (as for digits)."""
    params = dict(locals())  # exactly the keyword arguments: the task's parameters
    x_train, y_train, x_test, y_test = load_mnist()
    return SupervisedTask.from_labelled(
        "mnist", x_train, y_train, x_test, y_test, NUM_CLASSES,
        model=lambda seed: seeded_model(lambda: cnn(channels, hidden), seed),
        partitioner=task_label_partitioner(y_train, y_test, NUM_CLASSES, params),
        params=params,
    )
