"""TLS by default, enrollment tokens, admin token: a call without valid credentials gets
UNAUTHENTICATED and changes nothing."""

from __future__ import annotations

import asyncio
from pathlib import Path

import grpc
import pytest
from fed_harness import FAST, BackgroundRoot, Federation, add_clients, start_run, wait_status

from orchard.client.secure import DeviceTrust
from orchard.config import CohortConfig, RunConfig, SecureAggregationConfig
from orchard.ops import ControlClient
from orchard.server.app import start_aggregator, start_root
from orchard.server.store import SQLiteStore
from orchard.server.tls import TlsPaths
from orchard.v1 import orchard_pb2 as pb
from orchard.v1 import orchard_pb2_grpc as pbg


def _issue(data_dir: Path, role: str, n: int = 1) -> list[str]:
    st = SQLiteStore(data_dir / "orchard.db")
    try:
        return [st.issue_token(role) for _ in range(n)]
    finally:
        st.close()


def test_tls_tree_with_tokens(tmp_path: Path) -> None:
    async def main():
        data = tmp_path / "root"
        root = await start_root(data, server_cfg=FAST, start_grace_s=0.2)
        assert root.ca_cert is not None and (data / "admin.token").stat().st_mode & 0o777 == 0o600
        paths = TlsPaths.in_dir(data / "tls")
        agg_tok = _issue(data, "aggregator")[0]
        client_toks = _issue(data, "client", 3)
        agg = await start_aggregator(root.address, token=agg_tok, ca_cert=paths.ca_cert, tls_dir=data / "tls",
                                     server_cfg=FAST)
        fed = Federation(root, [agg])
        for i, tok in enumerate(client_toks):
            await add_clients(fed, agg.address, [i], 3, token=tok, ca=paths.ca_cert, insecure=False)
        await start_run(root, RunConfig(task="digits", rounds=1, cohort=CohortConfig(target=3, over_selection=1.0)),
                        insecure=False)
        st = await wait_status(root, lambda s: s.get("status") in ("completed", "failed"), 60)
        nodes = set(root.coordinator.children)
        await fed.stop()
        return st, nodes, agg.coordinator.name

    st, nodes, agg_name = asyncio.run(main())
    assert st["status"] == "completed" and st["rounds"][0]["participants"] == 3, st
    assert nodes == {agg_name}


def test_enrolled_clients_run_the_active_secure_session(tmp_path: Path) -> None:
    """Clients enrolled with tokens hold the root's certificate of their identity keys and
    get their roster credential with the session's setup: the secure session is the active
    protocol, each client checking its neighbours' keys against the root's signed roster,
    and the round completes with every client in it."""
    async def main():
        data = tmp_path / "root"
        root = await start_root(data, server_cfg=FAST, start_grace_s=0.2)
        paths = TlsPaths.in_dir(data / "tls")
        agg = await start_aggregator(root.address, token=_issue(data, "aggregator")[0], ca_cert=paths.ca_cert,
                                     tls_dir=data / "tls", server_cfg=FAST)
        fed = Federation(root, [agg])
        for i, tok in enumerate(_issue(data, "client", 3)):
            await add_clients(fed, agg.address, [i], 3, token=tok, ca=paths.ca_cert, insecure=False)
        run = RunConfig(task="digits", rounds=1, cohort=CohortConfig(target=3, over_selection=1.0),
                        secure_aggregation=SecureAggregationConfig(enabled=True))
        await start_run(root, run, insecure=False)
        st = await wait_status(root, lambda s: s.get("status") in ("completed", "failed"), 90)
        trust = [DeviceTrust.of(rt.link.identity) for rt in fed.clients]
        rosters = [rt.rosters for rt in fed.clients]
        await fed.stop()
        return st, trust, rosters

    st, trust, rosters = asyncio.run(main())
    assert st["status"] == "completed" and st["rounds"][0]["participants"] == 3, st
    assert all(t.identity.certificate and t.policy.root_public_key for t in trust)
    # Each client vouched for its keys with its credential in the root's signed roster,
    # which the aggregator passed on, and checked the roster's signature once.
    assert all(r is not None and r.newest_epoch > 0 and r.cache.signatures_checked == 1 for r in rosters), rosters


@pytest.fixture()
def tls_root(tmp_path: Path):
    srv = BackgroundRoot(tmp_path / "root", start_grace_s=5.0, insecure=False)
    yield srv.root, tmp_path / "root"
    srv.stop()


def _fleet(root, token: str | None) -> tuple[grpc.Channel, pbg.FleetStub, tuple]:
    creds = grpc.ssl_channel_credentials(root_certificates=Path(root.ca_cert).read_bytes())
    ch = grpc.secure_channel(root.address, creds)
    meta = (("authorization", f"Bearer {token}"),) if token else ()
    return ch, pbg.FleetStub(ch), meta


