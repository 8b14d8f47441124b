"""An aggregator: a coordinator whose rounds come from upstream and whose results go back up.

It dials its upstream like a client (join, long-poll with its pool size, pull the model,
push), runs each round for its own cohort with the same :class:`Coordinator` as the
root, and pushes the cohort's partial sum (float64, lossless) upstream. Tiers above see
one upload per aggregator, whatever the size of its cohort.
"""

from __future__ import annotations

import asyncio
import logging

from orchard.errors import AuthError, OrchardError
from orchard.link import FleetLink, UploadRefused
from orchard.messages import Idle, TaskAssignment
from orchard.server.coordinator import Coordinator
from orchard.server.round import RoundOutcome, partial_upload, task_from_assignment

log = logging.getLogger("orchard.server.aggregator")


class UpstreamLink:
    def __init__(self, coordinator: Coordinator, link: FleetLink) -> None:
        self.coord = coordinator
        self.link = link
        self.rounds_done = 0
        self.pool_report_s = 1.0
        self.stopped = asyncio.Event()

    async def run(self) -> None:
        """Serve upstream tasks until cancelled. Never exits on a transient upstream failure."""
        while not self.stopped.is_set():
            try:
                size, elig = self.coord.capacity()
                # Short polls keep the pool size the upstream allocates by fresh.
                got = await self.link.poll(pool_size=size, pool_eligible=elig, wait_s=self.pool_report_s)
                if isinstance(got, Idle):
                    continue
                await self._serve(got)
            except asyncio.CancelledError:
                raise
            except AuthError:
                log.error("upstream refused this aggregator's token; stopping")
                raise
            except OrchardError as err:
                log.warning("round from upstream failed: %s", err)
                await asyncio.sleep(1.0)
            except Exception:  # keep serving the tree below whatever went wrong above
                log.exception("upstream link error; retrying")
                await asyncio.sleep(1.0)

    async def _serve(self, t: TaskAssignment) -> None:
        blob = await self.link.pull_model(t.model_hash)
        task = task_from_assignment(t, blob)
        cr = self.coord.open_round(task)
        log.info("round %d: target %d, selected %d", t.round, task.target, len(cr.assignments))
        beat = asyncio.create_task(self._heartbeats(t, cr))
        try:
            out = await self.coord.wait_round(cr)
        finally:
            beat.cancel()
        await self._push(t, out)
        self.rounds_done += 1

    async def _heartbeats(self, t: TaskAssignment, cr) -> None:
        while not cr.closed:
            await asyncio.sleep(self.link.heartbeat_s / 2)
            if not await self.link.heartbeat(t.task_id, progress=cr.received / max(1, cr.task.target)):
                self.coord.close_round(cr, "upstream no longer wants this round")
                return

    async def _push(self, t: TaskAssignment, out: RoundOutcome) -> None:
        header, payload = partial_upload(t, self.link.node_id, out)
        try:
            await self.link.push_update(header, payload)
            log.info("round %d: pushed partial of %d updates upstream", t.round, out.partial.count)
        except UploadRefused as err:
            log.warning("round %d: upstream refused the partial: %s", t.round, err)
