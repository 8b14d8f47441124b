"""Secure aggregation of one tier's direct-client cohort over the wire (SecAgg+).

The lowest aggregating tier runs one :class:`~orchard.secure_agg.SecAggServer` per round
for the clients it selected. Clients post each stage's message and long-poll for the
next broadcast (``Fleet.SecAgg``); the tier moves a stage on when every expected
client has answered, or at the stage's deadline, with whoever did.

What the tier learns is the cohort's sum. Each client masks ``(w / weight_scale) *
values`` (the values its codec's payload decodes to, so any field-linear codec works),
quantised with the run's clip and bits; weights, counts and metrics travel in the clear
in the header that comes with the masked input. The unmasked, dequantised sum times
``weight_scale`` is ``sum_i w_i * values_i``: the cohort's partial sum, folded like any
other and pushed up the tree as a PARTIAL_SUM.

Stage deadlines, as fractions of the round's time: keys 15% each, masked input until
85%, the consistency round (active sessions) until 92%, unmasking until the deadline.

With ``secure_aggregation.scope = "tree"`` the session is the root's, over every client
selected anywhere below it, and the tiers between relay (``TreeRoster``,
``SecureUpstream``; the tier's side is ``orchard.server.tier.secure_tree``). A relay
sees a subset of what the root's session sees (its own clients' messages: keys, shares
encrypted to their neighbours, masked inputs, unmasking shares), and the root's view
reveals only the sum over the whole round (SecAgg+'s guarantee, see
``orchard.secure_agg``). That holds against a relay that lies only in an active session
(``secure_aggregation.adversary = "active"``, the default) whose clients hold the root's
key: each client's keys are signed with its device identity key, which the root vouches
for (a signed roster, ``server/rosterbook.py``, or a certificate), so a relay that
substitutes keys is detected and gets nothing. In a semi-honest
session, or with clients that were never enrolled (``--insecure``), a relay that
substitutes keys reads the updates it relays.

Each session logs the bounds its k and t achieve (correctness, secret leak,
disconnection) for the configured dropout rate and corrupt fraction. After unmasking,
the sum is checked against the bound honest inputs imply (every quantised input is below
2^bits): a coordinate above it means a malicious client's input was out of range. Below
that bound a malicious client can still move the sum by up to its clip: without a proof
of each input's range (not implemented) no server can tell.
"""

from __future__ import annotations

import contextlib
import logging
import math
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from orchard.aggregation import MetricSums, Partial
from orchard.aggregation.privacy import DDGParams, ddg_decode, session_params
from orchard.config import RunConfig, SecureAggregationConfig
from orchard.errors import SecAggAbort, SecAggError, UpdateSchemaError
from orchard.messages import UploadHeader
from orchard.secure_agg import (
    SecAggServer,
    SessionConfig,
    Stage,
    WrongStage,
    check_headroom,
    dequantize,
    parameters_from_config,
)
from orchard.server.maskworkers import MaskWorkers
from orchard.typing import TensorSpec

log = logging.getLogger("orchard.server.secagg")

# A tier starts its mask worker processes (orchard.server.maskworkers) with the first
# session that will expand at least this many bytes of mask (about 25 ms of keystream on
# one core), where sparing the threads' waits for the GIL outweighs the workers' start
# (0.2-0.3 s, once) and a session's pipe traffic (one sum back from each worker).
MASK_WORKERS_MIN_BYTES = 256 << 20

# Fraction of the round's time by which each stage must be over.
STAGE_END = {Stage.ADVERTISE_KEYS: 0.15, Stage.SHARE_KEYS: 0.30, Stage.MASKED_INPUT: 0.85,
             Stage.CONSISTENCY: 0.92, Stage.UNMASKING: 1.0}


# A tree-scope session opens once every selected aggregator reported its roster, or at
# this fraction of the round's time with the rosters that are in.
ROSTER_END = 0.05


