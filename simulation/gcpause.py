"""The cyclic garbage collector, paused while a round runs.

A simulated round allocates millions of short-lived objects (device readings, governor
samples, headers, per-tensor views), almost all freed by reference counting the moment
they are done with. With the collector on, each of those allocations counts towards its
next generation-0 pass, and every pass also walks the objects that survive until the
round ends -- the round's devices, assignments and uploads -- so it ran several hundred
times a round and took about a fifth of a 10,000-client round's CPU time for nothing.

:func:`cyclic_gc_paused` turns it off for a round and, when the round is over, collects
the young generations (what the round allocated and did not free: a few milliseconds).
Memory is unchanged in practice: what reference counting cannot free, cycles, lives at
most one round longer than it would have, and the code that builds large cycles breaks
them itself (see ``backends._Unpacked``). The older generations are left to the
collector's own schedule between rounds.
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator


@contextlib.contextmanager
def cyclic_gc_paused() -> Iterator[None]:
    """Pause the cyclic collector inside the block, then collect generations 0 and 1.
    A no-op when the caller had already turned the collector off."""
    if not gc.isenabled():
        yield
        return
    gc.disable()
    try:
        yield
    finally:
        gc.enable()
        gc.collect(1)
