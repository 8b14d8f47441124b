"""Join's rate limits, on a clock driven by hand: failed joins and joins that never poll
spend a bucket per peer address and per credential; a join whose node polls gives its
token back; a refusal says when to come back."""

from __future__ import annotations

import pytest

from orchard.errors import RateLimitedError
from orchard.server.ratelimit import Buckets, JoinLimiter, TokenBucket, peer_host
from tests.server.clock import Clock


def test_a_bucket_gives_its_burst_then_its_rate() -> None:
    b = TokenBucket(rate=2.0, burst=3, tokens=3, stamp=0.0)
    for _ in range(3):
        assert b.wait(0.0) == 0.0
        b.take(0.0)
    assert b.wait(0.0) == pytest.approx(0.5)
    assert b.wait(0.5) == 0.0  # one back after 1 / rate
    b.take(0.5)
    b.give(0.5)
    b.give(0.5)
    assert b.tokens <= 3  # never above its burst
    b.give(100.0)
    assert b.tokens == 3


def test_buckets_keep_the_most_recent_keys_only() -> None:
    clock = Clock(50.0)
    bs = Buckets(rate=0.1, burst=1, monotonic=clock, max_keys=2)
    for k in ("a", "b", "c"):
        bs.take(k)
    assert bs.wait("a") == 0.0  # forgotten: a full bucket again
    assert bs.wait("c") > 0 and bs.wait("b") > 0


@pytest.mark.parametrize("peer, host", [("ipv4:10.0.0.7:5123", "10.0.0.7"), ("ipv6:[::1]:5123", "::1"),
                                        ("unix:/tmp/s", "unix:/tmp/s")])
def test_peer_host_drops_the_port(peer: str, host: str) -> None:
    assert peer_host(peer) == host


def test_failed_joins_from_one_address_are_limited_and_say_when_to_retry() -> None:
    clock = Clock(50.0)
    lim = JoinLimiter(clock, failures_burst=3, failures_per_s=0.5)
    for k in range(3):
        lim.check("10.0.0.9", f"bad-{k}")
        lim.failed("10.0.0.9", f"bad-{k}")
    with pytest.raises(RateLimitedError, match="failed joins from this address") as ei:
        lim.check("10.0.0.9", "bad-new")
    assert ei.value.retry_after_s == pytest.approx(2.0)
    lim.check("10.0.0.10", "good")  # another address: its own bucket
    clock.t += 2.0
    lim.check("10.0.0.9", "bad-new")


def test_one_bad_credential_is_limited_from_any_address() -> None:
    clock = Clock(50.0)
    lim = JoinLimiter(clock, failures_burst=2, failures_per_s=0.1)
    for k in range(2):
        lim.failed(f"10.0.1.{k}", "revoked")
    with pytest.raises(RateLimitedError, match="this credential"):
        lim.check("10.0.2.1", "revoked")


def test_joins_that_never_poll_spend_the_bucket_and_a_poll_gives_the_token_back() -> None:
    clock = Clock(50.0)
    lim = JoinLimiter(clock, unpolled_burst=3, unpolled_per_s=0.5)
    for k in range(100):  # a device that joins and polls costs nothing
        lim.check("10.0.0.1", "shared")
        lim.joined(f"dev-{k}", "10.0.0.1", "shared")
        lim.polled(f"dev-{k}")
    for k in range(3):
        lim.check("10.0.0.1", "shared")
        lim.joined(f"ghost-{k}", "10.0.0.1", "shared")
    lim.joined("ghost-0", "10.0.0.1", "shared")  # the same node again owes once
    with pytest.raises(RateLimitedError, match="joins that never polled"):
        lim.check("10.0.0.1", "shared")
    lim.polled("ghost-1")  # it polls after all: its token comes back
    lim.check("10.0.0.1", "shared")
