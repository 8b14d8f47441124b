"""Signed rosters (orchard.secure_agg.roster): one root signature and a Merkle path per
device stand in for a certificate per device, and refuse what a certificate refuses."""

from __future__ import annotations

import dataclasses
import struct

import numpy as np
import pytest

from orchard.identity import SigningKey
from orchard.secure_agg import (
    ClientPolicy,
    MalformedMessage,
    SecAggClient,
    SecAggServer,
    SessionIdentity,
    SessionSetup,
    Stage,
    decode,
)
from orchard.secure_agg.active import advertise_message
from orchard.secure_agg.roster import (
    ROSTER_BYTES,
    ForgedRoster,
    NotInRoster,
    RosterCache,
    StaleRoster,
    build_roster,
)
from tests.secure_agg.harness import ACTIVE_STAGES, entropy, make_config

ROOT = SigningKey.from_bytes(entropy("root"))


def _members(n: int, tag: str = "device") -> dict[str, SigningKey]:
    return {f"c{i:04d}": SigningKey.from_bytes(entropy(f"{tag}/{i}")) for i in range(n)}


@pytest.mark.parametrize("n", [1, 2, 5, 8, 33])
def test_every_member_proves_its_own_key_with_one_signature_checked(n: int) -> None:
    keys = _members(n)
    roster, creds = build_roster(ROOT, 3, {p: k.public_key for p, k in keys.items()})
    cache = RosterCache()
    for p, k in keys.items():
        assert cache.identity_key(creds[p], p, ROOT.public_key, min_epoch=3) == k.public_key
    assert cache.signatures_checked == 1
    assert roster.epoch == 3 and roster.size == n


def test_a_forged_roster_is_refused() -> None:
    keys = _members(5)
    members = {p: k.public_key for p, k in keys.items()}
    other = SigningKey.from_bytes(entropy("not-the-root"))
    _, creds = build_roster(other, 1, members)  # signed by another key
    with pytest.raises(ForgedRoster, match="not signed by this root"):
        RosterCache().identity_key(creds["c0001"], "c0001", ROOT.public_key)
    # The root's roster with its Merkle root swapped for one over a roster of the
    # forger's choosing: the signature no longer covers it.
    _, real = build_roster(ROOT, 1, members)
    forged_members = dict(members, c0001=other.public_key)
    _, fake = build_roster(ROOT, 1, forged_members)
    tampered = real["c0001"][:1 + 12] + fake["c0001"][1 + 12:1 + 44] + real["c0001"][1 + 44:]
    with pytest.raises(ForgedRoster):
        RosterCache().identity_key(tampered, "c0001", ROOT.public_key)


def test_a_path_for_a_key_not_in_the_roster_is_refused() -> None:
    keys = _members(6)
    _, creds = build_roster(ROOT, 1, {p: k.public_key for p, k in keys.items()})
    cache = RosterCache()
    # Another member's credential, presented for c0002: its key is not c0002's.
    with pytest.raises(NotInRoster, match="'c0002'"):
        cache.identity_key(creds["c0003"], "c0002", ROOT.public_key)
    # The right path with a key substituted in it.
    cred = bytearray(creds["c0002"])
    key_at = 1 + ROSTER_BYTES + 4
    cred[key_at:key_at + 32] = SigningKey.from_bytes(entropy("intruder")).public_key
    with pytest.raises(NotInRoster):
        cache.identity_key(bytes(cred), "c0002", ROOT.public_key)
    # A sibling altered, a leaf index moved, a path cut short: none reaches the root.
    for bad in (creds["c0002"][:-1] + bytes([creds["c0002"][-1] ^ 1]),
                creds["c0002"][:1 + ROSTER_BYTES] + struct.pack(">I", 3) + creds["c0002"][key_at:],
                creds["c0002"][:-32]):
        with pytest.raises(NotInRoster):
            cache.identity_key(bad, "c0002", ROOT.public_key)
    # A node that was never enrolled.
    with pytest.raises(NotInRoster):
        cache.identity_key(creds["c0000"], "c9999", ROOT.public_key)


