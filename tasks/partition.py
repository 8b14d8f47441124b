"""Deterministic client partitions of a labelled pool, and how skewed they are.

Every function takes an explicit seed and returns index arrays into the pool it was
given; nothing here touches a global RNG. Three schemes:

- :func:`dirichlet_partition`: for each class ``c`` draw client shares
  ``q_c ~ Dir(alpha * 1_N)`` and split the class's examples by them (Yurochkin et al.,
  2019; Hsu et al., 2019). Small ``alpha`` means few classes per client.
- :func:`shard_partition`: sort by label, cut into ``N * shards_per_client`` equal
  shards, deal them out at random (McMahan et al., 2017, the "pathological non-IID"
  split).
- :func:`sample_with_replacement`: each client draws its class mix
  ``q_i ~ Dir(alpha * p)`` (``p`` the pool's class frequencies, Hsu et al., 2019) and
  then a fixed number of examples with replacement. This is the only scheme whose
  population is not bounded by the pool size (10,000 clients of 20 examples from
  1,437 digits).

The *local test split* of a client is drawn from the held-out test pool with the same
per-class shares as its training data, so a client evaluates on its own label mix and
trains on all of its training examples.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from orchard.errors import ConfigError

IndexArray = np.ndarray  # int64, indices into a pool


@dataclass(frozen=True)
class LabelSkew:
    """Per-client label histograms and one summary number.

    ``mean_tv_distance`` is the mean over clients of the total-variation distance
    between a client's label distribution and the pooled one: 0 for IID clients,
    approaching 1 when each client holds one rare class.
    """

    histograms: np.ndarray  # (num_partitions, num_classes) int64
    mean_tv_distance: float
    max_tv_distance: float
    mean_classes_per_client: float


@dataclass(frozen=True)
class Partition:
    """Training (and local test) indices per client, with sizes and label skew."""

    indices: list[IndexArray]  # per client: indices into the task's training pool
    test_indices: list[IndexArray]  # per client: indices into the task's test pool
    sizes: list[int]
    label_skew: LabelSkew
    scheme: str

    @property
    def num_partitions(self) -> int:
        return len(self.indices)


def label_skew(labels: np.ndarray, indices: Sequence[IndexArray], num_classes: int) -> LabelSkew:
    """Histograms of ``labels[indices[i]]`` and their distance from the pooled mix."""
    hist = np.zeros((len(indices), num_classes), dtype=np.int64)
    for i, idx in enumerate(indices):
        hist[i] = np.bincount(labels[idx], minlength=num_classes)[:num_classes]
    totals = hist.sum(axis=1, keepdims=True)
    pooled = hist.sum(axis=0) / max(1, int(hist.sum()))
    with np.errstate(invalid="ignore", divide="ignore"):
        dist = np.where(totals > 0, hist / np.maximum(totals, 1), pooled)
    tv = 0.5 * np.abs(dist - pooled).sum(axis=1)
    return LabelSkew(
        histograms=hist,
        mean_tv_distance=float(tv.mean()) if len(tv) else 0.0,
        max_tv_distance=float(tv.max()) if len(tv) else 0.0,
        mean_classes_per_client=float((hist > 0).sum(axis=1).mean()) if len(tv) else 0.0,
    )


def _check_num_partitions(num_partitions: int) -> None:
    if num_partitions < 1:
        raise ConfigError(f"num_partitions must be >= 1, got {num_partitions}")


def _split_by_shares(pool: IndexArray, shares: np.ndarray) -> list[IndexArray]:
    """Cut ``pool`` into ``len(shares)`` consecutive pieces proportional to ``shares``."""
    cuts = (np.cumsum(shares)[:-1] * len(pool)).astype(np.int64)
    return np.split(pool, cuts)


def _class_pools(
    labels: np.ndarray, num_classes: int, rng: np.random.Generator
) -> list[IndexArray]:
    return [rng.permutation(np.flatnonzero(labels == c)) for c in range(num_classes)]


def _assemble(pieces: list[list[IndexArray]], num_partitions: int) -> list[IndexArray]:
    """``pieces[c][i]`` are client i's examples of class c; concatenate per client, sorted."""
    out = []
    for i in range(num_partitions):
        parts = [pieces[c][i] for c in range(len(pieces))]
        out.append(
            np.sort(np.concatenate(parts)).astype(np.int64) if parts else np.empty(0, np.int64)
        )
    return out


