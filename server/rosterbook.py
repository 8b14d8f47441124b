"""The root's signed roster of the client devices it admits, one per epoch
(:mod:`orchard.secure_agg.roster`).

A client device that is enrolled and not revoked is in the roster, with the identity key
the root certified at enrollment. The root signs the roster with its certificate key
(the one that signs device certificates) and hands each client its roster credential:
the signed roster with the client's Merkle path. In a SecAgg+ session a client vouches
for its keys with that credential, and its neighbours check one signature per epoch and
a path of ceil(log2 size) hashes per neighbour, where certificates cost one signature
per neighbour.

Epochs: the root looks at its store at most every ``refresh_s`` seconds (5 s, the time
an aggregator keeps the root's answer about a node) when asked for a credential, and
signs a new roster when the admitted devices changed: an enrollment, a revocation
(written into the store by this process or by ``orchard tokens revoke``), a new key. A
new epoch is the wall clock's second, and more than the last one this root signed, so
epochs grow across restarts too (unless the clock goes back). A client refuses a roster
older than the newest it held before a session (``orchard.client.secure``), so a device
revoked since cannot take part with an older roster's path.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from orchard.secure_agg.roster import SignedRoster, build_roster
from orchard.server.store import Store
from orchard.typing import Role


class RosterBook:
    """The root's current roster and the credentials of its members."""

    def __init__(self, store: Store, clock: Callable[[], float] = time.time, refresh_s: float = 5.0) -> None:
        self.store = store
        self._clock = clock
        self.refresh_s = refresh_s
        self._checked = -float("inf")
        self._members: dict[str, bytes] = {}
        self._credentials: dict[str, bytes] = {}
        self.roster: SignedRoster | None = None

    @property
    def epoch(self) -> int:
        return self.roster.epoch if self.roster is not None else 0

    def changed(self) -> None:
        """The admitted devices may have changed (this root enrolled one): look again at
        the next request."""
        self._checked = -float("inf")

    def credential(self, node_id: str) -> bytes:
        """``node_id``'s roster credential of the current epoch; b"" for a node that is
        not an admitted client (an aggregator, a revoked or unknown node)."""
        now = self._clock()
        if now - self._checked >= self.refresh_s:
            self._checked = now
            self._refresh(now)
        return self._credentials.get(node_id, b"")

    def _refresh(self, now: float) -> None:
        members = {d.node_id: d.public_key for d in self.store.list_devices()
                   if d.role == Role.CLIENT.value and not d.revoked}
        if members == self._members:
            return
        self._members = members
        if not members:
            self.roster, self._credentials = None, {}
            return
        self.roster, self._credentials = build_roster(self.store.signing_key(), max(self.epoch + 1, int(now)),
                                                      members)
