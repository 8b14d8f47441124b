import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from orchard.errors import ConfigError
from orchard.tasks.partition import (
    RaggedIndex,
    dirichlet_partition,
    group_by_owner,
    iid_partition,
    label_skew,
    sample_with_replacement,
    shard_partition,
    stratified_split,
)

RNG = np.random.default_rng(123)
TRAIN = RNG.integers(0, 10, size=2000)
TEST = RNG.integers(0, 10, size=500)


def _disjoint_cover(parts: list[np.ndarray], n: int) -> bool:
    allidx = np.concatenate(parts)
    return len(allidx) == n and len(np.unique(allidx)) == n


@settings(max_examples=25, deadline=None)
@given(
    n=st.integers(1, 50),
    alpha=st.floats(0.05, 100.0),
    seed=st.integers(0, 2**31),
)
def test_dirichlet_uses_every_example_once_and_is_deterministic(
    n: int, alpha: float, seed: int
) -> None:
    try:
        p = dirichlet_partition(TRAIN, TEST, 10, n, alpha, seed)
    except ConfigError:
        return  # extreme alpha with many clients: refused with a reason, fine
    assert _disjoint_cover(p.indices, len(TRAIN))
    assert _disjoint_cover(p.test_indices, len(TEST))
    assert p.sizes.tolist() == [len(i) for i in p.indices] and min(p.sizes) >= 2
    q = dirichlet_partition(TRAIN, TEST, 10, n, alpha, seed)
    assert all(np.array_equal(a, b) for a, b in zip(p.indices, q.indices, strict=True))


def test_smaller_alpha_means_more_label_skew() -> None:
    skew = [
        dirichlet_partition(TRAIN, TEST, 10, 20, a, 0).label_skew.mean_tv_distance
        for a in (0.1, 1.0, 100.0)
    ]
    assert skew[0] > skew[1] > skew[2]
    assert skew[2] < 0.15  # near IID


def test_local_test_split_follows_the_client_label_mix() -> None:
    p = dirichlet_partition(TRAIN, TEST, 10, 5, 0.3, 1)
    for tr, te in zip(p.indices, p.test_indices, strict=True):
        train_mix = np.bincount(TRAIN[tr], minlength=10) / len(tr)
        test_mix = np.bincount(TEST[te], minlength=10) / max(len(te), 1)
        assert 0.5 * np.abs(train_mix - test_mix).sum() < 0.25


def test_too_many_clients_is_refused_with_the_way_out() -> None:
    with pytest.raises(ConfigError, match="with_replacement"):
        dirichlet_partition(TRAIN, TEST, 10, 1500, 0.5, 0)


def test_iid_is_balanced_and_unskewed() -> None:
    p = iid_partition(TRAIN, TEST, 10, 10, 0)
    assert max(p.sizes) - min(p.sizes) <= 1
    assert _disjoint_cover(p.indices, len(TRAIN))
    assert p.label_skew.mean_tv_distance < 0.1


def test_shards_give_each_client_few_classes() -> None:
    p = shard_partition(TRAIN, TEST, 10, 50, 0, shards_per_client=2)
    assert _disjoint_cover(p.indices, len(TRAIN))
    assert p.label_skew.mean_classes_per_client <= 3.0


def test_with_replacement_scales_past_the_pool() -> None:
    p = sample_with_replacement(TRAIN, TEST, 10, 10_000, 0.5, 7, 20, 5)
    assert p.num_partitions == 10_000
    assert all(len(i) == 20 for i in p.indices) and all(len(i) == 5 for i in p.test_indices)
    assert max(int(i.max()) for i in p.indices) < len(TRAIN)
    q = sample_with_replacement(TRAIN, TEST, 10, 10_000, 0.5, 7, 20, 5)
    assert all(np.array_equal(a, b) for a, b in zip(p.indices[:100], q.indices[:100], strict=True))
    r = sample_with_replacement(TRAIN, TEST, 10, 10_000, 0.5, 8, 20, 5)
    assert not all(
        np.array_equal(a, b) for a, b in zip(p.indices[:100], r.indices[:100], strict=True)
    )
    iid_like = sample_with_replacement(TRAIN, TEST, 10, 2000, 1000.0, 7, 20, 5)
    assert p.label_skew.mean_tv_distance > iid_like.label_skew.mean_tv_distance + 0.2


def test_uneven_sizes_are_lognormal_around_the_mean_and_seeded() -> None:
    even = sample_with_replacement(TRAIN, TEST, 10, 3000, 0.5, 7, 20, 5)
    p = sample_with_replacement(TRAIN, TEST, 10, 3000, 0.5, 7, 20, 5, size_spread=1.0)
    sizes = p.sizes
    assert sizes.min() >= 1 and sizes.max() <= 10 * 20
    assert abs(sizes.mean() - 20) < 1.5  # the mean is kept (the clipped tail costs ~2%)
    assert len(np.unique(sizes)) > 50 and np.median(sizes) < 15  # long-tailed: most clients hold less
    assert all(len(i) == 5 for i in p.test_indices)  # local test splits keep their size
    # The same class mixes: a client's labels follow its mix whatever its size.
    assert np.array_equal(p.indices.lengths, sizes)
    same = sample_with_replacement(TRAIN, TEST, 10, 3000, 0.5, 7, 20, 5, size_spread=1.0)
    assert p.indices == same.indices and p.test_indices == same.test_indices
    assert not np.array_equal(sample_with_replacement(TRAIN, TEST, 10, 3000, 0.5, 8, 20, 5,
                                                      size_spread=1.0).sizes, sizes)
    # size_spread=0 draws nothing more: the partition of before, index for index.
    zero = sample_with_replacement(TRAIN, TEST, 10, 3000, 0.5, 7, 20, 5, size_spread=0.0)
    assert zero.indices == even.indices and zero.test_indices == even.test_indices


