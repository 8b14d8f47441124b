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
  1,437 digits). With ``size_spread`` > 0 the number is a client's own (see
  :func:`client_sizes`): uneven clients, as real devices hold.

The *local test split* of a client is drawn from the held-out test pool with the same
per-class shares as its training data, so a client evaluates on its own label mix and
trains on all of its training examples.

Per-client indices are held as a :class:`RaggedIndex` (one flat array and offsets),
not as a list of one array per client: every simulator process holds the partition
of its whole population, and for 100,000 clients 200,000 small arrays cost about
90 MB where the flat form costs 11 MB. The schemes build the flat form directly: each
assigns every pool position an owner and groups positions by owner
(:func:`group_by_owner`), which yields each client's indices in ascending order,
exactly what sorting its pieces gave.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, overload

import numpy as np

from orchard.errors import ConfigError
from orchard.tasks.sizes import check_size_spread, client_sizes

IndexArray = np.ndarray  # int64, indices into a pool

_INT32_MIN, _INT32_MAX = int(np.iinfo(np.int32).min), int(np.iinfo(np.int32).max)
# Partitions are drawn and measured a block of clients at a time, about this many
# values per block, so that temporaries stay a few MB for any population: in one step
# a 100,000-client partition makes a dozen 16 MB temporaries, and the process's heap
# keeps part of that after they are freed.
_CHUNK_VALUES = 1 << 18


def _index_dtype(pool_size: int) -> type[np.signedinteger]:
    return np.int32 if pool_size - 1 <= _INT32_MAX else np.int64


def _client_blocks(offsets: np.ndarray) -> Iterator[tuple[int, int]]:
    """Consecutive client ranges ``[lo, hi)`` of about ``_CHUNK_VALUES`` values each
    (at least one client each), for ragged data with these ``offsets``."""
    n = len(offsets) - 1
    lo = 0
    while lo < n:
        hi = int(np.searchsorted(offsets, offsets[lo] + _CHUNK_VALUES, side="right")) - 1
        hi = min(max(hi, lo + 1), n)
        yield lo, hi
        lo = hi


