"""The root's state: runs, rounds, nodes, tokens, device credentials and the checkpoint index.

:class:`Store` is the interface the root, the CLI and the demo use. Two implementations
keep it: :class:`SQLiteStore`, the durable one every server runs on, and
:class:`MemoryStore`, the same behaviour in dicts, for tests and in-process runs where
nothing has to survive the process. One test suite (``tests/server/test_store.py``)
runs against both.

Checkpoints themselves are safetensors files written atomically (temp file, fsync,
rename, fsync of the folder) *before* the index row that names them is committed, so a
crash at any point leaves either the previous completed round or the new one, never a
row pointing at a partial file. A restarted root resumes from the last indexed round.

Tokens and credentials (docs/operating.md, "Device credentials"): an enrollment
token is *shared* (any number of nodes enroll with it) or a *device* token (one node:
bound to the first node id that uses it, spent once that node exchanged it for its own
credential). A device row holds a node's credential (as its sha256), its certified
public key and which token enrolled it; revoking a token revokes every credential it
enrolled. The root's certificate key is kept beside the store (``signing_key``).

The store is used from the server's event loop only; each method is one short
transaction.
"""

from __future__ import annotations

import json
import sqlite3
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Protocol

from orchard.errors import StoreError

# atomic_write is re-exported: the root writes the checkpoints it indexes here with it.
from orchard.files import atomic_write as atomic_write
from orchard.files import create_private
from orchard.identity import SigningKey
from orchard.server.tokens import (
    DeviceRow,
    Revoked,
    TokenRow,
    hash_token,
    load_or_create_key,
    new_token,
    token_id,
)

SCHEMA_VERSION = 1

_DDL = """
CREATE TABLE IF NOT EXISTS meta(key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS tokens(hash TEXT PRIMARY KEY, role TEXT NOT NULL, created REAL NOT NULL,
    revoked INTEGER NOT NULL DEFAULT 0, label TEXT NOT NULL DEFAULT '', kind TEXT NOT NULL DEFAULT 'shared',
    node_id TEXT NOT NULL DEFAULT '', spent INTEGER NOT NULL DEFAULT 0);
CREATE TABLE IF NOT EXISTS devices(node_id TEXT PRIMARY KEY, role TEXT NOT NULL, credential_hash TEXT NOT NULL,
    public_key BLOB NOT NULL, certificate BLOB NOT NULL, token_id TEXT NOT NULL, issued REAL NOT NULL,
    revoked INTEGER NOT NULL DEFAULT 0);
CREATE INDEX IF NOT EXISTS devices_by_credential ON devices(credential_hash);
CREATE TABLE IF NOT EXISTS nodes(node_id TEXT PRIMARY KEY, role TEXT NOT NULL, token_hash TEXT NOT NULL,
    first_seen REAL NOT NULL, last_seen REAL NOT NULL, capabilities_json TEXT NOT NULL DEFAULT '{}');
CREATE INDEX IF NOT EXISTS nodes_by_last_seen ON nodes(last_seen);
CREATE TABLE IF NOT EXISTS runs(run_id TEXT PRIMARY KEY, config_json TEXT NOT NULL, status TEXT NOT NULL,
    created REAL NOT NULL, updated REAL NOT NULL, completed_rounds INTEGER NOT NULL DEFAULT 0,
    error TEXT NOT NULL DEFAULT '');
CREATE TABLE IF NOT EXISTS rounds(run_id TEXT NOT NULL, round INTEGER NOT NULL, attempt INTEGER NOT NULL,
    status TEXT NOT NULL, started REAL NOT NULL, finished REAL, record_json TEXT NOT NULL DEFAULT '{}',
    PRIMARY KEY(run_id, round, attempt));
CREATE TABLE IF NOT EXISTS buffers(run_id TEXT NOT NULL, round INTEGER NOT NULL, seq INTEGER NOT NULL,
    state_json TEXT NOT NULL, sums BLOB NOT NULL, PRIMARY KEY(run_id, round));
CREATE TABLE IF NOT EXISTS checkpoints(run_id TEXT NOT NULL, round INTEGER NOT NULL, path TEXT NOT NULL,
    sha256 TEXT NOT NULL, optimizer_path TEXT NOT NULL DEFAULT '', created REAL NOT NULL,
    PRIMARY KEY(run_id, round));
"""


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
class BufferRow:
    """An asynchronous run's journaled buffer (``orchard.server.buffer.BufferState``)."""

    run_id: str
    round: int
    seq: int
    state_json: str
    sums: bytes