@dataclass(frozen=True)
class SecAggReply:
    """What a node learns from one secure-aggregation exchange."""

    stage: int  # the session's current stage index
    broadcast: bytes  # the broadcast this node must answer, or b""
    done: bool
    aborted: str  # why the session aborted, or ""


class SecureUpstream(Protocol):
    """How a tier below the root reaches the round's session (scope "tree"), bound to the
    tier's own task in the round: gRPC sends ``Fleet.SecAgg`` on the tier's upstream link
    (``orchard.server.aggregator``), the simulator calls the parent coordinator."""

    async def roster(self, nodes: list[str], tiers: list[str]) -> None:
        """Report the clients selected below this tier (and the lowest tier of each)."""

    async def exchange(self, node: str, stage_index: int, message: bytes, header: UploadHeader | None,
                       wait_s: float, bytes_down: int = 0) -> SecAggReply:
        """Relay one client's exchange (as ``Coordinator.secagg_exchange``) to the session,
        with the bytes this tier sent down since its last report (for the round's record)."""


@dataclass
class TreeRoster:
    """A tier's part of a tree-scope session in one round: which child each client below
    it comes through (a direct client: itself), the lowest tier of each, and the
    aggregator children whose rosters are still to come."""

    route: dict[str, str] = field(default_factory=dict)
    tiers: dict[str, str] = field(default_factory=dict)
    waiting: set[str] = field(default_factory=set)
    reporters: set[str] = field(default_factory=set)  # the aggregator children whose rosters are in
    sent: bool = False  # reported upstream (a tier below the root)
    inputs: set[str] = field(default_factory=set)  # clients whose masked input went up through here
    final: SecAggReply | None = None  # the session's end, as relayed (a tier below the root)
    reported_down: int = 0  # of this tier's bytes_down, how much went up with exchanges
    roster_deadline: float = math.inf  # wall time: the root opens the session then, rosters or not

    def reported(self, via: str) -> dict[str, str]:
        """The roster ``via`` reported: each client and its lowest tier."""
        return {n: self.tiers[n] for n, v in self.route.items() if v == via}

    def add(self, via: str, nodes: list[str], tiers: list[str]) -> None:
        if len(nodes) != len(tiers):
            raise SecAggError(f"a roster names {len(nodes)} clients and {len(tiers)} tiers; one tier per client")
        if len(set(nodes)) != len(nodes):
            raise SecAggError("a roster names a client twice")
        for n in nodes:
            if not n or n in self.route:
                raise SecAggError(f"client {n!r} is named twice in this round's rosters (or is empty)")
        for n, t in zip(nodes, tiers, strict=True):
            self.route[n] = via
            self.tiers[n] = t
        self.reporters.add(via)


def check_masked_header(header: UploadHeader | None) -> None:
    """What a tier checks of the header that comes with a masked input (its session's
    tier, or a relay before it passes the input on)."""
    if header is None:
        raise UpdateSchemaError("a masked input must come with its header (weight, counts, metrics)")
    if not (np.isfinite(header.weight) and header.weight > 0):
        raise UpdateSchemaError(f"update weight must be positive and finite, got {header.weight}")


def flat_to_sums(flat: np.ndarray, schema: tuple[TensorSpec, ...]) -> dict[str, np.ndarray]:
    out, off = {}, 0
    for s in schema:
        out[s.name] = flat[off : off + s.numel].reshape(s.shape)
        off += s.numel
    return out


