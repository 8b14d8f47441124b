"""The simulator's worker pool: calls, errors, cancellation, a worker that dies, closing."""

from __future__ import annotations

import math
import operator
import os
import time

import pytest

from orchard.simulation.workers import WorkerError, WorkerPool


@pytest.fixture()
def pool():  # type: ignore[no-untyped-def]
    p = WorkerPool(1, int, ())
    yield p
    p.close()


def test_calls_return_their_results_in_order(pool: WorkerPool) -> None:
    calls = [pool.submit(math.sqrt, float(i * i)) for i in range(20)]
    assert [c.result() for c in calls] == [float(i) for i in range(20)]
    # A large result comes back whole (more than the pipe holds at once), and large
    # arguments go out whole: what does not fit waits in the engine's outbox.
    big = pool.submit(bytes, 5_000_000)
    assert big.result() == bytes(5_000_000)
    sizes = [pool.submit(len, bytes(3_000_000 + i)) for i in range(3)]
    assert [c.result() for c in sizes] == [3_000_000, 3_000_001, 3_000_002]


def test_an_error_in_a_call_is_raised_by_its_result(pool: WorkerPool) -> None:
    bad = pool.submit(operator.truediv, 1, 0)
    with pytest.raises(ZeroDivisionError):
        bad.result()
    assert pool.submit(operator.add, 2, 3).result() == 5  # the worker goes on


def test_a_call_cancelled_before_its_turn_is_skipped_and_settled_after_the_worker_answers(pool: WorkerPool) -> None:
    slow = pool.submit(time.sleep, 0.3)
    queued = pool.submit(operator.add, 1, 1)
    seen: list[bool] = []
    queued.add_done_callback(lambda f: seen.append(f.cancelled()))
    assert queued.cancel()
    assert seen == []  # not settled until the worker says it skipped it
    assert slow.result() is None
    while not queued.done():
        time.sleep(0.01)
    assert queued.cancelled() and seen == [True]
    # One already running finishes; its result is kept but nobody has to wait for it.
    running = pool.submit(time.sleep, 0.2)
    time.sleep(0.1)
    running.cancel()
    assert running.result() is None and not running.cancelled()


def test_a_worker_that_dies_fails_its_calls_by_name() -> None:
    p = WorkerPool(1, int, ())
    try:
        dying = p.submit(os._exit, 3)
        after = p.submit(operator.add, 1, 2)
        with pytest.raises(WorkerError, match="exit code 3"):
            dying.result()
        with pytest.raises(WorkerError):
            after.result()
        with pytest.raises(WorkerError, match="every simulation worker process has stopped .exit code 3"):
            p.submit(operator.add, 1, 2)
    finally:
        p.close()


def test_closing_settles_every_call_and_stops_the_workers() -> None:
    p = WorkerPool(2, int, ())
    calls = [p.submit(time.sleep, 0.05) for _ in range(6)]
    procs = [w.proc for w in p._workers]
    p.close()
    assert all(c.done() for c in calls)
    assert not any(proc.is_alive() for proc in procs)
    with pytest.raises(RuntimeError, match="closed"):
        p.submit(operator.add, 1, 2)


def test_calls_go_to_the_least_busy_worker() -> None:
    p = WorkerPool(2, int, ())
    try:
        pids = [p.submit(os.getpid) for _ in range(4)]
        assert len({c.result() for c in pids}) == 2
    finally:
        p.close()


def test_a_worker_that_cannot_start_fails_its_calls_instead_of_hanging() -> None:
    p = WorkerPool(1, operator.truediv, (1, 0))  # its set-up raises ZeroDivisionError
    try:
        call = p.submit(operator.add, 1, 2)
        with pytest.raises(WorkerError, match="exit code 1"):
            call.result()
    finally:
        p.close()


def test_a_call_can_go_to_a_chosen_worker() -> None:
    # A shard keeps state in its worker: its calls go there, whoever is less busy.
    p = WorkerPool(2, int, ())
    try:
        pids = {p.submit_to(1, os.getpid).result() for _ in range(3)}
        assert len(pids) == 1
        assert pids != {p.submit_to(0, os.getpid).result()}
    finally:
        p.close()


def test_a_sharded_simulation_whose_worker_dies_stops_with_a_named_error() -> None:
    # A worker that holds a shard dies between rounds: the next round fails with the
    # pool's error, saying how the worker stopped, instead of hanging or going on
    # without that part of the tree.
    import multiprocessing
    import signal

    from orchard.config import RunConfig
    from orchard.simulation import SimulationConfig, run_simulation

    run = RunConfig.model_validate(dict(task="digits", task_params={"with_replacement": True, "samples_per_client": 20},
                                        train={"epochs": 1, "batch_size": 10, "learning_rate": 0.1}))
    cfg = SimulationConfig(clients=200, clients_per_round=20, rounds=3, aggregators=2, backend="process", workers=1,
                           progress=False, run=run)

    def kill_worker(row: dict) -> bool:
        for child in multiprocessing.active_children():
            os.kill(child.pid, signal.SIGKILL)
        return False

    with pytest.raises(WorkerError, match="killed by signal 9"):
        run_simulation(cfg, stop=kill_worker)