@dataclass(frozen=True)
class CheckpointRow:
    run_id: str
    round: int
    path: str
    sha256: str
    optimizer_path: str


# What a revocation covers, as (tokens, devices) conditions on its one key: a token (by id)
# and every credential it enrolled, or a node's credential and its device token.
_REVOKE_BY_TOKEN = ("substr(hash, 1, 12)=?", "token_id=?")
_REVOKE_BY_NODE = ("node_id=? AND kind='device'", "node_id=?")


class Store(Protocol):
    """What the root keeps. Rounds are kept as their records (``RoundRecord.as_dict()``)."""

    def close(self) -> None: ...
    def get_meta(self, key: str) -> str | None: ...
    def set_meta(self, key: str, value: str) -> None: ...
    # Enrollment tokens and device credentials (see the module's docstring).
    def issue_token(self, role: str, label: str = "", device: bool = False) -> str: ...
    def token(self, token_hash: str) -> TokenRow | None: ...
    def token_role(self, token_hash: str) -> str | None: ...
    def bind_token(self, token_hash: str, node_id: str, spent: bool = False) -> None: ...
    def revoke_token(self, token_hash: str) -> bool: ...
    def revoke(self, token_id: str = "", node_id: str = "") -> Revoked: ...
    def list_tokens(self) -> list[TokenRow]: ...
    def enroll_device(self, node_id: str, role: str, credential_hash: str, public_key: bytes, certificate: bytes,
                      token_id: str) -> None: ...
    def device(self, node_id: str) -> DeviceRow | None: ...
    def device_by_credential(self, credential_hash: str) -> DeviceRow | None: ...
    def list_devices(self) -> list[DeviceRow]: ...
    def signing_key(self) -> SigningKey: ...
    # A node joined; the rows of nodes last seen before ``forget_before`` (unix seconds) go.
    def upsert_node(self, node_id: str, role: str, token_hash: str, capabilities: dict[str, str],
                    forget_before: float = 0.0) -> None: ...
    def node_token(self, node_id: str) -> str | None: ...
    def create_run(self, run_id: str, config_json: str) -> None: ...
    def set_run_status(self, run_id: str, status: str, error: str = "") -> None: ...
    def get_run(self, run_id: str) -> RunRow | None: ...
    def latest_run(self) -> RunRow | None: ...
    def list_runs(self, limit: int = 0) -> list[RunRow]: ...
    def active_runs(self) -> list[RunRow]: ...
    def record_round(self, run_id: str, rnd: int, attempt: int, status: str, started: float,
                     finished: float | None, record: dict[str, Any]) -> None: ...
    def attempts(self, run_id: str, rnd: int) -> int: ...
    def interrupt_open_rounds(self, run_id: str) -> int: ...
    def rounds(self, run_id: str) -> list[dict[str, Any]]: ...
    def complete_round(self, run_id: str, rnd: int, attempt: int, started: float, record: dict[str, Any],
                       ckpt_path: str, ckpt_sha256: str, optimizer_path: str) -> None: ...
    def index_checkpoint(self, run_id: str, rnd: int, path: str, sha256: str, optimizer_path: str = "") -> None: ...
    def checkpoint(self, run_id: str, rnd: int | None = None) -> CheckpointRow | None: ...
    # Asynchronous runs: the root's open buffers, journaled after every accepted fold.
    # ``save_buffer`` keeps the state with the largest ``seq`` per (run, round); with
    # ``supersede_later`` it also drops the run's buffers of later rounds, in the same
    # transaction. ``complete_round`` drops the run's buffers up to the completed round.
    def save_buffer(self, run_id: str, rnd: int, seq: int, state_json: str, sums: bytes,
                    supersede_later: bool = False) -> None: ...
    def buffers(self, run_id: str) -> list[BufferRow]: ...


