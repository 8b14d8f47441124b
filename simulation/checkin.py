"""Devices come and go: check-in at the lowest tiers, and back into the population.

Devices are drawn in a seeded random order; the ones online at this hour (their kind's
availability) are brought up to the present a batch at a time (``Population.catch_up``:
the edge runtime's device model over columns), each is made the edge runtime's
:class:`SimulatedDevice`, and it checks in (``join``) at the lowest-tier coordinator it
dials if the device-side policy lets it. When the round is over (or, in asynchronous
mode, when its training is) it leaves, and its state goes back to the population.
"""

from __future__ import annotations

import math

import numpy as np

from orchard.server.round import SimulatedCounts
from orchard.simulation.context import Context
from orchard.simulation.population import LiveDevice, Population
from orchard.simulation.tree import TOKEN, Tree
from orchard.typing import Role


class CheckIn:
    """The population's devices checking in at the tree's lowest tiers, and leaving."""

    def __init__(self, ctx: Context, tree: Tree) -> None:
        self._ctx = ctx
        self._tree = tree
        self.pop = ctx.pop
        self.run = ctx.run
        self.time = ctx.time
        self.leaves = tree.leaves

    def check_in(self, rnd: int, attempt: int, stats: SimulatedCounts,
                 busy: dict[str, LiveDevice] | None = None) -> dict[str, LiveDevice]:
        """Devices check in at their lowest-tier nodes until each node has its share of
        ``clients_per_round * over_selection * checkin_factor`` (or everyone was asked):
        the lowest tiers fill independently, as aggregators' pools do, so a process that
        runs only some of them (a shard) checks in exactly the devices they would get.
        ``busy``: devices still training (asynchronous mode), which do not poll."""
        cfg = self.run
        want = math.ceil(cfg.cohort.target * cfg.cohort.over_selection * self._ctx.checkin_factor)
        n_leaves = len(self.leaves)
        mine = self._tree.mine
        # Each lowest tier's share, in tree order; a tier this process does not run wants none.
        left = [want // n_leaves + (li < want % n_leaves) if mine[li] else 0 for li in range(n_leaves)]
        need = sum(left)
        live: dict[str, LiveDevice] = {}
        now = self.time.t
        wall = self.time.wall()
        # Offer devices in a seeded order until enough are in (or everyone was asked). The
        # online ones whose tier still wants devices are brought up to now a slice at a
        # time (Population.catch_up, which writes nothing), each slice no longer than the
        # devices still wanted; each then reads its state and decides, in order, and only
        # a device that was asked (its tier still wanted one) is written back.
        leaves = self.leaves
        for k, order in enumerate(self.pop.candidates(rnd, attempt, max(64, 2 * want))):
            online = order[self.pop.online(order, now, rnd, attempt * 1_000_003 + k)]
            if n_leaves > 1:
                online = online[np.asarray(left)[online % n_leaves] > 0]
            ids_online = online.tolist()
            if busy:  # still training (asynchronous mode): not polling
                ids_online = [i for i in ids_online if f"device-{i}" not in busy]
            pos = 0
            while pos < len(ids_online) and need > 0:
                ids = ids_online[pos:pos + max(64, need)]
                pos += len(ids)
                cols = self.pop.catch_up(np.asarray(ids, dtype=np.int64), now)
                for j, i in enumerate(ids):
                    li = i % n_leaves
                    if not left[li]:
                        continue
                    node = f"device-{i}"
                    if not leaves[li].coord.registry.participation.allows(node, rnd):
                        continue  # past DP-FTRL's bound at its tier: it could not be selected
                    dev = self.pop.device(i, cols, j)
                    state = Population.state_of(dev)
                    if not Population.eligible(state, cfg.eligibility, wall):
                        self.pop.store(dev)
                        continue
                    leaves[li].coord.join(node, Role.CLIENT, TOKEN, state)
                    live[node] = dev
                    left[li] -= 1
                    need -= 1
                    if not need:
                        break
            if not need:
                break
        stats.checked_in = len(live)
        return live

    def leave(self, live: dict[str, LiveDevice]) -> None:
        """Devices disconnect when the round is over; their state goes back to the population."""
        for leaf in self.leaves:
            # A simulated device that goes away goes at once (a real one would expire).
            for node in [n for n, c in leaf.coord.children.items() if c.role is Role.CLIENT]:
                leaf.coord.leave(node)
        self.pop.store_many(list(live.values()), self.time.t)

    def release(self, node: str, dev: LiveDevice) -> None:
        """A device leaves its tier and goes back to the population (it may check in again)."""
        self._tree.root.coord.leave(node)
        dev.clock.advance(max(0.0, self.time.t - dev.clock.monotonic()))
        self.pop.store(dev)