class RaggedIndex(Sequence[IndexArray]):
    """A read-only sequence of index arrays, stored flat.

    Client ``i``'s indices are ``values[offsets[i]:offsets[i + 1]]``; ``offsets`` is
    int64 of length ``len(self) + 1`` starting at 0. ``values`` is int32 when every
    index fits (any pool under 2**31 examples), int64 otherwise, and read-only.

    ``self[i]`` is a fresh int64 array (the :data:`IndexArray` contract, and callers
    may keep or modify it); ``self[a:b]`` is a ``RaggedIndex`` sharing the buffer.
    Equality with a ``RaggedIndex`` or any sequence of arrays is element-wise.
    """

    __slots__ = ("values", "offsets")

    def __init__(self, values: np.ndarray, offsets: np.ndarray) -> None:
        values = np.asarray(values)
        offsets = np.asarray(offsets)
        if values.ndim != 1 or offsets.ndim != 1 or len(offsets) < 1:
            raise ValueError(
                f"RaggedIndex needs 1-D values and non-empty 1-D offsets, got shapes "
                f"{values.shape} and {offsets.shape}"
            )
        if values.size and not np.issubdtype(values.dtype, np.integer):
            raise ValueError(f"RaggedIndex values must be integers, got {values.dtype}")
        offsets = np.ascontiguousarray(offsets, dtype=np.int64)
        rising = bool(np.all(np.diff(offsets) >= 0))
        if offsets[0] != 0 or offsets[-1] != len(values) or not rising:
            raise ValueError(
                f"RaggedIndex offsets must rise from 0 to len(values) = {len(values)}, "
                f"got {offsets[0]} .. {offsets[-1]}"
                + ("" if rising else " and they decrease somewhere")
            )
        fits = (
            values.dtype == np.int32
            or values.size == 0
            or (int(values.min()) >= _INT32_MIN and int(values.max()) <= _INT32_MAX)
        )
        values = np.ascontiguousarray(values, dtype=np.int32 if fits else np.int64).view()
        values.flags.writeable = False
        offsets = offsets.view()
        offsets.flags.writeable = False
        self.values = values
        self.offsets = offsets

    @classmethod
    def from_lengths(cls, values: np.ndarray, lengths: np.ndarray) -> RaggedIndex:
        """Consecutive runs of ``values``, run ``i`` of length ``lengths[i]``."""
        offsets = np.zeros(len(lengths) + 1, np.int64)
        np.cumsum(lengths, out=offsets[1:])
        return cls(values, offsets)

    @classmethod
    def from_arrays(cls, arrays: Sequence[np.ndarray]) -> RaggedIndex:
        """The flat form of a sequence of 1-D integer arrays (copied; a
        ``RaggedIndex`` is returned as it is)."""
        if isinstance(arrays, RaggedIndex):
            return arrays
        parts = [np.asarray(a, dtype=np.int64).reshape(-1) for a in arrays]
        values = np.concatenate(parts) if parts else np.empty(0, np.int64)
        return cls.from_lengths(values, np.array([len(p) for p in parts], np.int64))

    @property
    def lengths(self) -> np.ndarray:
        """Per-element lengths, int64."""
        return np.diff(self.offsets)

    @property
    def nbytes(self) -> int:
        return int(self.values.nbytes + self.offsets.nbytes)

    def owners(self) -> np.ndarray:
        """For each entry of ``values``, the position of the array it belongs to."""
        return np.repeat(np.arange(len(self), dtype=np.int64), self.lengths)

    def __len__(self) -> int:
        return len(self.offsets) - 1

    @overload
    def __getitem__(self, i: int) -> IndexArray: ...

    @overload
    def __getitem__(self, i: slice) -> RaggedIndex: ...

    def __getitem__(self, i: int | slice) -> IndexArray | RaggedIndex:
        n = len(self)
        if isinstance(i, slice):
            start, stop, step = i.indices(n)
            if step == 1:
                stop = max(start, stop)
                o = self.offsets[start : stop + 1]
                return RaggedIndex(self.values[o[0] : o[-1]], o - o[0])
            return RaggedIndex.from_arrays([self[k] for k in range(start, stop, step)])
        try:
            k = operator.index(i)
        except TypeError:
            raise TypeError(
                f"RaggedIndex indices must be integers or slices, not {type(i).__name__}"
            ) from None
        if k < 0:
            k += n
        if not 0 <= k < n:
            raise IndexError(f"index {i} out of range for a RaggedIndex of length {n}")
        return self.values[self.offsets[k] : self.offsets[k + 1]].astype(np.int64)

    def __iter__(self) -> Iterator[IndexArray]:
        bounds = self.offsets.tolist()
        for a, b in zip(bounds[:-1], bounds[1:], strict=True):
            yield self.values[a:b].astype(np.int64)

    def __eq__(self, other: object) -> bool:
        if isinstance(other, RaggedIndex):
            return np.array_equal(self.offsets, other.offsets) and np.array_equal(
                self.values, other.values
            )
        if not isinstance(other, Sequence) or isinstance(other, str | bytes):
            return NotImplemented
        return len(self) == len(other) and all(
            np.array_equal(a, b) for a, b in zip(self, other, strict=True)
        )

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"RaggedIndex({len(self)} arrays, {len(self.values)} values, {self.values.dtype})"


def group_by_owner(owner: np.ndarray, n: int) -> RaggedIndex:
    """Positions of ``owner`` grouped by owner ``0 .. n-1``, ascending within a group.

    ``group[i]`` is ``np.flatnonzero(owner == i)``; an owner outside ``[0, n)`` means
    "nobody's" and its positions are left out.
    """
    owner = np.asarray(owner)
    valid = (owner >= 0) & (owner < n)
    key = np.where(valid, owner, n)  # the unowned sort last, then are cut off
    order = np.argsort(key, kind="stable")
    lengths = np.bincount(key, minlength=n + 1)[:n]
    return RaggedIndex.from_lengths(order[: int(lengths.sum())], lengths)


