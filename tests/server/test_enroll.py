"""Enrollment and credentials at the root (StoreAuthenticator) and at an aggregator
(UpstreamAuthenticator): each attack the docs promise to refuse is a test here."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from orchard.errors import AuthError
from orchard.identity import (
    Enrollment,
    NodeIdentity,
    UpstreamUnavailable,
    enrollment_message,
    verify_certificate,
)
from orchard.server.auth import StoreAuthenticator, UpstreamAuthenticator
from orchard.server.store import MemoryStore, hash_token
from orchard.typing import Role

C = Role.CLIENT


def run(coro: Any) -> Any:
    return asyncio.run(coro)


def enroll(auth: StoreAuthenticator, token: str, node_id: str, ident: NodeIdentity | None = None,
           role: Role = C) -> Enrollment:
    ident = ident or NodeIdentity()
    proof = ident.sign(enrollment_message(role.value, node_id, token))
    return run(auth.enroll(token, role, node_id, ident.public_key, proof))


@pytest.fixture()
def root() -> StoreAuthenticator:
    return StoreAuthenticator(MemoryStore(), "")


def test_a_device_token_enrolls_one_node_with_its_own_credential(root: StoreAuthenticator) -> None:
    tok = root.store.issue_token("client", device=True)
    ident = NodeIdentity()
    e = enroll(root, tok, "phone-1", ident)
    assert e.node_id == "phone-1" and e.credential.startswith("orc_dev_") and e.token_hash == hash_token(e.credential)
    cert = verify_certificate(e.certificate, e.root_public_key, "phone-1")
    assert cert.public_key == ident.public_key and e.root_public_key == root.root_public_key
    # The credential authenticates that node, and only that node.
    assert run(root.verify(e.credential, C, "phone-1")) == e.token_hash
    with pytest.raises(AuthError, match="cannot act as 'phone-2'"):
        run(root.verify(e.credential, C, "phone-2"))
    with pytest.raises(AuthError, match="cannot act as 'phone-2'"):
        run(root.enroll(e.credential, C, "phone-2", ident.public_key))
    with pytest.raises(AuthError, match="cannot act as an aggregator"):
        run(root.verify(e.credential, Role.AGGREGATOR, "phone-1"))
    # Joining again with the credential: the same node, its certificate, no new credential.
    again = run(root.enroll(e.credential, C, "", ident.public_key))
    assert (again.node_id, again.credential, again.certificate) == ("phone-1", "", e.certificate)
    assert root.certificate("phone-1") == e.certificate
    # The token is spent: it cannot enroll anyone else, nor act as the node.
    with pytest.raises(AuthError, match="exchanged for node 'phone-1'"):
        enroll(root, tok, "phone-2")
    with pytest.raises(AuthError, match="exchanged for node 'phone-1'"):
        run(root.verify(tok, C, "phone-1"))


def test_a_lost_reply_is_retried_only_by_the_key_that_enrolled(root: StoreAuthenticator) -> None:
    tok = root.store.issue_token("client", device=True)
    ident = NodeIdentity()
    first = enroll(root, tok, "phone-1", ident)
    retry = enroll(root, tok, "phone-1", ident)  # the first reply never arrived
    assert retry.node_id == "phone-1" and retry.credential and retry.credential != first.credential
    with pytest.raises(AuthError):
        run(root.verify(first.credential, C, "phone-1"))  # replaced
    # Someone holding the leaked token and the device's *public* key cannot prove the key.
    with pytest.raises(AuthError, match="key proof"):
        run(root.enroll(tok, C, "phone-1", ident.public_key, b"\x00" * 64))
    # Nor with a key of their own.
    with pytest.raises(AuthError, match="exchanged for node 'phone-1'"):
        enroll(root, tok, "phone-1")


def test_a_key_proof_is_required_and_bound_to_the_request(root: StoreAuthenticator) -> None:
    tok = root.store.issue_token("client", device=True)
    ident = NodeIdentity()
    for proof in (b"", ident.sign(enrollment_message("client", "other", tok)),
                  ident.sign(enrollment_message("aggregator", "phone-1", tok))):
        with pytest.raises(AuthError, match="key proof"):
            run(root.enroll(tok, C, "phone-1", ident.public_key, proof))
    with pytest.raises(AuthError, match="32 bytes"):
        run(root.enroll(tok, C, "phone-1", b"short", b""))
    assert root.store.device("phone-1") is None


def test_an_enrolled_node_id_cannot_be_taken_with_another_token(root: StoreAuthenticator) -> None:
    shared = root.store.issue_token("client")
    e = enroll(root, shared, "phone-1")
    for tok in (shared, root.store.issue_token("client"), root.store.issue_token("client", device=True)):
        with pytest.raises(AuthError, match="enrolled"):
            enroll(root, tok, "phone-1")
        with pytest.raises(AuthError, match="enrolled"):
            run(root.enroll(tok, C, "phone-1"))  # an older node, without a key
    with pytest.raises(AuthError, match="enrolled"):
        run(root.verify(shared, C, "phone-1"))
    assert run(root.verify(e.credential, C, "phone-1"))


def test_a_shared_token_enrolls_many_nodes_and_older_nodes_without_a_key(root: StoreAuthenticator) -> None:
    shared = root.store.issue_token("client")
    a, b = enroll(root, shared, "a"), enroll(root, shared, "")
    assert a.credential != b.credential and b.node_id.startswith("client-")
    older = run(root.enroll(shared, C, "legacy"))  # no key: the token authenticates it, as before
    assert (older.node_id, older.token_hash, older.credential) == ("legacy", hash_token(shared), "")
    assert run(root.verify(shared, C, "legacy")) == hash_token(shared)


def test_an_older_node_binds_a_device_token_to_its_node_id(root: StoreAuthenticator) -> None:
    tok = root.store.issue_token("client", device=True)
    assert run(root.enroll(tok, C, "native-1")).node_id == "native-1"
    assert run(root.verify(tok, C, "native-1"))
    with pytest.raises(AuthError, match="bound to node 'native-1'"):
        run(root.verify(tok, C, "native-2"))
    with pytest.raises(AuthError, match="bound to node 'native-1'"):
        run(root.enroll(tok, C, "native-2"))
    # The same node may later enroll its key with it: the token is then spent.
    e = enroll(root, tok, "native-1")
    assert e.credential and root.store.token(hash_token(tok)).spent  # type: ignore[union-attr]


def test_revocation_holds_at_the_next_call(root: StoreAuthenticator) -> None:
    tok = root.store.issue_token("client", device=True)
    e = enroll(root, tok, "phone-1")
    root.store.revoke(node_id="phone-1")
    with pytest.raises(AuthError, match="revoked"):
        run(root.verify(e.credential, C, "phone-1"))
    with pytest.raises(AuthError, match="revoked"):
        run(root.enroll(e.credential, C, "phone-1"))
    assert root.certificate("phone-1") is None  # no peer is handed a revoked device's certificate
    with pytest.raises(AuthError):
        enroll(root, tok, "phone-1")  # its token went with it
    # A new device token enrolls the node again, with a new key.
    fresh = enroll(root, root.store.issue_token("client", device=True), "phone-1")
    assert root.certificate("phone-1") == fresh.certificate


def test_revoking_a_token_revokes_what_it_enrolled(root: StoreAuthenticator) -> None:
    shared = root.store.issue_token("client")
    creds = [enroll(root, shared, f"n{i}").credential for i in range(3)]
    got = root.store.revoke(token_id=hash_token(shared)[:12])
    assert got.nodes == ("n0", "n1", "n2")
    for i, c in enumerate(creds):
        with pytest.raises(AuthError):
            run(root.verify(c, C, f"n{i}"))


class FakeRoot:
    """The root's answers, as an aggregator's link gets them, counting the questions."""

    def __init__(self, root: StoreAuthenticator) -> None:
        self.root = root
        self.asked = 0
        self.down = False

    async def __call__(self, token: str, role: Role, *, node_id: str = "", enroll: bool = False,
                       public_key: bytes = b"", key_proof: bytes = b"") -> Enrollment:
        self.asked += 1
        if self.down:
            raise UpstreamUnavailable("UNAVAILABLE")
        if enroll:
            return await self.root.enroll(token, role, node_id, public_key, key_proof)
        h = await self.root.verify(token, role, node_id)
        return Enrollment(node_id, h, certificate=self.root.certificate(node_id) or b"")


def test_an_aggregator_refuses_a_revoked_credential_once_its_answer_expires(root: StoreAuthenticator) -> None:
    now = [0.0]
    up = FakeRoot(root)
    agg = UpstreamAuthenticator(up, ttl_s=5.0, stale_s=300.0, monotonic=lambda: now[0])
    tok = root.store.issue_token("client", device=True)
    ident = NodeIdentity()
    e = run(agg.enroll(tok, C, "phone-1", ident.public_key,
                       ident.sign(enrollment_message("client", "phone-1", tok))))
    assert agg.certificate("phone-1") == e.certificate
    assert run(agg.verify(e.credential, C, "phone-1")) == e.token_hash
    asked = up.asked
    now[0] = 4.0
    assert run(agg.verify(e.credential, C, "phone-1"))  # within the TTL: not asked again
    assert up.asked == asked
    with pytest.raises(AuthError, match="cannot act as 'phone-2'"):
        run(agg.verify(e.credential, C, "phone-2"))
    root.store.revoke(node_id="phone-1")
    now[0] = 5.5  # the answer expired: the root is asked and refuses
    with pytest.raises(AuthError, match="revoked"):
        run(agg.verify(e.credential, C, "phone-1"))
    assert agg.certificate("phone-1") is None
    up.down = True  # a refusal is not forgotten while the root is away
    with pytest.raises(AuthError, match="revoked"):
        run(agg.verify(e.credential, C, "phone-1"))


def test_an_aggregator_rides_out_a_root_restart_on_its_last_positive_answer(root: StoreAuthenticator) -> None:
    now = [0.0]
    up = FakeRoot(root)
    agg = UpstreamAuthenticator(up, ttl_s=5.0, stale_s=300.0, monotonic=lambda: now[0])
    e = enroll(root, root.store.issue_token("client"), "n")
    assert run(agg.verify(e.credential, C, "n"))
    up.down = True
    now[0] = 100.0
    assert run(agg.verify(e.credential, C, "n"))  # the root is away: the last answer holds
    now[0] = 301.0
    with pytest.raises(UpstreamUnavailable):
        run(agg.verify(e.credential, C, "n"))
    with pytest.raises(UpstreamUnavailable):
        run(agg.verify("orc_never_seen", C, "x"))


def test_a_bundle_names_the_roots_key(tmp_path) -> None:
    from pydantic import ValidationError

    from orchard.edge_runtime.bundle import ClientBundle, ClientBundleConfig

    base = {"server_address": "h:1", "model": {"name": "m", "sha256": "0"}, "input_name": "x", "output_name": "y",
            "adapter_onnx": {"name": "a", "sha256": "0"}, "adapter_safetensors": {"name": "s", "sha256": "0"},
            "adapter_version": 0}
    key = NodeIdentity().public_key
    cfg = ClientBundleConfig.model_validate({**base, "root_public_key": key.hex()})
    assert ClientBundle(tmp_path, cfg).root_public_key == key
    assert ClientBundle(tmp_path, ClientBundleConfig.model_validate(base)).root_public_key is None
    with pytest.raises(ValidationError):
        ClientBundleConfig.model_validate({**base, "root_public_key": "zz"})
