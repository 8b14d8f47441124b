"""The population ledger: every privacy charge a root makes, durable, by population.

A root records each round attempt's charge here before the attempt opens
(``orchard.server.runloop``), so an attempt whose result never comes back, or a root
killed mid-round, is charged all the same. Runs that name the same
``privacy.population_ledger`` run on the same devices: a new run's ledger starts from
their charges and composes its rounds with them against ``privacy.lifetime_epsilon``
(``orchard.aggregation.ledger``). Two implementations, one interface: SQLite in the
root's data dir, and in memory.

It also journals what a run's mechanism keeps between rounds (DP-FTRL: the tree of noise
and the participation bound's counts, ``save_state``), so that a restarted root continues
the same tree and the same bound instead of drawing noise again or forgetting who took
part.
"""

from __future__ import annotations

import sqlite3
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from orchard.errors import ConfigError, StoreError
from orchard.files import create_private

_DDL = """
CREATE TABLE IF NOT EXISTS privacy_charges(population TEXT NOT NULL, run_id TEXT NOT NULL, round INTEGER NOT NULL,
    attempt INTEGER NOT NULL, noise_multiplier REAL NOT NULL, adjacency TEXT NOT NULL, at REAL NOT NULL,
    PRIMARY KEY(run_id, round, attempt));
CREATE INDEX IF NOT EXISTS privacy_charges_population ON privacy_charges(population);
CREATE TABLE IF NOT EXISTS mechanism_state(run_id TEXT NOT NULL, key TEXT NOT NULL, data BLOB NOT NULL,
    PRIMARY KEY(run_id, key));
"""


@dataclass(frozen=True)
class Charge:
    population: str
    run_id: str
    round: int
    attempt: int
    noise_multiplier: float  # of the whole round's mechanism, stddev over clip norm
    adjacency: str


class ChargeLog(Protocol):
    def record(self, charge: Charge) -> None:
        """Durable before it returns; a charge recorded twice (same run, round, attempt) counts once."""
        ...

    def prior(self, population: str, adjacency: str, exclude_run: str = "") -> tuple[tuple[float, int], ...]:
        """Every charge on ``population`` but ``exclude_run``'s, as (noise multiplier, rounds)
        pairs; ConfigError if one was made under another adjacency (they do not compose)."""
        ...

    def run_rounds(self, run_id: str) -> int:
        """How many attempts of ``run_id`` were charged."""
        ...

    def save_state(self, run_id: str, key: str, data: bytes) -> None:
        """Durable before it returns: ``run_id``'s mechanism state under ``key``, replacing the last."""
        ...

    def state(self, run_id: str, key: str) -> bytes | None:
        """What :meth:`save_state` last wrote, or None."""
        ...

    def close(self) -> None: ...


def _grouped(rows: list[tuple[float, str]], population: str, adjacency: str) -> tuple[tuple[float, int], ...]:
    out: dict[float, int] = {}
    for z, adj in rows:
        if adj != adjacency:
            raise ConfigError(f"the population ledger {population!r} holds charges under adjacency {adj!r}; a run "
                             f"under {adjacency!r} cannot compose with them: use another privacy.population_ledger")
        out[z] = out.get(z, 0) + 1
    return tuple(sorted(out.items()))


class SQLiteChargeLog:
    def __init__(self, path: str | Path) -> None:
        try:
            # Owner-only, as the store: SQLite gives its -wal and -shm files the database's mode.
            create_private(path)
            self._db = sqlite3.connect(str(path), isolation_level=None, check_same_thread=False)
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute("PRAGMA synchronous=FULL")
            self._db.executescript(_DDL)
        except sqlite3.DatabaseError as err:
            raise StoreError(f"cannot open the population ledger at {path}: {err}") from None
        self._lock = threading.Lock()

    def record(self, charge: Charge) -> None:
        c = charge
        with self._lock:
            self._db.execute("INSERT OR IGNORE INTO privacy_charges VALUES (?, ?, ?, ?, ?, ?, ?)",
                             (c.population, c.run_id, c.round, c.attempt, c.noise_multiplier, c.adjacency,
                              time.time()))

    def prior(self, population: str, adjacency: str, exclude_run: str = "") -> tuple[tuple[float, int], ...]:
        with self._lock:
            rows = self._db.execute("SELECT noise_multiplier, adjacency FROM privacy_charges WHERE population = ? "
                                    "AND run_id != ?", (population, exclude_run)).fetchall()
        return _grouped([(float(z), str(a)) for z, a in rows], population, adjacency)

    def run_rounds(self, run_id: str) -> int:
        with self._lock:
            (n,) = self._db.execute("SELECT COUNT(*) FROM privacy_charges WHERE run_id = ?", (run_id,)).fetchone()
        return int(n)

    def save_state(self, run_id: str, key: str, data: bytes) -> None:
        with self._lock:
            self._db.execute("INSERT OR REPLACE INTO mechanism_state VALUES (?, ?, ?)", (run_id, key, data))

    def state(self, run_id: str, key: str) -> bytes | None:
        with self._lock:
            row = self._db.execute("SELECT data FROM mechanism_state WHERE run_id = ? AND key = ?",
                                   (run_id, key)).fetchone()
        return None if row is None else bytes(row[0])

    def close(self) -> None:
        self._db.close()


class MemoryChargeLog:
    def __init__(self) -> None:
        self._charges: dict[tuple[str, int, int], Charge] = {}
        self._states: dict[tuple[str, str], bytes] = {}

    def record(self, charge: Charge) -> None:
        self._charges.setdefault((charge.run_id, charge.round, charge.attempt), charge)

    def prior(self, population: str, adjacency: str, exclude_run: str = "") -> tuple[tuple[float, int], ...]:
        rows = [(c.noise_multiplier, c.adjacency) for c in self._charges.values()
                if c.population == population and c.run_id != exclude_run]
        return _grouped(rows, population, adjacency)

    def run_rounds(self, run_id: str) -> int:
        return sum(1 for c in self._charges.values() if c.run_id == run_id)

    def save_state(self, run_id: str, key: str, data: bytes) -> None:
        self._states[(run_id, key)] = bytes(data)

    def state(self, run_id: str, key: str) -> bytes | None:
        return self._states.get((run_id, key))

    def close(self) -> None:
        pass