@dataclass
class SecureCohort:
    """One SecAgg+ session over a tier's selected direct clients, for one round.

    With DP on, the clients' field vectors are their clipped, conditionally rounded
    updates in the encoding of ``aggregation.privacy.session_params`` (each decoded
    contribution within the clip norm under central DP; with its share of the noise
    under distributed DP): the sum is decoded with the same parameters, weighted by the
    number of contributors (every weight is 1), and under distributed DP released only
    when at least ``min_contributors`` clients contributed (fewer would carry less than
    the target noise)."""

    cfg: SecureAggregationConfig
    run: RunConfig
    schema: tuple[TensorSpec, ...]
    participants: tuple[str, ...]
    round_number: int
    started_wall: float
    deadline_wall: float
    workers: MaskWorkers | None = None  # the tier's mask worker processes, if it has them
    certificates: dict[str, bytes] = field(default_factory=dict)  # the participants' the tier knows
    server: SecAggServer = field(init=False)
    headers: dict[str, UploadHeader] = field(default_factory=dict)
    bytes_up: int = 0
    bytes_down: int = 0
    neighbours: int = 0
    threshold: int = 0
    # The unmasking stage is closing on another thread (advance(defer_unmasking=True)):
    # the session takes no message and writes no broadcast until close_due_stage returns.
    closing: bool = False
    failure: str = ""  # the unmasking raised something other than an abort (a bug): no sum
    bounds: dict[str, float] = field(default_factory=dict)  # what k and t achieve (log2 failure bounds)

    def __post_init__(self) -> None:
        n = len(self.participants)
        d = sum(s.numel for s in self.schema)
        self.ddg = session_params(self.run, n, d)  # with DP: the clients' bounded encoding
        if self.ddg is None:
            check_headroom(n, self.cfg.bits, self.cfg.modulus_bits)
        params = parameters_from_config(self.cfg, n)
        self.neighbours, self.threshold = params.neighbours, params.threshold
        log.info("round %d: secure session over %d clients (%s), k=%d t=%d; for dropout %.3g and corrupt "
                 "fraction %.3g: correctness failure <= 2^%.1f, secret leak <= 2^%.1f, disconnection <= 2^%.1f",
                 self.round_number, n, self.cfg.adversary, params.neighbours, params.threshold,
                 params.dropout_rate, params.corrupt_fraction, params.log2_correctness_failure,
                 params.log2_secret_leak, params.log2_disconnection)
        self.bounds = {"log2_correctness_failure": params.log2_correctness_failure,
                       "log2_secret_leak": params.log2_secret_leak,
                       "log2_disconnection": params.log2_disconnection}
        session = SessionConfig.create(sorted(self.participants), d, neighbours=params.neighbours,
                                       threshold=params.threshold, round_number=self.round_number,
                                       entropy=secrets.token_bytes(32), modulus_bits=self.cfg.modulus_bits,
                                       active=self.cfg.adversary == "active")
        self.server = SecAggServer(session, workers=self.workers, certificates=self.certificates)

    @property
    def stage(self) -> Stage:
        return self.server.stage

    @property
    def finished(self) -> bool:
        return self.server.stage in (Stage.DONE, Stage.ABORTED) or bool(self.failure)

    def broadcast(self, node: str) -> bytes:
        """The current broadcast for ``node`` if it is expected to answer now, else b""."""
        if self.closing or self.finished or node not in self.server.pending():
            return b""
        data = self.server.broadcast_bytes(node)
        self.bytes_down += len(data)
        return data

    def receive(self, node: str, stage: Stage, message: bytes, header: UploadHeader | None) -> None:
        if self.closing:
            raise WrongStage(f"{node!r} sent a {stage.value} message while the unmasking stage closes: "
                             "the session takes no more messages; poll without one for its end")
        if stage is Stage.MASKED_INPUT:
            check_masked_header(header)
        self.server.receive(stage, node, message)  # refuses with a SecAggError and changes nothing
        self.bytes_up += len(message)
        if stage is Stage.MASKED_INPUT and header is not None:
            self.headers[node] = header

    def advance(self, now_wall: float, *, defer_unmasking: bool = False) -> bool:
        """Close the current stage if everyone answered or its deadline passed. True if it
        moved. With ``defer_unmasking``, the unmasking stage (where the masks come off: up
        to seconds of work in a large session) is not closed here: the cohort is marked
        ``closing`` and the caller runs :meth:`close_due_stage` on another thread."""
        if self.finished or self.closing:
            return False
        end = self.started_wall + STAGE_END[self.stage] * (self.deadline_wall - self.started_wall)
        if self.server.pending() and now_wall < end:
            return False
        if defer_unmasking and self.server.stage is Stage.UNMASKING:
            self.closing = True
            return False
        self.close_due_stage()
        return True

    def close_due_stage(self) -> None:
        """Close the current stage. An abort is recorded by the session (abort_reason);
        this cohort then adds nothing."""
        with contextlib.suppress(SecAggAbort):
            self.server.close_stage()

    @property
    def abort_reason(self) -> str:
        if self.failure:
            return self.failure
        return (self.server.abort_reason or "aborted") if self.server.stage is Stage.ABORTED else ""

    def partial(self) -> Partial:
        """The cohort's unmasked partial sum (after DONE). Raises SecAggAbort when too few
        clients contributed for the distributed DP noise to reach its target."""
        res = self.server.result()
        n = len(res.contributors)
        metrics = MetricSums()
        for node in res.contributors:
            h = self.headers[node]
            metrics.merge(MetricSums(dict(h.metric_sums), dict(h.metric_weights)))
        if self.ddg is not None and n < self.ddg.min_contributors:
            raise SecAggAbort(f"{n} of {len(self.participants)} clients contributed; distributed DP releases a "
                              f"cohort sum only with at least {self.ddg.min_contributors} (their noise shares "
                              "would fall short of the target)")
        total = decode_total(self.run, res.total, n, self.ddg)
        if self.ddg is not None:
            return Partial(sums=flat_to_sums(total, self.schema), weight=float(n), count=n, metrics=metrics)
        if res.offenders:
            log.warning("round %d: shares of %s disagreed with the other holders' and were discarded",
                        self.round_number, list(res.offenders))
        bound = n * ((1 << self.cfg.bits) - 1)
        if n and int(res.total.max(initial=0)) > bound:
            raise SecAggAbort(f"the unmasked sum exceeds {bound}, the most {n} quantised inputs below 2^"
                              f"{self.cfg.bits} can add to: a client's input was out of range; no sum is released")
        w_scale = self.cfg.weight_scale
        weight = 0.0
        for node in res.contributors:
            weight += min(self.headers[node].weight, w_scale)
        return Partial(sums=flat_to_sums(np.asarray(total, np.float64), self.schema), weight=weight, count=n,
                       metrics=metrics)

    def contributors(self) -> list[str]:
        return list(self.server.result().contributors)


