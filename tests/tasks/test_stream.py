"""Streams of device data and the continual trainer: arrival by time, the new/replayed
mix, a restart that resumes the stream, a real device's appended file, validation."""

from __future__ import annotations

import numpy as np
import pytest

from orchard.client.launch import ClientOptions, ClientSetup, trainer_factory
from orchard.client.replay import budget_for
from orchard.config import ContinualConfig, RunConfig
from orchard.edge_runtime.policy import DevicePolicy, ReplayPolicy
from orchard.errors import ConfigError
from orchard.tasks import get_task
from orchard.tasks.continual import ContinualTrainer
from orchard.tasks.stream import (
    AppendedSamples,
    ArrivalStream,
    StreamingTask,
    class_incremental_arrivals,
)
from orchard.tasks.torch_trainer import TensorData
from orchard.trainer import TrainConfig
from orchard.validation import data_problems

PERIODS = [[0, 1, 2, 3, 4], [5, 6, 7, 8, 9]]


@pytest.fixture(scope="module")
def digits():
    return get_task("digits")


def test_class_incremental_arrivals_follow_the_periods():
    labels = np.array([0, 5, 1, 9, 3, 7, 4])
    t = class_incremental_arrivals(labels, [[0, 1], [3, 4], [5]], 10.0, np.random.default_rng(0))
    assert np.all((t[[0, 2]] >= 0) & (t[[0, 2]] < 10))
    assert np.all((t[[4, 6]] >= 10) & (t[[4, 6]] < 20))
    assert 20 <= t[1] < 30
    assert np.isinf(t[3]) and np.isinf(t[5])  # classes in no period never arrive


def test_a_stream_gives_what_arrived_by_its_clock():
    pool = TensorData.from_numpy(np.arange(6, dtype=np.float32).reshape(6, 1), np.arange(6))
    s = ArrivalStream(pool, np.arange(6), np.array([5.0, 1.0, np.inf, 3.0, 9.0, 2.0]))
    s.arrive(0.5)
    assert s.read(0)[1].tolist() == []
    s.arrive(3.0)
    assert s.read(0)[1].tolist() == [1, 5, 3]
    s.arrive(100.0)
    assert s.read(2)[1].tolist() == [3, 0, 4]  # after the first two, in arrival order; 2 never arrives


def _trainer(digits, tmp_path, ratio, now, budget_samples=20):
    st = StreamingTask(digits, ContinualConfig(periods=PERIODS, period_s=10.0, replay_ratio=ratio,
                                               simulated_budget_bytes=budget_for(budget_samples, 4, (64,))),
                       tmp_path)
    tr = st.client_trainer(0, 10, 0)
    tr.arrive(now)
    return tr


