"""The client side of SecAgg+ as a state machine (Bonawitz et al., 2017, Fig. 2 / §4,
user side of rounds 0-4; Bell et al., 2020, Alg. 2 restricted to the neighbour graph).

One :class:`SecAggClient` serves one session: it draws fresh keys and a fresh self-mask
seed from the entropy it is given, so nothing links two sessions. The transport feeds it
each broadcast it polls from the server and posts back what :meth:`SecAggClient.respond`
returns.

In an active session (``SessionConfig.active``) it also signs its keys with its identity
key and checks its neighbours' (:mod:`~orchard.secure_agg.active`), signs the survivor
view and reveals shares only under a view that t of its neighbours signed
(:mod:`~orchard.secure_agg.consistency`). A neighbour whose signed keys fail, or whose
share ciphertext does not decrypt, is treated as absent rather than ending the session.
Whatever the mode, it refuses a session below the floors of its own
:class:`~orchard.secure_agg.active.ClientPolicy`, and it forgets its secrets when the
session ends.
"""

from __future__ import annotations

import numpy as np

from orchard.errors import UpdateSchemaError
from orchard.identity import CertificateError
from orchard.secure_agg import crypto
from orchard.secure_agg._wire import ciphertext_size, pack_shares, unpack_shares
from orchard.secure_agg.active import (
    ClientPolicy,
    SessionIdentity,
    advertise_message,
    identity_key,
    is_low_order,
    seed_commitment,
    verify,
)
from orchard.secure_agg.consistency import (
    ConsistencyRequest,
    ConsistencySignature,
    View,
    consistency_message,
)
from orchard.secure_agg.errors import (
    DuplicateMessage,
    MalformedMessage,
    SecAggAbort,
    SecAggError,
    UnknownPeer,
    WrongSession,
    WrongStage,
)
from orchard.secure_agg.graph import NeighbourGraph
from orchard.secure_agg.messages import (
    AdvertiseKeys,
    KeysBroadcast,
    MaskedInput,
    Message,
    PeerKeys,
    SessionConfig,
    SessionSetup,
    ShareKeys,
    SharesBroadcast,
    Stage,
    UnmaskRequest,
    UnmaskShares,
)
from orchard.secure_agg.prg import SEED_BYTES, ByteStream, MaskFolder, modulus_mask, word_dtype
from orchard.secure_agg.roster import RosterCache
from orchard.secure_agg.shamir import share_bytes

__all__ = ["SecAggClient"]