def test_a_stale_roster_epoch_is_refused() -> None:
    keys = _members(4)
    _, old = build_roster(ROOT, 1, {p: k.public_key for p, k in keys.items()})
    cache = RosterCache()
    assert cache.identity_key(old["c0001"], "c0001", ROOT.public_key, min_epoch=1)
    # Once this client holds epoch 2, the epoch-1 roster is refused, even though it
    # checked (and cached) that roster's signature before.
    with pytest.raises(StaleRoster, match="epoch 1 is older than epoch 2"):
        cache.identity_key(old["c0001"], "c0001", ROOT.public_key, min_epoch=2)


def _roster_clients(cfg, *, epoch: int = 1, min_epoch: int = 1,
                    stale: frozenset[str] = frozenset()) -> dict[str, SecAggClient]:
    keys = {p: SigningKey.from_bytes(entropy(f"device/{p}")) for p in cfg.participants}
    _, creds = build_roster(ROOT, epoch, {p: k.public_key for p, k in keys.items()})
    _, old = build_roster(ROOT, epoch - 1, {p: k.public_key for p, k in keys.items()})
    return {p: SecAggClient(p, entropy=entropy(p), identity=SessionIdentity(keys[p], old[p] if p in stale else creds[p]),
                            policy=ClientPolicy(root_public_key=ROOT.public_key, min_roster_epoch=min_epoch,
                                                min_participants=2, min_neighbours=1, corrupt_fraction=0.0))
            for p in cfg.participants}


def test_a_session_over_roster_credentials_sums_exactly() -> None:
    cfg = make_config(10, 50, 6, 4)
    server = SecAggServer(cfg, root_public_key=ROOT.public_key)
    clients = _roster_clients(cfg, epoch=2, min_epoch=2)
    rng = np.random.default_rng(0)
    inputs = {p: rng.integers(0, 1 << 16, 50, dtype=np.uint32) for p in cfg.participants}
    for stage in ACTIVE_STAGES:
        for p in sorted(server.pending()):
            reply = clients[p].respond(decode(server.broadcast_bytes(p)),
                                       inputs[p] if stage is Stage.MASKED_INPUT else None)
            server.receive(stage, p, reply.to_bytes())
        server.close_stage()
    assert np.array_equal(server.result().total, sum(inputs.values()))
    assert all(c.rosters.signatures_checked == 1 for c in clients.values())


def test_neighbours_with_a_stale_or_substituted_roster_credential_are_treated_as_absent() -> None:
    cfg = make_config(10, 10, 6, 4)
    stale = cfg.participants[1]
    clients = _roster_clients(cfg, epoch=2, min_epoch=2, stale=frozenset({stale}))
    server = SecAggServer(cfg, root_public_key=ROOT.public_key)
    for p in cfg.participants:
        server.receive(Stage.ADVERTISE_KEYS, p, clients[p].respond(server.broadcast_for(p)).to_bytes())
    server.close_stage()
    # The server checks signatures, not freshness: the stale client's keys go out, and
    # each of its neighbours leaves it out of its shares.
    for p in cfg.participants:
        bcast = server.broadcast_for(p)
        if stale in {k.node for k in bcast.keys} and p != stale:
            out = clients[p].respond(bcast)
            assert stale not in {r for r, _ in out.ciphertexts}
    # A relay that swaps a neighbour's keys and vouches for its own identity key with a
    # roster it signed itself, or with another member's genuine path, is not believed.
    victim = cfg.participants[0]
    bcast = server.broadcast_for(victim)
    peer = next(k for k in bcast.keys if k.node != stale)
    relay = SigningKey.from_bytes(entropy("relay-identity"))
    _, own = build_roster(relay, 2, {peer.node: relay.public_key})
    other = next(k for k in bcast.keys if k.node not in (peer.node, stale))
    signed = advertise_message(cfg, peer.node, peer.channel_pk, peer.mask_pk, peer.seed_commitment)
    for credential in (own[peer.node], other.credential):
        forged = dataclasses.replace(peer, credential=credential, signature=relay.sign(signed))
        client = SecAggClient(victim, entropy=entropy(victim), identity=clients[victim].identity,
                              policy=clients[victim].policy)
        client.respond(SessionSetup(victim, cfg))
        out = client.respond(dataclasses.replace(bcast, keys=tuple(forged if k is peer else k for k in bcast.keys)))
        assert peer.node not in {r for r, _ in out.ciphertexts}
        assert "does not hold this identity key" in client.rejected[peer.node] or \
            "not signed by this root" in client.rejected[peer.node], client.rejected


