"""How a user's dataset is cut into clients: typed partitioner specs for
:func:`orchard.tasks.make_task`.

Each spec is checked when it is made and bound to a dataset by :func:`bind`, which
returns the ``(num_partitions, seed) -> Partition`` every task holds; the schemes are
those of :mod:`orchard.tasks.partition`, which Orchard's own tasks use.

- :class:`IID`: uniformly random, (nearly) equal clients.
- :class:`Dirichlet`: per-class client shares ~ Dir(alpha); with
  ``samples_per_client`` each client instead draws that many examples with
  replacement under its own Dir(alpha p) class mix, so any number of clients works.
- :class:`Shards`: McMahan et al.'s label-sorted shards, ``per_client`` each.
- :class:`ByColumn`: the natural clients, one per distinct value of a per-row column
  (a hospital, a user); fewer partitions group them, seeded.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from orchard.errors import ConfigError
from orchard.tasks.partition import (
    Partition,
    dirichlet_partition,
    group_by_owner,
    iid_partition,
    label_skew,
    sample_with_replacement,
    shard_partition,
)


@dataclass(frozen=True)
class IID:
    """Uniformly random, (nearly) equal-sized clients."""


@dataclass(frozen=True)
class Dirichlet:
    """Label skew: per class, client shares ~ Dir(alpha) (small alpha: few classes a
    client). ``samples_per_client``: draw that many with replacement per client instead
    (and ``test_samples_per_client`` local test examples), for any population."""

    alpha: float = 0.5
    min_size: int = 2
    samples_per_client: int | None = None
    test_samples_per_client: int = 5

    def __post_init__(self) -> None:
        problems = []
        if not self.alpha > 0:
            problems.append(f"Dirichlet.alpha must be > 0, got {self.alpha}")
        if self.min_size < 1:
            problems.append(f"Dirichlet.min_size must be >= 1, got {self.min_size}")
        if self.samples_per_client is not None and self.samples_per_client < 1:
            problems.append(f"Dirichlet.samples_per_client must be >= 1 or None, got {self.samples_per_client}")
        if self.test_samples_per_client < 0:
            problems.append(f"Dirichlet.test_samples_per_client must be >= 0, got {self.test_samples_per_client}")
        if problems:
            raise ConfigError(problems)


@dataclass(frozen=True)
class Shards:
    """``per_client`` label-sorted shards per client (McMahan et al., 2017)."""

    per_client: int = 2

    def __post_init__(self) -> None:
        if self.per_client < 1:
            raise ConfigError(f"Shards.per_client must be >= 1, got {self.per_client}")


@dataclass(frozen=True)
class ByColumn:
    """Natural clients: one per distinct value of per-row column ``column``."""

    column: str


PartitionerSpec = IID | Dirichlet | Shards | ByColumn
PARTITIONERS = "IID(), Dirichlet(alpha=...), Shards(per_client=...) or ByColumn(column=...)"

Bound = Callable[[int, int], Partition]


def _class_labels(y: np.ndarray, scheme: str) -> np.ndarray:
    if y.ndim != 1 or not np.issubdtype(y.dtype, np.integer):
        raise ConfigError(
            f"partitioner {scheme} splits by class label, and this task's targets are "
            f"{y.dtype} of shape {y.shape[1:] or '()'} per example, not one integer class; use IID() or ByColumn(...)"
        )
    return y


def _group(owner_ids: np.ndarray, num_natural: int, num_partitions: int, seed: int, column: str) -> np.ndarray:
    if not 1 <= num_partitions <= num_natural:
        raise ConfigError(
            f"ByColumn({column!r}) has {num_natural} natural clients (distinct values); num_partitions must be "
            f"in [1, {num_natural}], got {num_partitions}"
        )
    if num_partitions == num_natural:
        return owner_ids
    groups = np.empty(num_natural, np.int64)
    order = np.random.default_rng(seed).permutation(num_natural)
    for g, members in enumerate(np.array_split(order, num_partitions)):
        groups[members] = g
    return groups[owner_ids]


def bind(spec: PartitionerSpec, train_y: np.ndarray, test_y: np.ndarray, num_classes: int,
         train_columns: dict[str, np.ndarray], test_columns: dict[str, np.ndarray]) -> Bound:
    """``spec`` over a training and a test pool: ``(num_partitions, seed) -> Partition``.
    Everything that can be checked without a population size is checked here."""
    skew_labels = train_y if train_y.ndim == 1 and np.issubdtype(train_y.dtype, np.integer) else None
    k = num_classes if skew_labels is not None else 1
    flat_train = skew_labels if skew_labels is not None else np.zeros(len(train_y), np.int64)
    flat_test = test_y if skew_labels is not None else np.zeros(len(test_y), np.int64)

    if isinstance(spec, IID):
        return lambda n, seed: iid_partition(flat_train, flat_test, k, n, seed)
    if isinstance(spec, Dirichlet):
        train_l, test_l = _class_labels(train_y, "Dirichlet"), _class_labels(test_y, "Dirichlet")
        if spec.samples_per_client is not None:
            per = spec.samples_per_client
            return lambda n, seed: sample_with_replacement(train_l, test_l, num_classes, n, spec.alpha, seed,
                                                           per, spec.test_samples_per_client)
        return lambda n, seed: dirichlet_partition(train_l, test_l, num_classes, n, spec.alpha, seed, spec.min_size)
    if isinstance(spec, Shards):
        train_l, test_l = _class_labels(train_y, "Shards"), _class_labels(test_y, "Shards")
        return lambda n, seed: shard_partition(train_l, test_l, num_classes, n, seed, spec.per_client)
    if isinstance(spec, ByColumn):
        if spec.column not in train_columns or spec.column not in test_columns:
            have = ", ".join(sorted(train_columns)) or "none"
            raise ConfigError(
                f"partitioner ByColumn({spec.column!r}): the data has no per-row column {spec.column!r} "
                f"(its columns: {have}); keep it with Csv(..., columns=[{spec.column!r}]) or Arrays(..., columns=...)"
            )
        values = np.unique(np.concatenate([train_columns[spec.column].astype(str),
                                           test_columns[spec.column].astype(str)]))
        train_owner = np.searchsorted(values, train_columns[spec.column].astype(str))
        test_owner = np.searchsorted(values, test_columns[spec.column].astype(str))
        natural = len(values)

        def by_column(n: int, seed: int) -> Partition:
            train_idx = group_by_owner(_group(train_owner, natural, n, seed, spec.column), n)
            test_idx = group_by_owner(_group(test_owner, natural, n, seed, spec.column), n)
            return Partition(indices=train_idx, test_indices=test_idx,
                             label_skew=label_skew(flat_train, train_idx, k),
                             scheme=f"natural({spec.column})" + ("" if n == natural else f" grouped into {n}"))

        return by_column
    raise ConfigError(f"partitioner: expected {PARTITIONERS}; got {type(spec).__name__} {spec!r}")
