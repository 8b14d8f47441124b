"""The coordinator: the one piece of round logic that every tier runs.

A root is a coordinator whose rounds come from a run (``orchard.server.root``); an
aggregator is a coordinator whose rounds come from its upstream and whose results go
back up (``orchard.server.aggregator``). A tree of any depth is configuration.

Per round a coordinator:
  1. splits its target among live, eligible children (aggregators get a share of the
     target in proportion to their eligible pool; direct clients are over-selected,
     ``ceil(share * over_selection)``, so stragglers do not hold the round);
  2. hands out task assignments when selected children long-poll;
  3. checks each upload's header against the round before reading a byte of payload
     (round, attempt, selection, duplicates, schema, sizes, weight), then checks the
     payload (sha256, decode -- or, summing in the compressed domain, parse -- and
     finite values) before anything is folded;
  4. folds accepted uploads into one float64 accumulator (O(model) memory), one fold
     at a time. When the run sums in the compressed domain (a linear codec, no secure
     aggregation; integer codes only under uniform weighting: ``sums_compressed``),
     direct clients' payloads are added without decoding, each times its header's
     weight, into one ``PayloadSum`` per tensor instead (``CompressedCohort``), decoded
     once into the accumulator when the round's outcome is read; partials from below
     and secure cohorts' sums always go to the accumulator;
  5. closes when the target is reached, when every selected child has delivered or
     dropped, or at the deadline, and returns a ``RoundOutcome``.

Concurrency: everything here runs on the server's asyncio loop. State is mutated only
between awaits, so no lock guards it; CPU-heavy decode and fold run in executors and
their results are applied back on the loop. Nothing here awaits a network send while
round state is half-updated.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import math
import time
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np

from orchard.aggregation import Accumulator, MetricSums, Partial
from orchard.compression import (
    CheckedPayload,
    NonFiniteError,
    UpdateSum,
    build_codec,
    sums_compressed,
)
from orchard.config import RunConfig, ServerConfig
from orchard.errors import (
    CodecError,
    DuplicateUploadError,
    IntegrityError,
    NotSelectedError,
    OrchardError,
    RoundClosedError,
    SecAggError,
    UnknownNodeError,
    UpdateSchemaError,
)
from orchard.messages import PARTIAL_CODEC, Idle, TaskAssignment, UploadHeader, UploadKind
from orchard.secure_agg import Stage
from orchard.secure_agg.stages import stage_index as stage_index_of
from orchard.secure_agg.stages import stage_of
from orchard.server.downlink import DownlinkCache, ModelReply, full_reply
from orchard.server.secagg import SecureCohort, new_cohort
from orchard.server.selection import allocate, device_eligible, over_select
from orchard.typing import DeviceState, NDArrays, Role, TensorSpec
from orchard.updates import decode_partial, split
from orchard.wire import sha256_hex

# Decodes a client's payload into a float32 delta (codec-specific; see orchard.server.decoding).
ClientDecoder = Callable[[UploadHeader, bytes, "RoundTask"], NDArrays]


@dataclass
class RoundTask:
    """What a tier is asked to do for one round (from the run at the root, from upstream below)."""

    run_id: str
    round: int
    attempt: int
    config: RunConfig
    config_json: str
    model_blob: bytes
    model_hash: str
    schema: tuple[TensorSpec, ...]
    deadline_unix: float
    target: int
    shared_seed: int


@dataclass
class Child:
    node_id: str
    role: Role
    token_hash: str
    device: DeviceState = field(default_factory=DeviceState)
    last_seen: float = 0.0  # monotonic seconds
    pool_size: int = 1
    pool_eligible: int = 1


@dataclass
class Assignment:
    node_id: str
    task_id: str
    target: int  # updates expected from this child (1 for a client)
    handed_out: bool = False
    in_flight: bool = False
    delivered: bool = False
    dropped: bool = False


@dataclass
class RoundOutcome:
    task: RoundTask
    partial: Partial
    selected: int
    dropped: int
    bytes_up: int
    bytes_down: int
    tier_participants: dict[str, int]
    reason: str
    seconds: float
    rejected: dict[str, int]


@dataclass(frozen=True)
class CheckedUpload:
    """A direct client's upload, parsed and checked, ready to join the compressed sum."""

    parts: dict[str, CheckedPayload]


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
    accumulator's fold."""

    def __init__(self, task: RoundTask) -> None:
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

    def check(self, h: UploadHeader, payload: bytes | bytearray) -> CheckedUpload:
        """Parse every tensor's payload and check it as decoding would: the codec's layout
        and shape (CodecError), finite values (UpdateSchemaError). Nothing is summed."""
        if self.unit_weights and h.weight != 1.0:
            raise UpdateSchemaError(f"this round weighs every update 1 (uniform weighting), "
                                    f"the header says {h.weight}")
        try:
            parts = dict(zip(self.shapes, split(payload, h.payload_sizes), strict=True))
            return CheckedUpload(self.sums.check(parts))
        except NonFiniteError as err:
            raise UpdateSchemaError(f"{err}; refusing the update") from None
        except (CodecError, UpdateSchemaError):
            raise
        except (ValueError, IndexError, TypeError) as err:  # a codec bug must not crash the tier
            raise CodecError(f"payload could not be parsed with codec {self.codec.name!r}: {err}") from None

    def fold(self, h: UploadHeader, up: CheckedUpload) -> None:
        if self.merged:  # the outcome was read: nothing may join the sum after that
            raise RoundClosedError("the round's outcome was already read; late uploads are refused")
        self.sums.add(up.parts, h.weight)  # refuses before it changes anything
        self.metrics.merge(MetricSums(h.metric_sums, h.metric_weights))  # merge only reads them

    def partial(self) -> Partial:
        """The decoded weighted sum (float64) with the weights' sum. Drains the compressed
        sums tensor by tensor, so this runs once."""
        sums = dict(self.sums.drain())
        return Partial(sums=sums, weight=self.weight, count=self.count, metrics=self.metrics)


