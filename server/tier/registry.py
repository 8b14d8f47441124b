"""The nodes a tier knows: who joined, with which credential, when each was last seen,
and what each reported (device state; an aggregator's pool). A tier selects from it and
the sweep drops the silent; nothing here knows about rounds.

Two rules decide who takes part:

- *live*: a node with a long poll outstanding, or seen (any call) within the node
  timeout, and not known to be gone. A long poll that ends by cancellation (the peer
  disconnected: gRPC cancels its calls when the connection drops, as for a process killed
  with -9) marks the node gone at once, until it calls again.
- *waiting for work*: a live node that has polled since it joined and has a long poll
  outstanding now, or ended one (or delivered an upload) within ``ready_s``: a node
  between two polls. Only such nodes are selected and counted as eligible; a node that
  joined and never polled (a ghost) is never, and is forgotten after one timeout. A node
  joined in-process (the simulator's check-in) waits for work from its join.
"""

from __future__ import annotations

import math
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field

from orchard.config import EligibilityConfig, RunConfig
from orchard.errors import JOIN_FIRST, UnknownNodeError
from orchard.server.participation import ParticipationBound
from orchard.server.selection import device_eligible
from orchard.typing import DeviceState, Role


@dataclass
class Child:
    node_id: str
    role: Role
    token_hash: str
    device: DeviceState = field(default_factory=DeviceState)
    last_seen: float = 0.0  # monotonic seconds
    pool_size: int = 1
    pool_eligible: int = 1
    polls: int = 0  # long polls outstanding now
    polled: bool = False  # has polled since it joined
    ready_until: float = -math.inf  # waits for work until then (monotonic), besides while polling
    gone: bool = False  # its last long poll was cancelled: the peer went away
    # device_eligible's verdict, for the state and rules it was given (a round asks twice:
    # the pool report, then selection; the state only changes when the node reports one).
    _verdict: tuple[DeviceState, EligibilityConfig, bool] | None = field(default=None, repr=False, compare=False)

    def eligible(self, rules: EligibilityConfig) -> bool:
        """Whether this node's last reported state passes ``rules`` (``device_eligible``)."""
        v = self._verdict
        if v is not None and v[0] is self.device and v[1] is rules:
            return v[2]
        ok = device_eligible(self.device, rules)[0]
        self._verdict = (self.device, rules, ok)
        return ok