@dataclass(frozen=True)
class LabelSkew:
    """Per-client label histograms and one summary number.

    ``mean_tv_distance`` is the mean over clients of the total-variation distance
    between a client's label distribution and the pooled one: 0 for IID clients,
    approaching 1 when each client holds one rare class.
    """

    histograms: np.ndarray  # (num_partitions, num_classes) int32: counts below 2**31
    mean_tv_distance: float
    max_tv_distance: float
    mean_classes_per_client: float


@dataclass(frozen=True)
class Partition:
    """Training (and local test) indices per client, with sizes and label skew."""

    indices: RaggedIndex  # per client: indices into the task's training pool
    test_indices: RaggedIndex  # per client: indices into the task's test pool
    label_skew: LabelSkew
    scheme: str

    @property
    def num_partitions(self) -> int:
        return len(self.indices)

    @property
    def sizes(self) -> np.ndarray:
        """Training examples per client: an int64 array, one entry per client."""
        return self.indices.lengths


def label_skew(labels: np.ndarray, indices: Sequence[IndexArray], num_classes: int) -> LabelSkew:
    """Histograms of ``labels[indices[i]]`` and their distance from the pooled mix.

    Labels outside ``[0, num_classes)`` are not counted.
    """
    ragged = RaggedIndex.from_arrays(indices)
    n, offsets = len(ragged), ragged.offsets
    hist = np.zeros((n, num_classes), np.int32)
    for lo, hi in _client_blocks(offsets):
        picked = labels[ragged.values[offsets[lo] : offsets[hi]]]
        owner = np.repeat(np.arange(hi - lo), np.diff(offsets[lo : hi + 1]))
        counted = (picked >= 0) & (picked < num_classes)
        # One bincount over (client, label) pairs instead of one per client.
        key = owner[counted] * num_classes + picked[counted]
        hist[lo:hi] = np.bincount(key, minlength=(hi - lo) * num_classes).reshape(hi - lo, -1)
    totals = hist.sum(axis=1)
    pooled = hist.sum(axis=0) / max(1, int(totals.sum()))
    # Each client's label distribution (the pooled one for an empty client), then its
    # total-variation distance from the pooled one; in place, as these are (N, C).
    dist = hist / np.maximum(totals, 1)[:, None]
    dist[totals == 0] = pooled
    dist -= pooled
    np.abs(dist, out=dist)
    tv = 0.5 * dist.sum(axis=1)
    del dist
    return LabelSkew(
        histograms=hist,
        mean_tv_distance=float(tv.mean()) if len(tv) else 0.0,
        max_tv_distance=float(tv.max()) if len(tv) else 0.0,
        mean_classes_per_client=float((hist > 0).sum(axis=1).mean()) if len(tv) else 0.0,
    )


def _check_num_partitions(num_partitions: int) -> None:
    if num_partitions < 1:
        raise ConfigError(f"num_partitions must be >= 1, got {num_partitions}")


def _share_lengths(pool_size: int, shares: np.ndarray) -> np.ndarray:
    """Lengths of ``len(shares)`` consecutive pieces of a pool of ``pool_size``,
    proportional to ``shares`` (the pieces ``np.split`` makes at the floored cumulative
    shares)."""
    cuts = (np.cumsum(shares)[:-1] * pool_size).astype(np.int64)
    bounds = np.concatenate([[0], np.clip(cuts, 0, pool_size), [pool_size]])
    return np.diff(bounds)


def _class_pools(
    labels: np.ndarray, num_classes: int, rng: np.random.Generator
) -> list[IndexArray]:
    return [rng.permutation(np.flatnonzero(labels == c)) for c in range(num_classes)]


