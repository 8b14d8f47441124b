"""Where the simulator's clients train: the Ray and process backends, trees sharded over
worker processes, work handed to workers while the engine waits, and the packed outputs
and shared segments the workers send back -- each the same round as in one process."""

from __future__ import annotations

import numpy as np
import pytest
from sim_cases import ALWAYS_ON, _deterministic, _run, _sim

from orchard.config import CohortConfig
from orchard.messages import UploadHeader, UploadKind
from orchard.simulation import DeviceProfile, run_simulation
from orchard.typing import TensorSpec


def test_ray_backend_matches_local() -> None:
    pytest.importorskip("ray")
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    local = run_simulation(_deterministic(12, aggregators=2, rounds=1))
    # In a fresh process, as `orchard simulate --backend ray` runs (Ray forks its local
    # cluster's processes; a test worker that ran gRPC servers has threads a fork can
    # catch mid-call).
    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        remote = pool.submit(run_simulation, _deterministic(12, aggregators=2, rounds=1, backend="ray",
                                                            workers=2)).result()
    for k, v in local.final_arrays.items():
        np.testing.assert_array_equal(remote.final_arrays[k], v)


def test_process_backend_matches_local() -> None:
    # Worker processes (spawned, each with its own task) send their outputs back packed
    # (PackedOutputs): the same uploads, so the same model, as training in this process.
    local = run_simulation(_sim(rounds=2, chunk_size=16))
    remote = run_simulation(_sim(rounds=2, chunk_size=16, backend="process", workers=2))
    assert [r["participants"] for r in remote.rounds] == [r["participants"] for r in local.rounds]
    assert [r["bytes_up"] for r in remote.rounds] == [r["bytes_up"] for r in local.rounds]
    for k, v in local.final_arrays.items():
        np.testing.assert_array_equal(remote.final_arrays[k], v)


_ROUND_KEYS = ("participants", "selected", "dropped", "weight", "bytes_up", "bytes_down", "closed_because",
               "tier_participants", "rejected", "checked_in", "trained", "late", "vanished", "stopped_by_governor",
               "stopped_early", "failed_clients", "simulated_seconds")


def _same_rounds(a: list[dict], b: list[dict]) -> None:
    assert len(a) == len(b)
    for ra, rb in zip(a, b, strict=True):
        for key in _ROUND_KEYS:
            assert ra.get(key) == rb.get(key), (ra["round"], key, ra.get(key), rb.get(key))


@pytest.mark.parametrize(("aggregators", "extra"), [
    (3, {}),
    ([2, 2], {}),
    # Central DP (each round's config carries the clip, the root adds the noise) and
    # downlink deltas (each shard's devices hold their models, its tiers reply deltas).
    (3, {"downlink_delta": True, "privacy": {"mode": "central", "target_epsilon": 8.0, "clip_norm": 1.0}}),
])
def test_a_sharded_tree_runs_the_round_of_one_process(aggregators: object, extra: dict) -> None:
    # With worker processes, the root's subtrees are split between the engine and the
    # workers (shards), each checking in, training and folding its own. Some rounds here
    # are cut by the tiers' deadlines (slow devices that never make it, and devices that
    # vanish), so clients arrive late; codec states carry from round to round (error
    # feedback). Every count, every byte, the simulated time
    # and the model are those of one process running the whole tree, and of workers
    # that only train.
    from orchard.simulation import shards

    slow = DeviceProfile(gflops=1e-6, battery=False, availability=[1.0] * 24, dropout=0.1, latency_s=0.05)
    weighting = "uniform" if "privacy" in extra else "examples"  # (central DP bounds each client's share)
    run = _run(cohort=CohortConfig(target=24, over_selection=1.5, min_fraction=0.1, deadline_s=60.0,
                                   weighting=weighting),
               codec={"name": "error_feedback", "params": {"codec": {"name": "topk", "params": {"fraction": 0.1}}}},
               **extra)
    kw: dict[str, object] = dict(clients=300, clients_per_round=24, rounds=3, aggregators=aggregators, run=run,
                                 profiles={"box": ALWAYS_ON, "slow": slow}, devices={"box": 0.6, "slow": 0.4},
                                 chunk_size=8)
    runs: list[int] = []
    real = shards.Shard.run

    def counting(self: shards.Shard, *a: object) -> object:
        runs.append(len(self._tree.tops or []))
        return real(self, *a)  # type: ignore[arg-type]

    local = run_simulation(_sim(**kw))
    whole = run_simulation(_sim(**kw, backend="process", workers=1, shard=False))
    assert not runs
    shards.Shard.run = counting  # type: ignore[method-assign]
    try:
        sharded = run_simulation(_sim(**kw, backend="process", workers=2))
    finally:
        shards.Shard.run = real  # type: ignore[method-assign]
    assert runs and all(0 < n < (3 if aggregators == 3 else 2) for n in runs)  # the engine ran part of the tree
    assert any(r["closed_because"] != "target reached" for r in local.rounds)
    assert any(r["late"] > 0 for r in local.rounds)
    _same_rounds(local.rounds, whole.rounds)
    _same_rounds(local.rounds, sharded.rounds)
    for k, v in local.final_arrays.items():
        np.testing.assert_array_equal(whole.final_arrays[k], v)
        np.testing.assert_array_equal(sharded.final_arrays[k], v)


