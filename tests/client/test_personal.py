"""Personal adapters: the strategies, the device's store, what an upload carries, and the
config's validation."""

from __future__ import annotations

import asyncio
import stat
from pathlib import Path

import numpy as np
import pytest

from orchard import personal_metrics, wire
from orchard.client.personal import (
    DevicePersonal,
    Ditto,
    FineTune,
    NoPersonalization,
    PersonalizationError,
    PersonalStore,
    held_out_problems,
    personalize_and_evaluate,
)
from orchard.client.runtime import ClientRuntime
from orchard.compression import build_codec
from orchard.compression.update import decode_update
from orchard.config import RunConfig, parse_run_config
from orchard.errors import ConfigError
from orchard.messages import TaskAssignment
from orchard.tasks import get_task
from orchard.trainer import TrainConfig
from orchard.typing import schema_of
from orchard.updates import split
from orchard.validation import data_problems

POP = 20
TRAIN = TrainConfig(epochs=1, batch_size=8, learning_rate=0.1)


@pytest.fixture(scope="module")
def task():
    return get_task("digits", alpha=0.1)


def _distance(a, b) -> float:
    return float(np.sqrt(sum(float(np.sum((a[k] - b[k]) ** 2)) for k in a)))


def test_finetune_trains_from_the_global_adapter_and_leaves_it_alone(task) -> None:
    trainer = task.client_trainer(3, POP, 0)
    g = task.initial_arrays(0)
    kept = {k: v.copy() for k, v in g.items()}
    p = FineTune(steps=5).personalize(trainer, g, None, TRAIN)
    assert p is not None and _distance(p, g) > 0
    assert all(np.array_equal(g[k], kept[k]) for k in g)
    assert NoPersonalization().personalize(trainer, g, None, TRAIN) is None


def test_ditto_pulls_towards_the_global_adapter_and_starts_from_its_own(task) -> None:
    trainer = task.client_trainer(3, POP, 0)
    g = task.initial_arrays(0)
    own = task.initial_arrays(7)  # a personal adapter far from the global one
    free = Ditto(steps=20, lam=0.0, learning_rate=0.1).personalize(trainer, g, own, TRAIN)
    pulled = Ditto(steps=20, lam=5.0, learning_rate=0.1).personalize(trainer, g, own, TRAIN)
    assert free is not None and pulled is not None
    assert _distance(pulled, g) < _distance(free, g)
    # It starts from the kept adapter, not from the global one: with no pull it stays near it.
    assert _distance(free, own) < _distance(free, g)


def test_evaluation_reports_both_adapters_per_device(task) -> None:
    trainer = task.client_trainer(1, POP, 0)
    g = task.initial_arrays(0)
    new, ev = personalize_and_evaluate(FineTune(steps=30, learning_rate=0.2), trainer, g, None, TRAIN)
    assert new is not None and ev is not None and ev.num_examples > 0
    m = ev.metrics()
    assert m["device.global_accuracy"] == ev.global_accuracy
    assert sum(v for k, v in m.items() if k.startswith("device.personal_accuracy.bin")) == 1.0
    s = personal_metrics.summary(m)
    assert s["personal"]["mean"] == ev.personal_accuracy


def test_the_histogram_gives_the_10th_percentile_within_a_bin() -> None:
    rng = np.random.default_rng(0)
    values = rng.uniform(0.3, 1.0, size=500)
    sums: dict[str, float] = {}
    for v in values:
        for k, x in personal_metrics.encode(float(v), float(v)).items():
            sums[k] = sums.get(k, 0.0) + x
    means = {k: v / len(values) for k, v in sums.items()}
    got = personal_metrics.summary(means)["personal"]
    assert abs(got["p10"] - np.percentile(values, 10)) <= 1 / personal_metrics.BINS
    assert got["mean"] == pytest.approx(values.mean())
    assert personal_metrics.exact(list(values))["p10"] == pytest.approx(np.percentile(values, 10))


def test_the_store_is_owner_only_and_survives_a_restart(task, tmp_path: Path) -> None:
    trainer = task.client_trainer(2, POP, 0)
    g = task.initial_arrays(0)
    cfg = parse_run_config({"personalization": {"kind": "ditto", "steps": 3}}).personalization
    dev = DevicePersonal(tmp_path / "data")
    dev.round("run-1", cfg, trainer, g, TRAIN)
    path = PersonalStore(tmp_path / "data").path("run-1")
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700
    again = DevicePersonal(tmp_path / "data").get("run-1")  # a restarted device
    assert again is not None and all(np.array_equal(again[k], dev.get("run-1")[k]) for k in g)
    assert PersonalStore(tmp_path / "data").latest() == path
    with pytest.raises(PersonalizationError, match="cannot name a file"):
        PersonalStore(tmp_path).path("../escape")


