"""The C heap of a long-running process: freed memory kept for the next round to reuse.

glibc's malloc serves a large request (above 128 KiB at first, then above the largest
block freed so far, up to 32 MiB) with a fresh ``mmap`` and unmaps it when it is freed,
and it hands free memory at the top of its heap back to the kernel once there is more
than twice that threshold. Two kinds of Orchard process allocate and free blocks of that size thousands of times
a round. In a simulation a worker pickles each batch of outputs (a few MB, grown by
``realloc``), the engine receives them, and the trainer stacks the clients of each
slice. In a server, gRPC reads every upload (a megabyte or more) into new buffers that
are checked, folded and freed before the next. Memory the kernel hands out anew costs a
page fault per page at first touch, and with a round's mix of sizes the adaptive
thresholds rarely settle: after a round of the digits benchmark, pickling a batch of
160 of its outputs (3 MB) took 6.9 ms, and 1.4 ms once the heap kept its memory
(unpickling 1.8 against 1.3 ms); on the transport benchmark (1,000 uploads of 1 MiB)
the aggregator took 106,000-120,000 minor page faults a round, and 62,000-67,000 (its
resident set touched once) with the heap kept.

:func:`keep_freed_memory` fixes both thresholds (``mallopt``): blocks under 32 MiB come
from the heap and go back to it, and up to 64 MiB of free heap stays mapped for the
next allocation. (Either setting alone is worse than neither: the other keeps its
default and the heap is unmapped or trimmed at every turn.) The simulator calls it in
its engine process and in each worker (docs/simulation.md has what it did
to a 10,000-client round and to the processes' memory); ``orchard server start`` and
``orchard aggregator start`` call it through :func:`orchard.server.process.tune_server_process`.

It changes the whole process for its lifetime (glibc has no call that restores the
adaptive thresholds). Elsewhere than glibc (musl, macOS) it changes nothing.
"""

from __future__ import annotations

import ctypes
import sys

# mallopt parameters (glibc's malloc.h).
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD_BYTES = 32 << 20  # glibc's largest: HEAP_MAX_SIZE / 2 on 64-bit
TRIM_THRESHOLD_BYTES = 64 << 20


def keep_freed_memory() -> bool:
    """Keep freed blocks under 32 MiB, and up to 64 MiB of free heap, in this process
    for reuse. True when the C library took both settings; False where there is no
    glibc ``mallopt`` (nothing changed)."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt  # the process's own C library
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    # mallopt returns 1 on success, 0 on an unknown parameter or a value out of range.
    # Both are set whatever the first returns: either alone is worse than neither.
    mmap_set = mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES) == 1
    trim_set = mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES) == 1
    return mmap_set and trim_set
