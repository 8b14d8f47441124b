"""Clients trained ahead of their turn, on a worker that would otherwise sit idle.

While devices are still being dispatched no client's turn is known, so a backend with
workers is handed jobs of dispatched clients meanwhile. A client's output is a pure
function of its job, which is fixed once the device is dispatched (its steps, codec
state and start model), so training it early changes nothing; one that turns out never
to be needed (its tier closes first) was trained for nothing, which costs an idle core
only.
"""

from __future__ import annotations

from collections import deque
from concurrent.futures import Future

from orchard.simulation.clients import ClientOutput
from orchard.simulation.context import Context
from orchard.simulation.jobs import Arrival, Jobs
from orchard.typing import NDArrays

_AHEAD_BATCH = 320  # clients per job trained ahead, on an idle worker, while devices are dispatched
_AHEAD_MAX = 4096  # at most this many clients trained ahead per round (their uploads wait in memory)


class TrainingAhead:
    """The jobs trained ahead this round: in flight, in order; the outputs that came back,
    by partition; and every partition sent ahead (``parts``)."""

    def __init__(self, ctx: Context, jobs: Jobs) -> None:
        self._ctx = ctx
        self._jobs = jobs
        self._most = _AHEAD_MAX
        self._futures: deque[Future[list[ClientOutput]]] = deque()
        self._outputs: dict[int, ClientOutput] = {}
        self.parts: set[int] = set()

    @property
    def batch(self) -> int:
        """Clients a job: the hand-out sends its queue once it holds this many (fewer once
        the engine has timed its clients: see ``jobs.Pace``)."""
        return self._jobs.pace.clients(_AHEAD_BATCH)

    def send(self, queued: list[Arrival], arrays: NDArrays,
             starts: dict[str, tuple[bytes, NDArrays]]) -> list[Arrival]:
        """Hand the worker a job of the dispatched clients ``queued`` while it would sit
        idle; returns what is left queued. At most one such job waits behind the one
        running, and at most ``_AHEAD_MAX`` clients a round."""
        while self._futures and self._futures[0].done():
            self._collect(self._futures.popleft())
        if len(self._futures) >= 2:  # the worker is busy: keep the newest clients for later
            return queued[-self.batch:]
        if len(self.parts) + len(queued) > self._most:
            return []
        jobs = [self._jobs.job(a) for a in queued]
        need = {a.start for a in queued if a.start}
        self._futures.append(
            self._ctx.backend.submit(jobs, arrays, {k: v[1] for k, v in starts.items() if k in need} or None))
        self.parts.update(a.partition for a in queued)
        return []

    def _collect(self, fut: Future[list[ClientOutput]]) -> None:
        for o in fut.result():
            self._outputs[o.partition] = o

    def take(self, partition: int) -> ClientOutput | None:
        """The output of a client trained ahead (waiting for its job if need be), or None."""
        if partition not in self.parts:
            return None
        while partition not in self._outputs:
            self._collect(self._futures.popleft())
        return self._outputs.pop(partition)

    def forget(self) -> None:
        """Drop what was trained ahead for an earlier round (an attempt that ended early)."""
        for fut in self._futures:
            fut.cancel()
        self._futures.clear()
        self._outputs.clear()
        self.parts.clear()
