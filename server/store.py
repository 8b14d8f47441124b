"""The root's durable state: runs, rounds, nodes, tokens and the checkpoint index (SQLite).

Checkpoints themselves are safetensors files written atomically (temp file, fsync,
rename, fsync of the folder) *before* the index row that names them is committed, so a
crash at any point leaves either the previous completed round or the new one, never a
row pointing at a partial file. A restarted root resumes from the last indexed round.

The store is used from the server's event loop only; each method is one short
transaction. ``path=":memory:"`` gives the same store without a file (tests, simulator).
"""

from __future__ import annotations

import hashlib
import json
import os
import secrets
import sqlite3
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from orchard.errors import StoreError

SCHEMA_VERSION = 1

_DDL = """
CREATE TABLE IF NOT EXISTS meta(key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS tokens(hash TEXT PRIMARY KEY, role TEXT NOT NULL, created REAL NOT NULL,
    revoked INTEGER NOT NULL DEFAULT 0, label TEXT NOT NULL DEFAULT '');
CREATE TABLE IF NOT EXISTS nodes(node_id TEXT PRIMARY KEY, role TEXT NOT NULL, token_hash TEXT NOT NULL,
    first_seen REAL NOT NULL, last_seen REAL NOT NULL, capabilities_json TEXT NOT NULL DEFAULT '{}');
CREATE TABLE IF NOT EXISTS runs(run_id TEXT PRIMARY KEY, config_json TEXT NOT NULL, status TEXT NOT NULL,
    created REAL NOT NULL, updated REAL NOT NULL, completed_rounds INTEGER NOT NULL DEFAULT 0,
    error TEXT NOT NULL DEFAULT '');
CREATE TABLE IF NOT EXISTS rounds(run_id TEXT NOT NULL, round INTEGER NOT NULL, attempt INTEGER NOT NULL,
    status TEXT NOT NULL, started REAL NOT NULL, finished REAL, record_json TEXT NOT NULL DEFAULT '{}',
    PRIMARY KEY(run_id, round, attempt));
CREATE TABLE IF NOT EXISTS checkpoints(run_id TEXT NOT NULL, round INTEGER NOT NULL, path TEXT NOT NULL,
    sha256 TEXT NOT NULL, optimizer_path TEXT NOT NULL DEFAULT '', created REAL NOT NULL,
    PRIMARY KEY(run_id, round));
"""


