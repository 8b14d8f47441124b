"""Hostile callers of a TLS root, over real gRPC: Join's fields are bounded and nothing
oversized reaches the store; a heartbeat's numbers are checked; bad-token joins and joins
that never poll are rate-limited per address and per credential, with a retry hint,
while an enrolled device keeps joining and polling; the nodes table stays bounded."""

from __future__ import annotations

import asyncio
import sqlite3
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from fed_harness import FAST

from orchard.config import ServerConfig
from orchard.link import FleetLink, LinkConfig
from orchard.server.app import TierHandle, start_root
from orchard.server.store import SQLiteStore
from orchard.typing import Role
from orchard.v1 import orchard_pb2 as pb
from orchard.v1 import orchard_pb2_grpc as pbg

LIMITS = FAST.model_copy(update={"join_failures_burst": 5, "join_failures_per_s": 0.05, "unpolled_joins_burst": 5,
                                 "unpolled_joins_per_s": 0.05})


class Root:
    """A TLS root on its own event loop, for synchronous stubs."""

    def __init__(self, data: Path, cfg: ServerConfig) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.data = data
        self.root: TierHandle = self.call(start_root(data, server_cfg=cfg, start_grace_s=0.2))
        self.ca = Path(self.root.ca_cert)  # type: ignore[arg-type]
        self.channels: list[grpc.Channel] = []

    def call(self, coro, timeout: float = 60.0):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def token(self, role: str = "client") -> str:
        st = SQLiteStore(self.data / "orchard.db")
        try:
            return st.issue_token(role)
        finally:
            st.close()

    def stub(self) -> pbg.FleetStub:
        ch = grpc.secure_channel(self.root.address, grpc.ssl_channel_credentials(self.ca.read_bytes()))
        self.channels.append(ch)
        return pbg.FleetStub(ch)

    def node_rows(self) -> int:
        with sqlite3.connect(self.data / "orchard.db") as db:
            return int(db.execute("SELECT COUNT(*) FROM nodes").fetchone()[0])

    def stop(self) -> None:
        for ch in self.channels:
            ch.close()
        self.call(self.root.stop(0.1))
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)


@pytest.fixture()
def root(tmp_path: Path) -> Iterator[Root]:
    r = Root(tmp_path / "root", LIMITS)
    yield r
    r.stop()


def _meta(token: str) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {token}"),)


def _refused(call, code: grpc.StatusCode, match: str) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as ei:
        call()
    assert ei.value.code() == code, ei.value.details()
    assert match in (ei.value.details() or ""), ei.value.details()
    return ei.value


def test_join_bounds_every_field_and_stores_nothing_oversized(root: Root) -> None:
    stub, meta = root.stub(), _meta(root.token())
    size = (root.data / "orchard.db").stat().st_size
    _refused(lambda: stub.Join(pb.JoinRequest(node_id="x" * (1 << 20), role="client"), metadata=meta),
             grpc.StatusCode.INVALID_ARGUMENT, "node_id is 1048576 characters; at most 128")
    caps = {f"k{i}": "v" * 100_000 for i in range(39)}  # ~3.9 MB
    _refused(lambda: stub.Join(pb.JoinRequest(node_id="n1", role="client", capabilities=caps), metadata=meta),
             grpc.StatusCode.INVALID_ARGUMENT, "capabilities has 39 entries; at most 32")
    _refused(lambda: stub.Join(pb.JoinRequest(node_id="n1", role="client", capabilities={"k": "v" * 600}),
                               metadata=meta), grpc.StatusCode.INVALID_ARGUMENT, "at most 512")
    _refused(lambda: stub.Join(pb.JoinRequest(node_id="bad id!", role="client"), metadata=meta),
             grpc.StatusCode.INVALID_ARGUMENT, "outside [A-Za-z0-9._:@-]")
    assert root.node_rows() == 0 and "n1" not in root.root.coordinator.children
    assert (root.data / "orchard.db").stat().st_size < size + (64 << 10)
    # A heartbeat's numbers: NaN, inf, out of range are refused; the node's state is untouched.
    assert stub.Join(pb.JoinRequest(node_id="n1", role="client"), metadata=meta).node_id == "n1"
    for dev, hb in ((pb.DeviceState(battery_percent=float("nan")), {}), (pb.DeviceState(temperature_c=float("inf")), {}),
                    (pb.DeviceState(extra={"x": float("nan")}), {}), (pb.DeviceState(), {"progress": float("nan")}),
                    (pb.DeviceState(battery_percent=250.0), {})):
        _refused(lambda d=dev, h=hb: stub.Heartbeat(pb.HeartbeatRequest(node_id="n1", device=d, **h), metadata=meta),
                 grpc.StatusCode.INVALID_ARGUMENT, "expected a finite number in")
    assert root.root.coordinator.children["n1"].device.battery_percent is None