def test_a_sharded_round_that_fails_is_retried_as_in_one_process() -> None:
    # Every update is needed (min_fraction 1) and some devices vanish: attempts fail and
    # are retried (a new attempt: other check-ins, a fresh session at every tier) until
    # the retries run out. The sharded run fails the same attempts, with the same
    # counts and reason, as one process.
    run = _run(cohort=CohortConfig(target=20, over_selection=1.0, min_fraction=1.0, deadline_s=60.0, max_retries=2))
    kw: dict[str, object] = dict(clients=200, clients_per_round=20, rounds=2, aggregators=2, run=run, chunk_size=8)
    local = run_simulation(_sim(**kw))
    sharded = run_simulation(_sim(**kw, backend="process", workers=1))
    assert local.failed_attempts > 0
    assert (sharded.status, sharded.failed_attempts) == (local.status, local.failed_attempts)
    _same_rounds(local.rounds, sharded.rounds)
    for k, v in local.final_arrays.items():
        np.testing.assert_array_equal(sharded.final_arrays[k], v)


def test_a_shard_counts_only_what_happened_before_the_root_closed() -> None:
    # A shard runs its subtrees to the end; the root, in the engine, says when the round
    # ended. What the shard logged from then on is late (clients) or not counted at all
    # (partials), as when one loop stops at the root's close.
    from orchard.server.round import SimulatedCounts
    from orchard.simulation.jobs import count_log

    log = [(1.0, True, ""), (2.0, True, "failed"), (2.5, False, "LateRoundError"), (3.0, True, "StaleUpdateError"),
           (4.0, True, ""), (4.0, False, "LateRoundError"), (5.0, True, "late")]
    stats = SimulatedCounts()
    count_log(stats, log, 4.0)
    assert (stats.trained, stats.failed_clients, stats.late) == (3, 1, 2)
    assert stats.rejected == {"LateRoundError": 1, "StaleUpdateError": 1}


def test_clients_trained_ahead_change_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    # With worker processes, the engine hands the idle worker jobs of clients while it is
    # still dispatching devices (small jobs here, so it happens in a 40-client round):
    # some are later expected late and never needed. The model, the participants and the
    # bytes are the same as training every client at its turn, in this process.
    from orchard.simulation import ahead as ahead_module

    monkeypatch.setattr(ahead_module, "_AHEAD_BATCH", 4)
    monkeypatch.setattr(ahead_module, "_AHEAD_MAX", 24)
    ahead: list[int] = []
    real = ahead_module.TrainingAhead.send

    def counting(self: ahead_module.TrainingAhead, queued: list, *a: object) -> list:
        ahead.append(len(self.parts))
        return real(self, queued, *a)  # type: ignore[arg-type]

    monkeypatch.setattr(ahead_module.TrainingAhead, "send", counting)
    local = run_simulation(_sim(rounds=2, chunk_size=16))
    assert not ahead  # in-process backends train nothing ahead
    remote = run_simulation(_sim(rounds=2, chunk_size=16, backend="process", workers=1, shard=False))
    assert ahead and max(ahead) > 0
    assert [r["participants"] for r in remote.rounds] == [r["participants"] for r in local.rounds]
    assert [r["trained"] for r in remote.rounds] == [r["trained"] for r in local.rounds]
    assert [r["bytes_up"] for r in remote.rounds] == [r["bytes_up"] for r in local.rounds]
    for k, v in local.final_arrays.items():
        np.testing.assert_array_equal(remote.final_arrays[k], v)


