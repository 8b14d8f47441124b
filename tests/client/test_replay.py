"""The device's replay buffer: its sampling rules against plain references, its byte
budget, and its file (owner-only, checksummed, persisted, discarded when damaged)."""

from __future__ import annotations

import logging
import stat

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from orchard.client.replay import (
    HEADER_BYTES,
    ReplayBudgetError,
    ReplayBuffer,
    budget_for,
    capacity_for,
    record_bytes,
)
from orchard.client.replay_sampling import class_balanced_slot, draw_slots, reservoir_slot

SHAPE = (3, 2)


def _reference_reservoir(labels: list[int], capacity: int, seed: int) -> list[int]:
    """Algorithm R written out over a list, drawing from the same generator the same way."""
    rng = np.random.default_rng(seed)
    kept: list[int] = []
    for n, y in enumerate(labels):
        if n < capacity:
            kept.append(y)
            continue
        j = int(rng.integers(0, n + 1))
        if j < capacity:
            kept[j] = y
    return kept


def _reference_cbrs(labels: list[int], capacity: int, seed: int) -> list[int]:
    """Class-balancing reservoir sampling (Chrysakis & Moens 2020, Alg. 1) over a list."""
    rng = np.random.default_rng(seed)
    kept: list[int] = []
    seen: dict[int, int] = {}
    for y in labels:
        seen[y] = seen.get(y, 0) + 1
        if len(kept) < capacity:
            kept.append(y)
            continue
        counts = {c: kept.count(c) for c in set(kept)}
        largest = max(counts.values())
        if counts.get(y, 0) < largest:
            big = {c for c, m in counts.items() if m == largest}
            victims = [i for i, c in enumerate(kept) if c in big]
            kept[victims[int(rng.integers(0, len(victims)))]] = y
        elif rng.random() * seen[y] < counts[y]:
            own = [i for i, c in enumerate(kept) if c == y]
            kept[own[int(rng.integers(0, len(own)))]] = y
    return kept


def _fill(buf: ReplayBuffer, labels: list[int], seed: int) -> None:
    rng = np.random.default_rng(seed)
    for i, y in enumerate(labels):
        buf.offer(np.full(SHAPE, float(i), np.float32), y, rng)


@settings(max_examples=40, deadline=None)
@given(labels=st.lists(st.integers(0, 4), min_size=1, max_size=60), capacity=st.integers(1, 9),
       seed=st.integers(0, 2**32 - 1), sampling=st.sampled_from(["reservoir", "class_balanced"]))
def test_admission_matches_a_plain_reference(tmp_path_factory, labels, capacity, seed, sampling):
    d = tmp_path_factory.mktemp("buf")
    buf = ReplayBuffer(d, SHAPE, budget_for(capacity, 2, SHAPE), sampling=sampling, hot_samples=2)
    assert buf.capacity == capacity
    _fill(buf, labels, seed)
    ref = (_reference_reservoir if sampling == "reservoir" else _reference_cbrs)(labels, capacity, seed)
    assert buf.labels.tolist() == ref
    # Each slot's input is the one of the sample that took it last (inputs carry their index).
    xs, ys = buf.draw(64, np.random.default_rng(1))
    for x, y in zip(xs, ys, strict=True):
        assert labels[int(x[0, 0])] == y


def test_reservoir_keeps_every_sample_with_equal_probability():
    # Inclusion of each of n = 20 samples in a reservoir of 5: 5/20 each.
    hits = np.zeros(20)
    trials = 4000
    rng = np.random.default_rng(0)
    for _ in range(trials):
        kept = list(range(5))
        for n in range(5, 20):
            slot = reservoir_slot(n, 5, rng)
            if slot is not None:
                kept[slot] = n
        hits[kept] += 1
    p = hits / trials
    assert np.all(np.abs(p - 0.25) < 0.035), p


def test_class_balanced_evens_out_an_imbalanced_stream():
    labels = [0] * 90 + [1] * 10
    rng = np.random.default_rng(3)
    kept = np.zeros(0, dtype=np.int64)
    seen: dict[int, int] = {}
    for y in labels:
        seen[y] = seen.get(y, 0) + 1
        slot = class_balanced_slot(kept, y, seen, 10, rng)
        if slot is None:
            continue
        kept = np.append(kept, y) if slot == kept.shape[0] else np.where(np.arange(kept.shape[0]) == slot, y, kept)
    assert np.bincount(kept, minlength=2).tolist() == [5, 5]
    # Draws are balanced over the classes present, whatever their share of slots.
    drawn = draw_slots("class_balanced", np.array([0] * 9 + [1]), 4000, np.random.default_rng(0))
    share = float(np.mean(drawn == 9))
    assert 0.45 < share < 0.55