def dirichlet_partition(
    train_labels: np.ndarray,
    test_labels: np.ndarray,
    num_classes: int,
    num_partitions: int,
    alpha: float,
    seed: int,
    min_size: int = 2,
    max_draws: int = 100,
) -> Partition:
    """Dirichlet label-skew partition without replacement (every example used once).

    Redraws (up to ``max_draws`` times, deterministically) until every client holds
    at least ``min_size`` training examples, so no client is handed an empty dataset.
    """
    _check_num_partitions(num_partitions)
    if alpha <= 0:
        raise ConfigError(f"alpha must be > 0, got {alpha}")
    n = len(train_labels)
    if num_partitions * min_size > n:
        raise ConfigError(
            f"{num_partitions} clients x min_size {min_size} exceeds the {n} training examples; "
            "use fewer clients or sampling with replacement (with_replacement=True)"
        )
    rng = np.random.default_rng(seed)
    train_pools = _class_pools(train_labels, num_classes, rng)
    test_pools = _class_pools(test_labels, num_classes, rng)
    for _ in range(max_draws):
        shares = rng.dirichlet(np.full(num_partitions, alpha), size=num_classes)  # (C, N)
        train_pieces = [_split_by_shares(train_pools[c], shares[c]) for c in range(num_classes)]
        sizes = np.sum([[len(p) for p in pieces] for pieces in train_pieces], axis=0)
        if sizes.min() >= min_size:
            break
    else:
        raise ConfigError(
            f"no Dirichlet(alpha={alpha}) draw in {max_draws} gave all {num_partitions} clients "
            f">= {min_size} examples; raise alpha, lower num_partitions, or use with_replacement=True"
        )
    test_pieces = [_split_by_shares(test_pools[c], shares[c]) for c in range(num_classes)]
    train_idx = _assemble(train_pieces, num_partitions)
    return Partition(
        indices=train_idx,
        test_indices=_assemble(test_pieces, num_partitions),
        sizes=[len(i) for i in train_idx],
        label_skew=label_skew(train_labels, train_idx, num_classes),
        scheme=f"dirichlet(alpha={alpha})",
    )


def iid_partition(
    train_labels: np.ndarray,
    test_labels: np.ndarray,
    num_classes: int,
    num_partitions: int,
    seed: int,
) -> Partition:
    """Uniformly random, (nearly) equal-sized clients."""
    _check_num_partitions(num_partitions)
    if num_partitions > len(train_labels):
        raise ConfigError(
            f"{num_partitions} clients exceed the {len(train_labels)} training examples; "
            "use with_replacement=True"
        )
    rng = np.random.default_rng(seed)
    train_idx = [
        np.sort(p) for p in np.array_split(rng.permutation(len(train_labels)), num_partitions)
    ]
    test_idx = [
        np.sort(p) for p in np.array_split(rng.permutation(len(test_labels)), num_partitions)
    ]
    return Partition(
        indices=train_idx,
        test_indices=test_idx,
        sizes=[len(i) for i in train_idx],
        label_skew=label_skew(train_labels, train_idx, num_classes),
        scheme="iid",
    )


def shard_partition(
    train_labels: np.ndarray,
    test_labels: np.ndarray,
    num_classes: int,
    num_partitions: int,
    seed: int,
    shards_per_client: int = 2,
) -> Partition:
    """McMahan et al. (2017) shards: each client gets ``shards_per_client`` label-sorted shards.

    A client's local test split takes, for each class, the same fraction of the test
    pool's examples of that class as its training shards hold of the training pool's.
    """
    _check_num_partitions(num_partitions)
    num_shards = num_partitions * shards_per_client
    if num_shards > len(train_labels):
        raise ConfigError(
            f"{num_shards} shards exceed the {len(train_labels)} training examples; "
            "use fewer clients or shards_per_client"
        )
    rng = np.random.default_rng(seed)
    # Stable sort after a shuffle: random order within a class, classes contiguous.
    order = rng.permutation(len(train_labels))
    order = order[np.argsort(train_labels[order], kind="stable")]
    shards = np.array_split(order, num_shards)
    deal = rng.permutation(num_shards).reshape(num_partitions, shards_per_client)
    train_idx = [np.sort(np.concatenate([shards[s] for s in row])) for row in deal]
    hist = label_skew(train_labels, train_idx, num_classes).histograms
    class_totals = np.maximum(hist.sum(axis=0), 1)
    shares = (hist / class_totals).T  # (C, N): client's fraction of each class
    test_pools = _class_pools(test_labels, num_classes, rng)
    test_pieces = [_split_by_shares(test_pools[c], shares[c]) for c in range(num_classes)]
    return Partition(
        indices=train_idx,
        test_indices=_assemble(test_pieces, num_partitions),
        sizes=[len(i) for i in train_idx],
        label_skew=label_skew(train_labels, train_idx, num_classes),
        scheme=f"shards({shards_per_client} per client)",
    )