def decode_total(run: RunConfig, total: np.ndarray, contributors: int, params: DDGParams | None) -> np.ndarray:
    """The float sum (float64) a tier folds from the field sum of ``contributors``
    clients' vectors: with DP, decoded with the session's ``params``
    (``aggregation.privacy.session_params``); without, dequantised and times
    ``weight_scale``."""
    if params is not None:
        return ddg_decode(total, params)
    sa = run.secure_aggregation
    return np.asarray(dequantize(total, sa.clip, sa.bits, contributors) * sa.weight_scale, np.float64)


def new_cohort(run: RunConfig, schema: tuple[TensorSpec, ...], participants: list[str],
               round_number: int, deadline_wall: float, wall: Callable[[], float] = time.time,
               workers: MaskWorkers | None = None, certificates: dict[str, bytes] | None = None) -> SecureCohort:
    return SecureCohort(run.secure_aggregation, run, schema, tuple(participants), round_number, wall(), deadline_wall,
                        workers=workers, certificates=certificates or {})


def mask_bytes(run: RunConfig, schema: tuple[TensorSpec, ...], participants: int) -> int:
    """Bytes of mask a session's unmasking expands at least: one self mask of d words per
    contributor (more with dropouts: each dropped node's pairwise masks)."""
    word = 4 if run.secure_aggregation.modulus_bits <= 32 else 8
    return participants * sum(s.numel for s in schema) * word
