"""What one tier holds for one open round: its assignments and its sums.

A round's uploads are summed in one of three ways, and all three end as one
:class:`~orchard.aggregation.Partial` (``sum_i w_i x_i`` with weight ``sum_i w_i``):

- the round's aggregator (``orchard.aggregation.layer``: the float64 weighted sum, with
  clipping, a robust statistic or the root's DP noise wrapped around it when the run
  asks): decoded client updates and partials from lower tiers;
- :class:`CompressedCohort`, direct clients' payloads added without decoding when the
  run sums in the compressed domain (``orchard.compression.sums_compressed``);
- the secure cohort's unmasked sum (``orchard.server.secagg``), kept aside until the
  last fold.

:meth:`CohortRound.fold_aside` merges the last two into the aggregator once, when the
outcome is read. Nothing here does I/O or touches the event loop's clock.

A :class:`CohortRound` is closed: the tier's protocols (``orchard.server.tier``) change it
only through its methods, and every other reader (the simulator, the dashboard, tests)
sees read-only properties and mapping views.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import cast

import numpy as np

from orchard.aggregation import MetricSums, Partial
from orchard.aggregation.layer import (
    Aggregator,
    ClipStats,
    Measurements,
    WeightedSum,
    clip,
    clip_stage,
    noise,
    robust,
    running_sum,
    stale,
)
from orchard.aggregation.privacy import clip_factor
from orchard.compression import CheckedPayload, NonFiniteError, UpdateSum, build_codec
from orchard.errors import CodecError, ConfigError, RoundClosedError, UpdateSchemaError
from orchard.messages import UploadHeader, UploadKind
from orchard.server.buffer import BufferState
from orchard.server.round import RoundTask
from orchard.server.secagg import SecureCohort, SecureUpstream, TreeRoster
from orchard.typing import NDArrays


@dataclass
class Assignment:
    node_id: str
    task_id: str
    target: int  # updates expected from this child (1 for a client)
    handed_out: bool = False
    in_flight: bool = False
    delivered: bool = False
    dropped: bool = False
    # The model version (round) whose model this assignment carries. In asynchronous mode
    # an assignment outlives its buffer: it moves into the next buffers while its client
    # trains, and its update is weighted by how many versions passed (its staleness).
    round: int = 0

    @property
    def settled(self) -> bool:
        """Delivered or dropped: nothing more is expected of it in this round."""
        return self.delivered or self.dropped


@dataclass(frozen=True)
class CheckedUpload:
    """A direct client's upload, parsed and checked, ready to join the compressed sum;
    with its L2 norm when the round clips updates."""

    parts: Mapping[str, CheckedPayload]
    norm: float | None = None


class CompressedCohort:
    """A round's direct-client updates summed in the compressed domain.

    Used when the run's config says so (``sums_compressed``). Every client sent its
    plain update ``x_i`` with its weight ``w_i`` in the clear; the payloads add without
    decoding (one ``PayloadSum`` per tensor), each times ``w_i``, so the cohort's
    partial is their decoded weighted sum ``sum_i w_i x_i`` with weight ``sum_i w_i``:
    what the accumulator of the decode path holds. Integer codes (qsgd with a fixed
    scale) add only unweighted; such a run comes here only under uniform weighting, and
    an upload whose header weight is not 1 is refused. ``check`` only reads and runs in
    the decode pool; ``fold`` runs in the fold pool, one at a time, like the
    accumulator's fold.

    When the round clips updates (``clip_norm``), ``check`` reads each update's L2 norm
    ``n_i`` from its payload and ``fold`` adds it times ``w_i * clip_factor(n_i, C)``
    counted at weight ``w_i``: the sum the decode path forms from clipped updates, to
    float rounding (that path rounds each clipped update to float32 first). What it
    clipped is kept in :attr:`clip_stats` for the round's clip stage."""

    def __init__(self, task: RoundTask) -> None:
        self.clip = task.config.clip_norm
        self.clip_stats = ClipStats()
        self.codec = build_codec(task.config.codec)
        self.unit_weights = not self.codec.algebra.weighted_sums  # integer codes: every weight is 1
        self.shapes = {s.name: tuple(s.shape) for s in task.schema}
        self.sums = UpdateSum(self.codec, self.shapes, task.shared_seed)
        self.metrics = MetricSums()
        self.merged = False  # folded into the round's accumulator (at most once)

    @property
    def count(self) -> int:
        return self.sums.count

    @property
    def weight(self) -> float:
        return self.sums.weight

    def check(self, h: UploadHeader, payload: bytes | bytearray | memoryview) -> CheckedUpload:
        """Parse every tensor's payload and check it as decoding would: the codec's layout
        and shape (CodecError), finite values (UpdateSchemaError). Nothing is summed."""
        if self.unit_weights and h.weight != 1.0:
            raise UpdateSchemaError(f"this round weighs every update 1 (uniform weighting), "
                                    f"the header says {h.weight}")
        try:
            checked = self.sums.check_packed(payload, h.payload_sizes)
            return CheckedUpload(checked, None if self.clip is None else self.sums.norm(checked))
        except NonFiniteError as err:
            raise UpdateSchemaError(f"{err}; refusing the update") from None
        except (CodecError, UpdateSchemaError):
            raise
        except (ValueError, IndexError, TypeError) as err:  # a codec bug must not crash the tier
            raise CodecError(f"payload could not be parsed with codec {self.codec.name!r}: {err}") from None

    def fold(self, h: UploadHeader, up: CheckedUpload) -> None:
        if self.merged:  # the outcome was read: nothing may join the sum after that
            raise RoundClosedError("the round's outcome was already read; late uploads are refused")
        if self.clip is None:
            self.sums.add(up.parts, h.weight)  # refuses before it changes anything
        else:
            if up.norm is None:
                raise UpdateSchemaError("this round clips updates; the upload was checked without its norm")
            self.sums.add(up.parts, h.weight, clip_factor(up.norm, self.clip))
            self.clip_stats.record(up.norm, self.clip)
        self.metrics.merge_sums(h.metric_sums, h.metric_weights)

    def partial(self) -> Partial:
        """The decoded weighted sum (float64) with the weights' sum. Drains the compressed
        sums tensor by tensor, so this runs once."""
        sums = dict(self.sums.drain())
        return Partial(sums=sums, weight=self.weight, count=self.count, metrics=self.metrics)


