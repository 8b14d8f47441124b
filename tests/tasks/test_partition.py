import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from orchard.errors import ConfigError
from orchard.tasks.partition import (
    dirichlet_partition,
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
    assert p.sizes == [len(i) for i in p.indices] and min(p.sizes) >= 2
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
