"""A client's side of secure aggregation (SecAgg+) for one task.

The key stages run while the model trains; at the masked-input stage the client builds
its upload exactly as without secure aggregation (``build_upload``: codec, header),
decodes its own payload back to the values the codec carries (a field-linear codec's
values add), and masks ``(min(w, weight_scale) / weight_scale) * values`` quantised to
the run's clip and bits. The header (weight, counts, metrics) travels in the clear with
it; the payload never leaves the device.

The client signs its session keys with its device identity key (``orchard.identity``,
the link's) and vouches for that key with the root's word: its credential in the root's
current signed roster (``secure_agg.roster``; the tier hands it over with the session's
setup, as the root issued it), or, without a valid one, the root's certificate. An
enrolled client (one that holds the root's key) checks every neighbour's credential
against that root, refuses a roster older than the newest it held before the session,
reports the neighbours whose keys fail (treated as absent: a server or relay that
substitutes keys shows here), and refuses semi-honest sessions
(``secure_agg.ClientPolicy``). The floors it holds a session to are its own, never the
server's. Stochastic rounding and distributed-DP noise draw from a
numpy Generator seeded with 128 bits from the OS (``secrets``), unless the runtime was
told to round reproducibly (tests that compare a federation with the simulator).
"""

from __future__ import annotations

import asyncio
import logging
import secrets
from dataclasses import dataclass, field

import numpy as np

from orchard.aggregation import prescale_factor
from orchard.aggregation.privacy import ddg_encode, session_params
from orchard.compression import Codec, decode_update
from orchard.config import RunConfig
from orchard.errors import SecAggAbort
from orchard.identity import CertificateError, NodeIdentity
from orchard.link import FleetLink
from orchard.messages import TaskAssignment, UploadHeader
from orchard.randomness import os_random
from orchard.secure_agg import ClientPolicy, SecAggClient, SessionIdentity, Stage, decode, quantize
from orchard.secure_agg.roster import ROSTER_BYTES, RosterCache, SignedRoster, is_roster_credential
from orchard.secure_agg.stages import stage_of
from orchard.updates import split

log = logging.getLogger("orchard.client.secure")


def masked_vector(cfg: RunConfig, codec: Codec, t: TaskAssignment, header: UploadHeader, payload: bytes,
                  rng: np.random.Generator, participants: int = 0) -> np.ndarray:
    """The field vector a client masks: its weighted, scaled, quantised update values; with
    DP, its decoded update values clipped and rounded so that what the tier sums is
    bounded by the clip norm (after the codec, error feedback's residual included):
    central DP, :func:`~orchard.aggregation.privacy.bounded_params`; distributed DP, the
    discrete Gaussian encoding with the client's share of the noise (``rng`` must then
    be unpredictable to everyone else)."""
    shapes = {s.name: tuple(s.shape) for s in t.schema}
    parts = dict(zip(shapes, split(payload, header.payload_sizes), strict=True))
    values = decode_update(codec, parts, shapes, num_summands=1, shared_seed=t.shared_seed)
    flat = np.concatenate([np.asarray(values[k], np.float64).ravel() for k in shapes])
    params = session_params(cfg, participants, flat.size)
    if params is not None:  # DP: what the tier sums must be bounded by the clip, codec and rounding included
        return ddg_encode(flat, params, rng)
    sa = cfg.secure_aggregation
    return quantize(flat * prescale_factor(header.weight, sa.weight_scale), sa.clip, sa.bits, rng)


class SecureParticipant:
    """A client's side of one SecAgg+ session, with no transport: it answers the
    broadcasts it is handed. The client runtime drives it over ``Fleet.SecAgg``; the
    simulator drives the same object against an in-process tier."""

    def __init__(self, node_id: str, entropy: bytes, identity: SessionIdentity | None = None,
                 policy: ClientPolicy | None = None, rosters: RosterCache | None = None) -> None:
        self.client = SecAggClient(node_id, entropy=entropy, identity=identity, policy=policy, rosters=rosters)
        self.answered: set[int] = set()
        self.sent_input = False

    @property
    def participants(self) -> int:
        """How many clients the session started with (known once it is set up)."""
        return len(self.client.config.participants) if self.client.config is not None else 0

    def wants_input(self, stage_index: int, broadcast: bytes) -> bool:
        """Whether this broadcast asks for the masked input (the update must be ready)."""
        return bool(broadcast) and stage_index not in self.answered and stage_of(stage_index) is Stage.MASKED_INPUT

    def answer(self, stage_index: int, broadcast: bytes,
               masked: tuple[UploadHeader, np.ndarray] | None = None) -> tuple[bytes, UploadHeader | None] | None:
        """The message (and, with the masked input, its header) that answers ``broadcast``;
        None when there is nothing to answer now: no broadcast, answered already, or the
        masked input asked for and ``masked`` (header, field vector) not given."""
        if not broadcast or stage_index in self.answered:
            return None
        header = vector = None
        if stage_of(stage_index) is Stage.MASKED_INPUT:
            if masked is None:
                return None
            header, vector = masked
            self.sent_input = True
        message = self.client.respond(decode(broadcast), vector).to_bytes()
        self.answered.add(stage_index)
        return message, header


def os_generator() -> np.random.Generator:
    """A numpy Generator seeded with 128 bits from the OS's CSPRNG: nobody else can replay
    what it draws (PCG64 itself is not a cryptographic generator; its seed is the secret)."""
    return np.random.default_rng(secrets.randbits(128))