def test_the_server_refuses_keys_vouched_for_by_a_forged_roster() -> None:
    cfg = make_config(6, 10, 4, 3)
    server = SecAggServer(cfg, root_public_key=ROOT.public_key)
    p = cfg.participants[0]
    key = SigningKey.from_bytes(entropy("device/x"))
    _, forged = build_roster(SigningKey.from_bytes(entropy("forger")), 1, {p: key.public_key})
    client = SecAggClient(p, entropy=entropy(p), identity=SessionIdentity(key, forged[p]),
                          policy=ClientPolicy(min_participants=2, min_neighbours=1, corrupt_fraction=0.0))
    with pytest.raises(MalformedMessage, match="not signed by this root"):
        server.receive(Stage.ADVERTISE_KEYS, p, client.respond(server.broadcast_for(p)).to_bytes())


def test_a_client_that_advertised_a_certificate_is_shown_certificates() -> None:
    """A session of clients with roster credentials and clients with certificates (the
    native device client reads no roster): each of the latter is shown its neighbours'
    certificates, which the server holds, in place of their roster credentials; the others
    see the credentials as advertised. Every client keeps every neighbour, and the sum is exact."""
    from orchard.identity import certify, verify_certificate
    from orchard.secure_agg.roster import is_roster_credential

    cfg = make_config(8, 20, 7, 5)
    clients = _roster_clients(cfg)
    certs = {p: certify(ROOT, p, c.identity.key.public_key, 0) for p, c in clients.items()}
    legacy = set(cfg.participants[::3])
    for p in legacy:
        clients[p] = SecAggClient(p, entropy=entropy(p), identity=SessionIdentity(clients[p].identity.key, certs[p]),
                                  policy=clients[p].policy)
    server = SecAggServer(cfg, root_public_key=ROOT.public_key, certificates=certs)
    rng = np.random.default_rng(1)
    inputs = {p: rng.integers(0, 1 << 16, 20, dtype=np.uint32) for p in cfg.participants}
    for stage in ACTIVE_STAGES:
        for p in sorted(server.pending()):
            msg = decode(server.broadcast_bytes(p))
            if stage is Stage.SHARE_KEYS:
                kinds = {is_roster_credential(k.credential) for k in msg.keys}
                assert kinds == ({False} if p in legacy else {True, False}), (p, kinds)
                for k in msg.keys:
                    if p in legacy:
                        assert verify_certificate(k.credential, ROOT.public_key, k.node)
            reply = clients[p].respond(msg, inputs[p] if stage is Stage.MASKED_INPUT else None)
            server.receive(stage, p, reply.to_bytes())
        server.close_stage()
    assert np.array_equal(server.result().total, sum(inputs.values()))
    assert not any(c.rejected for c in clients.values())


def test_paths_proven_before_do_not_let_a_wrong_one_through() -> None:
    """A cache that proved every member's path stops a later path where it meets a node it
    proved, and refuses one that meets another value there: another member's path, a key
    substituted, a leaf index moved. (A sibling altered above the first proven node
    changes nothing the path proves, and is not looked at.)"""
    keys = _members(13)
    _, creds = build_roster(ROOT, 1, {p: k.public_key for p, k in keys.items()})
    cache = RosterCache()
    for p, k in keys.items():
        assert cache.identity_key(creds[p], p, ROOT.public_key) == k.public_key
    key_at = 1 + ROSTER_BYTES + 4
    intruder = SigningKey.from_bytes(entropy("intruder")).public_key
    for bad, node in ((creds["c0003"], "c0002"),
                      (creds["c0002"][:key_at] + intruder + creds["c0002"][key_at + 32:], "c0002"),
                      (creds["c0002"][:1 + ROSTER_BYTES] + struct.pack(">I", 3) + creds["c0002"][key_at:], "c0002")):
        with pytest.raises(NotInRoster):
            cache.identity_key(bad, node, ROOT.public_key)
    assert cache.identity_key(creds["c0002"], "c0002", ROOT.public_key) == keys["c0002"].public_key
