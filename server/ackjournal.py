"""What an aggregator acknowledged and has not forwarded: its journal of uploads, so that
an upload it acknowledged and then could not forward is reported upstream as dropped,
with the reason, instead of vanishing (docs/operating.md, "What a killed aggregator
loses").

One file per round the aggregator runs (its own ``CohortRound``: a synchronous attempt
or a buffer), in ``DATA_DIR/acks/``, owner-only, append-only, one JSON line per record:

- ``{"a": [run, round, attempt, node, task]}``: an upload acknowledged into the round
  (written before the acknowledgement is sent: one ``write`` per upload, no fsync);
- ``{"sending": 1}``: the round's partial is being pushed upstream;
- ``{"dropped": reason}``: the round's uploads reach no partial (the push was refused or
  failed, or the round ended without one).

A round whose partial the upstream accepted deletes its file. What is left is dropped:
the uploads of a file with a ``dropped`` line for that reason; of a file found at start
without one, because the process that held them died, :data:`RESTARTED` (or
:data:`RESTARTED_SENDING` when its partial was on its way: the root applied it only if
it took it before the death). The aggregator reports dropped uploads in its polls
(``PollRequest.dropped``, :meth:`AckJournal.pending`) and deletes a file once every one
of its uploads was reported (:meth:`AckJournal.reported`).

Durability: a ``write`` is in the kernel when it returns, so a ``kill -9`` of the
aggregator loses none of it; a crash of the host (power, kernel) may lose the last
writes, as no write is fsynced (one append per acknowledged upload keeps the
acknowledgement cheap: ``benchmarks/ackjournal.py``).

Memory: the ids of the open rounds' acknowledged uploads and of the dropped uploads not
yet reported (a few per client), never an upload's payload.
"""

from __future__ import annotations

import contextlib
import json
import logging
import re
import time
from collections.abc import Hashable
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

from orchard.files import open_append, private_dir
from orchard.messages import DroppedUpload

log = logging.getLogger("orchard.server.ackjournal")

RESTARTED = "aggregator restarted: held in memory"
RESTARTED_SENDING = "aggregator restarted while pushing its partial: applied only if the root took it"
_SAFE = re.compile(r"[^A-Za-z0-9._-]")


@dataclass
class _Open:
    path: Path
    f: IO[str]
    ids: list[DroppedUpload] = field(default_factory=list)