def test_device_models_run_on_a_worker_change_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    # With worker processes, the engine sends batches of devices (as snapshots) to run
    # their governors on the idle worker, first while it hands the cohort its tasks,
    # then while it runs the others (small batches here, so it happens in a 40-client
    # round). Every device's steps, time and state -- so the fates, the uploads and the
    # model -- are those of running each one here.
    import orchard.simulation.device_model as device_model
    from orchard.simulation.backends import ProcessBackend

    monkeypatch.setattr(device_model, "_DEVICE_BATCH", 4)
    sent: list[int] = []
    during_hand_out: list[int] = []
    real = ProcessBackend.run_devices
    real_results = device_model.DeviceRuns.results

    def counting(self: ProcessBackend, params: dict, batch: list) -> object:
        sent.append(len(batch))
        return real(self, params, batch)

    def results(self: device_model.DeviceRuns) -> list[tuple[float, int]]:
        during_hand_out.append(self._sent)
        return real_results(self)

    monkeypatch.setattr(ProcessBackend, "run_devices", counting)
    monkeypatch.setattr(device_model.DeviceRuns, "results", results)
    local = run_simulation(_sim(rounds=2, chunk_size=16))
    remote = run_simulation(_sim(rounds=2, chunk_size=16, backend="process", workers=1, shard=False))
    assert sum(sent) >= sum(during_hand_out) > 0  # some went while the cohort was handed out
    for key in ("participants", "trained", "bytes_up", "simulated_seconds", "stopped_by_governor", "stopped_early",
                "vanished", "late"):
        assert [r[key] for r in remote.rounds] == [r[key] for r in local.rounds], key
    for k, v in local.final_arrays.items():
        np.testing.assert_array_equal(remote.final_arrays[k], v)


def test_engine_trains_while_it_waits_on_a_slow_worker(monkeypatch: pytest.MonkeyPatch) -> None:
    # A backend whose worker is slow (each job takes 50 ms, on a thread) and that can run
    # jobs in the engine's process: the engine trains the next clients itself while it
    # waits, and the round's uploads -- so the model -- are the same.
    import threading
    import time
    from concurrent.futures import Future

    import orchard.simulation.runner as runner
    from orchard.simulation.backends import LocalBackend

    class SlowWorker(LocalBackend):
        def __init__(self, *a: object) -> None:
            super().__init__(*a)
            self.here = 0

        def submit(self, jobs, global_arrays, starts=None):  # type: ignore[no-untyped-def]
            fut: Future = Future()

            def work() -> None:
                time.sleep(0.05)
                fut.set_result(self._run(jobs, global_arrays, starts))

            threading.Thread(target=work).start()
            return fut

        def run_here(self, jobs, global_arrays, starts=None):  # type: ignore[no-untyped-def]
            self.here += len(jobs)
            return self._run(jobs, global_arrays, starts)

    made: list[SlowWorker] = []

    def make(kind, task, task_name, task_params, population, cfg, workers, vectorize, device="cpu"):  # type: ignore[no-untyped-def]
        made.append(SlowWorker(task, population, cfg, 1, vectorize))
        return made[-1]

    plain = run_simulation(_sim(rounds=2, chunk_size=8))
    monkeypatch.setattr(runner, "make_backend", make)
    helped = run_simulation(_sim(rounds=2, chunk_size=8))
    assert made[0].here > 0
    assert [r["trained"] for r in helped.rounds] == [r["trained"] for r in plain.rounds]
    for k, v in plain.final_arrays.items():
        np.testing.assert_array_equal(helped.final_arrays[k], v)


