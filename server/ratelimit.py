"""Rate limits for hostile callers of Join: token buckets per peer address and per
credential.

Two things are limited, each per peer host (the caller's IP address, without its port)
and per credential (the sha256 of the bearer token presented, a token id's source):

- *failed joins*: every Join refused for its credential takes a token from the peer's
  and the credential's bucket of failures;
- *joins that never poll*: every Join takes a token from the peer's and the credential's
  bucket of unpolled joins, and the node's first poll gives it back. A device that joins
  and polls costs nothing; a ghost that joins and never polls spends the bucket.

While either bucket of a peer or credential is empty, its Joins are refused before the
credential is checked (at an aggregator, before the root is asked), with
RESOURCE_EXHAUSTED and the seconds until a token is back. A node the tier already knows,
rejoining with the credential it registered with, is never refused: an enrolled device
behind the same address as an attacker keeps working. Buckets are kept for the most
recent ``max_keys`` keys each (a key forgotten comes back with a full bucket).

The clock is passed in (``monotonic``), so tests drive time by hand.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from orchard.errors import RateLimitedError


@dataclass
class TokenBucket:
    """``burst`` tokens at most, refilled at ``rate`` per second."""

    rate: float
    burst: float
    tokens: float
    stamp: float

    def _refill(self, now: float) -> None:
        self.tokens = min(self.burst, self.tokens + max(0.0, now - self.stamp) * self.rate)
        self.stamp = now

    def wait(self, now: float) -> float:
        """Seconds until a token is there (0: one is)."""
        self._refill(now)
        if self.tokens >= 1.0:
            return 0.0
        return (1.0 - self.tokens) / self.rate if self.rate > 0 else math.inf

    def take(self, now: float) -> None:
        self._refill(now)
        self.tokens -= 1.0  # may go below 0: a burst past the limit waits the longer

    def give(self, now: float) -> None:
        self._refill(now)
        self.tokens = min(self.burst, self.tokens + 1.0)


class Buckets:
    """A token bucket per key, for the ``max_keys`` most recently used keys."""

    def __init__(self, rate: float, burst: float, monotonic: Callable[[], float], max_keys: int = 10_000) -> None:
        self.rate, self.burst, self._mono, self.max_keys = rate, burst, monotonic, max_keys
        self._b: OrderedDict[str, TokenBucket] = OrderedDict()

    def _get(self, key: str) -> TokenBucket:
        b = self._b.get(key)
        if b is None:
            b = self._b[key] = TokenBucket(self.rate, self.burst, self.burst, self._mono())
            while len(self._b) > self.max_keys:
                self._b.popitem(last=False)
        else:
            self._b.move_to_end(key)
        return b

    def wait(self, key: str) -> float:
        b = self._b.get(key)
        return 0.0 if b is None else b.wait(self._mono())

    def take(self, key: str) -> None:
        self._get(key).take(self._mono())

    def give(self, key: str) -> None:
        b = self._b.get(key)
        if b is not None:
            b.give(self._mono())


def peer_host(peer: str) -> str:
    """The caller's address without its port, from gRPC's ``context.peer()``
    (``ipv4:10.0.0.7:5123``, ``ipv6:[::1]:5123``, ``unix:/path``)."""
    kind, _, rest = peer.partition(":")
    if kind == "ipv4":
        return rest.rsplit(":", 1)[0]
    if kind == "ipv6":
        return rest.rsplit(":", 1)[0].strip("[]")
    return peer


class JoinLimiter:
    """The limits on Join (see the module's docstring). ``failures_*``: failed joins;
    ``unpolled_*``: joins whose node has not polled yet."""

    def __init__(self, monotonic: Callable[[], float], failures_burst: float = 10, failures_per_s: float = 0.2,
                 unpolled_burst: float = 50, unpolled_per_s: float = 0.5, max_keys: int = 10_000) -> None:
        self.failures = Buckets(failures_per_s, failures_burst, monotonic, max_keys)
        self.unpolled = Buckets(unpolled_per_s, unpolled_burst, monotonic, max_keys)
        self._pending: OrderedDict[str, tuple[str, str]] = OrderedDict()  # node id -> (peer, credential)
        self._max_pending = max_keys

    def check(self, peer: str, credential: str) -> None:
        """Raise ``RateLimitedError`` if a Join from ``peer`` with ``credential`` (its
        hash) must wait."""
        for what, buckets in (("failed joins", self.failures), ("joins that never polled", self.unpolled)):
            for who, key in (("this address", "p:" + peer), ("this credential", "c:" + credential)):
                wait = buckets.wait(key)
                if wait > 0:
                    raise RateLimitedError(f"too many {what} from {who}", wait)

    def failed(self, peer: str, credential: str) -> None:
        self.failures.take("p:" + peer)
        self.failures.take("c:" + credential)

    def joined(self, node_id: str, peer: str, credential: str) -> None:
        """A Join was accepted: it owes a token until ``node_id`` polls. A node that joins
        again before it polled owes only once."""
        if node_id in self._pending:
            return
        self.unpolled.take("p:" + peer)
        self.unpolled.take("c:" + credential)
        self._pending[node_id] = (peer, credential)
        while len(self._pending) > self._max_pending:
            self._pending.popitem(last=False)

    def polled(self, node_id: str) -> None:
        got = self._pending.pop(node_id, None)
        if got is not None:
            self.unpolled.give("p:" + got[0])
            self.unpolled.give("c:" + got[1])
