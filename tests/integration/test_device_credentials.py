"""Device credentials over real gRPC and TLS: a root, an aggregator under it, nodes that
enroll with device tokens, keep their identity on disk, cannot act as another node, and
are refused at every tier within seconds of a revocation at the root."""

from __future__ import annotations

import asyncio
import stat
import time
from pathlib import Path

import grpc
import pytest
from fed_harness import FAST
from typer.testing import CliRunner

from orchard.cli import app
from orchard.errors import AuthError
from orchard.identity import NodeIdentity, verify_certificate
from orchard.link import FleetLink, LinkConfig
from orchard.server.app import start_aggregator, start_root
from orchard.server.store import SQLiteStore
from orchard.typing import Role
from orchard.v1 import orchard_pb2 as pb
from orchard.v1 import orchard_pb2_grpc as pbg


def _cli(*args: str) -> str:
    r = CliRunner().invoke(app, list(args))
    assert r.exit_code == 0, r.output
    return r.output


def _device_tokens(data: Path, role: str, n: int) -> list[str]:
    return _cli("tokens", "issue", "--data-dir", str(data), "--role", role, "--count", str(n)).split()


def _link(target: str, ca: Path, token: str | None, node_id: str = "", identity: Path | None = None) -> FleetLink:
    return FleetLink(LinkConfig(target=target, role=Role.CLIENT, token=token, ca_cert=ca, node_id=node_id,
                                identity_dir=identity, max_backoff_s=1.0))


