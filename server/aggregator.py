"""An aggregator: a coordinator whose rounds come from upstream and whose results go back up.

It dials its upstream like a client (join, long-poll with its pool size, pull the model,
push), runs each round for its own cohort with the same :class:`Coordinator` as the
root, through the same :class:`~orchard.server.upstream.ChildRound` as the simulator's
tiers, and pushes the cohort's partial sum (float64, lossless) upstream. Tiers above see
one upload per aggregator, whatever the size of its cohort.

With ``secure_aggregation.scope = "tree"`` the round's secure session is the root's: the
aggregator reports its roster and relays its clients' exchanges upstream
(:class:`LinkUpstream`, ``Fleet.SecAgg``), and pushes no partial (its clients' inputs
are in the root's sum).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable
from typing import TypeVar

import grpc

from orchard.errors import (
    AuthError,
    DuplicateUploadError,
    NotSelectedError,
    OrchardError,
    RoundClosedError,
    SecAggError,
)
from orchard.link import FleetLink, UploadRefused
from orchard.messages import DroppedUpload, Idle, TaskAssignment, UploadHeader
from orchard.secure_agg import Stage
from orchard.secure_agg.stages import stage_index as stage_index_of
from orchard.server.ackjournal import AckJournal
from orchard.server.bounds import DROPPED_MAX, REASON_MAX
from orchard.server.cohort import CohortRound
from orchard.server.coordinator import Coordinator
from orchard.server.round import RoundOutcome
from orchard.server.secagg import SecAggReply
from orchard.server.upstream import ChildRound

log = logging.getLogger("orchard.server.aggregator")
T = TypeVar("T")

# An upstream refusal of a relayed call, as the error this tier raises to the client below
# (the servicer maps it back to the same status code); any other: SecAggError. Never one
# the client's link would act on as its own (UNAUTHENTICATED, NOT_FOUND: rejoin): those
# are about this aggregator (the link rejoins by itself), not about the client.
REFUSED: dict[grpc.StatusCode, type[OrchardError]] = {
    grpc.StatusCode.ALREADY_EXISTS: DuplicateUploadError,
    grpc.StatusCode.PERMISSION_DENIED: NotSelectedError,
    grpc.StatusCode.FAILED_PRECONDITION: RoundClosedError,
}


async def _upstream(call: Awaitable[T]) -> T:
    """``call`` on the upstream link, its refusal named as an OrchardError."""
    try:
        return await call
    except AuthError as err:  # the link's: the upstream refused this aggregator's token
        raise SecAggError(f"upstream refused this aggregator: {err}") from None
    except grpc.aio.AioRpcError as err:
        cls = REFUSED.get(err.code(), SecAggError)
        raise cls(f"upstream refused ({err.code().name}): {err.details()}") from None


class LinkUpstream:
    """``SecureUpstream`` over ``Fleet.SecAgg`` on the aggregator's upstream link, bound to
    its task ``t`` (scope "tree"): the roster report, then each exchange relayed for a
    client below. An exchange waits for the roster to be in upstream (the parent knows this
    tier's clients only from it); a poll that finds it still missing answers "nothing yet"."""

    def __init__(self, link: FleetLink, t: TaskAssignment) -> None:
        self.link, self.t = link, t
        self._reported = asyncio.Event()
        self._unsent_down = 0  # bytes_down of polls answered here, for the next exchange sent

    async def roster(self, nodes: list[str], tiers: list[str]) -> None:
        await _upstream(self.link.secagg_roster(self.t, nodes, tiers))
        self._reported.set()

    async def exchange(self, node: str, stage_index: int, message: bytes, header: UploadHeader | None,
                       wait_s: float, bytes_down: int = 0) -> SecAggReply:
        start = time.monotonic()
        if not self._reported.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._reported.wait(), timeout=max(0.0, wait_s))
            if not self._reported.is_set():
                if message:
                    raise SecAggError(f"round {self.t.round}: this tier's roster is not in upstream yet, so the "
                                      "secure session cannot have asked for a message; poll without one")
                self._unsent_down += bytes_down
                return SecAggReply(stage_index_of(Stage.ADVERTISE_KEYS), b"", False, "")
        down, self._unsent_down = self._unsent_down + bytes_down, 0
        wait = max(0.0, wait_s - (time.monotonic() - start))
        try:
            r = await _upstream(self.link.secagg(self.t, stage_index, message, header, wait, client_id=node,
                                                 bytes_down=down))
        except BaseException:
            self._unsent_down += down - bytes_down  # the coordinator takes back its own part
            raise
        return SecAggReply(r.stage, r.broadcast, r.done, r.aborted)


