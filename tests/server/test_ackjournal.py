"""An aggregator's journal of acknowledged uploads (orchard.server.ackjournal) and the
bounds of the dropped uploads a poll reports (orchard.server.bounds.check_dropped)."""

from __future__ import annotations

import stat
from pathlib import Path

import pytest

from orchard.errors import InvalidRequestError
from orchard.messages import DroppedUpload
from orchard.server.ackjournal import RESTARTED, RESTARTED_SENDING, AckJournal
from orchard.server.bounds import DROPPED_MAX, check_dropped


def _up(node: str, rnd: int = 3) -> DroppedUpload:
    return DroppedUpload("run-1", rnd, 1, node, f"task-{node}")


def _ack(j: AckJournal, key: str, *nodes: str) -> None:
    for n in nodes:
        j.acked(key, "run-1", 3, 1, _up(n))


def test_a_forwarded_round_leaves_nothing(tmp_path: Path) -> None:
    j = AckJournal(tmp_path / "acks")
    _ack(j, "r3", "a", "b")
    (f,) = (tmp_path / "acks").glob("*.acks")
    assert stat.S_IMODE(f.stat().st_mode) == 0o600 and stat.S_IMODE((tmp_path / "acks").stat().st_mode) == 0o700
    j.sending("r3")
    j.forwarded("r3")
    assert not list((tmp_path / "acks").glob("*")) and j.pending(10) == []
    assert AckJournal(tmp_path / "acks").pending(10) == []


def test_what_a_dead_process_held_is_dropped_at_restart_with_its_reason(tmp_path: Path) -> None:
    j = AckJournal(tmp_path / "acks")
    _ack(j, "held", "a", "b")
    _ack(j, "pushing", "c")
    j.sending("pushing")
    _ack(j, "refused", "d")
    j.drop("refused", "upstream refused the partial")
    for p in (tmp_path / "acks").glob("*.acks"):
        with open(p, "a") as f:
            f.write('{"a": ["run-1", 3, 1, "e"')  # a line cut by the kill: never acknowledged
    # The process dies here (nothing closed); a new one reads what it left.
    j2 = AckJournal(tmp_path / "acks")
    got = {d.node_id: d.reason for d in j2.pending(100)}
    assert got == {"a": RESTARTED, "b": RESTARTED, "c": RESTARTED_SENDING, "d": "upstream refused the partial"}
    assert all(d.task_id == f"task-{d.node_id}" and d.round == 3 and d.attempt == 1 for d in j2.pending(100))


def test_reported_drops_are_forgotten_and_their_files_deleted(tmp_path: Path) -> None:
    j = AckJournal(tmp_path / "acks")
    _ack(j, "r3", *"abcde")
    assert j.drop("r3", "why") == 5
    first = j.pending(3)
    assert len(first) == 3 and all(d.reason == "why" for d in first)
    j.reported(first)
    rest = j.pending(10)
    assert {d.node_id for d in rest} == set("abcde") - {d.node_id for d in first}
    assert list((tmp_path / "acks").glob("*.acks"))  # some still to report
    j.reported(rest)
    assert j.pending(10) == [] and not list((tmp_path / "acks").glob("*.acks"))


def test_drops_relayed_from_below_survive_a_restart(tmp_path: Path) -> None:
    j = AckJournal(tmp_path / "acks")
    below = [DroppedUpload("run-1", 2, 0, "x", "t-x", "aggregator restarted: held in memory")]
    j.relay(below)
    assert AckJournal(tmp_path / "acks").pending(10) == below


def test_a_round_that_acknowledged_nothing_writes_nothing(tmp_path: Path) -> None:
    j = AckJournal(tmp_path / "acks")
    assert j.drop("never", "why") == 0
    j.forwarded("never")
    assert not list((tmp_path / "acks").glob("*"))


@pytest.mark.parametrize("bad, what", [
    (DroppedUpload("", 1, 0, "a", "t", "why"), "lacks"),
    (DroppedUpload("run", -1, 0, "a", "t", "why"), "round"),
    (DroppedUpload("run", 1, 0, "bad id!", "t", "why"), "node_id"),
    (DroppedUpload("run", 1, 0, "a", "t", "x" * 600), "reason"),
    (DroppedUpload("run", 1, 0, "a", "t\n", "why"), "control"),
])
def test_a_polls_dropped_uploads_are_bounded(bad: DroppedUpload, what: str) -> None:
    check_dropped([DroppedUpload("run", 1, 0, "a", "t", "why")])
    with pytest.raises(InvalidRequestError, match=what):
        check_dropped([bad])
    with pytest.raises(InvalidRequestError, match="at most"):
        check_dropped([DroppedUpload("run", 1, 0, "a", f"t{i}", "why") for i in range(DROPPED_MAX + 1)])


def test_a_round_moved_into_another_is_forwarded_or_dropped_with_it(tmp_path: Path) -> None:
    j = AckJournal(tmp_path / "acks")
    _ack(j, "continuation", "a")
    _ack(j, "next", "b")
    j.moved("continuation", "next", "run-1", 4, 0)
    _ack(j, "continuation", "c")  # a fold queued into the continuation, acknowledged after the move
    assert len(list((tmp_path / "acks").glob("*.acks"))) == 1
    assert j.drop("next", "why") == 3
    assert {d.node_id for d in j.pending(10)} == {"a", "b", "c"}
    _ack(j, "cont-2", "d")
    j.moved("cont-2", "next-2", "run-1", 5, 0)
    j.forwarded("next-2")
    j.reported(j.pending(10))
    assert not list((tmp_path / "acks").glob("*.acks")) and AckJournal(tmp_path / "acks").pending(10) == []