def test_budget_is_enforced_and_measured(tmp_path):
    shape = (1, 28, 28)
    budget = 40_000
    buf = ReplayBuffer(tmp_path, shape, budget, hot_samples=3)
    assert buf.capacity == capacity_for(budget, 3, shape) >= 1
    rng = np.random.default_rng(0)
    worst = 0
    for i in range(200):
        buf.offer(rng.random(shape, dtype=np.float32), i % 10, rng)
        worst = max(worst, buf.file_bytes() + buf.memory_bytes())
    buf.flush()
    worst = max(worst, buf.file_bytes() + buf.memory_bytes())
    assert len(buf) == buf.capacity
    assert worst <= budget
    # The file is the header, the labels, the inputs and the digest, nothing more.
    assert buf.file_bytes() == HEADER_BYTES + buf.capacity * record_bytes(shape) + 32


@pytest.mark.parametrize("sampling", ["reservoir", "class_balanced"])
def test_a_share_bounds_the_buffer_by_the_samples_seen(tmp_path, sampling):
    # share = 0.1: nothing kept before the 10th sample, then at most a tenth, up to capacity.
    buf = ReplayBuffer(tmp_path, SHAPE, budget_for(8, 2, SHAPE), hot_samples=2, sampling=sampling, share=0.1)
    rng = np.random.default_rng(0)
    for i in range(120):
        buf.offer(rng.random(SHAPE, dtype=np.float32), i % 4, rng)
        assert len(buf) == min(8, (i + 1) // 10)
    buf.flush()
    again = ReplayBuffer(tmp_path, SHAPE, budget_for(8, 2, SHAPE), hot_samples=2, sampling=sampling, share=0.1)
    assert (len(again), again.seen) == (8, 120)
    with pytest.raises(ReplayBudgetError, match="share"):
        ReplayBuffer(tmp_path, SHAPE, budget_for(8, 2, SHAPE), share=0.0)


def test_a_budget_below_one_sample_is_refused(tmp_path):
    with pytest.raises(ReplayBudgetError, match="holds no sample"):
        ReplayBuffer(tmp_path, (1, 28, 28), budget_for(1, 1, (1, 28, 28)) - 1, hot_samples=1)
    ReplayBuffer(tmp_path, (1, 28, 28), budget_for(1, 1, (1, 28, 28)), hot_samples=1)


def test_persisted_owner_only_and_reloaded(tmp_path):
    buf = ReplayBuffer(tmp_path / "data", SHAPE, budget_for(6, 2, SHAPE), hot_samples=2)
    _fill(buf, [0, 1, 2, 3, 4, 5, 6, 7, 8], seed=5)
    buf.cursor = 9
    buf.flush()
    assert stat.S_IMODE(buf.path.stat().st_mode) == 0o600
    again = ReplayBuffer(tmp_path / "data", SHAPE, budget_for(6, 2, SHAPE), hot_samples=2)
    assert again.labels.tolist() == buf.labels.tolist()
    assert (again.seen, again.cursor, again.class_seen) == (9, 9, buf.class_seen)
    a, _ = buf.draw(10, np.random.default_rng(2))
    b, _ = again.draw(10, np.random.default_rng(2))
    assert np.array_equal(a, b)


@pytest.mark.parametrize("damage", ["flip", "truncate", "shape"])
def test_a_damaged_file_is_discarded_with_a_warning(tmp_path, caplog, damage):
    buf = ReplayBuffer(tmp_path, SHAPE, budget_for(4, 1, SHAPE), hot_samples=1)
    _fill(buf, [1, 2, 3], seed=0)
    buf.flush()
    raw = bytearray(buf.path.read_bytes())
    if damage == "flip":
        raw[-40] ^= 0x01  # a bit of an input
        buf.path.write_bytes(bytes(raw))
    elif damage == "truncate":
        buf.path.write_bytes(bytes(raw[:-5]))
    shape = (2, 3) if damage == "shape" else SHAPE
    with caplog.at_level(logging.WARNING, logger="orchard.client.replay"):
        again = ReplayBuffer(tmp_path, shape, budget_for(4, 1, shape), hot_samples=1)
    assert len(again) == 0 and again.seen == 0
    assert "discarding the replay buffer" in caplog.text
    assert not again.path.exists()
    xs, _ = again.draw(5, np.random.default_rng(0))
    assert xs.shape[0] == 0  # nothing of the damaged file is ever drawn