class _Link:
    """What a client runtime calls on its link, in memory: one model to pull, uploads kept."""

    node_id = "client-3"
    heartbeat_s = 60.0
    long_poll_s = 1.0

    def __init__(self, blob: bytes) -> None:
        self.blob = blob
        self.pushed: list[tuple[object, bytes]] = []

    async def pull_model(self, model_hash: str, apply_delta=None) -> bytes:
        return self.blob

    async def push_update(self, header, payload: bytes) -> None:
        self.pushed.append((header, payload))

    async def heartbeat(self, task_id: str, device) -> None:
        return None


def _upload(task, kind: str, state_dir: Path):
    g = task.initial_arrays(0)
    blob = wire.arrays_to_blob(g)
    cfg = RunConfig(task="digits", task_params={"alpha": 0.1}, train={"epochs": 1, "batch_size": 8},
                    personalization={"kind": kind, "steps": 5})
    t = TaskAssignment(run_id="run-1", round=1, attempt=0, task_id="t1", model_hash=wire.sha256_hex(blob),
                       model_bytes=len(blob), config_json=cfg.model_dump_json(), schema=tuple(schema_of(g)),
                       deadline_unix=0.0, cohort_target=1, shared_seed=5)
    link = _Link(blob)
    rt = ClientRuntime(link, lambda c: task.client_trainer(3, POP, c.seed), partition_id=3, state_dir=state_dir)
    report = asyncio.run(rt.do_task(t))
    assert report.accepted, report.reason
    (header, payload), = link.pushed
    shapes = {s.name: s.shape for s in t.schema}
    payloads = dict(zip(shapes, split(payload, header.payload_sizes), strict=True))
    delta = decode_update(build_codec(cfg.codec), payloads, shapes, shared_seed=5)
    return g, header, payload, delta, rt


def test_the_personal_adapter_never_travels_in_an_upload(task, tmp_path: Path) -> None:
    g, plain_header, plain, _, _ = _upload(task, "none", tmp_path / "plain")
    _, header, payload, delta, rt = _upload(task, "ditto", tmp_path / "ditto")
    personal = rt.personal.get("run-1")
    assert personal is not None
    # The upload is the global update's, byte for byte: personalization adds metrics only.
    assert payload == plain
    assert header.weight == plain_header.weight and header.num_steps == plain_header.num_steps
    sent = {k: g[k] + delta[k] for k in g}
    assert _distance(sent, personal) > 1e-3
    # Not one of the personal adapter's tensors is in the bytes sent.
    for v in personal.values():
        assert v.astype(np.float32).tobytes() not in payload
    assert "device.personal_accuracy" in header.metric_sums
    assert header.metric_weights["device.personal_accuracy"] == 1.0  # one per device, not per example
    assert "device.personal_accuracy" not in plain_header.metric_sums


def test_config_accepts_the_three_kinds_and_refuses_others() -> None:
    for kind in ("none", "finetune", "ditto"):
        assert parse_run_config({"personalization": {"kind": kind}}).personalization.kind == kind
    with pytest.raises(ConfigError, match="personalization.kind"):
        parse_run_config({"personalization": {"kind": "pfedme"}})
    with pytest.raises(ConfigError, match="personalization.lam"):
        parse_run_config({"personalization": {"kind": "ditto", "lam": -1}})


def test_validate_refuses_personalization_without_a_held_out_split() -> None:
    ok = {"run": {"task": "digits", "personalization": {"kind": "ditto"}}}
    assert data_problems(ok) == []
    none = {"run": {"task": "digits", "task_params": {"with_replacement": True, "test_samples_per_client": 0},
                    "personalization": {"kind": "finetune"}}}
    problems = data_problems(none)
    assert any("no held-out split per device" in p for p in problems), problems
    off = {"run": {**none["run"], "personalization": {"kind": "none"}}}
    assert data_problems(off) == []


def test_a_task_without_partitions_has_no_held_out_split() -> None:
    assert held_out_problems(object(), "app")
