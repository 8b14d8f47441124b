"""One suite for every store: SQLite (durable) and in-memory behave the same."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from orchard.server.round import RoundRecord, RoundStatus
from orchard.server.store import MemoryStore, SQLiteStore, Store, hash_token


@pytest.fixture(params=["sqlite", "memory"])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Store]:
    st: Store = SQLiteStore(tmp_path / "orchard.db") if request.param == "sqlite" else MemoryStore()
    yield st
    st.close()


def _record(rnd: int, attempt: int, status: RoundStatus, participants: int) -> dict:
    return RoundRecord(rnd, attempt, status, participants=participants, metrics={"train_loss": 0.5}).as_dict()


def test_meta_and_tokens(store: Store) -> None:
    assert store.get_meta("schema_version") == "1"
    store.set_meta("k", "v")
    store.set_meta("k", "w")
    assert store.get_meta("k") == "w" and store.get_meta("missing") is None
    tok = store.issue_token("client", "label")
    assert tok.startswith("orc_") and store.token_role(hash_token(tok)) == "client"
    assert store.token_role(hash_token("orc_unknown")) is None
    assert store.revoke_token(hash_token(tok)) and store.token_role(hash_token(tok)) is None
    assert not store.revoke_token(hash_token("orc_unknown"))


def test_nodes(store: Store) -> None:
    assert store.node_token("n1") is None
    store.upsert_node("n1", "client", "h1", {"os": "linux"})
    store.upsert_node("n1", "client", "h2", {})
    assert store.node_token("n1") == "h2"


def test_a_join_forgets_the_rows_of_nodes_not_seen_since_its_horizon(store: Store) -> None:
    # The nodes table is bounded by the joins of a window, not by every id ever sent.
    for k in range(50):
        store.upsert_node(f"old-{k}", "client", "h", {"k": "v" * 100})
    t = time.time()
    store.upsert_node("fresh", "client", "h", {}, forget_before=t - 3600)
    assert store.node_token("old-0") == "h"  # seen within the horizon: kept
    store.upsert_node("newest", "client", "h", {}, forget_before=time.time() + 1.0)  # all before it
    assert [store.node_token(n) for n in ("old-0", "old-49", "fresh", "newest")] == [None, None, None, "h"]


def test_runs_rounds_and_checkpoints(store: Store) -> None:
    assert store.latest_run() is None and store.active_runs() == []
    store.create_run("run-a", '{"rounds": 2}')
    store.create_run("run-b", '{"rounds": 3}')
    assert store.latest_run().run_id == "run-b"  # type: ignore[union-attr]
    assert [r.run_id for r in store.list_runs()] == ["run-b", "run-a"]
    assert [r.run_id for r in store.list_runs(limit=1)] == ["run-b"]
    assert [r.run_id for r in store.active_runs()] == ["run-a", "run-b"]
    store.set_run_status("run-a", "failed", "boom")
    row = store.get_run("run-a")
    assert row is not None and (row.status, row.error, row.config_json) == ("failed", "boom", '{"rounds": 2}')
    assert store.get_run("nope") is None

    store.index_checkpoint("run-b", 0, "/ck/0", "s0")
    store.record_round("run-b", 1, 0, "running", 10.0, None, {"selected": 4})
    assert store.attempts("run-b", 1) == 1
    store.record_round("run-b", 1, 0, "failed", 11.0, 12.0, _record(1, 0, RoundStatus.FAILED, 1))
    store.record_round("run-b", 1, 1, "running", 13.0, None, {"selected": 4})
    assert store.interrupt_open_rounds("run-b") == 1
    assert store.attempts("run-b", 1) == 2
    store.complete_round("run-b", 1, 2, 14.0, _record(1, 2, RoundStatus.COMPLETED, 4), "/ck/1", "s1", "/ck/1.opt")
    rounds = store.rounds("run-b")
    assert [(r["round"], r["attempt"], r["status"]) for r in rounds] == [
        (1, 0, "failed"), (1, 1, "interrupted"), (1, 2, "completed")]
    assert rounds[0]["started"] == 10.0 and rounds[0]["finished"] == 12.0  # an upsert keeps the start
    assert rounds[2]["participants"] == 4 and rounds[2]["metrics"] == {"train_loss": 0.5}
    assert store.get_run("run-b").completed_rounds == 1  # type: ignore[union-attr]
    last = store.checkpoint("run-b")
    assert last is not None and (last.round, last.path, last.sha256, last.optimizer_path) == (1, "/ck/1", "s1",
                                                                                               "/ck/1.opt")
    assert store.checkpoint("run-b", 0).path == "/ck/0"  # type: ignore[union-attr]
    assert store.checkpoint("run-b", 5) is None and store.checkpoint("run-a") is None
    assert store.rounds("run-a") == []


def test_records_are_copies(store: Store) -> None:
    store.create_run("r", "{}")
    rec = _record(1, 0, RoundStatus.COMPLETED, 2)
    store.record_round("r", 1, 0, "completed", 1.0, 2.0, rec)
    rec["participants"] = 99
    got = store.rounds("r")[0]
    got["participants"] = 77
    assert store.rounds("r")[0]["participants"] == 2


def test_async_buffers_keep_the_newest_state_and_go_with_their_round(store: Store) -> None:
    store.create_run("run-a", "{}")
    store.create_run("run-b", "{}")
    assert store.buffers("run-a") == []
    store.save_buffer("run-a", 3, 5, '{"n": 5}', b"\x01")
    store.save_buffer("run-a", 3, 4, '{"n": 4}', b"\x02")  # an older state written late: ignored
    store.save_buffer("run-a", 4, 6, '{"n": 6}', b"\x03")  # the continuation of a full buffer
    store.save_buffer("run-b", 1, 1, '{"n": 1}', b"\x04")
    got = store.buffers("run-a")
    assert [(b.round, b.seq, b.state_json, b.sums) for b in got] == [(3, 5, '{"n": 5}', b"\x01"),
                                                                      (4, 6, '{"n": 6}', b"\x03")]
    # Applying round 3 drops its buffer (and any earlier one) in the same transaction.
    store.complete_round("run-a", 3, 0, 1.0, {}, "/ck/3", "s3", "")
    assert [b.round for b in store.buffers("run-a")] == [4]
    # A merged state replaces the later buffers at once.
    store.save_buffer("run-a", 4, 9, '{"n": 9}', b"\x05")
    store.save_buffer("run-a", 5, 10, '{"n": 10}', b"\x06")
    store.save_buffer("run-a", 4, 11, '{"merged": true}', b"\x07", supersede_later=True)
    assert [(b.round, b.seq) for b in store.buffers("run-a")] == [(4, 11)]
    assert [b.round for b in store.buffers("run-b")] == [1]