class SQLiteStore:
    """The durable store: one SQLite file in the root's data dir (WAL, synchronous=FULL)."""

    def __init__(self, path: str | Path) -> None:
        self.path = str(path)
        try:
            # SQLite gives its -wal and -shm files the database file's mode: owner-only.
            create_private(self.path)
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
        self._add_token_columns()
        self._signing_key: SigningKey | None = None

    def _add_token_columns(self) -> None:
        """A store made before device tokens: its tokens are shared tokens, and the columns
        they lack take their defaults (an additive change: the schema version stays)."""
        have = {r[1] for r in self._db.execute("PRAGMA table_info(tokens)")}
        for col, ddl in (("kind", "TEXT NOT NULL DEFAULT 'shared'"), ("node_id", "TEXT NOT NULL DEFAULT ''"),
                         ("spent", "INTEGER NOT NULL DEFAULT 0")):
            if col not in have:
                self._db.execute(f"ALTER TABLE tokens ADD COLUMN {col} {ddl}")

    def close(self) -> None:
        self._db.close()

    # ---------------------------------------------------------------- meta
    def get_meta(self, key: str) -> str | None:
        row = self._db.execute("SELECT value FROM meta WHERE key=?", (key,)).fetchone()
        return None if row is None else str(row[0])

    def set_meta(self, key: str, value: str) -> None:
        self._db.execute("INSERT INTO meta(key, value) VALUES(?, ?) ON CONFLICT(key) DO UPDATE SET value=excluded.value",
                         (key, value))

    # ---------------------------------------------------------------- tokens and devices
    _TOKEN_COLS = "hash, role, kind, label, created, revoked, node_id, spent"
    _DEVICE_COLS = "node_id, role, credential_hash, public_key, certificate, token_id, issued, revoked"

    def issue_token(self, role: str, label: str = "", device: bool = False) -> str:
        """Create an enrollment token; only its sha256 is stored. Returns the token (shown once)."""
        tok = new_token()
        self._db.execute("INSERT INTO tokens(hash, role, created, label, kind) VALUES(?, ?, ?, ?, ?)",
                         (hash_token(tok), role, time.time(), label, "device" if device else "shared"))
        return tok

    @staticmethod
    def _token_row(r: Any) -> TokenRow:
        return TokenRow(str(r[0]), str(r[1]), str(r[2]), str(r[3]), float(r[4]), bool(r[5]), str(r[6]), bool(r[7]))

    @staticmethod
    def _device_row(r: Any) -> DeviceRow:
        return DeviceRow(str(r[0]), str(r[1]), str(r[2]), bytes(r[3]), bytes(r[4]), str(r[5]), float(r[6]),
                         bool(r[7]))

    def token(self, token_hash: str) -> TokenRow | None:
        row = self._db.execute(f"SELECT {self._TOKEN_COLS} FROM tokens WHERE hash=?", (token_hash,)).fetchone()
        return None if row is None else self._token_row(row)

    def token_role(self, token_hash: str) -> str | None:
        row = self._db.execute("SELECT role FROM tokens WHERE hash=? AND revoked=0", (token_hash,)).fetchone()
        return None if row is None else str(row[0])

    def bind_token(self, token_hash: str, node_id: str, spent: bool = False) -> None:
        self._db.execute("UPDATE tokens SET node_id=?, spent=MAX(spent, ?) WHERE hash=?",
                         (node_id, int(spent), token_hash))

    def revoke_token(self, token_hash: str) -> bool:
        return bool(self.revoke(token_id=token_id(token_hash)).tokens) if self.token(token_hash) else False

    def revoke(self, token_id: str = "", node_id: str = "") -> Revoked:
        """Revoke a token (by id) and every credential it enrolled, or a node's credential
        and the device token bound to it: in one transaction."""
        try:
            self._db.execute("BEGIN IMMEDIATE")
            # The tokens and the device credentials it covers: constant conditions on one key.
            tokens, devices = _REVOKE_BY_TOKEN if token_id else _REVOKE_BY_NODE
            key = (token_id or node_id,)
            toks = [str(r[0]) for r in self._db.execute(f"SELECT hash FROM tokens WHERE {tokens} AND revoked=0", key)]
            nodes = [str(r[0]) for r in self._db.execute(
                f"SELECT node_id FROM devices WHERE {devices} AND revoked=0", key)]
            self._db.execute(f"UPDATE tokens SET revoked=1 WHERE {tokens}", key)
            self._db.execute(f"UPDATE devices SET revoked=1 WHERE {devices}", key)
            self._db.execute("COMMIT")
        except BaseException:
            self._db.execute("ROLLBACK")
            raise
        return Revoked(tuple(sorted({t[:12] for t in toks})), tuple(sorted(nodes)))

    def list_tokens(self) -> list[TokenRow]:
        rows = self._db.execute(f"SELECT {self._TOKEN_COLS} FROM tokens ORDER BY created, rowid").fetchall()
        return [self._token_row(r) for r in rows]

    def enroll_device(self, node_id: str, role: str, credential_hash: str, public_key: bytes, certificate: bytes,
                      token_id: str) -> None:
        """The node's credential and certified key, replacing any it had."""
        self._db.execute(f"INSERT OR REPLACE INTO devices({self._DEVICE_COLS}) VALUES(?,?,?,?,?,?,?,0)",
                         (node_id, role, credential_hash, public_key, certificate, token_id, time.time()))

    def device(self, node_id: str) -> DeviceRow | None:
        row = self._db.execute(f"SELECT {self._DEVICE_COLS} FROM devices WHERE node_id=?", (node_id,)).fetchone()
        return None if row is None else self._device_row(row)

    def device_by_credential(self, credential_hash: str) -> DeviceRow | None:
        row = self._db.execute(f"SELECT {self._DEVICE_COLS} FROM devices WHERE credential_hash=?",
                               (credential_hash,)).fetchone()
        return None if row is None else self._device_row(row)

    def list_devices(self) -> list[DeviceRow]:
        rows = self._db.execute(f"SELECT {self._DEVICE_COLS} FROM devices ORDER BY issued, node_id").fetchall()
        return [self._device_row(r) for r in rows]

    def signing_key(self) -> SigningKey:
        """The root's certificate key: ``identity/root.key`` beside the store (mode 0600 in
        a 0700 folder), made on first use; whoever makes it first, every process reads the same."""
        if self._signing_key is None:
            d = Path(self.path).parent / "identity"
            self._signing_key = load_or_create_key(d / "root.key")
        return self._signing_key

    # ---------------------------------------------------------------- nodes
    def upsert_node(self, node_id: str, role: str, token_hash: str, capabilities: dict[str, str],
                    forget_before: float = 0.0) -> None:
        now = time.time()
        self._db.execute("DELETE FROM nodes WHERE last_seen < ?", (forget_before,))
        self._db.execute(
            "INSERT INTO nodes(node_id, role, token_hash, first_seen, last_seen, capabilities_json) VALUES(?,?,?,?,?,?) "
            "ON CONFLICT(node_id) DO UPDATE SET role=excluded.role, token_hash=excluded.token_hash, "
            "last_seen=excluded.last_seen, capabilities_json=excluded.capabilities_json",
            (node_id, role, token_hash, now, now, json.dumps(capabilities)))

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

    _RUNS = "SELECT run_id, config_json, status, created, updated, completed_rounds, error FROM runs"

    def get_run(self, run_id: str) -> RunRow | None:
        row = self._db.execute(f"{self._RUNS} WHERE run_id=?", (run_id,)).fetchone()
        return None if row is None else RunRow(*row)

    def latest_run(self) -> RunRow | None:
        row = self._db.execute(f"{self._RUNS} ORDER BY created DESC, rowid DESC LIMIT 1").fetchone()
        return None if row is None else RunRow(*row)

    def list_runs(self, limit: int = 0) -> list[RunRow]:
        """Every run, newest first (``limit`` > 0: only that many)."""
        sql = f"{self._RUNS} ORDER BY created DESC, rowid DESC" + (" LIMIT ?" if limit > 0 else "")
        return [RunRow(*r) for r in self._db.execute(sql, (limit,) if limit > 0 else ()).fetchall()]

    def active_runs(self) -> list[RunRow]:
        rows = self._db.execute(f"{self._RUNS} WHERE status='running' ORDER BY created").fetchall()
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
            self._db.execute("DELETE FROM buffers WHERE run_id=? AND round<=?", (run_id, rnd))
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

    def save_buffer(self, run_id: str, rnd: int, seq: int, state_json: str, sums: bytes,
                    supersede_later: bool = False) -> None:
        try:
            self._db.execute("BEGIN IMMEDIATE")
            self._db.execute(
                "INSERT INTO buffers(run_id, round, seq, state_json, sums) VALUES(?,?,?,?,?) "
                "ON CONFLICT(run_id, round) DO UPDATE SET seq=excluded.seq, state_json=excluded.state_json, "
                "sums=excluded.sums WHERE excluded.seq > buffers.seq", (run_id, rnd, seq, state_json, sums))
            if supersede_later:
                self._db.execute("DELETE FROM buffers WHERE run_id=? AND round>?", (run_id, rnd))
            self._db.execute("COMMIT")
        except BaseException:
            self._db.execute("ROLLBACK")
            raise

    def buffers(self, run_id: str) -> list[BufferRow]:
        rows = self._db.execute("SELECT run_id, round, seq, state_json, sums FROM buffers WHERE run_id=? "
                                "ORDER BY round", (run_id,)).fetchall()
        return [BufferRow(r[0], int(r[1]), int(r[2]), str(r[3]), bytes(r[4])) for r in rows]


