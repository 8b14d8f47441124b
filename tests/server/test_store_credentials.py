"""Enrollment tokens and device credentials in the store: one suite for SQLite and memory."""

from __future__ import annotations

import sqlite3
import stat
from collections.abc import Iterator
from pathlib import Path

import pytest

from orchard.server.store import MemoryStore, SQLiteStore, Store, hash_token, token_id


@pytest.fixture(params=["sqlite", "memory"])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Store]:
    st: Store = SQLiteStore(tmp_path / "orchard.db") if request.param == "sqlite" else MemoryStore()
    yield st
    st.close()


def test_tokens_are_shared_unless_issued_per_device(store: Store) -> None:
    shared = store.issue_token("client", "fleet")
    dev = store.issue_token("client", "phone", device=True)
    a, b = store.token(hash_token(shared)), store.token(hash_token(dev))
    assert a is not None and (a.kind, a.label, a.node_id, a.spent, a.revoked) == ("shared", "fleet", "", False, False)
    assert b is not None and (b.kind, b.role) == ("device", "client")
    assert store.token(hash_token("orc_nope")) is None
    store.bind_token(hash_token(dev), "client-1")
    b = store.token(hash_token(dev))
    assert b is not None and (b.node_id, b.spent) == ("client-1", False)
    store.bind_token(hash_token(dev), "client-1", spent=True)
    store.bind_token(hash_token(dev), "client-1")  # spent stays spent
    b = store.token(hash_token(dev))
    assert b is not None and b.spent
    assert [t.token_id for t in store.list_tokens()] == [token_id(hash_token(shared)), token_id(hash_token(dev))]


def test_devices_and_revocation(store: Store) -> None:
    shared, dev = store.issue_token("client"), store.issue_token("client", device=True)
    sid, did = token_id(hash_token(shared)), token_id(hash_token(dev))
    store.enroll_device("c1", "client", "cred1", b"k" * 32, b"cert1", sid)
    store.enroll_device("c2", "client", "cred2", b"l" * 32, b"cert2", sid)
    store.enroll_device("c3", "client", "cred3", b"m" * 32, b"cert3", did)
    store.bind_token(hash_token(dev), "c3", spent=True)
    d = store.device("c1")
    assert d is not None and (d.credential_hash, d.public_key, d.certificate, d.token_id, d.revoked) == (
        "cred1", b"k" * 32, b"cert1", sid, False)
    assert store.device_by_credential("cred2") == store.device("c2")
    assert store.device_by_credential("nope") is None and store.device("nope") is None
    # A node: its credential and the device token bound to it.
    got = store.revoke(node_id="c3")
    assert (got.tokens, got.nodes) == ((did,), ("c3",))
    dev_row, c3 = store.token(hash_token(dev)), store.device("c3")
    assert dev_row is not None and dev_row.revoked and c3 is not None and c3.revoked
    # A token: itself and every credential it enrolled.
    got = store.revoke(token_id=sid)
    assert (got.tokens, got.nodes) == ((sid,), ("c1", "c2"))
    assert all(d.revoked for d in store.list_devices())
    assert store.revoke(token_id=sid) == store.revoke(node_id="nobody")  # nothing more: empty
    assert not store.revoke(token_id=sid).tokens
    # A revoked node enrolls again (with a new token): a fresh row, live.
    store.enroll_device("c1", "client", "cred9", b"n" * 32, b"cert9", "other")
    d = store.device("c1")
    assert d is not None and not d.revoked and d.credential_hash == "cred9"
    assert store.device_by_credential("cred1") is None


def test_the_roots_signing_key_is_kept_beside_the_store(tmp_path: Path) -> None:
    st = SQLiteStore(tmp_path / "orchard.db")
    key = st.signing_key()
    st.close()
    path = tmp_path / "identity" / "root.key"
    assert stat.S_IMODE(path.stat().st_mode) == 0o600 and stat.S_IMODE(path.parent.stat().st_mode) == 0o700
    again = SQLiteStore(tmp_path / "orchard.db")
    assert again.signing_key().public_key == key.public_key
    again.close()


def test_a_store_from_before_device_tokens_opens_with_its_tokens_shared(tmp_path: Path) -> None:
    db = sqlite3.connect(tmp_path / "orchard.db")
    db.executescript("""
        CREATE TABLE meta(key TEXT PRIMARY KEY, value TEXT NOT NULL);
        INSERT INTO meta VALUES('schema_version', '1');
        CREATE TABLE tokens(hash TEXT PRIMARY KEY, role TEXT NOT NULL, created REAL NOT NULL,
            revoked INTEGER NOT NULL DEFAULT 0, label TEXT NOT NULL DEFAULT '');
    """)
    db.execute("INSERT INTO tokens(hash, role, created) VALUES(?, 'client', 0)", (hash_token("orc_old"),))
    db.commit()
    db.close()
    st = SQLiteStore(tmp_path / "orchard.db")
    t = st.token(hash_token("orc_old"))
    assert t is not None and (t.kind, t.role, t.revoked) == ("shared", "client", False)
    assert st.token_role(hash_token("orc_old")) == "client"
    st.close()