class Registry:
    """A tier's children by node id (``children``: the map itself, read by the servers,
    the simulator and tests)."""

    def __init__(self, node_timeout_s: float, monotonic: Callable[[], float], ready_s: float = 5.0) -> None:
        self.timeout = node_timeout_s
        self.ready_s = ready_s
        self._mono = monotonic
        self.children: dict[str, Child] = {}
        self.participation = ParticipationBound()  # DP-FTRL's bound on who may be selected

    def join(self, node_id: str, role: Role, token_hash: str, device: DeviceState, waiting: bool = True) -> str:
        """Register a node. ``waiting``: it waits for work from now on (an in-process
        check-in); a node joined over the wire (False) waits once it polls."""
        node_id = node_id or f"{role.value}-{uuid.uuid4().hex[:12]}"
        prev = self.children.get(node_id)
        if prev is not None and prev.token_hash != token_hash:
            # A node id is bound to the credential that first claimed it.
            raise UnknownNodeError(f"node id {node_id!r} is registered with another token; pick another id")
        c = self.children[node_id] = self._new(node_id, role, token_hash, device)
        if waiting:
            c.polled, c.ready_until = True, math.inf
        elif prev is not None:  # the same node again (its credential): as waiting for work as it was
            c.polled, c.ready_until = prev.polled, prev.ready_until
        return node_id

    def register(self, node_id: str, role: Role, token_hash: str) -> Child:
        """A node known from a journal (a restarted root), unless it joined again already;
        with a fresh timeout to come back in."""
        c = self.children.get(node_id)
        if c is None:
            c = self.children[node_id] = self._new(node_id, role, token_hash, DeviceState())
            # The journal holds its task: it counts as waiting for work (to deliver it) until
            # its timeout, as if it had polled.
            c.polled, c.ready_until = True, c.last_seen + self.timeout
        return c

    def _new(self, node_id: str, role: Role, token_hash: str, device: DeviceState) -> Child:
        agg = role is Role.AGGREGATOR
        return Child(node_id, role, token_hash, device, self._mono(), pool_size=0 if agg else 1,
                     pool_eligible=0 if agg else 1)

    def child(self, node_id: str, token_hash: str | None = None) -> Child:
        c = self.children.get(node_id)
        if c is None:
            raise UnknownNodeError(f"node {node_id!r} has not joined this server (or expired); {JOIN_FIRST}")
        if token_hash is not None and c.token_hash != token_hash:
            raise UnknownNodeError(f"node {node_id!r} is registered with another token")
        return c

    def is_client(self, node_id: str) -> bool:
        c = self.children.get(node_id)
        return c is not None and c.role is Role.CLIENT

    def touch(self, node_id: str, device: DeviceState | None = None, pool_size: int | None = None,
              pool_eligible: int | None = None) -> Child:
        c = self.child(node_id)
        c.last_seen = self._mono()
        c.gone = False
        if device is not None:
            c.device = device
        if c.role is Role.AGGREGATOR:
            if pool_size is not None:
                c.pool_size = max(0, int(pool_size))
            if pool_eligible is not None:
                c.pool_eligible = max(0, min(int(pool_eligible), c.pool_size))
        return c

    def poll_started(self, c: Child) -> None:
        c.polls += 1
        c.polled = True

    def poll_ended(self, c: Child, cancelled: bool) -> None:
        """A long poll of ``c`` returned (it waits for work a moment longer: until its next
        poll) or was cancelled (its peer went away: gone until it calls again)."""
        c.polls = max(0, c.polls - 1)
        if cancelled:
            c.gone, c.ready_until = True, -math.inf
        else:
            c.last_seen = self._mono()
            c.ready_until = max(c.ready_until, c.last_seen + self.ready_s)

    def delivered(self, node_id: str) -> None:
        """``node_id`` delivered its upload: it polls for work again right away."""
        c = self.children.get(node_id)
        if c is not None and c.polled:
            c.ready_until = max(c.ready_until, self._mono() + self.ready_s)

    def live(self, c: Child) -> bool:
        return c.polls > 0 or (not c.gone and self._mono() - c.last_seen <= self.timeout)

    def waiting(self, c: Child) -> bool:
        """Whether ``c`` waits for work now (see the module's docstring)."""
        return c.polls > 0 or (c.polled and not c.gone and self._mono() <= c.ready_until)

    def selectable(self, c: Child, cfg: RunConfig | None = None) -> int:
        """How many clients ``c`` offers a round now: its eligible pool (an aggregator
        waiting for work), 1 (a client waiting for work and eligible), or 0."""
        if not self.waiting(c):
            return 0
        if c.role is Role.AGGREGATOR:
            return c.pool_eligible
        return int(self.may_select(c, cfg))

    def may_select(self, c: Child, cfg: RunConfig | None) -> bool:
        """Whether client ``c`` may be selected: eligible by its reported state, and within
        the run's participation bound (DP-FTRL; ``orchard.server.participation``)."""
        return (cfg is None or c.eligible(cfg.eligibility)) and self.participation.allows(c.node_id)

    def assigned(self, node_id: str) -> bool:
        """``node_id`` was handed an assignment: a client's counts against the participation
        bound. Whether it is a client."""
        client = self.children[node_id].role is Role.CLIENT
        if client:
            self.participation.record(node_id)
        return client

    def capacity(self, cfg: RunConfig | None = None) -> tuple[int, int]:
        """(live clients below this tier, clients below it that a round may select now)."""
        size = elig = 0
        for c in self.children.values():
            if not self.live(c):
                continue
            size += c.pool_size if c.role is Role.AGGREGATOR else 1
            elig += self.selectable(c, cfg)
        return size, elig

    def expire(self, keep: Callable[[str], bool]) -> list[str]:
        """Forget nodes unseen for a long time (10 x timeout; one timeout for a node that
        never polled), but those ``keep`` holds. Returns the ids forgotten."""
        now = self._mono()
        gone = [n for n, c in self.children.items() if c.polls == 0
                and now - c.last_seen > (10 if c.polled else 1) * self.timeout and not keep(n)]
        for nid in gone:
            del self.children[nid]
        return gone

    def leave(self, node_id: str) -> None:
        self.children.pop(node_id, None)
