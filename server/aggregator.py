"""An aggregator: a coordinator whose rounds come from upstream and whose results go back up.

It dials its upstream like a client (join, long-poll with its pool size, pull the model,
push), runs each round for its own cohort with the same :class:`Coordinator` as the
root, and pushes the cohort's partial sum (float64, lossless) upstream. Tiers above see
one upload per aggregator, whatever the size of its cohort.
"""

from __future__ import annotations

import asyncio
import logging

from orchard.config import RunConfig
from orchard.errors import AuthError, OrchardError
from orchard.link import FleetLink, UploadRefused
from orchard.messages import PARTIAL_CODEC, Idle, TaskAssignment, UploadHeader, UploadKind
from orchard.server.coordinator import Coordinator, RoundOutcome, RoundTask
from orchard.updates import encode_partial
from orchard.wire import sha256_hex

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
        cfg = RunConfig.model_validate_json(t.config_json)
        task = RoundTask(run_id=t.run_id, round=t.round, attempt=t.attempt, config=cfg, config_json=t.config_json,
                         model_blob=blob, model_hash=t.model_hash, schema=t.schema, deadline_unix=t.deadline_unix,
                         target=max(1, t.cohort_target), shared_seed=t.shared_seed)
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
        p = out.partial
        payload, sizes = encode_partial(p.sums)
        header = UploadHeader(
            node_id=self.link.node_id, run_id=t.run_id, round=t.round, attempt=t.attempt, task_id=t.task_id,
            kind=UploadKind.PARTIAL_SUM, schema=t.schema, payload_sizes=sizes, codec=PARTIAL_CODEC,
            payload_sha256=sha256_hex(payload), weight=p.weight, count=p.count,
            metric_sums=dict(p.metrics.sums), metric_weights=dict(p.metrics.weights),
            bytes_up=out.bytes_up, bytes_down=out.bytes_down,
            tier_participants=out.tier_participants)
        try:
            await self.link.push_update(header, payload)
            log.info("round %d: pushed partial of %d updates upstream", t.round, p.count)
        except UploadRefused as err:
            log.warning("round %d: upstream refused the partial: %s", t.round, err)