def tier_aggregator(task: RoundTask, noise_rng: np.random.Generator | None = None) -> Aggregator:
    """The aggregation stack a tier folds ``task``'s round through (``orchard.aggregation.layer``):
    the weighted sum; in asynchronous mode FedBuff's staleness weight on it; a robust
    statistic of its direct clients if the run asks for one; per-client clipping where
    updates are seen (here, unless secure aggregation moves it to the clients), outside
    the staleness weight (clip, then weight); the root's Gaussian noise (central DP:
    ``task.noise_stddev`` > 0 only at the root). With none of them it is exactly the
    weighted sum."""
    cfg = task.config
    agg: Aggregator = WeightedSum(task.schema)
    m = cfg.mode
    if m.is_async:
        agg = stale(m.weighting, agg, m.exponent, m.hinge)
    if cfg.robust.statistic != "mean":
        agg = robust(cfg.robust.statistic, agg, cfg.robust.trim_fraction)
    if cfg.clip_norm is not None and not cfg.secure_aggregation.enabled:
        agg = clip(cfg.clip_norm, agg)
    if task.noise_stddev > 0:
        if noise_rng is None:
            raise ConfigError("a round with DP noise needs a noise generator")
        agg = noise(task.noise_stddev, agg, noise_rng, cast(float, cfg.clip_norm))  # DP on: a clip norm is set
    return agg


def _add(counts: dict[str, int], key: str, n: int) -> None:
    counts[key] = counts.get(key, 0) + n


