"""orchard.heap: freed blocks stay in the process, so the next round's pickling does
not fault its memory in again."""

import platform
import subprocess
import sys

import pytest

from orchard.heap import keep_freed_memory

# A worker's round in small: pickle a batch of 160 uploads of 20 KB (a buffer grown by
# realloc to 3 MB, then freed) over and over, and count the page faults it takes.
_PROBE = """
import os, pickle, resource, sys
from orchard.heap import keep_freed_memory
if sys.argv[1] == "keep":
    assert keep_freed_memory()
batch = [os.urandom(20_000) for _ in range(160)]
pickle.dumps(batch)
faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(20):
    pickle.dumps(batch)
print((resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults) / 20)
"""


# mallopt and the thresholds it sets are glibc's; elsewhere keep_freed_memory changes nothing.
_GLIBC = sys.platform.startswith("linux") and platform.libc_ver()[0] == "glibc"


def _faults_per_pickle(mode: str) -> float:
    out = subprocess.run([sys.executable, "-c", _PROBE, mode], capture_output=True, text=True, check=True)
    return float(out.stdout.strip())


@pytest.mark.skipif(not _GLIBC, reason="the setting is glibc's mallopt; no other C library takes it")
def test_freed_blocks_are_reused_without_page_faults() -> None:
    # glibc's adaptive thresholds fault a regrown buffer in again (38 a pickle measured);
    # kept, the heap serves it from memory it already has.
    adaptive = _faults_per_pickle("default")
    kept = _faults_per_pickle("keep")
    assert kept <= 2 < adaptive, (kept, adaptive)


def test_reports_whether_the_settings_took() -> None:
    # Linux with glibc takes both (and again: the call is idempotent); elsewhere nothing changes.
    assert keep_freed_memory() is _GLIBC
    assert keep_freed_memory() is _GLIBC