def test_packed_outputs_round_trip() -> None:
    import pickle

    from orchard.simulation.clients import ClientOutput, PackedOutputs

    outs = [ClientOutput(3, "device-3", None, b"", error="no training data"),
            ClientOutput(5, "device-5", None, b"\x01\x02\x03", {"w": {"residual": np.ones(2)}},
                         metrics={"train_loss": 0.5}),
            ClientOutput(7, "device-7", None, bytes(range(256)) * 80)]
    header = UploadHeader(node_id="device-9", run_id="r", round=2, attempt=0, task_id="t",
                          kind=UploadKind.CLIENT_UPDATE, schema=(TensorSpec("w", (2,), "float32"),),
                          payload_sizes=(4,), codec="float32", payload_sha256="ab", weight=3.0, count=1,
                          metric_sums={"train_loss": 1.5}, metric_weights={"train_loss": 3.0})
    outs.append(ClientOutput(9, "device-9", header, b"\x00\x01\x02\x03"))
    back = pickle.loads(pickle.dumps(PackedOutputs(outs))).unpack()
    assert [(o.partition, o.node_id, o.header, o.payload, o.error, o.metrics) for o in back] == \
        [(o.partition, o.node_id, o.header, o.payload, o.error, o.metrics) for o in outs]
    assert type(back[3].header) is UploadHeader and back[3].header.total_bytes == 4
    assert all(type(o.payload) is bytes for o in back)
    np.testing.assert_array_equal(back[1].codec_state["w"]["residual"], np.ones(2))
    # Given the jobs' schemas, a header takes the engine's own schema object when equal.
    assert back[3].header.schema is not header.schema
    mine, other = (TensorSpec("w", (2,), "float32"),), (TensorSpec("v", (2,), "float32"),)
    again = pickle.loads(pickle.dumps(PackedOutputs(outs))).unpack((other, mine))
    assert again[3].header.schema is mine and again[3].header == header
    assert pickle.loads(pickle.dumps(PackedOutputs(outs))).unpack((other,))[3].header.schema == header.schema


def test_packed_outputs_write_payloads_into_a_shared_buffer_when_they_fit() -> None:
    import pickle

    from orchard.simulation.clients import ClientOutput, PackedOutputs

    outs = [ClientOutput(1, "device-1", None, b"abc"), ClientOutput(2, "device-2", None, b""),
            ClientOutput(3, "device-3", None, bytes(range(200)))]
    seg = memoryview(bytearray(256))
    packed = pickle.loads(pickle.dumps(PackedOutputs(outs, seg)))
    assert packed.in_segment and packed.blob == b""
    with pytest.raises(ValueError, match="shared segment"):
        packed.unpack()
    back = packed.unpack((), seg)
    assert [(o.partition, o.payload) for o in back] == [(o.partition, o.payload) for o in outs]
    assert all(type(o.payload) is bytes for o in back)
    seg[:] = bytes(256)  # copied out: the segment can take the next job's
    assert back[2].payload == bytes(range(200))
    # Too little room: the payloads travel in the pickle, as without a segment.
    small = pickle.loads(pickle.dumps(PackedOutputs(outs, memoryview(bytearray(100)))))
    assert not small.in_segment
    assert [o.payload for o in small.unpack()] == [o.payload for o in outs]


def test_worker_payloads_come_back_through_shared_segments(monkeypatch: pytest.MonkeyPatch) -> None:
    # After the first job (the payload size is not known before it), a worker writes its
    # jobs' payloads into the engine's shared segments; the round is the same as in this
    # process, and closing the backend removes every segment.
    from multiprocessing.shared_memory import SharedMemory

    import orchard.simulation.backends as backends
    from orchard.simulation.clients import PackedOutputs

    seen: list[bool] = []
    made: list[str] = []
    unpack, new_segment = PackedOutputs.unpack, backends._new_segment

    def recording_unpack(self, schemas=(), segment=None):  # type: ignore[no-untyped-def]
        seen.append(self.in_segment)
        return unpack(self, schemas, segment)

    def recording_new(size: int):  # type: ignore[no-untyped-def]
        seg = new_segment(size)
        made.append(seg.name)
        return seg

    monkeypatch.setattr(PackedOutputs, "unpack", recording_unpack)
    monkeypatch.setattr(backends, "_new_segment", recording_new)
    local = run_simulation(_sim(rounds=2, chunk_size=8))
    remote = run_simulation(_sim(rounds=2, chunk_size=8, backend="process", workers=1, shard=False))
    assert seen[0] is False and any(seen), seen
    assert 0 < len(made) <= 8  # about as many as jobs in flight, reused from job to job
    for k, v in local.final_arrays.items():
        np.testing.assert_array_equal(remote.final_arrays[k], v)
    for name in made:
        with pytest.raises(FileNotFoundError):
            SharedMemory(name)