@pytest.mark.parametrize(("ratio", "per_epoch"), [(0.0, 1), (0.5, 2), (1.0, 1)])
def test_steps_mix_new_and_replayed_samples_at_the_ratio(digits, tmp_path, ratio, per_epoch):
    tr = _trainer(digits, tmp_path, ratio, now=10.0)  # the first period
    first = tr.stream.read(0)[1]
    arrays = digits.initial_arrays(0)
    r1 = tr.train(arrays, TrainConfig(batch_size=len(first), epochs=1))
    assert (r1.num_examples, r1.num_steps) == (len(first), 1)  # empty buffer: all new
    assert set(tr.buffer().labels.tolist()) <= set(PERIODS[0])
    tr.arrive(20.0)
    new = len(tr.stream.read(tr.buffer().cursor)[1])
    b = 2 * ((new + 1) // 2)  # k = b/2 replayed, b/2 new: two steps an epoch at ratio 0.5
    r2 = tr.train(r1.arrays, TrainConfig(batch_size=b, epochs=1))
    assert r2.num_examples == new
    assert r2.num_steps == per_epoch
    assert tr.buffer().cursor == len(first) + new
    # What leaves the device is the model's tensors, nothing of the buffer.
    assert set(r2.arrays) == set(arrays)
    assert all(r2.arrays[k].shape == arrays[k].shape for k in arrays)


def test_a_restarted_trainer_resumes_its_stream_and_keeps_its_buffer(digits, tmp_path):
    tr = _trainer(digits, tmp_path, 0.5, now=10.0)
    arrays = digits.initial_arrays(0)
    tr.train(arrays, TrainConfig(batch_size=8))
    kept = tr.buffer().labels.tolist()
    again = _trainer(digits, tmp_path, 0.5, now=10.0)  # a new process, the same device directory
    assert again.buffer().labels.tolist() == kept
    assert again.train(arrays, TrainConfig(batch_size=8)).num_examples == 0  # nothing new arrived


def test_a_ratio_outside_unit_interval_is_refused(digits, tmp_path):
    with pytest.raises(ConfigError, match=r"replay_ratio must be in \[0, 1\]"):
        ContinualTrainer(lambda: digits.build_model(), AppendedSamples(tmp_path / "d.bin", (64,)), tmp_path,
                         10_000, replay_ratio=1.5)


def test_a_real_device_reads_samples_appended_between_rounds(digits, tmp_path):
    data = tmp_path / "samples.bin"
    x, y = digits.train_data.x.numpy(), digits.train_data.y.numpy()
    with open(data, "ab") as f:
        for i in range(12):
            f.write(AppendedSamples.record(x[i], int(y[i])))
    policy = DevicePolicy(replay=ReplayPolicy(budget_bytes=budget_for(6, 2, (64,)), hot_samples=2))
    setup = ClientSetup(ClientOptions(server="x:1", task="digits", data=data, state_dir=tmp_path / "state"),
                        policy=policy)
    cfg = RunConfig(task="digits", continual=ContinualConfig(periods=PERIODS, replay_ratio=0.5))
    trainer = trainer_factory(setup)(cfg)
    arrays = digits.initial_arrays(0)
    assert trainer.train(arrays, TrainConfig(batch_size=4)).num_examples == 12
    with open(data, "ab") as f:  # the app appends 5 more, and half of a sixth
        for i in range(12, 17):
            f.write(AppendedSamples.record(x[i], int(y[i])))
        f.write(AppendedSamples.record(x[17], int(y[17]))[:30])
    got = trainer.train(arrays, TrainConfig(batch_size=4))
    assert got.num_examples == 5
    buf = trainer.buffer()
    assert buf.cursor == 17 and len(buf) == buf.capacity == 6
    assert (tmp_path / "state" / "replay" / "replay.bin").is_file()
    # Without a replay budget in the policy a continual device is refused with its reason.
    bare = ClientSetup(setup.options, policy=DevicePolicy())
    with pytest.raises(ConfigError, match="replay budget"):
        trainer_factory(bare)(cfg)


def test_a_directory_of_npz_files_is_read_in_name_order(tmp_path):
    d = tmp_path / "drop"
    d.mkdir()
    np.savez(d / "001.npz", x=np.zeros((3, 2), np.float32), y=np.array([1, 2, 3]))
    s = AppendedSamples(d, (2,))
    assert s.read(0)[1].tolist() == [1, 2, 3]
    np.savez(d / "002.npz", x=np.ones((2, 2), np.float32), y=np.array([4, 5]))
    assert s.read(3)[1].tolist() == [4, 5]


def test_validate_names_each_continual_problem():
    base = {"task": "digits"}
    bad = data_problems({"run": {**base, "continual": {"periods": [[0, 1]], "replay_ratio": 1.2,
                                                       "simulated_budget_bytes": 100}}})
    assert any("continual.replay_ratio must be in [0, 1]" in p for p in bad)
    assert any("continual.simulated_budget_bytes" in p and "holds no sample" in p for p in bad)
    assert data_problems({"run": {**base, "continual": {"periods": [[0, 1]], "replay_ratio": -0.1}}})
    policy = data_problems({"run": base, "policy": {"replay": {"budget_bytes": 64}}})
    assert any(p.startswith("policy.replay.budget_bytes") and "holds no sample" in p for p in policy)
    ok = {"run": {**base, "continual": {"periods": [[0, 1], [2, 3]], "replay_ratio": 0.5,
                                        "simulated_budget_fraction": 0.1}},
          "policy": {"replay": {"budget_bytes": budget_for(4, 4, (64,))}}}
    assert data_problems(ok) == []


def test_a_simulated_buffer_keeps_at_most_its_share_of_what_it_has_seen(digits, tmp_path):
    # simulated_budget_fraction = 0.1: the buffer grows with the samples seen, never past 10%.
    st = StreamingTask(digits, ContinualConfig(periods=PERIODS, period_s=10.0, replay_ratio=0.5,
                                               simulated_budget_fraction=0.1), tmp_path)
    for now in (5.0, 10.0, 15.0, 20.0):
        tr = st.client_trainer(0, 10, 0)
        tr.arrive(now)
        tr.train(digits.initial_arrays(0), TrainConfig(epochs=1, batch_size=4, learning_rate=0.1, seed=1))
        buf = tr.buffer()
        assert buf.seen == buf.cursor > 0
        assert len(buf) == int(0.1 * buf.seen + 1e-9)  # filled up to the share, and no further


def test_a_personal_step_trains_on_the_round_samples_without_consuming_them(digits, tmp_path):
    from orchard.client.personal import Ditto

    tr = _trainer(digits, tmp_path, 0.5, 100.0)
    w = digits.initial_arrays(0)
    cfg = TrainConfig(epochs=1, batch_size=8, learning_rate=0.1, seed=3)
    res = tr.train(w, cfg)
    before = tr.buffer()
    personal = Ditto(steps=5, lam=0.5).personalize(tr, res.arrays, None, cfg)
    after = tr.buffer()
    # The buffer and the stream's cursor are the round's: the personal step read, not consumed.
    assert (after.cursor, after.seen, after.labels.tolist()) == (before.cursor, before.seen, before.labels.tolist())
    assert personal is not None and any(not np.allclose(personal[k], res.arrays[k]) for k in personal)
    # lam pulls towards the anchor: a huge pull keeps the adapter at the global one.
    pulled = Ditto(steps=5, lam=1e3, learning_rate=1e-3).personalize(tr, res.arrays, None, cfg)
    assert pulled is not None
    far = max(float(np.abs(personal[k] - res.arrays[k]).max()) for k in personal)
    near = max(float(np.abs(pulled[k] - res.arrays[k]).max()) for k in pulled)
    assert near < far


def test_a_streaming_task_scores_each_periods_classes(digits, tmp_path):
    st = StreamingTask(digits, ContinualConfig(periods=PERIODS, period_s=10.0), tmp_path)
    got = st.evaluate(digits.initial_arrays(0))
    labels = np.asarray(digits.test_labels)
    shares = [np.isin(labels, g).mean() for g in PERIODS]
    assert set(got) >= {"accuracy", "loss", "accuracy_period_0", "accuracy_period_1"}
    # The whole test set's accuracy is the periods' accuracies weighted by their share of it.
    assert got["accuracy"] == pytest.approx(sum(s * got[f"accuracy_period_{p}"] for p, s in enumerate(shares)))
