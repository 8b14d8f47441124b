"""Mask folding on worker processes (orchard.server.maskworkers): the same sum as the
one-shot masks, whatever the workers do (fail a derivation, die, are busy or closed)."""

from __future__ import annotations

import functools
import time
from collections.abc import Iterator

import numpy as np
import pytest
from harness import make_config, one_shot_sum, run_session
from hypothesis import given, settings
from hypothesis import strategies as st

from orchard.secure_agg import MalformedMessage, Stage, crypto
from orchard.secure_agg.prg import MaskFolder, SeedSource
from orchard.server.maskworkers import MaskWorkers


@pytest.fixture(scope="module")
def workers() -> Iterator[MaskWorkers]:
    with MaskWorkers(2) as w:
        yield w


def _fold(acc: np.ndarray, terms: list[tuple[SeedSource, int]], **kw: object) -> MaskFolder:
    with MaskFolder(acc, **kw) as folder:  # type: ignore[arg-type]
        for seed, sign in terms:
            folder.add(seed, sign)
        folder.finish()
    return folder


def _pairwise(n: int) -> list[crypto.PairwiseSeed]:
    sks = [crypto.private_bytes(crypto.load_private(bytes([i + 1]) * 32)) for i in range(3)]
    pk = crypto.public_bytes(crypto.load_private(b"\x42" * 32))
    return [crypto.PairwiseSeed(sks[i % 3], pk, b"session", 7, f"d{i % 3}", f"v{i}") for i in range(n)]


@settings(max_examples=25, deadline=None)
@given(length=st.integers(1, 5000), bits=st.sampled_from([32, 64]),
       signs=st.lists(st.sampled_from([1, -1]), max_size=14), batch=st.integers(1, 4),
       chunk_bytes=st.sampled_from([16, 100, 4096, 1 << 18]))
