"""Owner-only files and directories: the one place that decides the modes Orchard writes with.

Everything a root, an aggregator or a client keeps on disk (the store ``orchard.db`` and
SQLite's ``-wal``/``-shm`` beside it, checkpoints, run logs, the admin token, keys,
certificates, credentials, codec state) is created mode 0600, and every directory that
holds it 0700, whatever the process's umask: each file is opened with its mode, so a
secret never exists on disk with wider permissions, not even for an instant. SQLite
creates its ``-wal`` and ``-shm`` files with the mode of the database file, so the store
creates that file first, owner-only (``create_private``).

The ``orchard`` commands that keep state also set the process umask to 077
(``restrict_umask``), for whatever a library writes on their behalf.

A directory that already exists is used as it is found: its mode is the operator's
choice. When it (or anything in it) is open to group or others, ``report_loose`` says so
at start, with the ``chmod`` that closes it.
"""

from __future__ import annotations

import contextlib
import logging
import os
import stat
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import IO

FILE_MODE = 0o600
DIR_MODE = 0o700
UMASK = 0o077
_LOOSE = stat.S_IRWXG | stat.S_IRWXO


def restrict_umask() -> int:
    """Set the process umask to 077 (owner-only); returns the previous one."""
    return os.umask(UMASK)


def private_dir(path: str | Path) -> Path:
    """``path`` as a directory, creating it and any missing parents with mode 0700.
    Directories that exist already keep their mode (see ``report_loose``)."""
    path = Path(path)
    missing: list[Path] = []
    p = path
    while not p.exists():
        missing.append(p)
        if p.parent == p:
            break
        p = p.parent
    for d in reversed(missing):
        try:
            d.mkdir(mode=DIR_MODE)
        except FileExistsError:  # another process made it this instant
            continue
        os.chmod(d, DIR_MODE)  # mkdir's mode is masked by the umask
    if not path.is_dir():
        raise NotADirectoryError(f"{path} exists and is not a directory")
    return path


def create_private(path: str | Path) -> Path:
    """Create ``path`` empty with mode 0600 if it does not exist (its parent 0700)."""
    path = Path(path)
    private_dir(path.parent)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, FILE_MODE)
    except FileExistsError:
        return path
    os.fchmod(fd, FILE_MODE)
    os.close(fd)
    return path


def open_append(path: str | Path) -> IO[str]:
    """``path`` opened for appending text, created mode 0600 (its parent 0700)."""
    path = Path(path)
    private_dir(path.parent)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, FILE_MODE)
    return os.fdopen(fd, "a", encoding="utf-8")


def open_private(path: str | Path) -> IO[bytes]:
    """``path`` opened for writing bytes (truncated), created mode 0600 (its parent 0700)."""
    path = Path(path)
    private_dir(path.parent)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, FILE_MODE)
    return os.fdopen(fd, "wb")


def atomic_write(path: str | Path, data: bytes, *, mode: int = FILE_MODE, private_parent: bool = True) -> None:
    """Write ``data`` to ``path`` so that a crash leaves the old file or the new one, never a
    mix: a temporary file created with its final ``mode`` (a secret never exists on disk with
    wider permissions), fsynced, renamed over the target, and the directory fsynced.

    The default is the state files' rule: mode 0600 in a parent made 0700. A client bundle,
    meant to be copied to devices, passes ``mode=0o644, private_parent=False``."""
    path = Path(path)
    if private_parent:
        private_dir(path.parent)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        os.fchmod(fd, mode)
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    dfd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dfd)
    finally:
        os.close(dfd)


def loose_paths(root: str | Path) -> Iterator[tuple[Path, int]]:
    """``root`` and everything under it that group or others may access, with its mode
    (symbolic links are not followed)."""
    root = Path(root)
    for dirpath, dirnames, filenames in os.walk(root):
        d = Path(dirpath)
        if d == root:
            mode = stat.S_IMODE(os.lstat(d).st_mode)
            if mode & _LOOSE:
                yield d, mode
        for name in dirnames + filenames:
            p = d / name
            st = os.lstat(p)
            if stat.S_ISLNK(st.st_mode):
                continue
            if stat.S_IMODE(st.st_mode) & _LOOSE:
                yield p, stat.S_IMODE(st.st_mode)


def report_loose(root: str | Path, what: str, log: logging.Logger) -> list[Path]:
    """Warn (one line) when ``root`` or anything in it is open to group or others: what
    it is, the first few such paths with their modes, and the command that closes them.
    Returns those paths (empty: nothing to report, or ``root`` does not exist)."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = list(loose_paths(root))
    if found:
        shown = ", ".join(f"{p} ({m:o})" for p, m in found[:3])
        more = f" and {len(found) - 3} more" if len(found) > 3 else ""
        log.warning("%s %s is open to group or others: %s%s; Orchard keeps it owner-only (0700 directories, "
                    "0600 files): run `chmod -R go-rwx %s`", what, root, shown, more, root)
    return [p for p, _ in found]