def masked_input(cfg: RunConfig, codec: Codec, t: TaskAssignment, header: UploadHeader, payload: bytes,
                 seed: int, participants: int = 0, noise_rng: np.random.Generator | None = None,
                 reproducible: bool = False) -> tuple[UploadHeader, np.ndarray]:
    """What a client posts at the masked-input stage for an update trained with ``seed``:
    its header (in the clear) and its field vector. Rounding and, with distributed DP, the
    noise draw from ``noise_rng``; by default the noise from the operating system's CSPRNG
    (:func:`orchard.randomness.os_random`) and the rounding from :func:`os_generator`:
    nobody else may replay or predict a client's noise or rounding. ``reproducible``
    (without distributed DP): round with a stream derived from ``seed`` instead (a
    simulation, or a test comparing a federation with one)."""
    if noise_rng is not None:
        rng = noise_rng
    elif cfg.privacy.mode == "distributed":
        rng = os_random()
    elif reproducible:
        rng = np.random.default_rng([seed, 0x5EC])
    else:
        rng = os_generator()
    return header, masked_vector(cfg, codec, t, header, payload, rng, participants)


@dataclass
class RosterTrust:
    """What a device keeps of the root's signed rosters across its sessions: the rosters
    whose signature it checked (one check per epoch) and the newest epoch it has held."""

    cache: RosterCache = field(default_factory=RosterCache)
    newest_epoch: int = 0

    def own(self, credential: bytes, node: NodeIdentity, root_public_key: bytes) -> bytes:
        """``credential`` if it proves this device's own key in a roster the root signed,
        no older than the newest this device held; else b"" (the caller falls back to its
        certificate), with the reason logged."""
        if not credential or node.enrolled is None:
            return b""
        try:
            if not is_roster_credential(credential):
                raise CertificateError("not a roster credential")
            key = self.cache.identity_key(credential, node.enrolled.node_id, root_public_key, self.newest_epoch)
            if key != node.public_key:
                raise CertificateError("it names another identity key than this device's")
        except CertificateError as err:
            log.warning("the roster credential handed to %s is refused (%s): it vouches with its certificate",
                        node.enrolled.node_id, err)
            return b""
        return credential


@dataclass(frozen=True)
class DeviceTrust:
    """What a client brings to its sessions: its identity and the policy it holds them to."""

    identity: SessionIdentity
    policy: ClientPolicy

    @classmethod
    def of(cls, node: NodeIdentity, roster_credential: bytes = b"", rosters: RosterTrust | None = None) -> DeviceTrust:
        """From the node's identity: its key, and once enrolled its credential (the roster
        credential handed over for this session if it proves this device's key, else its
        certificate) and the root's key (then peers must be vouched for by that root, with
        a roster no older than the newest ``rosters`` held before, and sessions active)."""
        e = node.enrolled
        cert, root = (e.certificate, e.root_public_key) if e is not None else (b"", b"")
        if not (cert and root):
            return cls(SessionIdentity(node.key), ClientPolicy())
        rosters = rosters if rosters is not None else RosterTrust()
        floor = rosters.newest_epoch
        credential = rosters.own(roster_credential, node, root)
        if credential:
            rosters.newest_epoch = max(floor, SignedRoster.from_bytes(credential[1:1 + ROSTER_BYTES]).epoch)
        return cls(SessionIdentity(node.key, credential or cert),
                   ClientPolicy(root_public_key=root, min_roster_epoch=floor))


async def secure_session(link: FleetLink, t: TaskAssignment, cfg: RunConfig, codec: Codec,
                         upload: asyncio.Future[tuple[UploadHeader, bytes]], seed: int,
                         reproducible: bool = False, rosters: RosterTrust | None = None) -> None:
    """Run this client's SecAgg+ stages for task ``t``.

    Started when the task arrives, so the key stages overlap training; ``upload`` is
    resolved with the encoded update (header, payload) once training is done, and only
    its masked form leaves the device. ``rosters``: what the device keeps of signed
    rosters across sessions (the runtime's)."""
    rosters = rosters if rosters is not None else RosterTrust()
    me: SecureParticipant | None = None
    reported: set[str] = set()
    reply = await link.secagg(t)
    while True:
        if reply.aborted:
            raise SecAggAbort(f"the cohort's secure aggregation aborted: {reply.aborted}")
        if reply.done:
            break
        if me is None:
            if not reply.broadcast:
                reply = await link.secagg(t)
                continue
            # The session's setup comes with this client's roster credential, if the root has one for it.
            trust = DeviceTrust.of(link.identity, reply.roster_credential, rosters)
            me = SecureParticipant(link.node_id, entropy=secrets.token_bytes(32), identity=trust.identity,
                                   policy=trust.policy, rosters=rosters.cache)
        masked = None
        if me.wants_input(reply.stage, reply.broadcast):
            update, payload = await upload
            masked = masked_input(cfg, codec, t, update, payload, seed, me.participants, reproducible=reproducible)
        try:
            got = me.answer(reply.stage, reply.broadcast, masked)
        finally:  # reported even when too few neighbours are left and the client leaves
            for node in me.client.rejected.keys() - reported:
                reported.add(node)
                log.warning("round %d: %s leaves out neighbour %s, whose keys fail their check (%s): the server "
                            "or a relay may be substituting keys", t.round, link.node_id, node,
                            me.client.rejected[node])
        if got is None:
            reply = await link.secagg(t)
            continue
        message, sent_header = got
        reply = await link.secagg(t, reply.stage, message, sent_header)
    if me is None or not me.sent_input:
        raise SecAggAbort("the cohort's sum was formed without this client's update (dropped from the session)")