async def _refused_within(link: FleetLink, limit_s: float) -> float:
    """Seconds until ``link``'s calls are refused as unauthenticated (polling without waiting)."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < limit_s:
        try:
            await link.poll(wait_s=0)
        except AuthError:
            return time.monotonic() - t0
        await asyncio.sleep(0.2)
    raise AssertionError(f"still admitted {limit_s}s after the revocation")


def test_enroll_resume_impersonate_revoke(tmp_path: Path) -> None:
    data = tmp_path / "root"

    async def main() -> dict:
        root = await start_root(data, server_cfg=FAST, start_grace_s=0.2)
        ca = Path(root.ca_cert)  # type: ignore[arg-type]
        (agg_tok,) = _device_tokens(data, "aggregator", 1)
        t_agg, t_root, t_other = _device_tokens(data, "client", 3)
        agg = await start_aggregator(root.address, token=agg_tok, ca_cert=ca, tls_dir=data / "tls",
                                     server_cfg=FAST, node_id="agg-0")
        out: dict = {}
        try:
            # A client enrolls through the aggregator and keeps its identity owner-only.
            ident_dir = tmp_path / "phone" / "identity"
            phone = _link(agg.address, ca, t_agg, "phone-1", ident_dir)
            assert await phone.join() == "phone-1"
            out["modes"] = (stat.S_IMODE(ident_dir.stat().st_mode),
                            {f.name: stat.S_IMODE(f.stat().st_mode) for f in ident_dir.iterdir()})
            held = NodeIdentity(ident_dir).enrolled
            assert held is not None and held.credential.startswith("orc_dev_")
            cert = verify_certificate(held.certificate, held.root_public_key, "phone-1")
            assert cert.public_key == phone.identity.public_key
            assert held.root_public_key == SQLiteStore(data / "orchard.db").signing_key().public_key
            assert agg.upstream is not None and agg.upstream.link.certificate  # the aggregator enrolled too
            await phone.poll(wait_s=0)
            await phone.close()
            # A restart from the same data dir resumes the node without its (spent) token.
            phone = _link(agg.address, ca, None, "", ident_dir)
            assert await phone.join() == "phone-1" and phone.node_id == "phone-1"
            await phone.poll(wait_s=0)
            # The spent token enrolls nobody else.
            thief = _link(agg.address, ca, t_agg, "phone-9")
            with pytest.raises(AuthError, match="exchanged for node 'phone-1'"):
                await thief.join()
            await thief.close()
            # The credential cannot act as another node, at either tier.
            for target, other in ((agg.address, "phone-2"), (root.address, "agg-0")):
                ch = grpc.aio.secure_channel(target, grpc.ssl_channel_credentials(ca.read_bytes()))
                stub, meta = pbg.FleetStub(ch), (("authorization", f"Bearer {held.credential}"),)
                for call in (stub.Join(pb.JoinRequest(node_id=other, role="client"), metadata=meta),
                             stub.Poll(pb.PollRequest(node_id=other, wait_s=0), metadata=meta)):
                    with pytest.raises(grpc.aio.AioRpcError) as ei:
                        await call
                    assert ei.value.code() == grpc.StatusCode.UNAUTHENTICATED, ei.value.details()
                await ch.close()
            # A node given the root's key (a bundle names it) refuses a root with another key.
            pinned = FleetLink(LinkConfig(target=root.address, role=Role.CLIENT, token=t_root, ca_cert=ca,
                                          node_id="direct-0", root_public_key=b"\x01" * 32))
            with pytest.raises(AuthError, match="not the 010101"):
                await pinned.join()
            await pinned.close()
            t_root = _device_tokens(data, "client", 1)[0]
            # Another client directly under the root, and one more under the aggregator.
            direct = _link(root.address, ca, t_root, "direct-1")
            await direct.join()
            other = _link(agg.address, ca, t_other, "phone-2")
            await other.join()
            # Revoke at the root, as an operator does: both are refused within seconds.
            listed = _cli("tokens", "list", "--data-dir", str(data))
            assert "phone-1" in listed and "spent" in listed
            assert "phone-1" in _cli("tokens", "revoke", "--data-dir", str(data), "--node", "phone-1")
            assert "direct-1" in _cli("tokens", "revoke", "--data-dir", str(data), "--node", "direct-1")
            out["root_s"] = await _refused_within(direct, 10)
            out["agg_s"] = await _refused_within(phone, 15)
            await other.poll(wait_s=0)  # the others are untouched
            # A new device token enrolls the revoked node again, from its data dir: same id, new credential.
            await phone.close()
            phone = _link(agg.address, ca, _device_tokens(data, "client", 1)[0], "", ident_dir)
            assert await phone.join() == "phone-1"
            renewed = NodeIdentity(ident_dir).enrolled
            assert renewed is not None and renewed.credential != held.credential
            await phone.poll(wait_s=0)
            await asyncio.gather(phone.close(), direct.close(), other.close())
        finally:
            await agg.stop(0.1)
            await root.stop(0.1)
        return out

    out = asyncio.run(main())
    assert out["modes"] == (0o700, {"device.key": 0o600, "credential.json": 0o600}), out
    assert out["root_s"] < 1.0, out  # the root reads its store on every call
    # The aggregator keeps the root's answer for 5 s (UpstreamAuthenticator.ttl_s).
    assert out["agg_s"] < 5.0 + 2.0, out


def test_tokens_commands_refuse_nonsense(tmp_path: Path) -> None:
    r = CliRunner().invoke(app, ["tokens", "revoke", "--data-dir", str(tmp_path), "abc"])
    assert r.exit_code == 2 and "no root store" in r.output
    _cli("tokens", "issue", "--data-dir", str(tmp_path))
    r = CliRunner().invoke(app, ["tokens", "revoke", "--data-dir", str(tmp_path)])
    assert r.exit_code == 2 and "token id or --node" in r.output
    r = CliRunner().invoke(app, ["tokens", "revoke", "--data-dir", str(tmp_path), "--node", "nobody"])
    assert r.exit_code == 2 and "nothing to revoke" in r.output
    import json

    listed = json.loads(_cli("tokens", "list", "--data-dir", str(tmp_path), "--json"))
    assert [(t["kind"], t["state"]) for t in listed["tokens"]] == [("shared", "live")] and listed["nodes"] == []
    tid = listed["tokens"][0]["token_id"]
    assert tid in _cli("tokens", "revoke", "--data-dir", str(tmp_path), tid)


def test_a_restarted_aggregator_resumes_its_identity(tmp_path: Path) -> None:
    """An aggregator started with a data dir keeps its identity there (owner-only): a
    restart comes back as the same node, without its spent enrollment token."""
    data = tmp_path / "root"
    agg_data = tmp_path / "agg"

    async def main() -> tuple[str, str, int]:
        root = await start_root(data, server_cfg=FAST, start_grace_s=0.2)
        ca = Path(root.ca_cert)  # type: ignore[arg-type]
        (agg_tok,) = _device_tokens(data, "aggregator", 1)
        try:
            first = await start_aggregator(root.address, token=agg_tok, ca_cert=ca, tls_dir=data / "tls",
                                           server_cfg=FAST, data_dir=agg_data)
            name = first.coordinator.name
            await first.stop(0.1)
            again = await start_aggregator(root.address, token=None, ca_cert=ca, tls_dir=data / "tls",
                                           server_cfg=FAST, data_dir=agg_data)
            resumed = again.coordinator.name
            await again.stop(0.1)
        finally:
            await root.stop(0.1)
        return name, resumed, stat.S_IMODE((agg_data / "identity").stat().st_mode)

    name, resumed, mode = asyncio.run(main())
    assert resumed == name and name.startswith("aggregator-")
    assert mode == 0o700