class SecAggClient:
    """One client's part in one session.

    ``entropy`` (>= 32 unpredictable bytes, e.g. ``secrets.token_bytes(32)``) seeds every
    secret the client draws: both X25519 key pairs, the self-mask seed b_u and the Shamir
    polynomials. Reusing it across sessions would reuse b_u: never do that.

    ``identity``: the device's identity key and the root's certificate of it (default: an
    uncertified key drawn from ``entropy``); ``policy``: the floors and the root key this
    client holds every session to (its own configuration, never the server's);
    ``rosters``: the signed rosters this device has already checked (keep one across
    sessions: a roster's signature is then checked once per epoch, not once per session).
    """

    def __init__(self, node_id: str, *, entropy: bytes, identity: SessionIdentity | None = None,
                 policy: ClientPolicy | None = None, rosters: RosterCache | None = None) -> None:
        if len(entropy) < 32:
            raise ValueError(f"entropy must be at least 32 bytes, got {len(entropy)}")
        self.node_id = node_id
        self.identity = identity if identity is not None else SessionIdentity.ephemeral(entropy)
        self.policy = policy if policy is not None else ClientPolicy()
        self.rosters = rosters if rosters is not None else RosterCache()
        self._rand = ByteStream(crypto.hkdf(entropy, b"client:" + node_id.encode(), 32))
        self.stage = Stage.ADVERTISE_KEYS  # the stage whose broadcast it waits for
        self.config: SessionConfig | None = None
        self._neighbours: frozenset[str] = frozenset()
        self._index: dict[str, int] = {}
        self._peers: dict[str, tuple[bytes, bytes]] = {}  # U1 neighbours -> (c_pk, s_pk)
        self._held: dict[str, tuple[bytes, bytes]] = {}  # U2 neighbours -> (key share, seed share)
        self._channel: dict[str, bytes] = {}  # U1 neighbours -> X25519 agreement of c keys
        self._ids: dict[str, bytes] = {}  # neighbours with verified keys -> identity key
        self._masked: frozenset[str] = frozenset()  # the neighbours whose masks went into y_u
        self._view: bytes = b""  # the survivor view this client signed (active sessions)
        self._survivors: frozenset[str] = frozenset()  # its U3, among the neighbours
        self.masks_expanded = 0  # measurement
        # Neighbours whose keys failed their checks (active sessions) -> why: treated as
        # absent; the caller reports them (a server or relay substituting keys shows here).
        self.rejected: dict[str, str] = {}
        self._last: tuple[Message, Message] | None = None  # (broadcast, reply) for retries

    # ------------------------------------------------------------------ dispatch

    def respond(self, msg: Message, vector: np.ndarray | None = None) -> Message:
        """The reply to the server's broadcast for the current stage.

        ``vector`` (the quantised input: ``vector_length`` unsigned integers < 2^b) is
        needed with the :class:`SharesBroadcast`. Raises :class:`WrongStage` for a message
        of another stage, :class:`WrongSession` for another session or round, other
        :class:`~orchard.errors.SecAggError` subclasses for bad content, and
        :class:`~orchard.errors.SecAggAbort` when the protocol cannot go on safely.
        """
        if self._last is not None and msg == self._last[0]:
            # The same broadcast again (the reply was lost in transit): answer identically.
            # Recomputing would draw fresh Shamir polynomials and hand out extra shares.
            return self._last[1]
        if self.stage in (Stage.DONE, Stage.ABORTED):
            raise WrongStage(f"client {self.node_id!r} has finished its session ({self.stage.value})")
        if msg.STAGE is not self.stage or not isinstance(
                msg, SessionSetup | KeysBroadcast | SharesBroadcast | ConsistencyRequest | UnmaskRequest):
            raise WrongStage(f"client {self.node_id!r} waits for the {self.stage.value} broadcast, "
                             f"got a {type(msg).__name__}")
        if msg.node != self.node_id:
            raise UnknownPeer(f"broadcast addressed to {msg.node!r}, this is {self.node_id!r}")
        if self.config is not None:
            self._check_session(msg, self.config)
        try:
            reply: Message
            if isinstance(msg, SessionSetup):
                reply = self._advertise(msg)
            elif isinstance(msg, KeysBroadcast):
                reply = self._share(msg)
            elif isinstance(msg, SharesBroadcast):
                if vector is None:
                    raise UpdateSchemaError("the masked-input stage needs the quantised vector")
                reply = self._mask(msg, vector)
            elif isinstance(msg, ConsistencyRequest):
                reply = self._sign_view(msg)
            else:
                reply = self._unmask(msg)
        except SecAggAbort:
            self.stage = Stage.ABORTED
            self._forget()
            raise
        self._last = (msg, reply)
        return reply

    @staticmethod
    def _check_session(msg: Message, cfg: SessionConfig) -> None:
        if msg.session_id != cfg.session_id or msg.round_number != cfg.round_number:
            raise WrongSession(
                f"message for session {msg.session_id.hex()} round {msg.round_number}, this "
                f"client is in session {cfg.session_id.hex()} round {cfg.round_number}: "
                f"replayed or misrouted"
            )

    def _require_config(self) -> SessionConfig:
        if self.config is None:
            raise WrongStage("no session set up yet")
        return self.config

    # ------------------------------------------------------------------ stages

    def _advertise(self, msg: SessionSetup) -> AdvertiseKeys:
        """Round 0: two fresh X25519 key pairs (c for the channel, s for masks)."""
        cfg = msg.config
        if self.node_id not in cfg.participants:
            raise UnknownPeer(f"{self.node_id!r} is not among the session's participants")
        self.policy.check(cfg)
        self._index = {p: i for i, p in enumerate(cfg.participants)}
        graph = NeighbourGraph(len(cfg.participants), cfg.neighbours, cfg.graph_seed)
        self._neighbours = frozenset(cfg.participants[j]
                                     for j in graph.neighbours(self._index[self.node_id]))
        self._c_sk = crypto.load_private(self._rand.read(32))
        self._s_sk = crypto.load_private(self._rand.read(32))
        self._seed = self._rand.read(SEED_BYTES)  # b_u
        self.config = cfg
        self.stage = Stage.SHARE_KEYS
        c_pk, s_pk = crypto.public_bytes(self._c_sk), crypto.public_bytes(self._s_sk)
        if not cfg.active:
            return AdvertiseKeys(cfg.session_id, cfg.round_number, self.node_id, c_pk, s_pk)
        commitment = seed_commitment(cfg, self.node_id, self._seed)
        signature = self.identity.key.sign(advertise_message(cfg, self.node_id, c_pk, s_pk, commitment))
        return AdvertiseKeys(cfg.session_id, cfg.round_number, self.node_id, c_pk, s_pk, commitment,
                             self.identity.credential, signature)

    def _share(self, msg: KeysBroadcast) -> ShareKeys:
        """Round 1: Shamir-share s_sk and b_u among the neighbours that advertised keys,
        each share encrypted under the pairwise channel key."""
        cfg = self._require_config()
        own = {crypto.public_bytes(self._c_sk), crypto.public_bytes(self._s_sk)}
        seen_keys: set[bytes] = set(own)
        peers: dict[str, tuple[bytes, bytes]] = {}
        for k in msg.keys:
            if k.node not in self._neighbours:
                raise UnknownPeer(f"keys for {k.node!r}, which is not a neighbour of {self.node_id!r}")
            if k.node in peers:
                raise DuplicateMessage(f"keys for {k.node!r} listed twice")
            # Distinct keys (Bonawitz §4, round 1): a repeated key means a replay or a
            # server substituting keys.
            if k.channel_pk in seen_keys or k.mask_pk in seen_keys or k.channel_pk == k.mask_pk:
                raise MalformedMessage(f"keys of {k.node!r} repeat a key already seen")
            seen_keys.update((k.channel_pk, k.mask_pk))
            if cfg.active:
                if msg.version != 2:
                    self.rejected[k.node] = "unsigned keys in an active session"
                    continue
                if (key := self._verified(cfg, k)) is None:
                    continue  # substituted: treated as absent (why: self.rejected)
                self._ids[k.node] = key
            peers[k.node] = (k.channel_pk, k.mask_pk)
        if len(peers) < cfg.threshold:
            raise SecAggAbort(f"only {len(peers)} neighbours of {self.node_id!r} advertised keys, "
                              f"threshold is {cfg.threshold}: its secrets could not be recovered")
        self._peers = peers
        holders = sorted(peers, key=self._index.__getitem__)
        xs = [self._index[h] + 1 for h in holders]
        key_shares = share_bytes(crypto.private_bytes(self._s_sk), cfg.threshold, xs, self._rand)
        seed_shares = share_bytes(self._seed, cfg.threshold, xs, self._rand)
        out = []
        for holder, ks, ss in zip(holders, key_shares, seed_shares, strict=True):
            self._channel[holder] = crypto.agree(self._c_sk, peers[holder][0])
            key = crypto.channel_key(self._channel[holder], cfg.session_id, cfg.round_number,
                                     self.node_id, holder)
            ad = crypto.share_associated_data(cfg.session_id, cfg.round_number, self.node_id, holder)
            out.append((holder, crypto.encrypt_share(key, pack_shares(self.node_id, holder, ks, ss), ad)))
        self.stage = Stage.MASKED_INPUT
        return ShareKeys(cfg.session_id, cfg.round_number, self.node_id, tuple(out))

    def _verified(self, cfg: SessionConfig, k: PeerKeys) -> bytes | None:
        """The identity key of a neighbour whose keys carry a valid credential (certificate
        or roster path) and signature and are not of small order; None otherwise, with
        the reason kept in :attr:`rejected`."""
        if is_low_order(k.channel_pk) or is_low_order(k.mask_pk):
            self.rejected[k.node] = "an X25519 key of small order"
            return None
        try:
            key = identity_key(k.credential, k.node, self.policy.root_public_key, self.rosters,
                               self.policy.min_roster_epoch)
        except CertificateError as err:
            self.rejected[k.node] = f"its credential: {err}"
            return None
        signed = advertise_message(cfg, k.node, k.channel_pk, k.mask_pk, k.seed_commitment)
        if not verify(key, signed, k.signature):
            self.rejected[k.node] = "its keys are not signed by the identity key its credential names"
            return None
        return key

    def _mask(self, msg: SharesBroadcast, vector: np.ndarray) -> MaskedInput:
        """Round 2: decrypt the shares held for neighbours, then
        y_u = x_u + PRG(b_u) + sum_{v in U2 nbrs} sign(u, v) PRG(s_uv)  (mod 2^b)."""
        cfg = self._require_config()
        held: dict[str, tuple[bytes, bytes]] = {}
        masked: set[str] = set()
        for sender, ct in msg.ciphertexts:
            if sender not in self._peers:
                raise UnknownPeer(f"shares from {sender!r}, which did not advertise keys as a "
                                  f"neighbour of {self.node_id!r}")
            if sender in masked:
                raise DuplicateMessage(f"shares from {sender!r} delivered twice")
            masked.add(sender)
            try:
                held[sender] = self._open(cfg, sender, ct)
            except SecAggError:
                if not cfg.active:
                    raise
                # Active: a ciphertext that fails costs its sender this holder (its
                # secrets have k - 1 others); the pair's masks still cancel, since both
                # ends mask once the ciphertext was routed.
        if len(masked) < cfg.threshold:
            raise SecAggAbort(f"only {len(masked)} neighbours of {self.node_id!r} shared keys, "
                              f"threshold is {cfg.threshold}")
        x = self._check_vector(vector, cfg)
        dtype = word_dtype(cfg.modulus_bits)
        y = x.astype(dtype, copy=True)
        me = self._index[self.node_id]
        # One thread: a device has few cores, and a simulator runs many clients at once.
        # All the masks go in one batch, so y is walked once, a cache-sized chunk at a time.
        with MaskFolder(y, threads=1, batch=len(masked) + 1) as folder:
            folder.add(self._seed)
            for peer in sorted(masked, key=self._index.__getitem__):
                seed = crypto.pairwise_seed(self._s_sk, self._peers[peer][1], cfg.session_id,
                                            cfg.round_number, self.node_id, peer)
                # The lower-indexed node of a pair adds the mask, the higher one subtracts
                # it, so the pair's masks cancel in the sum (§4, "masking with one-time pads").
                folder.add(seed, 1 if me < self._index[peer] else -1)
            folder.finish()
        y &= np.asarray(modulus_mask(cfg.modulus_bits), dtype=dtype)
        self.masks_expanded += folder.expansions
        self._held = held
        self._masked = frozenset(masked)
        self._channel.clear()
        self.stage = Stage.CONSISTENCY if cfg.active else Stage.UNMASKING
        return MaskedInput(cfg.session_id, cfg.round_number, self.node_id, y)

    def _open(self, cfg: SessionConfig, sender: str, ct: bytes) -> tuple[bytes, bytes]:
        """Decrypt and check the shares ``sender`` sent this client."""
        if len(ct) != ciphertext_size(sender, self.node_id):
            raise MalformedMessage(f"ciphertext from {sender!r} has the wrong length {len(ct)}")
        key = crypto.channel_key(self._channel[sender], cfg.session_id, cfg.round_number,
                                 sender, self.node_id)
        ad = crypto.share_associated_data(cfg.session_id, cfg.round_number, sender, self.node_id)
        u, v, ks, ss = unpack_shares(crypto.decrypt_share(key, ct, ad, sender))
        if (u, v) != (sender, self.node_id):
            raise MalformedMessage(f"shares from {sender!r} name {u!r} -> {v!r} inside")
        return ks, ss

    def _sign_view(self, msg: ConsistencyRequest) -> ConsistencySignature:
        """Active sessions, between masking and unmasking: sign the view (U2, U3) if it
        fits what this client saw (see :mod:`~orchard.secure_agg.consistency`)."""
        cfg = self._require_config()
        view = View.from_bytes(msg.view, len(cfg.participants))
        ids = cfg.participants
        if self._index[self.node_id] not in view.u3:
            raise SecAggAbort(f"the survivor view leaves out {self.node_id!r}, whose masked input "
                              "was sent: the server lies about who survived")
        nbrs = frozenset(map(self._index.__getitem__, self._neighbours))
        in_u2 = {ids[j] for j in view.u2 & nbrs}
        if not in_u2 <= set(self._peers):
            raise SecAggAbort(f"the survivor view puts {sorted(in_u2 - set(self._peers))} in U2, which "
                              f"advertised no keys to {self.node_id!r}")
        if in_u2 & set(self._ids) != self._masked:
            short = sorted(in_u2 & set(self._ids) - self._masked)
            raise SecAggAbort(f"the shares broadcast to {self.node_id!r} lacked {short} (in U2) or named "
                              f"{sorted(self._masked - in_u2)} (not in U2): the server showed another view")
        self._view = msg.view
        self._survivors = frozenset(ids[j] for j in view.u3 & nbrs)
        self.stage = Stage.UNMASKING
        signature = self.identity.key.sign(consistency_message(cfg, msg.view))
        return ConsistencySignature(cfg.session_id, cfg.round_number, self.node_id, signature)

    def _check_vector(self, vector: np.ndarray, cfg: SessionConfig) -> np.ndarray:
        x = np.asarray(vector)
        if x.shape != (cfg.vector_length,) or x.dtype.kind != "u":
            raise UpdateSchemaError(f"expected {cfg.vector_length} unsigned integers, got "
                                    f"{x.dtype} with shape {x.shape}")
        if x.size and cfg.modulus_bits < 8 * x.dtype.itemsize and int(x.max()) >> cfg.modulus_bits:
            raise UpdateSchemaError(f"input values must be < 2^{cfg.modulus_bits}; quantise first")
        return x

    def _unmask(self, msg: UnmaskRequest) -> UnmaskShares:
        """Round 4: reveal b-shares of survivors and s_sk-shares of dropped neighbours,
        never both kinds for the same node."""
        cfg = self._require_config()
        if cfg.active:
            return self._unmask_active(cfg, msg)
        survivors, dropped = set(msg.survivors), set(msg.dropped)
        if len(survivors) != len(msg.survivors) or len(dropped) != len(msg.dropped):
            raise DuplicateMessage("the unmask request lists a node twice")
        both = survivors & dropped
        if both:
            raise MalformedMessage(f"the server asks for both shares of {sorted(both)}: that "
                                   f"would unmask their inputs; refusing")
        unknown = (survivors | dropped) - set(self._held)
        if unknown:
            raise UnknownPeer(f"unmask request names {sorted(unknown)}, whose shares "
                              f"{self.node_id!r} does not hold")
        if len(survivors) < cfg.threshold:
            raise SecAggAbort(f"only {len(survivors)} neighbours of {self.node_id!r} survived, "
                              f"threshold is {cfg.threshold}")
        seed_shares = tuple((u, self._held[u][1]) for u in msg.survivors)
        key_shares = tuple((u, self._held[u][0]) for u in msg.dropped)
        self.stage = Stage.DONE
        self._forget()
        return UnmaskShares(cfg.session_id, cfg.round_number, self.node_id, seed_shares, key_shares)

    def _unmask_active(self, cfg: SessionConfig, msg: UnmaskRequest) -> UnmaskShares:
        """Reveal only under the view this client signed, once t neighbours signed it too;
        which share of whom follows from the view, not from the server's say."""
        if msg.version != 2 or msg.view != self._view:
            raise SecAggAbort(f"the unmask request to {self.node_id!r} carries another survivor view than "
                              "the one it signed: the server shows different views")
        signed = consistency_message(cfg, self._view)
        good: set[str] = set()
        for s, sig in msg.signatures:  # t valid signatures are enough: stop there
            if len(good) >= cfg.threshold:
                break
            if s in self._ids and s not in good and verify(self._ids[s], signed, sig):
                good.add(s)
        if len(good) < cfg.threshold:
            raise SecAggAbort(f"only {len(good)} neighbours of {self.node_id!r} signed its survivor view, "
                              f"threshold is {cfg.threshold}: it reveals nothing")
        u3 = self._survivors  # the neighbours in U3 of the view it signed
        if len(self._masked & u3) < cfg.threshold:
            raise SecAggAbort(f"only {len(self._masked & u3)} neighbours of {self.node_id!r} survived, "
                              f"threshold is {cfg.threshold}")
        order = sorted(self._held, key=self._index.__getitem__)
        seed_shares = tuple((u, self._held[u][1]) for u in order if u in u3)
        key_shares = tuple((u, self._held[u][0]) for u in order if u not in u3)
        self.stage = Stage.DONE
        self._forget()
        return UnmaskShares(cfg.session_id, cfg.round_number, self.node_id, seed_shares, key_shares)

    def _forget(self) -> None:
        """Drop every secret of the session (keys, seed, the shares held): it is over."""
        for name in ("_c_sk", "_s_sk", "_seed"):
            self.__dict__.pop(name, None)
        self._held = {}
        self._channel.clear()