class AckJournal:
    """The journal in ``directory``: recovers what a previous process left at start."""

    def __init__(self, directory: str | Path) -> None:
        self.dir = private_dir(directory)
        self._open: dict[Hashable, _Open] = {}
        self._into: dict[Hashable, Hashable] = {}  # a round moved into another: what it takes goes there
        self._dropped: dict[Path, list[DroppedUpload]] = {}  # dropped, not yet reported, by file
        self._seq = 0
        for p in sorted(self.dir.glob("*.acks")):
            ids = _read(p)
            if ids:
                self._dropped[p] = ids
                log.warning("%d acknowledged uploads of %s were never forwarded: %s", len(ids), p.name, ids[0].reason)
            else:
                p.unlink(missing_ok=True)

    def _key(self, key: Hashable) -> Hashable:
        while key in self._into:
            key = self._into[key]
        return key

    def _finish(self, key: Hashable) -> _Open | None:
        self._into = {k: v for k, v in self._into.items() if v != key}
        return self._open.pop(key, None)

    def _file(self, key: Hashable, run_id: str, rnd: int, attempt: int) -> _Open:
        o = self._open.get(key)
        if o is None:
            self._seq += 1
            name = f"{_SAFE.sub('_', run_id)[:64]}-r{rnd}-a{attempt}-{time.time_ns()}-{self._seq}.acks"
            o = self._open[key] = _Open(self.dir / name, open_append(self.dir / name))
        return o

    def _line(self, o: _Open, rec: dict) -> None:
        o.f.write(json.dumps(rec, separators=(",", ":")) + "\n")
        o.f.flush()  # one write(2) per line: in the kernel before the caller goes on

    def acked(self, key: Hashable, run_id: str, rnd: int, attempt: int, up: DroppedUpload) -> None:
        """Upload ``up`` (its ids; no reason yet) was taken into round ``key`` (that round's
        run, round and attempt name its file); called before it is acknowledged."""
        o = self._file(self._key(key), run_id, rnd, attempt)
        self._line(o, {"a": [up.run_id, up.round, up.attempt, up.node_id, up.task_id]})
        o.ids.append(up)

    def moved(self, key: Hashable, into: Hashable, run_id: str, rnd: int, attempt: int) -> None:
        """Round ``key``'s sums moved into round ``into`` (``run_id``, ``rnd``, ``attempt``):
        its uploads, and any it takes from now on, are ``into``'s. Written into ``into``'s
        file before ``key``'s goes."""
        key, into = self._key(key), self._key(into)
        if key == into:
            return
        self._into = {k: (into if v == key else v) for k, v in self._into.items()}
        self._into[key] = into
        o = self._open.pop(key, None)
        if o is None:
            return
        d = self._file(into, run_id, rnd, attempt)
        d.f.write("".join(json.dumps({"a": [u.run_id, u.round, u.attempt, u.node_id, u.task_id]},
                                     separators=(",", ":")) + "\n" for u in o.ids))
        d.f.flush()
        d.ids.extend(o.ids)
        o.f.close()
        o.path.unlink(missing_ok=True)

    def sending(self, key: Hashable) -> None:
        """Round ``key``'s partial is about to be pushed upstream."""
        o = self._open.get(self._key(key))
        if o is not None:
            self._line(o, {"sending": 1})

    def forwarded(self, key: Hashable) -> None:
        """The upstream accepted round ``key``'s partial: its uploads are its to account for."""
        o = self._finish(self._key(key))
        if o is not None:
            o.f.close()
            o.path.unlink(missing_ok=True)

    def drop(self, key: Hashable, reason: str) -> int:
        """Round ``key``'s uploads reach no partial, for ``reason``; returns how many."""
        o = self._finish(self._key(key))
        if o is None:
            return 0
        with contextlib.closing(o.f):
            self._line(o, {"dropped": reason})
        if o.ids:
            self._dropped[o.path] = [DroppedUpload(u.run_id, u.round, u.attempt, u.node_id, u.task_id, reason)
                                     for u in o.ids]
        else:
            o.path.unlink(missing_ok=True)
        return len(o.ids)

    def relay(self, dropped: list[DroppedUpload]) -> None:
        """Dropped uploads a tier below reported: kept here until reported upstream."""
        if not dropped:
            return
        self._seq += 1
        path = self.dir / f"below-{time.time_ns()}-{self._seq}.acks"
        with open_append(path) as f:
            f.write("".join(json.dumps({"a": [d.run_id, d.round, d.attempt, d.node_id, d.task_id], "r": d.reason},
                                       separators=(",", ":")) + "\n" for d in dropped))
        self._dropped[path] = list(dropped)

    def pending(self, limit: int) -> list[DroppedUpload]:
        """Up to ``limit`` dropped uploads not yet reported upstream."""
        out: list[DroppedUpload] = []
        for ids in self._dropped.values():
            out.extend(ids[:limit - len(out)])
            if len(out) >= limit:
                break
        return out

    def reported(self, sent: list[DroppedUpload]) -> None:
        """``sent`` reached the upstream (its poll was answered): forget them."""
        gone = set(sent)
        for path in list(self._dropped):
            left = [d for d in self._dropped[path] if d not in gone]
            if left:
                self._dropped[path] = left
            else:
                del self._dropped[path]
                path.unlink(missing_ok=True)

    def close(self) -> None:
        for o in self._open.values():
            o.f.close()
        self._open.clear()


def _read(path: Path) -> list[DroppedUpload]:
    """A file left at start: its uploads, each with the reason it is dropped for."""
    ids: list[tuple[list, str]] = []
    reason, sending = "", False
    try:
        text = path.read_text(encoding="utf-8", errors="replace")
    except OSError as err:
        log.error("cannot read the journal file %s: %s", path, err)
        return []
    for line in text.splitlines():
        try:
            rec = json.loads(line)
        except ValueError:
            continue  # a line cut by the death of its writer: that upload was never acknowledged
        if not isinstance(rec, dict):
            continue
        if isinstance(rec.get("a"), list) and len(rec["a"]) == 5:
            ids.append((rec["a"], str(rec.get("r", ""))))
        elif "sending" in rec:
            sending = True
        elif "dropped" in rec:
            reason = str(rec["dropped"])
    fallback = reason or (RESTARTED_SENDING if sending else RESTARTED)
    out = []
    for (run, rnd, att, node, task), r in ids:
        with contextlib.suppress(TypeError, ValueError):
            out.append(DroppedUpload(str(run), int(rnd), int(att), str(node), str(task), r or fallback))
    return out