def test_workers_fold_what_one_shot_masks_sum(workers: MaskWorkers, length: int, bits: int,
                                              signs: list[int], batch: int, chunk_bytes: int) -> None:
    terms = [(bytes([i + 1]) * 16, s) for i, s in enumerate(signs)]
    acc = np.arange(length, dtype=np.uint32 if bits <= 32 else np.uint64)
    start = acc.copy()
    folder = _fold(acc, terms, batch=batch, chunk_bytes=chunk_bytes, workers=workers)  # type: ignore[arg-type]
    assert np.array_equal(acc - start, one_shot_sum(terms, length, bits))
    assert folder.batches_on_workers == -(-len(terms) // batch)


def test_pairwise_derivations_fold_on_workers_as_on_threads(workers: MaskWorkers) -> None:
    seeds = _pairwise(40)
    terms: list[tuple[SeedSource, int]] = [(s, 1 if i % 3 else -1) for i, s in enumerate(seeds)]
    on_threads = np.zeros(70_001, np.uint32)
    _fold(on_threads, terms, threads=2, batch=8)
    on_workers = np.zeros(70_001, np.uint32)
    folder = _fold(on_workers, terms, threads=2, batch=8, workers=workers)
    assert folder.batches_on_workers == 5
    assert np.array_equal(on_workers, on_threads)
    # The derivation is pairwise_seed's, from the loaded key.
    s = seeds[4]
    assert s() == crypto.pairwise_seed(crypto.load_private(s.s_sk), s.peer_s_pk, b"session", 7, "d1", "v4")
    assert np.array_equal(on_threads, one_shot_sum([(s(), sign) for s, sign in terms], 70_001, 32))


def test_a_workers_error_surfaces_from_finish_and_the_workers_go_on(workers: MaskWorkers) -> None:
    # An all-zero public key is refused by X25519: the worker's MalformedMessage is raised
    # from finish, as a thread's would be.
    bad = crypto.PairwiseSeed(b"\x01" * 32, bytes(32), b"s", 1, "a", "b")
    with pytest.raises(MalformedMessage, match="X25519"):
        _fold(np.zeros(100, np.uint32), [(b"\x01" * 16, 1), (bad, 1)], batch=1, workers=workers)
    acc = np.zeros(100, np.uint32)
    folder = _fold(acc, [(b"\x02" * 16, 1)], batch=1, workers=workers)
    assert folder.batches_on_workers == 1
    assert np.array_equal(acc, one_shot_sum([(b"\x02" * 16, 1)], 100, 32))


def test_busy_workers_mean_threads(workers: MaskWorkers) -> None:
    first = MaskFolder(np.zeros(10, np.uint32), batch=1, workers=workers)
    first.add(b"\x03" * 16)  # takes the workers
    try:
        acc = np.zeros(1000, np.uint32)
        second = _fold(acc, [(b"\x04" * 16, 1), (b"\x05" * 16, -1)], threads=2, batch=1, workers=workers)
        assert second.batches_on_workers == 0
        assert np.array_equal(acc, one_shot_sum([(b"\x04" * 16, 1), (b"\x05" * 16, -1)], 1000, 32))
    finally:
        first.close()  # gives them back without a result
    acc = np.zeros(10, np.uint32)
    assert _fold(acc, [(b"\x06" * 16, 1)], batch=1, workers=workers).batches_on_workers == 1
    assert np.array_equal(acc, one_shot_sum([(b"\x06" * 16, 1)], 10, 32))


def test_a_seed_source_that_does_not_pickle_folds_on_a_thread(workers: MaskWorkers) -> None:
    terms: list[tuple[SeedSource, int]] = [(lambda: b"\x07" * 16, 1), (b"\x08" * 16, -1)]
    acc = np.zeros(500, np.uint32)
    folder = _fold(acc, terms, batch=1, workers=workers)
    assert folder.batches_on_workers == 1
    assert np.array_equal(acc, one_shot_sum([(b"\x07" * 16, 1), (b"\x08" * 16, -1)], 500, 32))


def test_a_worker_that_dies_costs_time_not_the_sum() -> None:
    terms = [(bytes([i + 1]) * 16, 1 if i % 2 else -1) for i in range(6)]
    with MaskWorkers(2) as workers:
        acc = np.zeros(3000, np.uint32)
        folder = MaskFolder(acc, batch=1, workers=workers)
        for seed, sign in terms:
            folder.add(seed, sign)
        victim = workers._workers[0].process
        victim.kill()
        victim.join(5)
        folder.finish()
        assert np.array_equal(acc, one_shot_sum(terms, 3000, 32))
        assert folder.batches_on_workers == 3  # the dead worker's three were folded here
        assert workers.processes == 1 and len(workers.pids) == 2
        # The next fold uses the worker that is left.
        acc = np.zeros(3000, np.uint32)
        assert _fold(acc, terms, batch=1, workers=workers).batches_on_workers == 6
        assert np.array_equal(acc, one_shot_sum(terms, 3000, 32))
    assert workers.closed and workers.processes == 0
    acc = np.zeros(3000, np.uint32)
    assert _fold(acc, terms, batch=1, workers=workers).batches_on_workers == 0  # closed: threads
    assert np.array_equal(acc, one_shot_sum(terms, 3000, 32))


def test_workers_refuse_a_bad_count() -> None:
    with pytest.raises(ValueError, match="processes"):
        MaskWorkers(0)


@pytest.mark.parametrize("uneven_ids", [False, True])
def test_session_with_dropouts_unmasks_the_same_sum_on_workers(workers: MaskWorkers, uneven_ids: bool) -> None:
    """The whole protocol, clients dropping after sharing keys (so the server removes
    their pairwise masks): the sum with workers is the sum on threads, and the inputs'."""
    n, d = 12, 3001
    config = make_config(n, d, 6, 4, seed=21, uneven_ids=uneven_ids)
    rng = np.random.default_rng(5)
    p = config.participants
    inputs = {q: rng.integers(0, 1 << 16, d, dtype=np.uint32) for q in p}
    drop = {Stage.MASKED_INPUT: [p[2], p[7]]}
    results = []
    for w in (None, workers):
        server, _ = run_session(config, inputs, drop, seed=21, threads=2, workers=w)
        res = server.result()
        results.append(res.total)
        if w is not None:
            assert res.measurements["mask_batches_on_workers"] >= 1
            assert res.measurements["key_agreements"] > 0
    want = sum((inputs[q] for q in p if q not in (p[2], p[7])), np.zeros(d, np.uint32))
    assert np.array_equal(results[0], want) and np.array_equal(results[1], want)



def _slow_seed(i: int) -> bytes:
    time.sleep(0.02)
    return bytes([i % 250 + 1]) * 16


def test_a_fold_given_up_does_not_hold_up_the_next() -> None:
    """A session that aborts part-way (a corrupted key share, say) gives the workers back
    with batches still queued: they skip those instead of folding them for nobody."""
    with MaskWorkers(1) as workers:
        _fold(np.zeros(10, np.uint32), [(b"\x01" * 16, 1)], batch=1, workers=workers)  # started
        folder = MaskFolder(np.zeros(10, np.uint32), batch=1, workers=workers)
        for i in range(100):  # two seconds of derivations queued
            folder.add(functools.partial(_slow_seed, i))
        folder.close()
        t0 = time.perf_counter()
        acc = np.zeros(10, np.uint32)
        assert _fold(acc, [(b"\x02" * 16, 1)], batch=1, workers=workers).batches_on_workers == 1
        assert time.perf_counter() - t0 < 1.0
        assert np.array_equal(acc, one_shot_sum([(b"\x02" * 16, 1)], 10, 32))