def test_bad_token_bursts_are_limited_while_an_enrolled_device_keeps_working(root: Root, tmp_path: Path) -> None:
    async def enrolled() -> FleetLink:
        link = FleetLink(LinkConfig(target=root.root.address, role=Role.CLIENT, token=root.token(), ca_cert=root.ca,
                                    node_id="phone-1", identity_dir=tmp_path / "phone", max_backoff_s=1.0))
        await link.join()
        await link.poll(wait_s=0)
        return link

    phone = root.call(enrolled())
    stub = root.stub()
    for k in range(5):
        _refused(lambda k=k: stub.Join(pb.JoinRequest(node_id=f"intruder-{k}", role="client"),
                                       metadata=_meta(f"orc_guess-{k}")), grpc.StatusCode.UNAUTHENTICATED, "")
    err = _refused(lambda: stub.Join(pb.JoinRequest(node_id="intruder-9", role="client"), metadata=_meta("orc_guess-9")),
                   grpc.StatusCode.RESOURCE_EXHAUSTED, "too many failed joins from this address; retry in")
    trailers = dict(err.trailing_metadata() or ())  # type: ignore[attr-defined]
    assert float(trailers["retry-after-s"]) > 1.0
    # The enrolled device, on the same address: it joins again and polls, untouched.

    async def again() -> None:
        await phone.join()
        await phone.poll(wait_s=0)
        await phone.close()

    root.call(again())
    assert not any(n.startswith("intruder") for n in root.root.coordinator.children)


def test_joins_that_never_poll_are_limited_and_a_poll_gives_the_slot_back(root: Root) -> None:
    stub, meta = root.stub(), _meta(root.token())
    for k in range(5):
        stub.Join(pb.JoinRequest(node_id=f"ghost-{k}", role="client"), metadata=meta)
    _refused(lambda: stub.Join(pb.JoinRequest(node_id="ghost-5", role="client"), metadata=meta),
             grpc.StatusCode.RESOURCE_EXHAUSTED, "too many joins that never polled")
    stub.Poll(pb.PollRequest(node_id="ghost-0", wait_s=0), metadata=meta)
    assert stub.Join(pb.JoinRequest(node_id="ghost-5", role="client"), metadata=meta).node_id == "ghost-5"


def test_many_joins_do_not_grow_the_nodes_table_without_bound(tmp_path: Path) -> None:
    # Rows of nodes not seen for 10 node timeouts (here 0.5 s) go at the next join.
    r = Root(tmp_path / "root", FAST.model_copy(update={"node_timeout_s": 0.05, "heartbeat_s": 0.05}))
    try:
        stub, meta = r.stub(), _meta(r.token())
        for k in range(60):
            stub.Join(pb.JoinRequest(node_id=f"dev-{k}", role="client", capabilities={"k": "v" * 500}),
                      metadata=meta)
            stub.Poll(pb.PollRequest(node_id=f"dev-{k}", wait_s=0), metadata=meta)
        assert r.node_rows() >= 1
        time.sleep(0.6)
        stub.Join(pb.JoinRequest(node_id="last", role="client"), metadata=meta)
        assert r.node_rows() == 1
    finally:
        r.stop()