@pytest.mark.parametrize("spread", [-0.1, 3.5, float("nan")])
def test_size_spread_out_of_range_is_refused(spread: float) -> None:
    with pytest.raises(ConfigError, match="size_spread must be in"):
        sample_with_replacement(TRAIN, TEST, 10, 10, 0.5, 7, 20, 5, size_spread=spread)


def test_label_skew_of_disjoint_single_class_clients() -> None:
    labels = np.array([0, 0, 1, 1])
    skew = label_skew(labels, [np.array([0, 1]), np.array([2, 3])], 2)
    assert skew.histograms.tolist() == [[2, 0], [0, 2]]
    assert skew.mean_tv_distance == pytest.approx(0.5)


def test_stratified_split_keeps_class_shares() -> None:
    tr, te = stratified_split(TRAIN, 0.2, 0)
    assert len(np.intersect1d(tr, te)) == 0 and len(tr) + len(te) == len(TRAIN)
    for c in range(10):
        assert abs((TRAIN[te] == c).sum() - 0.2 * (c == TRAIN).sum()) <= 1


# ---------------------------------------------------------------------- RaggedIndex


def _reference(seed: int, n: int) -> list[np.ndarray]:
    """A list of arrays built the plain way, some empty."""
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 1000, size=int(rng.integers(0, 6))) for _ in range(n)]


@settings(max_examples=50, deadline=None)
@given(seed=st.integers(0, 2**31), n=st.integers(0, 30))
def test_ragged_index_behaves_like_its_list_of_arrays(seed: int, n: int) -> None:
    ref = _reference(seed, n)
    r = RaggedIndex.from_arrays(ref)
    assert len(r) == n and r == ref and r == RaggedIndex.from_arrays(ref)
    assert r.lengths.tolist() == [len(a) for a in ref]
    for i in range(-n, n):
        got = r[i]
        assert got.dtype == np.int64 and np.array_equal(got, ref[i])
    assert all(np.array_equal(a, b) for a, b in zip(r, ref, strict=True))
    for sl in (
        slice(None),
        slice(2, 7),
        slice(-3, None),
        slice(5, 2),
        slice(None, None, 2),
        slice(None, None, -1),
        slice(1, 100),
    ):
        part = r[sl]
        assert isinstance(part, RaggedIndex) and part == ref[sl]
        assert len(list(part)) == len(ref[sl])
    with pytest.raises(IndexError):
        r[n]
    with pytest.raises(IndexError):
        r[-n - 1]


def test_ragged_index_is_compact_and_read_only() -> None:
    r = RaggedIndex.from_arrays([np.array([3, 1, 2]), np.array([], np.int64), np.array([7])])
    assert r.values.dtype == np.int32 and r.offsets.tolist() == [0, 3, 3, 4]
    assert r[np.int64(2)].tolist() == [7] and r[1].shape == (0,)
    with pytest.raises(ValueError):
        r.values[0] = 5
    mine = r[0]
    mine[0] = 99  # the caller's copy, not the shared buffer
    assert r[0].tolist() == [3, 1, 2]
    assert r != [np.array([3, 1, 2]), np.array([]), np.array([8])]
    assert RaggedIndex(np.array([2**31 + 5]), np.array([0, 1])).values.dtype == np.int64
    with pytest.raises(TypeError):
        r["0"]  # type: ignore[call-overload]


def test_ragged_index_refuses_inconsistent_offsets() -> None:
    for offsets in ([1, 2], [0, 3], [0, 2, 1, 2], []):
        with pytest.raises(ValueError):
            RaggedIndex(np.array([1, 2]), np.array(offsets, np.int64))


def test_group_by_owner_is_flatnonzero_per_owner() -> None:
    owner = np.array([2, 0, 2, -1, 1, 0, 5, 2])
    groups = group_by_owner(owner, 3)
    assert groups == [np.flatnonzero(owner == g) for g in range(3)]


@pytest.mark.parametrize(
    "make",
    [
        lambda s: dirichlet_partition(TRAIN, TEST, 10, 13, 0.5, s),
        lambda s: iid_partition(TRAIN, TEST, 10, 13, s),
        lambda s: shard_partition(TRAIN, TEST, 10, 13, s, shards_per_client=3),
        lambda s: sample_with_replacement(TRAIN, TEST, 10, 13, 0.5, s, 20, 5),
    ],
    ids=["dirichlet", "iid", "shards", "with_replacement"],
)
def test_partition_sizes_and_skew_match_the_per_client_arrays(make) -> None:  # type: ignore[no-untyped-def]
    p = make(4)
    assert p.sizes.tolist() == [len(i) for i in p.indices]
    plain = [np.bincount(TRAIN[i], minlength=10) for i in p.indices]
    assert p.label_skew.histograms.tolist() == [h.tolist() for h in plain]
    from_list = label_skew(TRAIN, list(p.indices), 10)  # a plain list gives the same numbers
    assert np.array_equal(from_list.histograms, p.label_skew.histograms)
    assert from_list.mean_tv_distance == p.label_skew.mean_tv_distance