class CohortRound:
    """State of one open round at one tier."""

    def __init__(self, task: RoundTask, now: float) -> None:
        self.task = task
        self.started = now
        self.acc = Accumulator(list(task.schema))
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

    @property
    def received(self) -> int:
        c, s = self.compressed, self.secure_sum
        pending = (c.count if c is not None and not c.merged else 0) + (s.count if s is not None else 0)
        return self.acc.count + pending

    def fold_aside(self) -> None:
        """Fold the sums kept aside (the compressed sum, the secure cohort's) into the
        accumulator, once, after the last fold."""
        c = self.compressed
        if c is not None and not c.merged:
            if c.count:
                self.acc.merge(c.partial(), owned=True)
            c.merged = True
        if self.secure_sum is not None:
            self.acc.merge(self.secure_sum)
            self.secure_sum = None

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


@dataclass
class UploadSlot:
    header: UploadHeader
    cohort: CohortRound
    assignment: Assignment


class Coordinator:
    def __init__(self, name: str, cfg: ServerConfig, rng: np.random.Generator,
                 client_decoder: ClientDecoder, monotonic: Callable[[], float] = time.monotonic,
                 wall: Callable[[], float] = time.time) -> None:
        self.name = name
        self.cfg = cfg
        self.rng = rng
        self._decode_client = client_decoder
        self._mono = monotonic
        self._wall = wall
        self.children: dict[str, Child] = {}
        self.current: CohortRound | None = None
        # Long-pollers wait on the current event; a change sets it and installs a fresh one,
        # so waiting needs no lock and a timeout cannot leave one half-held.
        self._changed = asyncio.Event()
        self._changed_watched = False  # whether a waiter holds _changed (else there is no one to wake)
        self._ids = itertools.count()
        # One fold at a time (the accumulator is not thread-safe); decoding runs beside it.
        self._fold_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="orchard-fold")
        self._decode_pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="orchard-decode")
        self.upload_slots = asyncio.Semaphore(cfg.max_inflight_uploads)
        # Models nodes below may hold, for downlink deltas (orchard.server.downlink).
        self.downlink = DownlinkCache()
        self.counters: dict[str, int] = {"uploads_accepted": 0, "uploads_rejected": 0, "bytes_up": 0,
                                         "bytes_down": 0, "rounds_closed": 0}

    # ------------------------------------------------------------------ registry

    def join(self, node_id: str, role: Role, token_hash: str, device: DeviceState) -> str:
        node_id = node_id or f"{role.value}-{uuid.uuid4().hex[:12]}"
        prev = self.children.get(node_id)
        if prev is not None and prev.token_hash != token_hash:
            # A node id is bound to the credential that first claimed it.
            raise UnknownNodeError(f"node id {node_id!r} is registered with another token; pick another id")
        self.children[node_id] = Child(node_id, role, token_hash, device, self._mono(),
                                       pool_size=0 if role is Role.AGGREGATOR else 1,
                                       pool_eligible=0 if role is Role.AGGREGATOR else 1)
        self._notify()
        return node_id

    def child(self, node_id: str, token_hash: str | None = None) -> Child:
        c = self.children.get(node_id)
        if c is None:
            raise UnknownNodeError(f"node {node_id!r} has not joined this server (or expired); call Join first")
        if token_hash is not None and c.token_hash != token_hash:
            raise UnknownNodeError(f"node {node_id!r} is registered with another token")
        return c

    def touch(self, node_id: str, device: DeviceState | None = None, pool_size: int | None = None,
              pool_eligible: int | None = None) -> Child:
        c = self.child(node_id)
        c.last_seen = self._mono()
        if device is not None:
            c.device = device
        if c.role is Role.AGGREGATOR:
            if pool_size is not None:
                c.pool_size = max(0, int(pool_size))
            if pool_eligible is not None:
                c.pool_eligible = max(0, min(int(pool_eligible), c.pool_size))
        return c

    def live(self, c: Child) -> bool:
        return self._mono() - c.last_seen <= self.cfg.node_timeout_s

    def capacity(self, cfg: RunConfig | None = None) -> tuple[int, int]:
        """(live clients below this tier, eligible clients below this tier)."""
        size = elig = 0
        for c in self.children.values():
            if not self.live(c):
                continue
            if c.role is Role.AGGREGATOR:
                size += c.pool_size
                elig += c.pool_eligible
            else:
                size += 1
                elig += int(cfg is None or device_eligible(c.device, cfg.eligibility)[0])
        return size, elig

    def expire_children(self) -> None:
        """Forget nodes unseen for a long time (10 x timeout): bounds the registry."""
        now = self._mono()
        for nid in [n for n, c in self.children.items() if now - c.last_seen > 10 * self.cfg.node_timeout_s]:
            if self.current is None or nid not in self.current.assignments:
                del self.children[nid]

    # ------------------------------------------------------------------ rounds

    def open_round(self, task: RoundTask) -> CohortRound:
        if self.current is not None and not self.current.closed:
            self.close_round(self.current, "superseded by a new round")
        prev = self.current
        if task.config.downlink_delta and prev is not None and prev.task.model_hash != task.model_hash:
            # Nodes that trained last round hold that model: keep it as a delta base
            # (only when deltas are on: each base is one more model in memory).
            self.downlink.remember(prev.task.model_hash, prev.task.model_blob)
        cr = CohortRound(task, self._mono())
        if sums_compressed(task.config):
            cr.compressed = CompressedCohort(task)
        self.current = cr
        self._select(cr)
        if task.config.secure_aggregation.enabled:
            self._start_secure(cr)
        self._notify()
        return cr

    def _start_secure(self, cr: CohortRound) -> None:
        """One SecAgg+ session over the direct clients selected now; no fill-ins join it."""
        clients = [a.node_id for a in cr.assignments.values() if self.children[a.node_id].role is Role.CLIENT]
        cr.client_quota = len(clients)
        if not clients:
            return
        try:
            cr.secure = new_cohort(cr.task.config.secure_aggregation, cr.task.schema, clients, cr.task.round,
                                   cr.task.deadline_unix, self._wall)
        except OrchardError as err:
            # Too few clients for the protocol's threshold: this cohort contributes nothing.
            for n in clients:
                cr.settle(cr.assignments[n], delivered=False)
            cr.rejected[f"secure aggregation could not start: {err}"] = len(clients)

    def _select(self, cr: CohortRound) -> None:
        cfg = cr.task.config
        caps: dict[str, int] = {}
        for c in self.children.values():
            if not self.live(c):
                continue
            if c.role is Role.AGGREGATOR:
                if c.pool_eligible > 0:
                    caps[c.node_id] = c.pool_eligible
            elif device_eligible(c.device, cfg.eligibility)[0]:
                caps[c.node_id] = 1
        alloc = allocate(cr.task.target, caps)
        client_ids = [k for k in caps if self.children[k].role is Role.CLIENT]
        client_share = sum(alloc[k] for k in client_ids)
        for k, n in alloc.items():
            if n > 0 and self.children[k].role is Role.AGGREGATOR:
                self._assign(cr, k, n)
        # Direct clients are over-selected; the first `client_share` updates count.
        cr.client_quota = math.ceil(max(client_share, 0) * cfg.cohort.over_selection)
        for k in over_select(client_ids, client_share, cfg.cohort.over_selection, self.rng):
            self._assign(cr, k, 1)
        # Clients that join while the round is open may fill an unused quota; if no direct
        # client was known at open time, any remaining target may go to late joiners.
        if not caps:
            cr.client_quota = math.ceil(cr.task.target * cfg.cohort.over_selection)

    def _assign(self, cr: CohortRound, node_id: str, target: int) -> Assignment:
        a = Assignment(node_id, f"{cr.task.run_id}.{cr.task.round}.{cr.task.attempt}.{next(self._ids)}", target)
        cr.add(a, self.children[node_id].role is Role.CLIENT)
        return a

    @staticmethod
    def _selected_clients(cr: CohortRound) -> int:
        return cr.clients_selected

    def _task_for(self, cr: CohortRound, a: Assignment) -> TaskAssignment:
        c = self.children[a.node_id]
        deadline = cr.task.deadline_unix
        if c.role is Role.AGGREGATOR:
            # Leave the aggregator time to push its partial before our own deadline.
            deadline -= min(5.0, 0.1 * max(0.0, deadline - self._wall()))
        return TaskAssignment(
            run_id=cr.task.run_id, round=cr.task.round, attempt=cr.task.attempt, task_id=a.task_id,
            model_hash=cr.task.model_hash, model_bytes=len(cr.task.model_blob),
            config_json=cr.task.config_json, schema=cr.task.schema, deadline_unix=deadline,
            cohort_target=a.target, shared_seed=cr.task.shared_seed)

    async def poll(self, node_id: str, device: DeviceState | None, pool_size: int | None,
                   pool_eligible: int | None, wait_s: float) -> TaskAssignment | Idle:
        """Long-poll: return this node's assignment as soon as there is one, else Idle after ``wait_s``."""
        self.touch(node_id, device, pool_size, pool_eligible)
        deadline = self._mono() + max(0.0, min(wait_s, self.cfg.long_poll_s))
        while True:
            got = self._try_assign(node_id)
            if got is not None:
                return got
            remaining = deadline - self._mono()
            if remaining <= 0:
                return Idle(retry_after_s=0.0, reason=self._idle_reason(node_id))
            ev = self._watch()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(ev.wait(), timeout=remaining)
            self.touch(node_id)

    def _idle_reason(self, node_id: str) -> str:
        cr = self.current
        if cr is None or cr.closed:
            return "no round open"
        c = self.children[node_id]
        if c.role is Role.CLIENT:
            ok, why = device_eligible(c.device, cr.task.config.eligibility)
            if not ok:
                return "not eligible: " + "; ".join(why)
        return "not selected for this round"

    def _try_assign(self, node_id: str) -> TaskAssignment | None:
        cr = self.current
        if cr is None or cr.closed:
            return None
        a = cr.assignments.get(node_id)
        if a is None:
            c = self.children[node_id]
            # Fill-in: a client that arrived after selection may take an unused quota slot.
            if (c.role is Role.CLIENT and not cr.task.config.secure_aggregation.enabled
                    and self._selected_clients(cr) < cr.client_quota
                    and cr.received < cr.task.target
                    and device_eligible(c.device, cr.task.config.eligibility)[0]):
                a = self._assign(cr, node_id, 1)
            else:
                return None
        if a.delivered or a.dropped:
            return None
        a.handed_out = True
        return self._task_for(cr, a)

    def heartbeat(self, node_id: str, device: DeviceState | None, task_id: str) -> bool:
        self.touch(node_id, device)
        cr = self.current
        if cr is None or cr.closed:
            return False
        a = cr.assignments.get(node_id)
        return a is not None and a.task_id == task_id and not a.delivered and not a.dropped

    def model_blob(self, model_hash: str) -> bytes:
        cr = self.current
        if cr is None or cr.task.model_hash != model_hash:
            raise RoundClosedError(f"model {model_hash[:16]}... is not the current round's model; poll for a task")
        return cr.task.model_blob

    async def model_reply(self, model_hash: str, have_hash: str = "") -> ModelReply:
        """The current model for a node that holds ``have_hash`` (empty: nothing): a delta
        from it when the run allows downlink deltas, the tier knows it and the delta is
        smaller; the full model otherwise."""
        blob = self.model_blob(model_hash)
        cr = self.current
        if cr is None or not cr.task.config.downlink_delta or not have_hash:
            return full_reply(blob, model_hash)
        return await self.downlink.reply(blob, model_hash, have_hash, self._decode_pool)

    def count_bytes_down(self, n: int) -> None:
        self.counters["bytes_down"] += n
        if self.current is not None:
            self.current.bytes_down += n

    # ------------------------------------------------------------------ uploads

    def _assignment(self, node_id: str, run_id: str, rnd: int, attempt: int,
                    task_id: str) -> tuple[CohortRound, Assignment]:
        """The open round and this node's assignment in it, or the reason there is none."""
        cr = self.current
        if cr is None:
            raise RoundClosedError("no round is open at this tier; this upload is stale")
        t = cr.task
        if (run_id, rnd, attempt) != (t.run_id, t.round, t.attempt):
            when = "stale" if (run_id == t.run_id and (rnd, attempt) < (t.round, t.attempt)) else "unknown or future"
            raise RoundClosedError(
                f"upload for run {run_id!r} round {rnd} attempt {attempt} is {when}; "
                f"the open round is {t.run_id!r} round {t.round} attempt {t.attempt}")
        if cr.closed:
            raise RoundClosedError(f"round {t.round} closed ({cr.close_reason}); late uploads are refused")
        a = cr.assignments.get(node_id)
        if a is None or a.task_id != task_id:
            raise NotSelectedError(f"node {node_id!r} holds no assignment {task_id!r} in round {t.round}")
        return cr, a

    def begin_upload(self, node_id: str, h: UploadHeader) -> UploadSlot:
        """Check an upload's header against the open round. Nothing is reserved unless it passes."""
        c = self.child(node_id)
        if h.node_id != node_id:
            raise UpdateSchemaError(f"header names node {h.node_id!r} but the caller is {node_id!r}")
        cr, a = self._assignment(node_id, h.run_id, h.round, h.attempt, h.task_id)
        t = cr.task
        if a.delivered:
            raise DuplicateUploadError(f"node {node_id!r} already delivered its update for round {t.round}")
        if a.in_flight:
            raise DuplicateUploadError(f"an upload from {node_id!r} for round {t.round} is already in progress")
        if a.dropped:
            raise RoundClosedError(f"node {node_id!r} was dropped from round {t.round} after missing heartbeats")
        want_kind = UploadKind.PARTIAL_SUM if c.role is Role.AGGREGATOR else UploadKind.CLIENT_UPDATE
        if want_kind is UploadKind.CLIENT_UPDATE and t.config.secure_aggregation.enabled:
            raise UpdateSchemaError("this round uses secure aggregation: send the update masked, through SecAgg")
        if h.kind != want_kind:
            raise UpdateSchemaError(f"a {c.role.value} must upload {want_kind.name}, got {h.kind.name}")
        if h.schema != t.schema:  # equal specs pass every check below: compare them one by one only when not
            self._check_schema(h.schema, t.schema)
        if len(h.payload_sizes) != len(t.schema):
            raise UpdateSchemaError(f"{len(h.payload_sizes)} payload sizes for {len(t.schema)} tensors")
        if h.total_bytes > self.cfg.max_upload_bytes:
            from orchard.errors import PayloadTooLargeError

            raise PayloadTooLargeError(f"upload declares {h.total_bytes} bytes; the limit is {self.cfg.max_upload_bytes}")
        if want_kind is UploadKind.PARTIAL_SUM:
            if h.codec != PARTIAL_CODEC:
                raise UpdateSchemaError(f"partial sums travel as {PARTIAL_CODEC!r}, got codec {h.codec!r}")
            if not (0 <= h.count <= a.target * 10 + 10**6):
                raise UpdateSchemaError(f"partial count {h.count} is out of range")
            if h.count > 0 and not (math.isfinite(h.weight) and h.weight > 0):
                raise UpdateSchemaError(f"partial weight must be positive and finite, got {h.weight}")
        else:
            if h.codec != t.config.codec.name:
                raise UpdateSchemaError(f"update encoded with {h.codec!r}; this round uses {t.config.codec.name!r}")
            if h.count != 1:
                raise UpdateSchemaError(f"a client update counts 1, header says {h.count}")
            if not (math.isfinite(h.weight) and h.weight > 0):
                raise UpdateSchemaError(f"update weight must be positive and finite, got {h.weight}")
        for metrics in (h.metric_sums, h.metric_weights):
            for k, v in metrics.items():
                if not math.isfinite(v):
                    raise UpdateSchemaError(f"metric {k!r} is not finite ({v})")
        a.in_flight = True
        return UploadSlot(h, cr, a)

    @staticmethod
    def _check_schema(got_schema: tuple[TensorSpec, ...], schema: tuple[TensorSpec, ...]) -> None:
        """An upload's declared tensors against the round's: names, shapes, dtypes."""
        names = [s.name for s in schema]
        if [s.name for s in got_schema] != names:
            raise UpdateSchemaError(f"update names {[s.name for s in got_schema][:5]} do not match the round's {names[:5]}")
        for got, want in zip(got_schema, schema, strict=True):
            if tuple(got.shape) != tuple(want.shape):
                raise UpdateSchemaError(f"tensor {want.name!r} declared shape {got.shape}, expected {want.shape}")
            if got.dtype != want.dtype:
                raise UpdateSchemaError(f"tensor {want.name!r} declared dtype {got.dtype!r}, expected {want.dtype!r}")

    def abort_upload(self, slot: UploadSlot, reason: str) -> None:
        slot.assignment.in_flight = False
        self._reject(slot.cohort, reason)

    def _reject(self, cr: CohortRound | None, reason: str) -> None:
        self.counters["uploads_rejected"] += 1
        if cr is not None:
            cr.rejected[reason] = cr.rejected.get(reason, 0) + 1

    def reject(self, err: OrchardError) -> None:
        self._reject(self.current, type(err).__name__)

    def _decode(self, slot: UploadSlot, payload: bytes) -> NDArrays | CheckedUpload:
        """Everything that is checked before a fold: a decoded update or partial, or a
        client's payload checked for the compressed sum."""
        h, cr = slot.header, slot.cohort
        if h.kind is UploadKind.PARTIAL_SUM:
            return decode_partial(payload, cr.task.schema, h.payload_sizes)
        if cr.compressed is not None:
            return cr.compressed.check(h, payload)
        return self._decode_client(h, payload, cr.task)

    async def complete_upload(self, slot: UploadSlot, payload: bytes) -> None:
        """Decode, check, and fold a fully received, hash-checked payload."""
        h, cr, a = slot.header, slot.cohort, slot.assignment
        loop = asyncio.get_running_loop()
        try:
            arrays = await loop.run_in_executor(self._decode_pool, self._decode, slot, payload)
            self._reserve_fold(cr, h)
            try:
                if h.count > 0:
                    await loop.run_in_executor(self._fold_pool, self._fold, cr, h, arrays)
            except BaseException:
                cr.reserved -= h.count
                raise
        except BaseException:
            a.in_flight = False
            raise
        self._delivered(slot)

    def _reserve_fold(self, cr: CohortRound, h: UploadHeader) -> None:
        """The last check before a fold, on the loop thread. A fold reserves its count here,
        before it runs, so two uploads racing for the last slot cannot both get in. (A
        partial from below is never refused for overshooting: it is a whole cohort.)"""
        if cr.closed:
            raise RoundClosedError(f"round {cr.task.round} closed ({cr.close_reason}) while the upload arrived; "
                                   "late uploads are refused")
        if h.kind is UploadKind.CLIENT_UPDATE and cr.reserved >= cr.task.target:
            raise RoundClosedError(f"round {cr.task.round} already has its {cr.task.target} updates; "
                                   "late uploads are refused")
        cr.reserved += h.count

    def submit_local(self, node_id: str, h: UploadHeader, payload: bytes) -> None:
        """In-process upload (the simulator): the same checks, decode and fold as over gRPC,
        run synchronously on the caller's thread. Not for use while gRPC uploads are folding."""
        try:
            slot = self.begin_upload(node_id, h)
        except OrchardError as err:
            self.reject(err)
            raise
        try:
            if sha256_hex(payload) != h.payload_sha256 or len(payload) != h.total_bytes:
                raise IntegrityError("payload does not match its declared size and sha256")
            arrays = self._decode(slot, payload)
            self._reserve_fold(slot.cohort, h)
            try:
                if h.count > 0:
                    self._fold(slot.cohort, h, arrays)
            except BaseException:
                slot.cohort.reserved -= h.count
                raise
        except OrchardError as err:
            self.abort_upload(slot, type(err).__name__)
            raise
        self._delivered(slot)

    def _delivered(self, slot: UploadSlot) -> None:
        h, cr, a = slot.header, slot.cohort, slot.assignment
        a.in_flight = False
        cr.settle(a, delivered=True)
        n = h.total_bytes
        self.counters["uploads_accepted"] += 1
        self.counters["bytes_up"] += n
        cr.bytes_up += n + (h.bytes_up if h.kind is UploadKind.PARTIAL_SUM else 0)
        if h.kind is UploadKind.PARTIAL_SUM:
            cr.bytes_down += h.bytes_down
            for k, v in h.tier_participants.items():
                cr.tier_participants[k] = cr.tier_participants.get(k, 0) + v
        else:
            cr.tier_participants[self.name] = cr.tier_participants.get(self.name, 0) + 1
        self._check_close(cr)
        self._notify()

    @staticmethod
    def _fold(cr: CohortRound, h: UploadHeader, arrays: NDArrays | CheckedUpload) -> None:
        if isinstance(arrays, CheckedUpload):
            assert cr.compressed is not None  # only _decode makes one, for such a round
            cr.compressed.fold(h, arrays)
            return
        ms = MetricSums(dict(h.metric_sums), dict(h.metric_weights))
        if h.kind is UploadKind.PARTIAL_SUM:
            cr.acc.merge(Partial(sums=arrays, weight=h.weight, count=h.count, metrics=ms))
        else:
            cr.acc.accumulate(arrays, h.weight, checked=True)  # the decoder checked it
            cr.acc.partial.metrics.merge(ms)

    # ------------------------------------------------------------------ secure aggregation

    async def secagg_exchange(self, node_id: str, run_id: str, rnd: int, attempt: int, task_id: str,
                              stage_index: int, message: bytes, header: UploadHeader | None,
                              wait_s: float) -> tuple[int, bytes, bool, str]:
        """Take one stage message (if any), then long-poll for this node's next broadcast.

        Returns (current stage index, broadcast or b"", done, abort reason)."""
        self.touch(node_id)
        cr, a = self._assignment(node_id, run_id, rnd, attempt, task_id)
        sc = cr.secure
        if sc is None:
            raise SecAggError(f"round {rnd} runs no secure aggregation for {node_id!r}")
        if message:
            if header is not None:
                names = [s.name for s in cr.task.schema]
                if header.node_id != node_id or [s.name for s in header.schema] != names:
                    raise UpdateSchemaError("masked-input header does not match the caller or the round's schema")
            sc.receive(node_id, stage_of(stage_index), message, header)
            self._secure_progress(cr)
            self._notify()
        end = self._mono() + max(0.0, min(wait_s, self.cfg.long_poll_s))
        while True:
            if sc.finished:
                return stage_index_of(sc.stage), b"", sc.stage is Stage.DONE, sc.abort_reason
            b = sc.broadcast(node_id)
            if b:
                return stage_index_of(sc.stage), b, False, ""
            remaining = end - self._mono()
            if remaining <= 0 or cr.closed:
                return stage_index_of(sc.stage), b"", False, ""
            ev = self._watch()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(ev.wait(), timeout=remaining)
            self.touch(node_id)

    def _secure_progress(self, cr: CohortRound) -> None:
        """Move the session's stages on; fold the cohort's sum once it is unmasked."""
        sc = cr.secure
        if sc is None or cr.closed:
            return
        moved = False
        while sc.advance(self._wall()):
            moved = True
        if not moved or not sc.finished:
            if moved:
                self._notify()
            return
        clients = [a for a in cr.assignments.values() if self.children.get(a.node_id) is not None
                   and self.children[a.node_id].role is Role.CLIENT]
        if sc.stage is Stage.DONE:
            p = sc.partial()
            contributed = set(sc.contributors())
            if p.count > 0:
                cr.secure_sum = p  # folded with the outcome (fold_aside), after the fold pool drained
                cr.reserved += p.count
            for a in clients:
                cr.settle(a, a.node_id in contributed)
            cr.tier_participants[self.name] = cr.tier_participants.get(self.name, 0) + p.count
            self.counters["uploads_accepted"] += p.count
        else:
            for a in clients:
                cr.settle(a, delivered=False)
            cr.rejected[f"secure aggregation aborted: {sc.abort_reason}"] = len(clients)
        cr.bytes_up += sc.bytes_up
        cr.bytes_down += sc.bytes_down
        self.counters["bytes_up"] += sc.bytes_up
        self._check_close(cr)
        self._notify()

    # ------------------------------------------------------------------ closing

    def sweep(self) -> None:
        """Drop silent selected nodes, enforce the deadline; called periodically."""
        cr = self.current
        if cr is None or cr.closed:
            return
        now = self._mono()
        for a in cr.pending():
            c = self.children.get(a.node_id)
            if c is None or (now - c.last_seen > self.cfg.node_timeout_s and not a.in_flight):
                cr.settle(a, delivered=False)
        if cr.secure is not None:
            self._secure_progress(cr)
            if cr.closed:
                return
        if self._wall() >= cr.task.deadline_unix:
            self.close_round(cr, "deadline")
            return
        self._check_close(cr)

    def _check_close(self, cr: CohortRound) -> None:
        if cr.closed:
            return
        if cr.received >= cr.task.target:
            self.close_round(cr, "target reached")
        elif cr.assignments and cr.open == 0 and cr.clients_selected >= cr.client_quota:
            self.close_round(cr, "every selected node delivered or dropped")

    def close_round(self, cr: CohortRound, reason: str) -> None:
        if cr.closed:
            return
        cr.closed = True
        cr.close_reason = reason
        self.counters["rounds_closed"] += 1
        cr.closed_event.set()
        self._notify()

    async def wait_round(self, cr: CohortRound) -> RoundOutcome:
        await cr.closed_event.wait()
        # Let folds already queued finish before the partial is read.
        await asyncio.get_running_loop().run_in_executor(self._fold_pool, lambda: None)
        return self.outcome(cr)

    def outcome(self, cr: CohortRound) -> RoundOutcome:
        """The result of a closed round (the simulator calls this directly), once its folds
        are done."""
        cr.fold_aside()
        dropped = sum(1 for a in cr.assignments.values() if a.dropped)
        return RoundOutcome(task=cr.task, partial=cr.acc.partial, selected=len(cr.assignments), dropped=dropped,
                            bytes_up=cr.bytes_up, bytes_down=cr.bytes_down,
                            tier_participants=dict(cr.tier_participants), reason=cr.close_reason,
                            seconds=self._mono() - cr.started, rejected=dict(cr.rejected))

    def _watch(self) -> asyncio.Event:
        """The event a long-poller waits on; set (and replaced) at the next change."""
        self._changed_watched = True
        return self._changed

    def _notify(self) -> None:
        # A tier notifies on every fold; with no long-poller holding the event (the
        # simulator, a busy round) there is nothing to wake and nothing to replace.
        if not self._changed_watched:
            return
        ev, self._changed, self._changed_watched = self._changed, asyncio.Event(), False
        ev.set()

    def shutdown(self) -> None:
        self._fold_pool.shutdown(wait=False, cancel_futures=True)
        self._decode_pool.shutdown(wait=False, cancel_futures=True)
