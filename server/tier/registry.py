"""The nodes a tier knows: who joined, with which credential, when each was last seen,
and what each reported (device state; an aggregator's pool). A tier selects from it and
the sweep drops the silent; nothing here knows about rounds."""

from __future__ import annotations

import uuid
from collections.abc import Callable
from dataclasses import dataclass, field

from orchard.config import EligibilityConfig, RunConfig
from orchard.errors import JOIN_FIRST, UnknownNodeError
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

    def __init__(self, node_timeout_s: float, monotonic: Callable[[], float]) -> None:
        self.timeout = node_timeout_s
        self._mono = monotonic
        self.children: dict[str, Child] = {}

    def join(self, node_id: str, role: Role, token_hash: str, device: DeviceState) -> str:
        node_id = node_id or f"{role.value}-{uuid.uuid4().hex[:12]}"
        prev = self.children.get(node_id)
        if prev is not None and prev.token_hash != token_hash:
            # A node id is bound to the credential that first claimed it.
            raise UnknownNodeError(f"node id {node_id!r} is registered with another token; pick another id")
        self.children[node_id] = self._new(node_id, role, token_hash, device)
        return node_id

    def register(self, node_id: str, role: Role, token_hash: str) -> Child:
        """A node known from a journal (a restarted root), unless it joined again already;
        with a fresh timeout to come back in."""
        c = self.children.get(node_id)
        if c is None:
            c = self.children[node_id] = self._new(node_id, role, token_hash, DeviceState())
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
        if device is not None:
            c.device = device
        if c.role is Role.AGGREGATOR:
            if pool_size is not None:
                c.pool_size = max(0, int(pool_size))
            if pool_eligible is not None:
                c.pool_eligible = max(0, min(int(pool_eligible), c.pool_size))
        return c

    def live(self, c: Child) -> bool:
        return self._mono() - c.last_seen <= self.timeout

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
                elig += int(cfg is None or c.eligible(cfg.eligibility))
        return size, elig

    def expire(self, keep: Callable[[str], bool]) -> None:
        """Forget nodes unseen for a long time (10 x timeout), but those ``keep`` holds."""
        now = self._mono()
        for nid in [n for n, c in self.children.items() if now - c.last_seen > 10 * self.timeout]:
            if not keep(nid):
                del self.children[nid]

    def leave(self, node_id: str) -> None:
        self.children.pop(node_id, None)