class MemoryStore:
    """The store's behaviour in dicts: nothing survives the process."""

    def __init__(self) -> None:
        self._meta: dict[str, str] = {"schema_version": str(SCHEMA_VERSION)}
        self._tokens: dict[str, TokenRow] = {}  # hash -> row, in issue order
        self._devices: dict[str, DeviceRow] = {}  # node id -> row
        self._key = SigningKey.generate()
        self._nodes: dict[str, tuple[str, str, dict[str, str], float]] = {}  # id -> (role, token hash, caps, seen)
        self._runs: dict[str, RunRow] = {}  # in creation order
        # (run, round, attempt) -> (status, started, finished, record)
        self._rounds: dict[tuple[str, int, int], tuple[str, float, float | None, dict[str, Any]]] = {}
        self._checkpoints: dict[tuple[str, int], CheckpointRow] = {}
        self._buffers: dict[tuple[str, int], BufferRow] = {}

    def close(self) -> None:
        pass

    def get_meta(self, key: str) -> str | None:
        return self._meta.get(key)

    def set_meta(self, key: str, value: str) -> None:
        self._meta[key] = value

    def issue_token(self, role: str, label: str = "", device: bool = False) -> str:
        tok = new_token()
        h = hash_token(tok)
        self._tokens[h] = TokenRow(h, role, "device" if device else "shared", label, time.time(), False, "", False)
        return tok

    def token(self, token_hash: str) -> TokenRow | None:
        return self._tokens.get(token_hash)

    def token_role(self, token_hash: str) -> str | None:
        got = self._tokens.get(token_hash)
        return None if got is None or got.revoked else got.role

    def bind_token(self, token_hash: str, node_id: str, spent: bool = False) -> None:
        got = self._tokens.get(token_hash)
        if got is not None:
            self._tokens[token_hash] = replace(got, node_id=node_id, spent=got.spent or spent)

    def revoke_token(self, token_hash: str) -> bool:
        return bool(self.revoke(token_id=token_id(token_hash)).tokens) if token_hash in self._tokens else False

    def revoke(self, token_id: str = "", node_id: str = "") -> Revoked:
        if token_id:
            toks = [t for t in self._tokens.values() if t.token_id == token_id]
            devs = [d for d in self._devices.values() if d.token_id == token_id]
        else:
            toks = [t for t in self._tokens.values() if t.node_id == node_id and t.kind == "device"]
            devs = [d for d in self._devices.values() if d.node_id == node_id]
        for t in toks:
            self._tokens[t.hash] = replace(t, revoked=True)
        for d in devs:
            self._devices[d.node_id] = replace(d, revoked=True)
        return Revoked(tuple(sorted({t.token_id for t in toks if not t.revoked})),
                       tuple(sorted(d.node_id for d in devs if not d.revoked)))

    def list_tokens(self) -> list[TokenRow]:
        return list(self._tokens.values())

    def enroll_device(self, node_id: str, role: str, credential_hash: str, public_key: bytes, certificate: bytes,
                      token_id: str) -> None:
        self._devices.pop(node_id, None)  # re-enrolled: listed in enrollment order
        self._devices[node_id] = DeviceRow(node_id, role, credential_hash, bytes(public_key), bytes(certificate),
                                           token_id, time.time(), False)

    def device(self, node_id: str) -> DeviceRow | None:
        return self._devices.get(node_id)

    def device_by_credential(self, credential_hash: str) -> DeviceRow | None:
        return next((d for d in self._devices.values() if d.credential_hash == credential_hash), None)

    def list_devices(self) -> list[DeviceRow]:
        return list(self._devices.values())

    def signing_key(self) -> SigningKey:
        return self._key

    def upsert_node(self, node_id: str, role: str, token_hash: str, capabilities: dict[str, str],
                    forget_before: float = 0.0) -> None:
        self._nodes = {n: r for n, r in self._nodes.items() if r[3] >= forget_before}
        self._nodes[node_id] = (role, token_hash, dict(capabilities), time.time())

    def node_token(self, node_id: str) -> str | None:
        got = self._nodes.get(node_id)
        return None if got is None else got[1]

    def create_run(self, run_id: str, config_json: str) -> None:
        if run_id in self._runs:
            raise StoreError(f"run {run_id!r} exists already")
        now = time.time()
        self._runs[run_id] = RunRow(run_id, config_json, "running", now, now, 0, "")

    def _update_run(self, run_id: str, **fields: Any) -> None:
        row = self._runs.get(run_id)
        if row is not None:
            self._runs[run_id] = replace(row, updated=time.time(), **fields)

    def set_run_status(self, run_id: str, status: str, error: str = "") -> None:
        self._update_run(run_id, status=status, error=error)

    def get_run(self, run_id: str) -> RunRow | None:
        return self._runs.get(run_id)

    def latest_run(self) -> RunRow | None:
        return next(reversed(self._runs.values()), None)

    def list_runs(self, limit: int = 0) -> list[RunRow]:
        rows = list(reversed(self._runs.values()))
        return rows[:limit] if limit > 0 else rows

    def active_runs(self) -> list[RunRow]:
        return [r for r in self._runs.values() if r.status == "running"]

    def record_round(self, run_id: str, rnd: int, attempt: int, status: str, started: float,
                     finished: float | None, record: dict[str, Any]) -> None:
        prev = self._rounds.get((run_id, rnd, attempt))
        # As SQLite's upsert: a round keeps the time it started.
        self._rounds[(run_id, rnd, attempt)] = (status, prev[1] if prev else started, finished,
                                                json.loads(json.dumps(record)))

    def attempts(self, run_id: str, rnd: int) -> int:
        return sum(1 for (r, n, _) in self._rounds if (r, n) == (run_id, rnd))

    def interrupt_open_rounds(self, run_id: str) -> int:
        now, n = time.time(), 0
        for key, (status, started, _, rec) in list(self._rounds.items()):
            if key[0] == run_id and status == "running":
                self._rounds[key] = ("interrupted", started, now, rec)
                n += 1
        return n

    def rounds(self, run_id: str) -> list[dict[str, Any]]:
        out = []
        for (r, rnd, attempt), (status, started, finished, rec) in sorted(self._rounds.items()):
            if r == run_id:
                d = json.loads(json.dumps(rec))
                d.update(round=rnd, attempt=attempt, status=status, started=started, finished=finished)
                out.append(d)
        return out

    def complete_round(self, run_id: str, rnd: int, attempt: int, started: float, record: dict[str, Any],
                       ckpt_path: str, ckpt_sha256: str, optimizer_path: str) -> None:
        rec = json.loads(json.dumps(record))  # refuses what SQLite's json.dumps would, before any change
        self._checkpoints[(run_id, rnd)] = CheckpointRow(run_id, rnd, ckpt_path, ckpt_sha256, optimizer_path)
        self._rounds[(run_id, rnd, attempt)] = ("completed", started, time.time(), rec)
        self._update_run(run_id, completed_rounds=rnd)
        for key in [k for k in self._buffers if k[0] == run_id and k[1] <= rnd]:
            del self._buffers[key]

    def index_checkpoint(self, run_id: str, rnd: int, path: str, sha256: str, optimizer_path: str = "") -> None:
        self._checkpoints[(run_id, rnd)] = CheckpointRow(run_id, rnd, path, sha256, optimizer_path)

    def checkpoint(self, run_id: str, rnd: int | None = None) -> CheckpointRow | None:
        if rnd is not None:
            return self._checkpoints.get((run_id, rnd))
        rows = [c for (r, _), c in self._checkpoints.items() if r == run_id]
        return max(rows, key=lambda c: c.round, default=None)

    def save_buffer(self, run_id: str, rnd: int, seq: int, state_json: str, sums: bytes,
                    supersede_later: bool = False) -> None:
        prev = self._buffers.get((run_id, rnd))
        if prev is None or seq > prev.seq:
            self._buffers[(run_id, rnd)] = BufferRow(run_id, rnd, seq, state_json, bytes(sums))
        if supersede_later:
            for key in [k for k in self._buffers if k[0] == run_id and k[1] > rnd]:
                del self._buffers[key]

    def buffers(self, run_id: str) -> list[BufferRow]:
        return [b for (r, _), b in sorted(self._buffers.items()) if r == run_id]