def _split_classes(
    pools: list[IndexArray], shares: np.ndarray, pool_size: int, num_partitions: int
) -> RaggedIndex:
    """Cut each class pool ``pools[c]`` into consecutive pieces by ``shares[c]``; client
    ``i`` holds piece ``i`` of every class, in ascending order."""
    owner = np.full(pool_size, -1, np.int64)
    clients = np.arange(num_partitions)
    for c, pool in enumerate(pools):
        owner[pool] = np.repeat(clients, _share_lengths(len(pool), shares[c]))
    return group_by_owner(owner, num_partitions)


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
        sizes = np.zeros(num_partitions, np.int64)
        for c in range(num_classes):
            sizes += _share_lengths(len(train_pools[c]), shares[c])
        if sizes.min() >= min_size:
            break
    else:
        raise ConfigError(
            f"no Dirichlet(alpha={alpha}) draw in {max_draws} gave all {num_partitions} clients "
            f">= {min_size} examples; raise alpha, lower num_partitions, or use with_replacement=True"
        )
    train_idx = _split_classes(train_pools, shares, len(train_labels), num_partitions)
    return Partition(
        indices=train_idx,
        test_indices=_split_classes(test_pools, shares, len(test_labels), num_partitions),
        label_skew=label_skew(train_labels, train_idx, num_classes),
        scheme=f"dirichlet(alpha={alpha})",
    )


