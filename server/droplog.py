"""The root's record of dropped uploads: every upload a tier acknowledged that is in no
aggregate, by its ids (run, round, attempt, node, task: its header's) and why.

Aggregators report them in their polls (``PollRequest.dropped``; what they journal:
``orchard.server.ackjournal``); the root keeps them here, a table in its store's SQLite
file (``orchard.db``), one row per (run, node, task): a report sent again, because its
poll's reply was lost, changes nothing. Readers (``orchard`` tools, the chaos run's
checks) list a run's rows with :meth:`DropLog.dropped`.

It holds its own connection to the file (WAL: the store's connection and this one see
each other's commits); each method is one short transaction, called from the server's
event loop.
"""

from __future__ import annotations

import sqlite3
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from orchard.errors import StoreError
from orchard.files import create_private
from orchard.messages import DroppedUpload

_DDL = """
CREATE TABLE IF NOT EXISTS dropped_uploads(run_id TEXT NOT NULL, node_id TEXT NOT NULL, task_id TEXT NOT NULL,
    round INTEGER NOT NULL, attempt INTEGER NOT NULL, reason TEXT NOT NULL, via TEXT NOT NULL, recorded REAL NOT NULL,
    PRIMARY KEY(run_id, node_id, task_id));
"""


class DropLog:
    """Dropped uploads in the SQLite file at ``path`` (the root's ``orchard.db``)."""

    def __init__(self, path: str | Path) -> None:
        try:
            create_private(path)
            self._db = sqlite3.connect(str(path), isolation_level=None, check_same_thread=False, timeout=10.0)
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute("PRAGMA synchronous=FULL")
            self._db.executescript(_DDL)
        except sqlite3.DatabaseError as err:
            raise StoreError(f"cannot open the dropped-uploads table in {path}: {err}; is it an Orchard data dir?"
                             ) from None

    def close(self) -> None:
        self._db.close()

    def record(self, via: str, dropped: Sequence[DroppedUpload], runs: set[str] | None = None) -> int:
        """Keep ``dropped`` as reported by tier ``via`` (the first report of an upload
        stands). ``runs``: the run ids this root knows; reports of others are ignored.
        Returns how many rows are new."""
        rows = [(d.run_id, d.node_id, d.task_id, d.round, d.attempt, d.reason, via, time.time())
                for d in dropped if runs is None or d.run_id in runs]
        if not rows:
            return 0
        before = self._db.total_changes
        self._db.execute("BEGIN")
        try:
            self._db.executemany("INSERT OR IGNORE INTO dropped_uploads VALUES(?, ?, ?, ?, ?, ?, ?, ?)", rows)
        except BaseException:
            self._db.execute("ROLLBACK")
            raise
        self._db.execute("COMMIT")
        return self._db.total_changes - before

    def dropped(self, run_id: str) -> list[dict[str, Any]]:
        """The run's dropped uploads, by round, attempt, node and task."""
        cur = self._db.execute("SELECT round, attempt, node_id, task_id, reason, via, recorded FROM dropped_uploads "
                               "WHERE run_id=? ORDER BY round, attempt, node_id, task_id", (run_id,))
        return [{"round": r[0], "attempt": r[1], "node_id": r[2], "task_id": r[3], "reason": r[4], "via": r[5],
                 "recorded": r[6]} for r in cur]