def test_a_segment_goes_back_whatever_becomes_of_its_job() -> None:
    from concurrent.futures import Future

    from orchard.simulation.backends import _Segments, _Unpacked
    from orchard.simulation.clients import ClientOutput, PackedOutputs

    segments = _Segments()
    segments.give(None, 1000)  # a first job came back through the pipe: 1,000-byte payloads
    try:
        seg = segments.take(3)
        assert seg is not None and seg.size >= 3000
        failed: Future = Future()
        _Unpacked(failed, (), segments, seg)
        failed.set_exception(RuntimeError("worker died"))
        assert segments.take(3) is seg  # back in the pool, and reused
        done: Future = Future()
        outer = _Unpacked(done, (), segments, seg)
        assert done.set_running_or_notify_cancel()  # the worker took it
        outer.cancel()  # the engine no longer waits for it; the worker still writes to it
        assert segments.take(3) is not seg
        done.set_result(PackedOutputs([ClientOutput(1, "device-1", None, b"x" * 10)], seg.buf))
        assert segments.take(3) is seg
        queued: Future = Future()
        _Unpacked(queued, (), segments, seg).cancel()  # cancelled before a worker took it
        assert queued.cancelled() and segments.take(3) is seg
    finally:
        segments.close()


def test_a_finished_worker_job_is_freed_without_the_garbage_collector() -> None:
    # The packed outputs must not be kept alive by a reference cycle between the
    # worker's future and the unpacking one (~40 MB a job until a full collection).
    import gc
    import weakref
    from concurrent.futures import Future

    from orchard.simulation.backends import _Unpacked
    from orchard.simulation.clients import ClientOutput, PackedOutputs

    gc.disable()
    try:
        inner: Future = Future()
        outer = _Unpacked(inner)
        alive = weakref.ref(inner)
        inner.set_result(PackedOutputs([ClientOutput(1, "device-1", None, b"x" * 100)]))
        del inner
        assert alive() is None
        assert outer.result()[0].payload == b"x" * 100
    finally:
        gc.enable()


def test_job_sizes_do_not_change_the_round() -> None:
    # The engine starts each round with small training jobs and grows them to
    # chunk_size; which clients train and what they send must not depend on that.
    whole = run_simulation(_deterministic(40, aggregators=2, rounds=1, chunk_size=1024))
    pieces = run_simulation(_deterministic(40, aggregators=2, rounds=1, chunk_size=3, workers=2))
    assert whole.rounds[0]["participants"] == pieces.rounds[0]["participants"] == 40
    for k, v in whole.final_arrays.items():
        np.testing.assert_allclose(pieces.final_arrays[k], v, rtol=1e-6, atol=1e-7)




def test_pace_sizes_jobs_to_the_measured_training_time() -> None:
    from orchard.simulation.jobs import Pace

    pace = Pace()
    assert pace.clients(512) == 512  # not measured yet: the sizes as asked
    pace.timed(100, 100 * 20e-6)  # 20 us a client (a vectorised small model)
    assert pace.clients(512) == 512
    pace.timed(50, 50 * 0.004)  # 4 ms a client: 0.1 s is 25 clients
    assert pace.clients(512) == 25 and pace.clients(10) == 10
    pace.timed(2, 2 * 3.0)  # slower than a job's time: one client a job
    assert pace.clients(512) == 1
    pace.timed(0, 1.0)  # nothing trained says nothing
    assert pace.clients(512) == 1


def test_jobs_sized_by_the_pace_change_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    # Once the engine has timed clients it trained itself, the jobs it hands the worker
    # (and the ones it trains while it waits) hold about Pace.JOB_SECONDS of training:
    # here so little that they shrink to a client or two. Which clients train and what
    # they upload do not depend on how they were grouped into jobs.
    from orchard.simulation.backends import ProcessBackend
    from orchard.simulation.jobs import Pace

    monkeypatch.setattr(Pace, "JOB_SECONDS", 1e-9)
    sizes: list[int] = []
    real = ProcessBackend.submit

    def counting(self: ProcessBackend, jobs: list, *a: object) -> object:
        sizes.append(len(jobs))
        return real(self, jobs, *a)  # type: ignore[arg-type]

    monkeypatch.setattr(ProcessBackend, "submit", counting)
    local = run_simulation(_sim(rounds=3, chunk_size=16))
    remote = run_simulation(_sim(rounds=3, chunk_size=16, backend="process", workers=1, shard=False))
    assert sizes and min(sizes) == 1 and max(sizes) > 1  # shrunk once measured
    for key in ("participants", "trained", "bytes_up", "late"):
        assert [r[key] for r in remote.rounds] == [r[key] for r in local.rounds], key
    for k, v in local.final_arrays.items():
        np.testing.assert_array_equal(remote.final_arrays[k], v)
