"""simulation.heap: freed blocks stay in the process, so the next round's pickling does
not fault its memory in again."""

import subprocess
import sys

import pytest

from orchard.simulation.heap import keep_freed_memory

# A worker's round in small: pickle a batch of 160 uploads of 20 KB (a buffer grown by
# realloc to 3 MB, then freed) over and over, and count the page faults it takes.
_PROBE = """
import os, pickle, resource, sys
from orchard.simulation.heap import keep_freed_memory
if sys.argv[1] == "keep":
    assert keep_freed_memory()
batch = [os.urandom(20_000) for _ in range(160)]
pickle.dumps(batch)
faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(20):
    pickle.dumps(batch)
print((resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults) / 20)
"""


def _faults_per_pickle(mode: str) -> float:
    out = subprocess.run([sys.executable, "-c", _PROBE, mode], capture_output=True, text=True, check=True)
    return float(out.stdout.strip())


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt: Linux only")
def test_freed_blocks_are_reused_without_page_faults() -> None:
    adaptive = _faults_per_pickle("default")
    kept = _faults_per_pickle("keep")
    if adaptive <= 2:
        pytest.skip(f"this C library already reuses the blocks ({adaptive} faults a pickle)")
    assert kept <= 2 < adaptive, (kept, adaptive)


def test_reports_whether_the_settings_took() -> None:
    # Linux with glibc takes both (and again: the call is idempotent); elsewhere nothing changes.
    expected = sys.platform.startswith("linux") and "glibc" in " ".join(__import__("platform").libc_ver())
    assert keep_freed_memory() is expected
    assert keep_freed_memory() is expected