def _even_owner(order: np.ndarray, num_partitions: int) -> np.ndarray:
    """Owner of each position when ``order`` is cut into ``num_partitions`` pieces the
    way ``np.array_split`` cuts it (the first ``len % n`` pieces one longer)."""
    q, r = divmod(len(order), num_partitions)
    lengths = np.full(num_partitions, q, np.int64)
    lengths[:r] += 1
    owner = np.empty(len(order), np.int64)
    owner[order] = np.repeat(np.arange(num_partitions), lengths)
    return owner


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
    train_owner = _even_owner(rng.permutation(len(train_labels)), num_partitions)
    test_owner = _even_owner(rng.permutation(len(test_labels)), num_partitions)
    train_idx = group_by_owner(train_owner, num_partitions)
    test_idx = group_by_owner(test_owner, num_partitions)
    return Partition(
        indices=train_idx,
        test_indices=test_idx,
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
    shard_of = _even_owner(order, num_shards)  # training example -> shard
    deal = rng.permutation(num_shards).reshape(num_partitions, shards_per_client)
    client_of = np.empty(num_shards, np.int64)  # shard -> client
    client_of[deal.ravel()] = np.repeat(np.arange(num_partitions), shards_per_client)
    train_idx = group_by_owner(client_of[shard_of], num_partitions)
    skew = label_skew(train_labels, train_idx, num_classes)
    hist = skew.histograms
    class_totals = np.maximum(hist.sum(axis=0), 1)
    shares = (hist / class_totals).T  # (C, N): client's fraction of each class
    test_pools = _class_pools(test_labels, num_classes, rng)
    return Partition(
        indices=train_idx,
        test_indices=_split_classes(test_pools, shares, len(test_labels), num_partitions),
        label_skew=skew,
        scheme=f"shards({shards_per_client} per client)",
    )


def _draw_with_replacement(
    labels: np.ndarray,
    num_classes: int,
    mixes: np.ndarray,
    per_client: int | np.ndarray,
    rng: np.random.Generator,
) -> RaggedIndex:
    """For each client i draw ``per_client`` examples (or ``per_client[i]``, one size a
    client) with class mix ``mixes[i]``.

    Vectorised over clients: one multinomial for the class counts, then one uniform
    draw per example within its class's pool.
    """
    n_clients = mixes.shape[0]
    order = np.argsort(labels, kind="stable")
    class_sizes = np.bincount(labels, minlength=num_classes)[:num_classes]
    class_start = np.concatenate([[0], np.cumsum(class_sizes)[:-1]])
    # A class that is absent from the pool cannot be drawn: renormalise without it.
    mixes = mixes * (class_sizes > 0)
    mixes /= mixes.sum(axis=1, keepdims=True)
    counts = rng.multinomial(per_client, mixes)  # (N, C)
    del mixes
    offsets = np.zeros(n_clients + 1, np.int64)
    np.cumsum(counts.sum(axis=1), out=offsets[1:])
    picks = np.empty(int(offsets[-1]), _index_dtype(len(labels)))
    class_ids = np.arange(num_classes)
    # Block by block; the uniforms of consecutive blocks are one stream, the same
    # numbers as a single rng.random(total).
    for lo, hi in _client_blocks(offsets):
        classes = np.repeat(np.tile(class_ids, hi - lo), counts[lo:hi].ravel())
        within = np.floor(rng.random(len(classes)) * class_sizes[classes]).astype(np.int64)
        picks[offsets[lo] : offsets[hi]] = order[class_start[classes] + within]
    return RaggedIndex(picks, offsets)


def sample_with_replacement(
    train_labels: np.ndarray,
    test_labels: np.ndarray,
    num_classes: int,
    num_partitions: int,
    alpha: float,
    seed: int,
    samples_per_client: int,
    test_samples_per_client: int,
    size_spread: float = 0.0,
) -> Partition:
    """Clients of ``samples_per_client`` examples drawn with replacement under a
    Dirichlet(alpha * p) class mix each; any population size works. ``size_spread`` > 0:
    client i draws its own number of training examples (:func:`client_sizes`, mean about
    ``samples_per_client``); its local test split keeps ``test_samples_per_client``."""
    _check_num_partitions(num_partitions)
    if alpha <= 0:
        raise ConfigError(f"alpha must be > 0, got {alpha}")
    if samples_per_client < 1 or test_samples_per_client < 0:
        raise ConfigError(
            f"samples_per_client must be >= 1 and test_samples_per_client >= 0, got "
            f"{samples_per_client} and {test_samples_per_client}"
        )
    check_size_spread(size_spread)
    rng = np.random.default_rng(seed)
    prior = np.bincount(train_labels, minlength=num_classes)[:num_classes] / len(train_labels)
    # Classes with zero prior get a tiny concentration so Dirichlet stays defined.
    mixes = rng.dirichlet(np.maximum(alpha * prior * num_classes, 1e-3), size=num_partitions)
    # Drawn only when spread: size_spread=0 keeps the stream, so the same partition as before.
    sizes = (client_sizes(num_partitions, samples_per_client, size_spread, rng) if size_spread > 0
             else samples_per_client)
    train_idx = _draw_with_replacement(train_labels, num_classes, mixes, sizes, rng)
    test_idx = _draw_with_replacement(test_labels, num_classes, mixes, test_samples_per_client, rng)
    spread = f", size_spread={size_spread}" if size_spread > 0 else ""
    return Partition(
        indices=train_idx,
        test_indices=test_idx,
        label_skew=label_skew(train_labels, train_idx, num_classes),
        scheme=f"with_replacement(alpha={alpha}, n={samples_per_client}{spread})",
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
    size_spread: float = 0.0,
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
    check_size_spread(size_spread)
    if size_spread != 0.0 and not with_replacement:
        raise ConfigError(f"size_spread={size_spread} spreads the sizes of clients drawn with replacement: "
                          "set with_replacement=True, or size_spread=0")

    def partition(num_partitions: int, seed: int) -> Partition:
        if with_replacement:
            return sample_with_replacement(train_labels, test_labels, num_classes, num_partitions, alpha, seed,
                                           samples_per_client, test_samples_per_client, size_spread)
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


def task_label_partitioner(
    train_labels: np.ndarray, test_labels: np.ndarray, num_classes: int, params: Mapping[str, Any]
) -> Callable[[int, int], Partition]:
    """:func:`label_partitioner` configured by a labelled task's own parameter names
    (``partitioner``, ``alpha``, ``min_partition_size``, ``shards_per_client``,
    ``with_replacement``, ``samples_per_client``, ``test_samples_per_client``,
    ``size_spread``; a task without ``size_spread`` has even sizes)."""
    return label_partitioner(
        train_labels,
        test_labels,
        num_classes,
        scheme=params["partitioner"],
        alpha=params["alpha"],
        min_size=params["min_partition_size"],
        shards_per_client=params["shards_per_client"],
        with_replacement=params["with_replacement"],
        samples_per_client=params["samples_per_client"],
        test_samples_per_client=params["test_samples_per_client"],
        size_spread=params.get("size_spread", 0.0),
    )
