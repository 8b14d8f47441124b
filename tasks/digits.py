"""``digits``: scikit-learn's 8x8 handwritten digits (1,797 images, 10 classes) and a
64-64-10 MLP.

The data has no writers, so clients are made by label skew (Dirichlet by default).
A stratified ``test_fraction`` of the data is held out once, with ``split_seed``, and
never partitioned into training data: central evaluation and the clients' local test
splits come from it. ``with_replacement=True`` lets any number of clients draw
``samples_per_client`` examples each (the simulator's 10,000-client benchmark), or,
with ``size_spread`` > 0, a lognormal number of examples around it.
"""

from __future__ import annotations

import gzip
from pathlib import Path

import numpy as np
from torch import nn

from orchard.tasks.core import SupervisedTask, seeded_model
from orchard.tasks.partition import stratified_split, task_label_partitioner
from orchard.tasks.registry import trains_with

DATA_DIR = Path(__file__).parent / "data" / "digits"
NUM_CLASSES = 10
NUM_FEATURES = 64


def load_digits() -> tuple[np.ndarray, np.ndarray]:
    """(x, y): x (1797, 64) float32 in [0, 1] (pixels / 16), y (1797,) int64."""
    with gzip.open(DATA_DIR / "digits.csv.gz", "rt") as f:
        raw = np.loadtxt(f, delimiter=",", dtype=np.int64)
    return (raw[:, :NUM_FEATURES] / 16.0).astype(np.float32), raw[:, NUM_FEATURES].astype(np.int64)


def mlp(hidden: int) -> nn.Module:
    return nn.Sequential(nn.Linear(NUM_FEATURES, hidden), nn.ReLU(), nn.Linear(hidden, NUM_CLASSES))


# Three momentum epochs at 0.2: what the digits MLP reaches ~90% with in a few rounds of a
# handful of clients (a live run or the demo). The simulator's configs set their own
# (plain SGD, the batched fast path).
@trains_with(epochs=3, learning_rate=0.2, momentum=0.9, batch_size=16)
def build(
    *,
    alpha: float = 0.5,
    partitioner: str = "dirichlet",
    with_replacement: bool = False,
    samples_per_client: int = 20,
    test_samples_per_client: int = 5,
    size_spread: float = 0.0,
    shards_per_client: int = 2,
    min_partition_size: int = 2,
    test_fraction: float = 0.2,
    split_seed: int = 0,
    hidden: int = 64,
) -> SupervisedTask:
    """Build the digits task.

    ``partitioner``: "dirichlet" (label shares per class ~ Dir(alpha)), "iid" or
    "shards"; ``with_replacement`` (Dirichlet only): each client draws
    ``samples_per_client`` training and ``test_samples_per_client`` test examples with
    replacement, so the population is unbounded; ``size_spread`` > 0 (with replacement
    only) makes training sizes uneven, lognormal with that sigma and mean about
    ``samples_per_client`` (``orchard.tasks.sizes``).
    """
    params = dict(locals())  # exactly the keyword arguments: the task's parameters
    x, y = load_digits()
    train_idx, test_idx = stratified_split(y, test_fraction, split_seed)
    return SupervisedTask.from_labelled(
        "digits", x[train_idx], y[train_idx], x[test_idx], y[test_idx], NUM_CLASSES,
        model=lambda seed: seeded_model(lambda: mlp(hidden), seed),
        partitioner=task_label_partitioner(y[train_idx], y[test_idx], NUM_CLASSES, params),
        params=params,
    )


__all__ = ["build", "load_digits", "mlp"]
