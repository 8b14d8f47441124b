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
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from orchard.aggregation import Accumulator, MetricSums, Partial
from orchard.aggregation.layer import (
    Aggregator,
    ClipStats,
    Measurements,
    WeightedSum,
    clip,
    clip_stage,
    noise,
    robust,
)
from orchard.aggregation.privacy import clip_factor
from orchard.compression import CheckedPayload, NonFiniteError, UpdateSum, build_codec
from orchard.errors import CodecError, ConfigError, RoundClosedError, UpdateSchemaError
from orchard.messages import UploadHeader
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
    the weighted sum; a robust statistic of its direct clients if the run asks for one;
    per-client clipping where updates are seen (here, unless secure aggregation moves it to
    the clients); the root's Gaussian noise (central DP: ``task.noise_stddev`` > 0 only at
    the root). With none of them it is exactly the weighted sum."""
    cfg = task.config
    agg: Aggregator = WeightedSum(task.schema)
    if cfg.robust.statistic != "mean":
        agg = robust(cfg.robust.statistic, agg, cfg.robust.trim_fraction)
    if cfg.clip_norm is not None and not cfg.secure_aggregation.enabled:
        agg = clip(cfg.clip_norm, agg)
    if task.noise_stddev > 0:
        if noise_rng is None:
            raise ConfigError("a round with DP noise needs a noise generator")
        agg = noise(task.noise_stddev, agg, noise_rng)
    return agg


class CohortRound:
    """State of one open round at one tier."""

    def __init__(self, task: RoundTask, now: float, noise_rng: np.random.Generator | None = None) -> None:
        self.task = task
        self.started = now
        self.agg = tier_aggregator(task, noise_rng)
        self.state = self.agg.zero()
        self._result: tuple[Partial, Measurements] | None = None
        # Direct clients' weighted sum in the compressed domain, when the run takes that
        # path (None: every client update is decoded, then accumulated).
        self.compressed: CompressedCohort | None = None
        # The secure cohort's unmasked sum, waiting to be folded with the round's outcome:
        # the loop thread must not add into the accumulator while the fold pool does.
        self.secure_sum: Partial | None = None
        self.assignments: dict[str, Assignment] = {}
        self.client_quota = 0  # how many direct clients may be selected in total
        self.closed = False
        self.close_reason = ""
        self.closed_event = asyncio.Event()
        self.bytes_up = 0
        self.bytes_down = 0
        self.tier_participants: dict[str, int] = {}
        self.rejected: dict[str, int] = {}
        self.reserved = 0  # updates (counts) folded or being folded: never above target for clients
        self.open = 0  # assignments neither delivered nor dropped
        self.clients_selected = 0
        self.secure: SecureCohort | None = None  # SecAgg+ session over the direct clients, if on
        # Secure aggregation over the whole tree (scope "tree"): who is in the round's
        # session through this tier, and, below the root, the way to the session.
        self.tree: TreeRoster | None = None
        self.upstream: SecureUpstream | None = None
        # Asynchronous mode: updates folded, by staleness; and whether this buffer is the
        # continuation a full buffer left behind (it takes uploads until the next version
        # opens and moves its sums into it; it never closes or emits by itself).
        self.staleness: dict[int, int] = {}
        self.continuation = False
        # (node, task id) of every update folded here, in fold order (the root's journal).
        self.accepted: list[tuple[str, str]] = []

    @property
    def received(self) -> int:
        c, s = self.compressed, self.secure_sum
        pending = (c.count if c is not None and not c.merged else 0) + (s.count if s is not None else 0)
        return self.agg.count(self.state) + pending

    @property
    def acc(self) -> Accumulator:
        """The plain weighted sum's accumulator, for the folds that bypass the stack:
        asynchronous mode's staleness-weighted folds, buffer moves and journal (validation
        refuses privacy and robust stages in asynchronous mode)."""
        if not isinstance(self.agg, WeightedSum):
            raise ConfigError("asynchronous mode folds into the plain weighted sum; this round has aggregation "
                              "stages (privacy or robust) that it cannot bypass")
        return self.state  # type: ignore[no-any-return]

    def fold_update(self, update: NDArrays, weight: float, metrics: MetricSums) -> None:
        """A direct client's decoded, checked update."""
        self.state = self.agg.accumulate(self.state, update, weight, metrics)

    def fold_partial(self, partial: Partial) -> None:
        """A lower tier's partial sum."""
        self.state = self.agg.merge(self.state, partial)

    def fold_aside(self) -> None:
        """Fold the sums kept aside (the compressed sum, the secure cohort's) into the
        round's aggregator, once, after the last fold."""
        c = self.compressed
        if c is not None and not c.merged:
            if c.count:
                self.state = self.agg.merge(self.state, c.partial(), owned=True)
            if c.clip_stats.clients:
                found = clip_stage(self.agg, self.state)
                if found is None:  # tier_aggregator puts a clip stage wherever clip_norm is set
                    raise ConfigError("updates were clipped in the compressed sum of a round without a clip stage")
                found[0].merge_stats(found[1], c.clip_stats)
            c.merged = True
        if self.secure_sum is not None:
            self.state = self.agg.merge(self.state, self.secure_sum)
            self.secure_sum = None

    def result(self) -> tuple[Partial, Measurements]:
        """The round's partial and the aggregator's measurements: finalized once (the
        root's noise is drawn once), after ``fold_aside``."""
        if self._result is None:
            self.fold_aside()
            self._result = self.agg.finalize(self.state)
        return self._result

    def pending(self) -> list[Assignment]:
        return [a for a in self.assignments.values() if not (a.delivered or a.dropped)]

    def add(self, a: Assignment, is_client: bool) -> None:
        self.assignments[a.node_id] = a
        self.open += 1
        self.clients_selected += int(is_client)

    def settle(self, a: Assignment, delivered: bool) -> None:
        """Mark an assignment delivered or dropped, once. Counts are kept incrementally so that
        closing checks stay O(1) per upload, not O(cohort)."""
        if a.delivered or a.dropped:
            return
        a.delivered, a.dropped = delivered, not delivered
        self.open -= 1


