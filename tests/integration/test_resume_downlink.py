"""After a restart, the root still serves downlink deltas from the model the last
completed round started from (the one its clients hold)."""

from __future__ import annotations

from pathlib import Path

import pytest

from orchard import wire
from orchard.config import RunConfig
from orchard.server.coordinator import Coordinator
from orchard.server.store import SQLiteStore, atomic_write
from orchard.tasks import get_task
from tests.server.restart import resume_root


def _blob(seed: int) -> bytes:
    return wire.arrays_to_blob(get_task("digits").initial_arrays(seed))


def _resume(tmp_path: Path, downlink: bool, rounds_done: int) -> tuple[Coordinator, list[str]]:
    store = SQLiteStore(tmp_path / "orchard.db")
    cfg = RunConfig(task="digits", rounds=5, downlink_delta=downlink)
    store.create_run("run-x", cfg.model_dump_json())
    hashes = []
    for rnd in range(rounds_done + 1):  # checkpoints 0..rounds_done, as a killed root leaves them
        blob = _blob(rnd)
        path = tmp_path / "checkpoints" / "run-x" / f"round-{rnd:06d}.safetensors"
        atomic_write(path, blob)
        store.index_checkpoint("run-x", rnd, str(path), wire.sha256_hex(blob))
        hashes.append(wire.sha256_hex(blob))
    coord, runner = resume_root(store, tmp_path)
    assert runner.run is not None and runner.run.completed_rounds == rounds_done
    store.close()
    return coord, hashes


@pytest.mark.parametrize("downlink", [True, False])
def test_resumed_root_keeps_the_previous_model_as_a_delta_base(tmp_path: Path, downlink: bool) -> None:
    coord, hashes = _resume(tmp_path, downlink, rounds_done=2)
    # Clients of round 2 hold the model round 2 started from (checkpoint 1).
    assert coord.downlink.knows(hashes[1]) is downlink
    assert not coord.downlink.knows(hashes[0])
    if downlink:
        target = _blob(2)
        reply = coord.downlink.reply_now(target, hashes[2], hashes[1])
        assert reply.is_delta and len(reply.blob) < 0.3 * len(target)


def test_a_tampered_previous_checkpoint_is_not_a_base(tmp_path: Path) -> None:
    store_dir = tmp_path
    coord, hashes = _resume(store_dir, True, rounds_done=1)
    assert coord.downlink.knows(hashes[0])
    path = tmp_path / "checkpoints" / "run-x" / "round-000000.safetensors"
    path.write_bytes(path.read_bytes()[:-4] + b"\0\0\0\0")
    store = SQLiteStore(tmp_path / "orchard.db")
    coord2, _ = resume_root(store, tmp_path)
    store.close()
    assert not coord2.downlink.knows(hashes[0])
