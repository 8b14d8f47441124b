"""The repository's size rule: no hand-written Python file over 600 lines.

A file that long holds more than one concept; split it along a seam (one concept a
file), re-exporting from the old module the names other code imports. Generated stubs
(``orchard/v1/*_pb2*``, excluded from the linters too) are exempt.
"""

from __future__ import annotations

import fnmatch
import os
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
LIMIT = 600
GENERATED = ("orchard/v1/*_pb2*",)
SKIPPED_DIRS = {".venv", "build", "node_modules", "__pycache__"}


def _python_files() -> list[str]:
    """Repo-relative paths of the Python files Orchard keeps: git's tracked files, or,
    outside a checkout (an unpacked sdist), every .py below the root but virtual
    environments, build outputs and hidden folders."""
    try:
        out = subprocess.run(["git", "-C", str(REPO), "ls-files", "-z", "--", "*.py"],
                             capture_output=True, check=True).stdout
        return [p for p in out.decode().split("\0") if p]
    except (OSError, subprocess.CalledProcessError):
        pass
    found = []
    for root, dirs, files in os.walk(REPO):
        dirs[:] = [d for d in dirs if not d.startswith(".") and d not in SKIPPED_DIRS
                   and not d.endswith(".egg-info")]
        found += [Path(root, f).relative_to(REPO).as_posix() for f in files if f.endswith(".py")]
    return found


def _is_generated(path: str) -> bool:
    return any(fnmatch.fnmatch(path, pattern) for pattern in GENERATED)


def test_no_hand_written_python_file_passes_600_lines() -> None:
    files = [p for p in _python_files() if not _is_generated(p) and (REPO / p).is_file()]
    assert files, "found no Python files: the listing is broken, not the rule kept"
    long = {}
    for p in files:
        n = len((REPO / p).read_text(encoding="utf-8").splitlines())
        if n > LIMIT:
            long[p] = n
    assert not long, (
        f"Python files over {LIMIT} lines (split each along a seam, one concept a file, and "
        f"re-export moved names from the old module): {dict(sorted(long.items()))}"
    )


def test_the_rule_sees_the_files_it_guards() -> None:
    # The listing must reach every source folder and the tests, and leave the stubs out.
    files = set(_python_files())
    for expected in ("compression/aggregate.py", "secure_agg/messages.py", "benchmarks/simulation.py",
                     "tests/conftest.py"):
        assert expected in files
    assert _is_generated("orchard/v1/orchard_pb2_grpc.py")
    assert not _is_generated("orchard/v1/__init__.py")