class UpstreamLink:
    """The aggregator's side of its upstream: polls (reporting the dropped uploads its
    ``journal`` holds), serves each task as a round of its own and pushes its partial.
    ``journal``: where it journals what it acknowledges (``orchard.server.ackjournal``);
    None (no data dir): nothing is journaled, and a kill loses what it held unrecorded."""

    def __init__(self, coordinator: Coordinator, link: FleetLink, journal: AckJournal | None = None) -> None:
        self.coord = coordinator
        self.link = link
        self.journal = journal
        if journal is not None:
            coordinator.acks = self
        self._no_round_since: float | None = None  # upstream has answered "no round open" since
        self.rounds_done = 0
        self.pool_report_s = 1.0
        self.stopped = asyncio.Event()

    async def run(self) -> None:
        """Serve upstream tasks until cancelled. Never exits on a transient upstream failure."""
        while not self.stopped.is_set():
            try:
                size, elig = self.coord.capacity()
                report = self.journal.pending(DROPPED_MAX) if self.journal is not None else []
                # Short polls keep the pool size the upstream allocates by fresh.
                try:
                    got = await self.link.poll(pool_size=size, pool_eligible=elig, wait_s=self.pool_report_s,
                                               dropped=report)
                except grpc.aio.AioRpcError as err:
                    if report and err.code() is grpc.StatusCode.INVALID_ARGUMENT:  # never send it again
                        log.error("upstream refused the report of %d dropped uploads, which stay unrecorded: %s",
                                  len(report), err.details())
                        self.journal.reported(report)  # type: ignore[union-attr]
                    raise
                if report:
                    self.journal.reported(report)  # type: ignore[union-attr]
                    log.info("reported %d dropped uploads upstream", len(report))
                if isinstance(got, Idle):
                    self._idle(got)
                    continue
                self._no_round_since = None
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
        child = ChildRound(self.coord, self.link.node_id, t, blob, lambda a: LinkUpstream(self.link, a))
        cr = child.cr
        log.info("round %d: target %d, selected %d", t.round, cr.task.target, len(cr.assignments))
        beat = asyncio.create_task(self._heartbeats(t, cr))
        try:
            try:
                await child.report_roster()
                out = await self.coord.wait_round(cr)
            finally:
                beat.cancel()
            up = child.partial(out)
            if up is None:  # the clients' masked inputs went to the root's secure session
                log.info("round %d: relayed to the root's secure session (%s)", t.round, out.reason)
            else:
                await self._push(t, out, cr, *up)
        finally:  # whatever this round acknowledged and did not forward is dropped, and said why
            self.dropped(cr, f"round {t.round}: the aggregator's round ended without a partial accepted upstream")
        self.rounds_done += 1

    def _idle(self, idle: Idle) -> None:
        """A buffer's continuation waits for its run's next round from upstream. Once the
        upstream has had no round open for the run's deadline (the run is over, not between
        two buffers), nothing will carry what it took: it closes, and its uploads are
        dropped with that reason."""
        cr = self.coord.current
        if idle.reason != "no round open" or cr is None or cr.closed or not cr.continuation:
            self._no_round_since = None
            return
        now = time.monotonic()
        self._no_round_since = self._no_round_since or now
        if now - self._no_round_since >= cr.task.config.cohort.deadline_s:
            self.coord.close_round(cr, "upstream has no round open: the run is over")
            self.dropped(cr, f"run over before applied: upstream had no round open for {now - self._no_round_since:.0f}"
                             f" s after round {cr.task.round} of run {cr.task.run_id!r} closed")

    # The tier's AckLog (orchard.server.tier.uploads): rounds are the journal's keys, by identity
    # (held until the round is forwarded or dropped: ids of freed rounds would be reused).
    def acked(self, cr: CohortRound, up: DroppedUpload) -> None:
        assert self.journal is not None
        try:
            self.journal.acked(cr, cr.task.run_id, cr.task.round, cr.task.attempt, up)
        except OSError as err:  # the update is folded: acknowledge it, and say it is not journaled
            log.error("cannot journal upload %s of %s: %s", up.task_id, up.node_id, err)

    def moved(self, prev: CohortRound, cr: CohortRound) -> None:
        assert self.journal is not None
        try:
            self.journal.moved(prev, cr, cr.task.run_id, cr.task.round, cr.task.attempt)
        except OSError as err:
            log.error("cannot journal round %d's move into round %d: %s", prev.task.round, cr.task.round, err)

    def dropped(self, cr: CohortRound, reason: str) -> None:
        if self.journal is None:
            return
        try:
            n = self.journal.drop(cr, " ".join(reason.split())[:REASON_MAX])  # printable, as a poll carries it
        except OSError as err:
            log.error("cannot journal the dropped uploads of round %d: %s", cr.task.round, err)
            return
        if n:
            log.warning("%d acknowledged uploads reach no partial: %s", n, reason)

    async def _heartbeats(self, t: TaskAssignment, cr) -> None:
        while not cr.closed:
            await asyncio.sleep(self.link.heartbeat_s / 2)
            if not await self.link.heartbeat(t.task_id, progress=min(1.0, cr.received / max(1, cr.task.target))):
                self.coord.close_round(cr, "upstream no longer wants this round")
                return

    async def _push(self, t: TaskAssignment, out: RoundOutcome, cr: CohortRound, header: UploadHeader, payload: bytes) -> None:
        if self.journal is not None:
            with contextlib.suppress(OSError):
                self.journal.sending(cr)
        try:
            await self.link.push_update(header, payload)
        except UploadRefused as err:
            if err.code is grpc.StatusCode.ALREADY_EXISTS:  # a retry of a push the upstream took
                log.info("round %d: upstream already has this partial: %s", t.round, err)
                if self.journal is not None:
                    self.journal.forwarded(cr)
                return
            log.warning("round %d: upstream refused the partial: %s", t.round, err)
            # The root's round or buffer closed (the run's last one too), or the update is too stale.
            over = err.code in (grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.ABORTED)
            self.dropped(cr, ("round over before applied: " if over else "") + f"upstream refused the partial ({err})")
            return
        log.info("round %d: pushed partial of %d updates upstream", t.round, out.partial.count)
        if self.journal is not None:
            self.journal.forwarded(cr)
