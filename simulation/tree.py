"""The tree of tiers a simulation runs: real coordinators, each opened from its parent.

Every tier is a :class:`orchard.server.coordinator.Coordinator` built ``inline`` on the
virtual clock. Aggregators report their pools upward, the root opens the round, and
each tier takes its assignment from its parent (``assign``) and opens its own round
(``server.upstream.ChildRound``), exactly as ``server.aggregator`` does over gRPC.
"""

from __future__ import annotations

import hashlib
import math
from collections import deque
from dataclasses import dataclass, field

import numpy as np

from orchard.client.secure import SecureParticipant
from orchard.config import RunConfig
from orchard.messages import TaskAssignment
from orchard.server.cohort import CohortRound
from orchard.server.coordinator import Coordinator, ParentUpstream, run_inline
from orchard.server.decoding import ClientUpdateDecoder
from orchard.server.round import RoundTask, root_task
from orchard.server.upstream import ChildRound
from orchard.simulation.context import Context
from orchard.typing import DeviceState, NDArrays, Role
from orchard.wire import sha256_hex

TOKEN = "simulated"  # every simulated node presents the same (unchecked) credential


@dataclass
class Tier:
    name: str
    coord: Coordinator
    parent: Tier | None
    children: list[Tier] = field(default_factory=list)
    # per round
    cr: CohortRound | None = None
    pushed: bool = False
    waiting: int = 0  # selected clients still expected to upload (not vanished, not late)
    last_silence: float = -math.inf  # latest time a vanished client fell silent
    working: set[str] = field(default_factory=set)  # selected clients still training
    assignment: TaskAssignment | None = None  # this tier's task from its parent
    child: ChildRound | None = None  # this tier's round for that task
    # Secure aggregation: each selected client's side of the tier's SecAgg+ session and its task.
    secure: dict[str, tuple[SecureParticipant, TaskAssignment]] = field(default_factory=dict)

    def reset(self) -> None:
        self.cr, self.pushed, self.waiting, self.last_silence = None, False, 0, -math.inf
        self.working, self.assignment, self.child, self.secure = set(), None, None, {}


class Tree:
    """The tiers, root first, and which of them this process runs: all of them, or with
    sharded rounds (:meth:`serve`) the subtrees under some of the root's children."""

    def __init__(self, ctx: Context, fanout: list[int]) -> None:
        self._ctx = ctx
        self.root = self._tier("root", None, 0)
        level = [self.root]
        for depth, fan in enumerate(fanout, start=1):
            nxt = []
            for p in level:
                for i in range(fan):
                    t = self._tier(f"{p.name}/agg{depth}.{i}" if p.parent else f"agg{depth}.{i}", p, depth)
                    p.children.append(t)
                    p.coord.join(t.name, Role.AGGREGATOR, TOKEN, _box_state())
                    nxt.append(t)
            level = nxt
        self.leaves = level
        # Each tier's place in the tree's order, the tiers by name; the lowest tiers whose
        # devices check in here, and the root's subtrees run here (None: the whole tree,
        # with the root).
        self.order = {t.name: i for i, t in enumerate(self.tiers())}
        self.by_name = {t.name: t for t in self.tiers()}
        self.mine = [True] * len(self.leaves)
        self.tops: list[Tier] | None = None

    def _tier(self, name: str, parent: Tier | None, depth: int) -> Tier:
        ctx = self._ctx
        h = int(hashlib.sha256(name.encode()).hexdigest()[:8], 16)
        rng = np.random.default_rng([ctx.seed, depth, h])
        # DP noise (central, at the root) is seeded like everything else in a simulation,
        # so a seed replays a run; a real root draws it from OS entropy.
        coord = Coordinator(name, ctx.server_cfg, rng, ClientUpdateDecoder(),
                            monotonic=ctx.time.monotonic, wall=ctx.time.wall, inline=True,
                            noise_rng=np.random.default_rng([ctx.seed, depth, h, 0xD9]))
        return Tier(name, coord, parent)

    def tiers(self, tops: list[Tier] | None = None) -> list[Tier]:
        """The tree's tiers in breadth-first order (from ``tops`` down, if given)."""
        out, queue = [], deque([self.root] if tops is None else tops)
        while queue:
            t = queue.popleft()
            out.append(t)
            queue.extend(t.children)
        return out

    def serve(self, tops: list[str]) -> None:
        """Run only the subtrees under the root's children ``tops``: devices check in at
        their lowest tiers only, and only their clients are trained and folded."""
        self.tops = [self.by_name[n] for n in tops]
        below = {id(t) for t in self.tiers(self.tops)}
        self.mine = [id(leaf) in below for leaf in self.leaves]

    def report_pools(self, run: RunConfig, tops: list[Tier] | None = None) -> dict[str, tuple[int, int]]:
        """Bottom-up: each aggregator tells its parent how many clients it can reach. With
        ``tops`` (a shard's subtrees), the tops' own reports are returned, by name, for
        the root (in another process) instead."""
        out: dict[str, tuple[int, int]] = {}
        for t in reversed(self.tiers(tops)):
            if t.parent is not None:
                size, elig = t.coord.capacity(run)
                if tops is not None and t.parent is self.root:
                    out[t.name] = (size, elig)
                else:
                    t.parent.coord.touch(t.name, pool_size=size, pool_eligible=elig)
        return out

    def root_task(self, rnd: int, attempt: int, arrays: NDArrays, blob: bytes, cfg: RunConfig,
                  config: RunConfig | None, noise_stddev: float) -> RoundTask:
        """The root's task for an attempt of round ``rnd`` (``config``: the round's config
        when it is not the run's), stamped now."""
        ctx = self._ctx
        return root_task(ctx.run_id, rnd, attempt, cfg, ctx.config_json if config is None else cfg.model_dump_json(),
                         arrays, blob, sha256_hex(blob), ctx.time.wall(), noise_stddev)

    def open_root(self, task: RoundTask) -> None:
        """Every tier's round state cleared, and the root's round opened on ``task``."""
        for t in self.tiers():
            t.reset()
        self.root.cr = self.root.coord.open_round(task)

    def open_below(self, parent: Tier, blob: bytes) -> None:
        for t in parent.children:
            a = parent.coord.assign(t.name)
            if a is None:
                continue
            parent.coord.count_bytes_down(len(blob))
            self.open_tier(t, a, blob)

    def open_tier(self, t: Tier, a: TaskAssignment, blob: bytes) -> None:
        """Tier ``t`` opens its parent's assignment ``a``, and the tiers below it theirs."""
        parent = t.parent
        assert parent is not None
        # The gRPC aggregator's ChildRound: the parent's task, this tier's cohort; under
        # secure aggregation over the whole tree the tier relays to its parent's session
        # and reports its roster once its own children have.
        t.child = ChildRound(t.coord, t.name, a, blob, lambda a: ParentUpstream(parent.coord, t.name, a),
                             self._ctx.round_cfg)
        t.assignment, t.cr = a, t.child.cr
        self.open_below(t, blob)
        run_inline(t.child.report_roster())

    def close_open(self, tops: list[Tier] | None = None) -> None:
        """The round is over: every tier still open (from ``tops`` down) closes."""
        for t in self.tiers(tops):
            if t.cr is not None and not t.cr.closed:
                t.coord.close_round(t.cr, "simulation round over")

    def shutdown(self) -> None:
        for t in self.tiers():
            t.coord.shutdown()


def _box_state() -> DeviceState:
    # Aggregators run on mains power in a data centre: always eligible.
    return DeviceState(charging=True)