def hash_token(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


def new_token() -> str:
    return "orc_" + secrets.token_urlsafe(32)


@dataclass(frozen=True)
class RunRow:
    run_id: str
    config_json: str
    status: str  # "running" | "completed" | "failed" | "stopped"
    created: float
    updated: float
    completed_rounds: int
    error: str


@dataclass(frozen=True)
class CheckpointRow:
    run_id: str
    round: int
    path: str
    sha256: str
    optimizer_path: str


class Store:
    def __init__(self, path: str | Path) -> None:
        self.path = str(path)
        try:
            self._db = sqlite3.connect(self.path, isolation_level=None, check_same_thread=False)
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute("PRAGMA synchronous=FULL")
            self._db.executescript(_DDL)
        except sqlite3.DatabaseError as err:
            raise StoreError(f"cannot open the store at {self.path}: {err}; is it an Orchard data dir?") from None
        v = self.get_meta("schema_version")
        if v is None:
            self.set_meta("schema_version", str(SCHEMA_VERSION))
        elif int(v) != SCHEMA_VERSION:
            raise StoreError(f"store schema version {v}, this Orchard expects {SCHEMA_VERSION}")

    def close(self) -> None:
        self._db.close()

    # ---------------------------------------------------------------- meta
    def get_meta(self, key: str) -> str | None:
        row = self._db.execute("SELECT value FROM meta WHERE key=?", (key,)).fetchone()
        return None if row is None else str(row[0])

    def set_meta(self, key: str, value: str) -> None:
        self._db.execute("INSERT INTO meta(key, value) VALUES(?, ?) ON CONFLICT(key) DO UPDATE SET value=excluded.value",
                         (key, value))

    # ---------------------------------------------------------------- tokens
    def issue_token(self, role: str, label: str = "") -> str:
        """Create an enrollment token; only its sha256 is stored. Returns the token (shown once)."""
        tok = new_token()
        self._db.execute("INSERT INTO tokens(hash, role, created, label) VALUES(?, ?, ?, ?)",
                         (hash_token(tok), role, time.time(), label))
        return tok

    def token_role(self, token_hash: str) -> str | None:
        row = self._db.execute("SELECT role FROM tokens WHERE hash=? AND revoked=0", (token_hash,)).fetchone()
        return None if row is None else str(row[0])

    def revoke_token(self, token_hash: str) -> bool:
        cur = self._db.execute("UPDATE tokens SET revoked=1 WHERE hash=?", (token_hash,))
        return cur.rowcount > 0

    # ---------------------------------------------------------------- nodes
    def upsert_node(self, node_id: str, role: str, token_hash: str, capabilities: dict[str, str]) -> None:
        now = time.time()
        self._db.execute(
            "INSERT INTO nodes(node_id, role, token_hash, first_seen, last_seen, capabilities_json) VALUES(?,?,?,?,?,?) "
            "ON CONFLICT(node_id) DO UPDATE SET role=excluded.role, token_hash=excluded.token_hash, "
            "last_seen=excluded.last_seen, capabilities_json=excluded.capabilities_json",
            (node_id, role, token_hash, now, now, json.dumps(capabilities)),
        )

    def node_token(self, node_id: str) -> str | None:
        row = self._db.execute("SELECT token_hash FROM nodes WHERE node_id=?", (node_id,)).fetchone()
        return None if row is None else str(row[0])

    # ---------------------------------------------------------------- runs and rounds
    def create_run(self, run_id: str, config_json: str) -> None:
        now = time.time()
        self._db.execute("INSERT INTO runs(run_id, config_json, status, created, updated) VALUES(?,?,?,?,?)",
                         (run_id, config_json, "running", now, now))

    def set_run_status(self, run_id: str, status: str, error: str = "") -> None:
        self._db.execute("UPDATE runs SET status=?, error=?, updated=? WHERE run_id=?",
                         (status, error, time.time(), run_id))

    def get_run(self, run_id: str) -> RunRow | None:
        row = self._db.execute("SELECT run_id, config_json, status, created, updated, completed_rounds, error "
                               "FROM runs WHERE run_id=?", (run_id,)).fetchone()
        return None if row is None else RunRow(*row)

    def latest_run(self) -> RunRow | None:
        row = self._db.execute("SELECT run_id, config_json, status, created, updated, completed_rounds, error "
                               "FROM runs ORDER BY created DESC, rowid DESC LIMIT 1").fetchone()
        return None if row is None else RunRow(*row)

    def list_runs(self, limit: int = 0) -> list[RunRow]:
        """Every run, newest first (``limit`` > 0: only that many)."""
        sql = ("SELECT run_id, config_json, status, created, updated, completed_rounds, error "
               "FROM runs ORDER BY created DESC, rowid DESC")
        rows = self._db.execute(sql + " LIMIT ?", (limit,)).fetchall() if limit > 0 else self._db.execute(sql).fetchall()
        return [RunRow(*r) for r in rows]

    def active_runs(self) -> list[RunRow]:
        rows = self._db.execute("SELECT run_id, config_json, status, created, updated, completed_rounds, error "
                                "FROM runs WHERE status='running' ORDER BY created").fetchall()
        return [RunRow(*r) for r in rows]

    def record_round(self, run_id: str, rnd: int, attempt: int, status: str, started: float,
                     finished: float | None, record: dict[str, Any]) -> None:
        self._db.execute(
            "INSERT INTO rounds(run_id, round, attempt, status, started, finished, record_json) VALUES(?,?,?,?,?,?,?) "
            "ON CONFLICT(run_id, round, attempt) DO UPDATE SET status=excluded.status, finished=excluded.finished, "
            "record_json=excluded.record_json",
            (run_id, rnd, attempt, status, started, finished, json.dumps(record)),
        )

    def attempts(self, run_id: str, rnd: int) -> int:
        row = self._db.execute("SELECT COUNT(*) FROM rounds WHERE run_id=? AND round=?", (run_id, rnd)).fetchone()
        return int(row[0])

    def interrupt_open_rounds(self, run_id: str) -> int:
        """Rounds left 'running' by a crash: their partial work is gone; say so."""
        cur = self._db.execute("UPDATE rounds SET status='interrupted', finished=? WHERE run_id=? AND status='running'",
                               (time.time(), run_id))
        return cur.rowcount

    def rounds(self, run_id: str) -> list[dict[str, Any]]:
        rows = self._db.execute("SELECT round, attempt, status, started, finished, record_json FROM rounds "
                                "WHERE run_id=? ORDER BY round, attempt", (run_id,)).fetchall()
        out = []
        for rnd, attempt, status, started, finished, rec in rows:
            d = json.loads(rec)
            d.update(round=rnd, attempt=attempt, status=status, started=started, finished=finished)
            out.append(d)
        return out

    def complete_round(self, run_id: str, rnd: int, attempt: int, started: float, record: dict[str, Any],
                       ckpt_path: str, ckpt_sha256: str, optimizer_path: str) -> None:
        """Index a checkpoint (already durably on disk) and mark the round complete, atomically."""
        now = time.time()
        try:
            self._db.execute("BEGIN IMMEDIATE")
            self._db.execute(
                "INSERT OR REPLACE INTO checkpoints(run_id, round, path, sha256, optimizer_path, created) VALUES(?,?,?,?,?,?)",
                (run_id, rnd, ckpt_path, ckpt_sha256, optimizer_path, now))
            self._db.execute(
                "INSERT OR REPLACE INTO rounds(run_id, round, attempt, status, started, finished, record_json) "
                "VALUES(?,?,?,?,?,?,?)", (run_id, rnd, attempt, "completed", started, now, json.dumps(record)))
            self._db.execute("UPDATE runs SET completed_rounds=?, updated=? WHERE run_id=?", (rnd, now, run_id))
            self._db.execute("COMMIT")
        except BaseException:
            self._db.execute("ROLLBACK")
            raise

    def index_checkpoint(self, run_id: str, rnd: int, path: str, sha256: str, optimizer_path: str = "") -> None:
        self._db.execute(
            "INSERT OR REPLACE INTO checkpoints(run_id, round, path, sha256, optimizer_path, created) VALUES(?,?,?,?,?,?)",
            (run_id, rnd, path, sha256, optimizer_path, time.time()))

    def checkpoint(self, run_id: str, rnd: int | None = None) -> CheckpointRow | None:
        if rnd is None:
            row = self._db.execute("SELECT run_id, round, path, sha256, optimizer_path FROM checkpoints "
                                   "WHERE run_id=? ORDER BY round DESC LIMIT 1", (run_id,)).fetchone()
        else:
            row = self._db.execute("SELECT run_id, round, path, sha256, optimizer_path FROM checkpoints "
                                   "WHERE run_id=? AND round=?", (run_id, rnd)).fetchone()
        return None if row is None else CheckpointRow(*row)


def atomic_write(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` so that a crash leaves the old file or the new one, never a mix."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    dfd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dfd)
    finally:
        os.close(dfd)
