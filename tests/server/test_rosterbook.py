"""The root's signed roster of admitted client devices (server/rosterbook.py) and what a
client makes of the credential it is handed (client/secure.py's RosterTrust)."""

from __future__ import annotations

import asyncio

import pytest

from orchard.client.secure import DeviceTrust, RosterTrust
from orchard.identity import Enrolled, Enrollment, NodeIdentity, enrollment_message
from orchard.secure_agg.roster import ROSTER_BYTES, RosterCache, SignedRoster, is_roster_credential
from orchard.server.auth import StoreAuthenticator, UpstreamAuthenticator
from orchard.server.store import MemoryStore
from orchard.typing import Role


class Clock:
    def __init__(self) -> None:
        self.t = 1_000_000.0

    def __call__(self) -> float:
        return self.t


def _enroll(auth: StoreAuthenticator, node_id: str, role: Role = Role.CLIENT) -> tuple[NodeIdentity, str]:
    tok = auth.store.issue_token(role.value, device=True)
    ident = NodeIdentity()
    proof = ident.sign(enrollment_message(role.value, node_id, tok))
    e = asyncio.run(auth.enroll(tok, role, node_id, ident.public_key, proof))
    ident.save(Enrolled(e.node_id, e.credential, e.certificate, e.root_public_key))
    return ident, e.credential


def _epoch(credential: bytes) -> int:
    return SignedRoster.from_bytes(credential[1:1 + ROSTER_BYTES]).epoch


def test_the_roster_holds_admitted_clients_and_moves_on_when_they_change() -> None:
    clock = Clock()
    root = StoreAuthenticator(MemoryStore(), "", clock)
    cred = lambda n: asyncio.run(root.roster_credential(None, n))  # noqa: E731
    ids = {n: _enroll(root, n)[0] for n in ("phone-1", "phone-2")}
    _enroll(root, "agg-1", Role.AGGREGATOR)
    first = cred("phone-1")
    assert is_roster_credential(first) and cred("agg-1") == b"" and cred("nobody") == b""
    cache = RosterCache()
    for n, ident in ids.items():
        assert cache.identity_key(cred(n), n, root.root_public_key) == ident.public_key
    assert cache.signatures_checked == 1  # one roster for both
    # A new enrollment is in the next roster, of a later epoch.
    ids["phone-3"] = _enroll(root, "phone-3")[0]
    assert cred("phone-3") and _epoch(cred("phone-3")) > _epoch(first)
    # A revocation written into the store (here, or by `orchard tokens revoke`) takes the
    # device out once the root looks again (refresh_s).
    epoch = _epoch(cred("phone-1"))
    root.store.revoke(node_id="phone-2")
    assert cred("phone-2")  # not looked again yet
    clock.t += root.rosters.refresh_s
    assert cred("phone-2") == b"" and _epoch(cred("phone-1")) > epoch
    # Nothing changed: the same roster, however often it is asked for.
    clock.t += 10 * root.rosters.refresh_s
    assert cred("phone-1") == cred("phone-1") and root.rosters.epoch == _epoch(cred("phone-1"))


def test_an_aggregator_passes_on_the_roots_credential_asked_afresh() -> None:
    root = StoreAuthenticator(MemoryStore(), "")
    ident, credential = _enroll(root, "phone-1")
    asked = []

    async def ask(token, role, node_id="", **_):  # the root's VerifyToken, as the servicer answers it
        asked.append(node_id)
        h = await root.verify(token, role, node_id)
        return Enrollment(node_id, h, certificate=root.certificate(node_id) or b"",
                          roster_credential=await root.roster_credential(None, node_id))

    agg = UpstreamAuthenticator(ask)
    got = asyncio.run(agg.roster_credential(credential, "phone-1"))
    assert got == asyncio.run(root.roster_credential(None, "phone-1")) and asked == ["phone-1"]
    assert asyncio.run(agg.roster_credential("orc_not_a_credential", "phone-1")) == b""  # the root refuses it
    assert asyncio.run(agg.roster_credential(None, "phone-1")) == b""


def test_a_client_vouches_with_its_own_roster_credential_only() -> None:
    root = StoreAuthenticator(MemoryStore(), "")
    me, _ = _enroll(root, "phone-1")
    _enroll(root, "phone-2")
    mine = asyncio.run(root.roster_credential(None, "phone-1"))
    theirs = asyncio.run(root.roster_credential(None, "phone-2"))
    rosters = RosterTrust()
    trust = DeviceTrust.of(me, mine, rosters)
    assert trust.identity.credential == mine and trust.policy.min_roster_epoch == 0
    assert rosters.newest_epoch == _epoch(mine)
    # Another device's credential, or none, and the client vouches with its certificate;
    # from now on it refuses rosters older than the one it held.
    for handed in (theirs, b"", b"\x02" + bytes(200)):
        trust = DeviceTrust.of(me, handed, rosters)
        assert trust.identity.credential == me.enrolled.certificate
        assert trust.policy.min_roster_epoch == _epoch(mine)
    # Not enrolled (--insecure): no roster, no root key.
    loose = DeviceTrust.of(NodeIdentity(), mine)
    assert loose.policy.root_public_key is None and len(loose.identity.credential) == 32


@pytest.mark.parametrize("clock_back", [True, False])
def test_epochs_grow_across_a_restart(clock_back: bool) -> None:
    clock = Clock()
    store = MemoryStore()
    root = StoreAuthenticator(store, "", clock)
    _enroll(root, "phone-1")
    before = root.rosters.credential("phone-1") and root.rosters.epoch
    clock.t += -100 if clock_back else 100
    again = StoreAuthenticator(store, "", clock)  # the root restarted
    after = again.rosters.credential("phone-1") and again.rosters.epoch
    # Epochs are the wall clock's seconds: a restart moves on unless the clock went back.
    assert (after > before) is (not clock_back)