def _draw_with_replacement(
    labels: np.ndarray,
    num_classes: int,
    mixes: np.ndarray,
    per_client: int,
    rng: np.random.Generator,
) -> list[IndexArray]:
    """For each client i draw ``per_client`` examples with class mix ``mixes[i]``.

    Vectorised over clients: one multinomial for the class counts, then one uniform
    draw per example within its class's pool.
    """
    n_clients = mixes.shape[0]
    order = np.argsort(labels, kind="stable")
    class_sizes = np.bincount(labels, minlength=num_classes)[:num_classes]
    class_start = np.concatenate([[0], np.cumsum(class_sizes)[:-1]])
    # A class that is absent from the pool cannot be drawn: renormalise without it.
    mixes = mixes * (class_sizes > 0)
    mixes = mixes / mixes.sum(axis=1, keepdims=True)
    counts = rng.multinomial(per_client, mixes)  # (N, C)
    classes = np.repeat(np.tile(np.arange(num_classes), n_clients), counts.ravel())
    offsets = np.floor(rng.random(len(classes)) * class_sizes[classes]).astype(np.int64)
    picks = order[class_start[classes] + offsets].astype(np.int64)
    return np.split(picks, np.cumsum(counts.sum(axis=1))[:-1])


def sample_with_replacement(
    train_labels: np.ndarray,
    test_labels: np.ndarray,
    num_classes: int,
    num_partitions: int,
    alpha: float,
    seed: int,
    samples_per_client: int,
    test_samples_per_client: int,
) -> Partition:
    """Clients of ``samples_per_client`` examples drawn with replacement under a
    Dirichlet(alpha * p) class mix each; any population size works."""
    _check_num_partitions(num_partitions)
    if alpha <= 0:
        raise ConfigError(f"alpha must be > 0, got {alpha}")
    if samples_per_client < 1 or test_samples_per_client < 0:
        raise ConfigError(
            f"samples_per_client must be >= 1 and test_samples_per_client >= 0, got "
            f"{samples_per_client} and {test_samples_per_client}"
        )
    rng = np.random.default_rng(seed)
    prior = np.bincount(train_labels, minlength=num_classes)[:num_classes] / len(train_labels)
    # Classes with zero prior get a tiny concentration so Dirichlet stays defined.
    mixes = rng.dirichlet(np.maximum(alpha * prior * num_classes, 1e-3), size=num_partitions)
    train_idx = _draw_with_replacement(train_labels, num_classes, mixes, samples_per_client, rng)
    test_idx = _draw_with_replacement(test_labels, num_classes, mixes, test_samples_per_client, rng)
    return Partition(
        indices=train_idx,
        test_indices=test_idx,
        sizes=[samples_per_client] * num_partitions,
        label_skew=label_skew(train_labels, train_idx, num_classes),
        scheme=f"with_replacement(alpha={alpha}, n={samples_per_client})",
    )


def stratified_split(
    labels: np.ndarray, test_fraction: float, seed: int
) -> tuple[IndexArray, IndexArray]:
    """Split indices into (train, test) with each class's test share ``test_fraction``."""
    if not 0.0 < test_fraction < 1.0:
        raise ConfigError(f"test_fraction must be in (0, 1), got {test_fraction}")
    rng = np.random.default_rng(seed)
    train, test = [], []
    for c in np.unique(labels):
        idx = rng.permutation(np.flatnonzero(labels == c))
        k = int(round(len(idx) * test_fraction))
        test.append(idx[:k])
        train.append(idx[k:])
    return np.sort(np.concatenate(train)), np.sort(np.concatenate(test))


LABEL_SCHEMES = ("dirichlet", "iid", "shards")


def label_partitioner(
    train_labels: np.ndarray,
    test_labels: np.ndarray,
    num_classes: int,
    *,
    scheme: str,
    alpha: float,
    min_size: int,
    shards_per_client: int,
    with_replacement: bool,
    samples_per_client: int,
    test_samples_per_client: int,
) -> Callable[[int, int], Partition]:
    """A ``(num_partitions, seed) -> Partition`` for a labelled pool, checked up front."""
    if scheme not in LABEL_SCHEMES:
        raise ConfigError(
            f"unknown partitioner {scheme!r}; expected one of {', '.join(LABEL_SCHEMES)}"
        )
    if with_replacement and scheme != "dirichlet":
        raise ConfigError(
            "with_replacement=True draws a Dirichlet mix per client: use partitioner='dirichlet'"
        )

    def partition(num_partitions: int, seed: int) -> Partition:
        if with_replacement:
            return sample_with_replacement(
                train_labels,
                test_labels,
                num_classes,
                num_partitions,
                alpha,
                seed,
                samples_per_client,
                test_samples_per_client,
            )
        if scheme == "iid":
            return iid_partition(train_labels, test_labels, num_classes, num_partitions, seed)
        if scheme == "shards":
            return shard_partition(
                train_labels, test_labels, num_classes, num_partitions, seed, shards_per_client
            )
        return dirichlet_partition(
            train_labels, test_labels, num_classes, num_partitions, alpha, seed, min_size
        )

    return partition
