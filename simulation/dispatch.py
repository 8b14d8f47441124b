"""The hand-out: selected devices get their task, download, train and upload, in simulated time.

A selected device downloads the model (its link speed; a downlink delta when it holds
an earlier model), trains under the edge runtime's governor (``device_model``), and
uploads. Its finish time is download + training + upload; some devices vanish mid-task
(their kind's dropout rate) and are never heard from again. What comes out is the
round's arrivals in finish-time order, for ``simulation.arrivals``.
"""

from __future__ import annotations

import time

import numpy as np

from orchard.compression import encode_update
from orchard.edge_runtime.policy import DevicePolicy, RoundBudget
from orchard.messages import TaskAssignment
from orchard.server.round import SimulatedCounts
from orchard.simulation.ahead import TrainingAhead
from orchard.simulation.context import Context
from orchard.simulation.device_model import DeviceRuns
from orchard.simulation.downlink import Downlink
from orchard.simulation.jobs import Arrival
from orchard.simulation.population import LiveDevice
from orchard.simulation.secure import SecureClients
from orchard.simulation.tree import Tier, Tree
from orchard.typing import NDArrays
from orchard.updates import pack


class Dispatch:
    """Hands a round's tasks out to the devices its lowest tiers selected and runs their
    device models; ``device_seconds``: the last dispatch's wall seconds waiting for them."""

    def __init__(self, ctx: Context, tree: Tree, num_partitions: int, downlink: Downlink, secure: SecureClients,
                 ahead: TrainingAhead) -> None:
        self._ctx = ctx
        self.time = ctx.time
        self.run = ctx.run
        self.seed = ctx.seed
        self.governor = ctx.governor
        self.leaves = tree.leaves
        self.downlink = downlink
        self._secure = secure
        self._ahead = ahead
        # Each partition's example count, read per device as a Python int.
        self._size_of: list[int] = [int(n) for n in ctx.task.partition(num_partitions, ctx.seed).sizes]
        self._policies: dict[tuple[int, float], DevicePolicy] = {}  # device policies by (steps, seconds)
        self.device_seconds = 0.0  # (a round's phase_seconds)

    def dispatch(self, live: dict[str, LiveDevice], blob: bytes, schema: tuple, shared_seed: int,
                 stats: SimulatedCounts, starts: dict[str, tuple[bytes, NDArrays]],
                 ahead_of: NDArrays | None = None) -> list[Arrival]:
        """Hand out assignments; simulate each selected device's download, training time and upload.

        ``starts``: the round's downlink reconstructions, by sha256, filled as devices pull
        them. ``ahead_of``: the round's global model, to train clients ahead on an idle
        worker while the rest are dispatched (``TrainingAhead``); None to train none ahead."""
        up_bytes = self.payload_estimate(schema, shared_seed)
        self._policies.clear()
        self._ahead.forget()
        backend = self._ctx.backend
        ahead = ahead_of is not None and getattr(backend, "run_here", None) is not None
        ahead_batch = self._ahead.batch
        queued: list[Arrival] = []
        self.downlink.prune()
        pull = self.downlink.pull
        t_open = self.time.t
        # First every selected device is handed its task and downloads; then their device
        # models run (on an idle worker from the first full batch on, the rest here and
        # there: see DeviceRuns); then, in the same order, each one's fate and arrival.
        # No step reads what a later one of another device writes, so this is the order
        # of doing each device whole.
        picked: list[tuple[Tier, str, TaskAssignment, LiveDevice, str, float, int, tuple[float, float]]] = []
        runs = DeviceRuns(getattr(backend, "run_devices", None) if self.governor else None,
                          self._ctx.pop.kind_params())
        for li, leaf in enumerate(self.leaves):
            if leaf.cr is None:
                continue
            # One stream per tier and round, drawn in assignment order: same seed, same fates.
            # Two doubles per dispatched device, all drawn at once: Generator.random fills
            # an array from the stream in order, so row j is the j-th device's pair.
            nodes = list(leaf.cr.assignments)
            fates = np.random.default_rng([self.seed, leaf.cr.task.round, leaf.cr.task.attempt, li, 0xD0]
                                          ).random((len(nodes), 2)).tolist()
            drawn = 0
            # Only selected devices get a task; the others' polls would come back Idle
            # (every eligible device was already a candidate, so none can fill in).
            for node in nodes:
                if node not in live:
                    continue
                a = leaf.coord.assign(node)
                if a is None:
                    continue
                dev = live[node]
                part = dev.index
                down_bytes, start = pull(leaf, part, blob, starts)
                leaf.coord.count_bytes_down(down_bytes)
                if leaf.cr.secure is not None or leaf.cr.tree is not None:
                    # Its side of the tier's (or the tree's) session: the key stages run while it trains.
                    self._secure.enroll(leaf, node, a)
                stats.selected += 1
                down_s = dev.profile.latency_s + down_bytes * 8 / (dev.profile.down_mbps * 1e6)
                dev.clock.advance(max(0.0, t_open + down_s - dev.clock.monotonic()))
                planned = self.planned_steps(part)
                picked.append((leaf, node, a, dev, start, down_s, planned, fates[drawn]))
                drawn += 1
                runs.add(self.device_plan(dev, planned, a.deadline_unix - self.time.wall() - down_s))
        started = time.perf_counter()
        trained = runs.results()
        self.device_seconds = time.perf_counter() - started
        arrivals: list[Arrival] = []
        for (leaf, node, a, dev, start, down_s, planned, (fate, when)), (train_s, steps) in zip(
                picked, trained, strict=True):
            up_s = dev.profile.latency_s + up_bytes * 8 / (dev.profile.up_mbps * 1e6)
            finish = t_open + down_s + train_s + up_s
            if steps == 0:
                stats.stopped_by_governor += 1
                continue
            if fate < dev.profile.dropout:
                stats.vanished += 1
                leaf.last_silence = max(leaf.last_silence, t_open + when * (finish - t_open))
                continue
            if steps < planned:
                stats.stopped_early += 1
            leaf.waiting += 1
            leaf.working.add(node)
            arrivals.append(Arrival(finish, dev.index, node, leaf, a, steps if steps < planned else None, start,
                                    now_s=t_open + down_s))
            if ahead:
                queued.append(arrivals[-1])
                if len(queued) >= ahead_batch:
                    assert ahead_of is not None
                    queued = self._ahead.send(queued, ahead_of, starts)
        arrivals.sort(key=lambda x: (x.finish, x.partition))
        return arrivals

    def planned_steps(self, partition: int) -> int:
        tc = self.run.train
        if tc.steps is not None:
            return tc.steps
        n = self._size_of[partition]
        return tc.epochs * max(1, -(-n // tc.batch_size))

    def payload_estimate(self, schema: tuple, shared_seed: int) -> int:
        # The codec's size for a zero update: exact for fixed-size codecs, close for the rest.
        zeros = {s.name: np.zeros(s.shape, np.float32) for s in schema}
        payloads, _ = encode_update(self._ctx.codec, zeros, np.random.default_rng(0), None, shared_seed)
        return len(pack(list(payloads.values()))[0])

    def _policy(self, planned: int, time_left_s: float) -> DevicePolicy:
        """A device's governor policy for this round: its eligibility rules, its planned
        steps and the time it has. Devices of one kind share a link and so a time budget:
        their (frozen) policies are one object, built once a round."""
        key = (planned, max(time_left_s, 1e-3))
        policy = self._policies.get(key)
        if policy is None:
            if len(self._policies) >= 256:
                self._policies.clear()
            policy = self._policies[key] = DevicePolicy(
                eligibility=self.run.eligibility, budget=RoundBudget(max_steps=key[0], time_s=key[1]))
        return policy

    def device_plan(self, dev: LiveDevice, planned: int, time_left_s: float
                    ) -> tuple[LiveDevice, DevicePolicy | None, int, int]:
        """(device, policy, planned steps, examples a step) for a device that trains
        ``planned`` steps with ``time_left_s`` seconds before its deadline."""
        n = self._size_of[dev.index]
        per_step = min(self.run.train.batch_size, max(n, 1))
        return dev, self._policy(planned, time_left_s) if self.governor else None, planned, per_step