@pytest.mark.parametrize("token", [None, "orc_not-a-real-token"])
def test_join_without_valid_token_is_refused_and_changes_nothing(tls_root, token) -> None:
    root, _ = tls_root
    ch, stub, meta = _fleet(root, token)
    with pytest.raises(grpc.RpcError) as ei:
        stub.Join(pb.JoinRequest(node_id="intruder", role="client"), metadata=meta)
    assert ei.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert "intruder" not in root.coordinator.children
    with pytest.raises(grpc.RpcError) as ei:
        stub.Poll(pb.PollRequest(node_id="intruder"), metadata=meta)
    assert ei.value.code() == grpc.StatusCode.UNAUTHENTICATED
    ch.close()


def test_token_role_is_enforced(tls_root) -> None:
    root, data = tls_root
    tok = _issue(data, "client")[0]
    ch, stub, meta = _fleet(root, tok)
    with pytest.raises(grpc.RpcError) as ei:
        stub.Join(pb.JoinRequest(node_id="sneaky", role="aggregator"), metadata=meta)
    assert ei.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert "a client's enrollment token, not an aggregator's" in ei.value.details()
    assert stub.Join(pb.JoinRequest(node_id="honest", role="client"), metadata=meta).node_id == "honest"
    # Another token cannot act as that node.
    other = _issue(data, "client")[0]
    ch2, stub2, meta2 = _fleet(root, other)
    with pytest.raises(grpc.RpcError) as ei:
        stub2.Poll(pb.PollRequest(node_id="honest", wait_s=0), metadata=meta2)
    assert ei.value.code() == grpc.StatusCode.NOT_FOUND
    ch.close()
    ch2.close()


def test_only_an_aggregator_relays_secure_aggregation(tls_root) -> None:
    """Scope "tree": a roster report or a relayed exchange must come from an aggregator; a
    client that tries either is refused before the round is looked at."""
    root, data = tls_root
    client_tok, agg_tok = _issue(data, "client")[0], _issue(data, "aggregator")[0]
    ch, stub, meta = _fleet(root, client_tok)
    assert stub.Join(pb.JoinRequest(node_id="c", role="client"), metadata=meta).node_id == "c"
    task = {"node_id": "c", "run_id": "r", "round": 1, "attempt": 0, "task_id": "t"}
    for req in (pb.SecAggRequest(**task, client_id="someone-else", wait_s=0),
                pb.SecAggRequest(**task, roster=pb.SecAggRoster(nodes=["c"], tiers=["c"]))):
        with pytest.raises(grpc.RpcError) as ei:
            stub.SecAgg(req, metadata=meta)
        assert ei.value.code() == grpc.StatusCode.PERMISSION_DENIED and "not an aggregator" in ei.value.details()
    # An aggregator gets as far as the round: none is open.
    ch2, stub2, meta2 = _fleet(root, agg_tok)
    assert stub2.Join(pb.JoinRequest(node_id="a", role="aggregator"), metadata=meta2).node_id == "a"
    with pytest.raises(grpc.RpcError) as ei:
        stub2.SecAgg(pb.SecAggRequest(**{**task, "node_id": "a"}, client_id="c", wait_s=0), metadata=meta2)
    assert ei.value.code() == grpc.StatusCode.FAILED_PRECONDITION and "no round is open" in ei.value.details()
    ch.close()
    ch2.close()


def test_revoked_token_is_refused(tls_root) -> None:
    root, data = tls_root
    tok = _issue(data, "client")[0]
    st = SQLiteStore(data / "orchard.db")
    from orchard.server.store import hash_token

    assert st.revoke_token(hash_token(tok))
    st.close()
    ch, stub, meta = _fleet(root, tok)
    with pytest.raises(grpc.RpcError) as ei:
        stub.Join(pb.JoinRequest(node_id="x", role="client"), metadata=meta)
    assert ei.value.code() == grpc.StatusCode.UNAUTHENTICATED
    ch.close()


def test_control_needs_admin_token(tls_root) -> None:
    root, data = tls_root
    with ControlClient(root.address, admin_token="wrong", ca_cert=root.ca_cert) as ctl, \
            pytest.raises(grpc.RpcError) as ei:
        ctl.status()
    assert ei.value.code() == grpc.StatusCode.UNAUTHENTICATED
    admin = (data / "admin.token").read_text().strip()
    with ControlClient(root.address, admin_token=admin, ca_cert=root.ca_cert) as ctl:
        assert ctl.status()["status"] == "idle"


def test_plaintext_client_cannot_talk_to_tls_root(tls_root) -> None:
    root, _ = tls_root
    ch = grpc.insecure_channel(root.address)
    with pytest.raises(grpc.RpcError) as ei:
        pbg.FleetStub(ch).Join(pb.JoinRequest(node_id="x", role="client"), timeout=3)
    assert ei.value.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
    ch.close()