class CohortRound:
    """State of one open round (asynchronous mode: one buffer) at one tier.

    Read through its properties; changed only through its methods, by the tier's
    protocols. ``assignments``, ``rejected``, ``tier_participants`` and ``staleness`` are
    read-only views of the round's own maps."""

    def __init__(self, task: RoundTask, now: float, noise_rng: np.random.Generator | None = None,
                 compressed: bool = False, upstream: SecureUpstream | None = None,
                 continuation: bool = False) -> None:
        self._task = task
        self._started = now
        self._agg = tier_aggregator(task, noise_rng)
        self._state = self._agg.zero()
        self._result: tuple[Partial, Measurements] | None = None
        # Direct clients' weighted sum in the compressed domain, when the run takes that
        # path (None: every client update is decoded, then accumulated).
        self._compressed = CompressedCohort(task) if compressed else None
        # The secure cohort's unmasked sum, waiting to be folded with the round's outcome:
        # the loop thread must not add into the accumulator while the fold pool does.
        self._secure_sum: Partial | None = None
        self._assignments: dict[str, Assignment] = {}
        self._client_quota = 0  # how many direct clients may be selected in total
        self._closed = False
        self._close_reason = ""
        self._closed_event = asyncio.Event()
        self._bytes_up = 0
        self._bytes_down = 0
        self._tier_participants: dict[str, int] = {}
        self._rejected: dict[str, int] = {}
        self._dropped_below = 0  # nodes dropped below this tier, as its partials reported
        self._reserved = 0  # updates (counts) folded or being folded: never above target for clients
        self._open = 0  # assignments neither delivered nor dropped
        self._clients_selected = 0
        self._secure: SecureCohort | None = None  # SecAgg+ session over the direct clients, if on
        # Secure aggregation over the whole tree (scope "tree"): who is in the round's
        # session through this tier, and, below the root, the way to the session.
        self._tree: TreeRoster | None = None
        self._upstream = upstream
        # Asynchronous mode: updates folded, by staleness; and whether this buffer is the
        # continuation a full buffer left behind (it takes uploads until the next version
        # opens and moves its sums into it; it never closes or emits by itself).
        self._staleness: dict[int, int] = {}
        self._continuation = continuation
        # (node, task id) of every update folded here, in fold order (the root's journal).
        self._accepted: list[tuple[str, str]] = []
        self._views = (MappingProxyType(self._assignments), MappingProxyType(self._rejected),
                       MappingProxyType(self._tier_participants), MappingProxyType(self._staleness))

    # ------------------------------------------------------------------ reads

    @property
    def task(self) -> RoundTask:
        return self._task

    @property
    def started(self) -> float:
        return self._started

    @property
    def assignments(self) -> Mapping[str, Assignment]:
        return self._views[0]

    @property
    def rejected(self) -> Mapping[str, int]:
        return self._views[1]

    @property
    def tier_participants(self) -> Mapping[str, int]:
        return self._views[2]

    @property
    def staleness(self) -> Mapping[int, int]:
        """Updates folded into this buffer, by staleness (asynchronous mode)."""
        return self._views[3]

    @property
    def accepted(self) -> tuple[tuple[str, str], ...]:
        return tuple(self._accepted)

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def close_reason(self) -> str:
        return self._close_reason

    @property
    def closed_event(self) -> asyncio.Event:
        return self._closed_event

    @property
    def bytes_up(self) -> int:
        return self._bytes_up

    @property
    def bytes_down(self) -> int:
        return self._bytes_down

    @property
    def dropped_below(self) -> int:
        return self._dropped_below

    @property
    def reserved(self) -> int:
        return self._reserved

    @property
    def open(self) -> int:
        return self._open

    @property
    def clients_selected(self) -> int:
        return self._clients_selected

    @property
    def client_quota(self) -> int:
        return self._client_quota

    @property
    def compressed(self) -> CompressedCohort | None:
        return self._compressed

    @property
    def secure(self) -> SecureCohort | None:
        return self._secure

    @property
    def secure_sum(self) -> Partial | None:
        return self._secure_sum

    @property
    def tree(self) -> TreeRoster | None:
        return self._tree

    @property
    def upstream(self) -> SecureUpstream | None:
        return self._upstream

    @property
    def continuation(self) -> bool:
        return self._continuation

    @property
    def received(self) -> int:
        c, s = self._compressed, self._secure_sum
        pending = (c.count if c is not None and not c.merged else 0) + (s.count if s is not None else 0)
        return self._agg.count(self._state) + pending

    def pending(self) -> list[Assignment]:
        return [a for a in self._assignments.values() if not (a.delivered or a.dropped)]

    # ------------------------------------------------------------------ assignments

    def add(self, a: Assignment, is_client: bool) -> None:
        self._assignments[a.node_id] = a
        self._open += 1
        self._clients_selected += int(is_client)

    def record_delivered(self, a: Assignment) -> None:
        """An assignment already delivered into an earlier buffer (a restarted root's
        journal), kept so that a retried upload of it is a duplicate."""
        self._assignments[a.node_id] = a

    def hand_out(self, a: Assignment) -> None:
        a.handed_out = True

    def set_in_flight(self, a: Assignment, flag: bool) -> None:
        a.in_flight = flag

    def settle(self, a: Assignment, delivered: bool) -> None:
        """Mark an assignment delivered or dropped, once. Counts are kept incrementally so that
        closing checks stay O(1) per upload, not O(cohort)."""
        if a.delivered or a.dropped:
            return
        a.delivered, a.dropped = delivered, not delivered
        self._open -= 1

    def set_quota(self, n: int) -> None:
        self._client_quota = n

    def extend_deadline(self, deadline_unix: float) -> None:
        self._task.deadline_unix = deadline_unix

    # ------------------------------------------------------------------ counts

    def reserve(self, n: int) -> None:
        self._reserved += n

    def count_bytes(self, up: int = 0, down: int = 0) -> None:
        self._bytes_up += up
        self._bytes_down += down

    def count_participants(self, tier: str, n: int = 1) -> None:
        self._tier_participants[tier] = self._tier_participants.get(tier, 0) + n

    def set_participants(self, tier: str, n: int) -> None:
        """A relay's count of its clients in the tree's session, as the session ended."""
        self._tier_participants[tier] = n

    def count_dropped_below(self, n: int) -> None:
        self._dropped_below += n

    def count_rejected(self, reason: str, n: int = 1) -> None:
        self._rejected[reason] = self._rejected.get(reason, 0) + n

    def set_rejected(self, reason: str, n: int) -> None:
        """A refusal that covers ``n`` nodes at once (a session that could not start)."""
        self._rejected[reason] = n

    def close(self, reason: str) -> bool:
        """Close the round; False if it was closed already (the first reason stays)."""
        if self._closed:
            return False
        self._closed = True
        self._close_reason = reason
        self._closed_event.set()
        return True

    # ------------------------------------------------------------------ secure aggregation

    def attach_secure(self, sc: SecureCohort) -> None:
        self._secure = sc

    def attach_tree(self, tree: TreeRoster) -> None:
        self._tree = tree

    def set_secure_sum(self, p: Partial) -> None:
        """The secure session's unmasked sum: folded with the outcome (``fold_aside``),
        after the fold pool drained; it counts as reserved from now."""
        self._secure_sum = p
        self._reserved += p.count

    # ------------------------------------------------------------------ folds (the fold pool)

    def fold(self, h: UploadHeader, arrays: NDArrays | CheckedUpload, staleness: int = 0) -> None:
        """Fold one checked upload: a client's decoded update, a client's payload checked
        for the compressed sum, or a lower tier's partial; ``staleness``: server steps since
        its model (asynchronous mode), which the stack's stale stage weights."""
        if isinstance(arrays, CheckedUpload):
            assert self._compressed is not None and staleness == 0  # only fresh updates take this path
            self._compressed.fold(h, arrays)
            return
        ms = MetricSums(dict(h.metric_sums), dict(h.metric_weights))
        if h.kind is UploadKind.PARTIAL_SUM:
            p = Partial(sums=arrays, weight=h.weight, count=h.count, metrics=ms)
            self._state = self._agg.merge(self._state, p, False, staleness)
        elif staleness:
            self._state = self._agg.accumulate(self._state, arrays, h.weight, ms, staleness)
        else:
            self._state = self._agg.accumulate(self._state, arrays, h.weight, ms)  # the decoder checked it

    def record_fold(self, node_id: str, task_id: str, staleness: Mapping[int, int],
                    totals: dict[int, int] | None = None) -> None:
        """Asynchronous mode: which (node, task) is in the buffer (the journal's, against
        retried uploads) and the staleness of the updates it brought (``totals``: the
        tier's histogram over the run, changed here with the sum)."""
        self._accepted.append((node_id, task_id))
        for k, n in staleness.items():
            self._staleness[k] = self._staleness.get(k, 0) + n
            if totals is not None:
                totals[k] = totals.get(k, 0) + n

    def fold_aside(self) -> None:
        """Fold the sums kept aside (the compressed sum, the secure cohort's) into the
        round's aggregator, once, after the last fold."""
        c = self._compressed
        if c is not None and not c.merged:
            if c.count:
                self._state = self._agg.merge(self._state, c.partial(), owned=True)
            if c.clip_stats.clients:
                found = clip_stage(self._agg, self._state)
                if found is None:  # tier_aggregator puts a clip stage wherever clip_norm is set
                    raise ConfigError("updates were clipped in the compressed sum of a round without a clip stage")
                found[0].merge_stats(found[1], c.clip_stats)
            c.merged = True
        if self._secure_sum is not None:
            self._state = self._agg.merge(self._state, self._secure_sum)
            self._secure_sum = None

    def result(self) -> tuple[Partial, Measurements]:
        """The round's partial and the aggregator's measurements: finalized once (the
        root's noise is drawn once), after ``fold_aside``."""
        if self._result is None:
            self.fold_aside()
            self._result = self._agg.finalize(self._state)
        return self._result

    # ------------------------------------------------------------------ buffers (asynchronous mode)

    def restore(self, state: BufferState) -> None:
        """A journaled buffer's sum, ids and histogram (a restarted root)."""
        p = state.partial
        if p.count:
            self._state = self._agg.merge(self._state, p, owned=True)
            self._reserved += p.count
        self._accepted = list(state.accepted)
        self._staleness.clear()
        self._staleness.update(state.staleness)

    def absorb_counts(self, prev: CohortRound) -> None:
        """The loop's half of moving buffer ``prev`` into this one: the counts it keeps."""
        self._reserved += prev._reserved
        self._bytes_up += prev._bytes_up
        self._bytes_down += prev._bytes_down
        self._dropped_below += prev._dropped_below
        for k, v in prev._tier_participants.items():
            _add(self._tier_participants, k, v)
        for k, v in prev._rejected.items():
            _add(self._rejected, k, v)

    def absorb_sums(self, prev: CohortRound) -> None:
        """The fold pool's half: ``prev``'s running sum (no noise drawn), what it clipped,
        the updates' ids and staleness."""
        prev.fold_aside()
        p = running_sum(prev._agg, prev._state).partial
        if p.count:
            self._state = self._agg.merge(self._state, p, owned=True)
        found, mine = clip_stage(prev._agg, prev._state), clip_stage(self._agg, self._state)
        if found is not None and mine is not None:
            mine[0].merge_stats(mine[1], found[1].stats)
        for s_, n in prev._staleness.items():
            _add(self._staleness, s_, n)  # type: ignore[arg-type]
        self._accepted += prev._accepted

    def snapshot(self, seq: int) -> BufferState:
        """The buffer as the root journals it, right after a fold (fold thread only): a
        copy of its running sum, its ids and histogram; the loop adds what it keeps."""
        p = running_sum(self._agg, self._state).partial
        copy = Partial(sums={k: v.copy() for k, v in p.sums.items()}, weight=p.weight, count=p.count,
                       metrics=MetricSums(dict(p.metrics.sums), dict(p.metrics.weights)))
        return BufferState(round=self._task.round + int(self._continuation), seq=seq, partial=copy,
                           accepted=list(self._accepted), staleness=dict(self._staleness))
