"""orchard.files: owner-only whatever the umask, and a loose directory reported once."""

from __future__ import annotations

import logging
import os
import stat
from collections.abc import Iterator
from pathlib import Path

import pytest

from orchard.files import atomic_write, create_private, open_append, private_dir, report_loose


def mode(p: Path) -> int:
    return stat.S_IMODE(p.stat().st_mode)


@pytest.fixture
def open_umask() -> Iterator[None]:
    old = os.umask(0)  # the loosest: every mode below is the code's own
    try:
        yield
    finally:
        os.umask(old)


def test_everything_is_created_owner_only(tmp_path: Path, open_umask: None) -> None:
    d = private_dir(tmp_path / "a" / "b" / "c")
    assert [mode(tmp_path / p) for p in ("a", "a/b", "a/b/c")] == [0o700] * 3
    atomic_write(d / "x.bin", b"1")
    atomic_write(d / "x.bin", b"2")  # replacing keeps the mode
    assert (d / "x.bin").read_bytes() == b"2" and mode(d / "x.bin") == 0o600
    assert [p.name for p in d.iterdir()] == ["x.bin"]  # no temporary file left
    create_private(tmp_path / "new" / "db")
    assert mode(tmp_path / "new") == 0o700 and mode(tmp_path / "new" / "db") == 0o600
    with open_append(tmp_path / "logs" / "run.jsonl") as f:
        f.write("line\n")
    assert mode(tmp_path / "logs" / "run.jsonl") == 0o600 and mode(tmp_path / "logs") == 0o700


def test_an_existing_directory_keeps_its_mode(tmp_path: Path) -> None:
    os.chmod(tmp_path, 0o750)
    private_dir(tmp_path)
    assert mode(tmp_path) == 0o750
    (tmp_path / "f").write_text("x")
    with pytest.raises(NotADirectoryError):
        private_dir(tmp_path / "f")


def test_a_loose_tree_is_reported_with_the_chmod_that_closes_it(tmp_path: Path,
                                                                caplog: pytest.LogCaptureFixture) -> None:
    log = logging.getLogger("test.files")
    d = private_dir(tmp_path / "data")
    atomic_write(d / "orchard.db", b"")
    assert report_loose(d, "the root's data dir", log) == [] and not caplog.records
    for name in ("orchard.db", "a", "b", "c"):
        (d / name).touch()
        os.chmod(d / name, 0o644)
    with caplog.at_level(logging.WARNING, logger="test.files"):
        found = report_loose(d, "the root's data dir", log)
    assert sorted(p.name for p in found) == ["a", "b", "c", "orchard.db"]
    (msg,) = [r.getMessage() for r in caplog.records]
    assert msg.startswith(f"the root's data dir {d} is open to group or others: ")
    assert "(644)" in msg and "and 1 more" in msg and msg.endswith(f"run `chmod -R go-rwx {d}`")
    assert report_loose(tmp_path / "absent", "x", log) == []
