"""The server side of SecAgg+ as a state machine driven one message at a time
(Bonawitz et al., 2017, Fig. 2 / §4, server side of rounds 0-4; Bell et al., 2020,
Alg. 2 restricted to the neighbour graph).

Driving it::

    server = SecAggServer(config)
    # for each stage, until server.stage is DONE:
    #   clients poll server.broadcast_for(node) and post server.receive(stage, node, msg)
    #   at the deadline (or once server.pending() is empty) call server.close_stage()
    result = server.result()   # sum of the contributors' inputs mod 2^b

Node sets follow the paper: U1 advertised keys, U2 shared keys, U3 sent masked inputs,
U4 sent unmasking shares. A node missing a stage has dropped out; the session goes on as
long as every secret that must be reconstructed still has ``threshold`` holders, and
otherwise raises :class:`~orchard.errors.SecAggAbort` and stays aborted.

Masked inputs are added to one running sum as they arrive: memory is O(d + n k), never
O(n d) (O(threads d + n k) while unmasking: each mask thread, or each mask worker process,
folds into its own sum).

An active session (``SessionConfig.active``) adds the consistency stage between masked
input and unmasking (U4 are then the clients that signed the view and went on to
reveal), refuses keys whose signature does not verify, and recovers every secret from
all of its shares, dropping shares that disagree and naming their holders
(:mod:`~orchard.secure_agg.verify`), checked against H(b_u) or s_pk. Both modes refuse
X25519 keys of small order.
"""

from __future__ import annotations

import secrets
from collections.abc import Mapping
from typing import TYPE_CHECKING, cast

import numpy as np

from orchard.identity import CertificateError
from orchard.secure_agg import crypto
from orchard.secure_agg._wire import (
    MASK_KEY_SHARE_BYTES,
    SELF_MASK_SHARE_BYTES,
    ciphertext_size,
)
from orchard.secure_agg.active import (
    advertise_message,
    identity_key,
    is_low_order,
    seed_commitment,
    verify,
)
from orchard.secure_agg.consistency import ConsistencyRequest, ConsistencySignature, View
from orchard.secure_agg.errors import (
    DuplicateMessage,
    ExcludedNode,
    MalformedMessage,
    NotEnoughShares,
    SecAggAbort,
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
    PairColumns,
    PeerKeys,
    SessionConfig,
    SessionSetup,
    ShareKeys,
    SharesBroadcast,
    Stage,
    UnmaskRequest,
    UnmaskShares,
    as_columns,
    decode_columns,
    encoded_id,
    shares_broadcast_bytes,
)
from orchard.secure_agg.prg import (
    SEED_BYTES,
    ByteStream,
    MaskFolder,
    available_cores,
    modulus_mask,
    word_dtype,
)
from orchard.secure_agg.results import SecAggResult, StageReport
from orchard.secure_agg.roster import RosterCache, is_roster_credential, with_certificates
from orchard.secure_agg.shamir import reconstruct_many_bytes
from orchard.secure_agg.verify import recover_verified

if TYPE_CHECKING:
    from orchard.secure_agg.prg import FoldWorkers

__all__ = ["SecAggResult", "SecAggServer", "StageReport"]

_CLIENT_MESSAGE = {
    Stage.ADVERTISE_KEYS: AdvertiseKeys,
    Stage.SHARE_KEYS: ShareKeys,
    Stage.MASKED_INPUT: MaskedInput,
    Stage.CONSISTENCY: ConsistencySignature,
    Stage.UNMASKING: UnmaskShares,
}
_NEXT = {
    Stage.ADVERTISE_KEYS: Stage.SHARE_KEYS,
    Stage.SHARE_KEYS: Stage.MASKED_INPUT,
    Stage.MASKED_INPUT: Stage.UNMASKING,
    Stage.UNMASKING: Stage.DONE,
}
_NEXT_ACTIVE = {**_NEXT, Stage.MASKED_INPUT: Stage.CONSISTENCY, Stage.CONSISTENCY: Stage.UNMASKING}


class SecAggServer:
    """The server's side of one session. Not thread-safe: the caller serialises calls.

    ``threads`` is how many threads expand masks when the session unmasks (None: every
    core this process may use). Mask expansion is nearly all of the server's work in a
    large session; the threads live only inside :meth:`close_stage` of the last stage.
    Given ``workers`` (:class:`~orchard.secure_agg.prg.FoldWorkers`: the mask worker
    processes a server starts once, ``orchard.server.maskworkers.MaskWorkers``), the masks are expanded on those processes instead, free of this
    process's GIL; the threads are then the fallback for when the workers are busy.

    ``root_public_key``: check each active client's certificate against the root (without
    it, its signature is checked against the key its credential names; the clients check
    the certificates either way). ``entropy``: the randomness of the share checks, which no
    client may predict (default: 32 bytes from the OS). ``rosters``: the signed rosters
    this server has checked (:mod:`~orchard.secure_agg.roster`; a tier keeps one across
    sessions). ``certificates``: the root's certificates of the participants' keys (node
    id -> certificate), as far as the server holds them: a client that advertised no
    roster credential is shown them instead (:func:`~orchard.secure_agg.roster.with_certificates`).
    """

    def __init__(self, config: SessionConfig, *, threads: int | None = None,
                 workers: FoldWorkers | None = None, root_public_key: bytes | None = None,
                 entropy: bytes | None = None, rosters: RosterCache | None = None,
                 certificates: Mapping[str, bytes] | None = None) -> None:
        if threads is not None and threads < 1:
            raise ValueError(f"threads must be >= 1 (or None for every core), got {threads}")
        self.config = config
        self.root_public_key = root_public_key
        self._rosters = rosters if rosters is not None else RosterCache()
        self._certificates = dict(certificates or {})
        self._rand = ByteStream(crypto.hkdf(entropy if entropy is not None else secrets.token_bytes(32),
                                            b"server-checks", 32))
        self.threads = threads if threads is not None else available_cores()
        self.workers = workers
        self.stage = Stage.ADVERTISE_KEYS
        self.abort_reason: str | None = None
        ids = config.participants
        self._ids = ids
        self._index = {p: i for i, p in enumerate(ids)}
        graph = NeighbourGraph(len(ids), config.neighbours, config.graph_seed)
        self._nbrs: list[frozenset[int]] = graph.adjacency()
        self._nbr_order: list[list[int]] = [sorted(a) for a in self._nbrs]  # for broadcasts
        self._live: set[int] = set(range(len(ids)))  # may send in the current stage
        self._sent: set[int] = set()  # sent in the current stage
        self._keys: dict[int, tuple[bytes, bytes]] = {}  # U1: (c_pk, s_pk)
        self._signed: dict[int, tuple[bytes, bytes, bytes]] = {}  # U1, active: (H(b_u), credential, sig)
        self._view = b""  # active: the survivor view every client in U3 is shown
        self._view_sigs: dict[int, bytes] = {}  # active: who signed it
        self._offenders: set[int] = set()
        self._peer_keys: dict[int, PeerKeys] = {}  # U1, as sent to neighbours (made once)
        self._cert_keys: dict[int, PeerKeys] = {}  # U1, as sent to those that advertised no roster credential
        # Expected ciphertext length i -> j is _ct_base + _id_len[i] + _id_len[j]
        # (ciphertext_size without encoding both ids for each of the n k ciphertexts).
        self._id_len = [len(p.encode()) for p in ids]
        self._ct_base = ciphertext_size("", "")
        # With ids of one length (the usual case) every ciphertext has one length.
        self._ct_len: int | None = (self._ct_base + 2 * self._id_len[0]
                                    if len(set(self._id_len)) == 1 else None)
        self._seen_keys: set[bytes] = set()
        self._encoded_ids: list[bytes] | None = None  # ids in wire form, made when first needed
        # Ciphertexts in transit, as parallel lists rather than n k long-lived pairs (fewer
        # objects for the garbage collector to walk while the session runs).
        self._inbox: dict[int, tuple[list[int], list[bytes]]] = {}  # recipient -> senders, cts
        self._outbox: dict[int, tuple[list[int], list[bytes]]] = {}  # sender -> recipients, cts
        self._u2: frozenset[int] = frozenset()
        self._u3: frozenset[int] = frozenset()
        self._dtype = word_dtype(config.modulus_bits)
        self._total: np.ndarray | None = None
        self._seed_shares: dict[int, dict[int, bytes]] = {}  # owner -> {x: share}
        self._key_shares: dict[int, dict[int, bytes]] = {}
        self._result: SecAggResult | None = None
        self._measurements: dict[str, float] = {"bytes_received": 0.0}

    # ------------------------------------------------------------------ queries

    def pending(self) -> frozenset[str]:
        """Nodes that may still send in the current stage (empty: close now)."""
        if self.stage in (Stage.DONE, Stage.ABORTED):
            return frozenset()
        return frozenset(self._ids[i] for i in self._live - self._sent)

    def received(self) -> frozenset[str]:
        return frozenset(self._ids[i] for i in self._sent)

    def _check_open(self) -> None:
        if self.stage is Stage.ABORTED:
            raise SecAggAbort(f"session aborted: {self.abort_reason}")

    def _node(self, node: str) -> int:
        i = self._index.get(node)
        if i is None:
            raise UnknownPeer(f"{node!r} is not a participant of this session")
        return i

    # ------------------------------------------------------------------ broadcasts

    def broadcast_for(self, node: str) -> Message:
        """The message ``node`` needs to act in the current stage.

        Raises :class:`ExcludedNode` for a node that dropped out earlier, :class:`WrongStage`
        once the session is done, :class:`~orchard.errors.SecAggAbort` once it aborted.
        """
        i = self._broadcast_target(node)
        cfg = self.config
        if self.stage is Stage.ADVERTISE_KEYS:
            return SessionSetup(node, cfg)
        sid, rnd = cfg.session_id, cfg.round_number
        if self.stage is Stage.SHARE_KEYS:
            pk = self._peer_keys if is_roster_credential(self._signed.get(i, (b"", b""))[1]) else self._cert_keys
            return KeysBroadcast(sid, rnd, node, tuple([pk[j] for j in self._nbr_order[i] if j in pk]),
                                 active=cfg.active)
        if self.stage is Stage.MASKED_INPUT:
            senders, cts = self._inbox.get(i, ([], []))
            ids = self._ids
            return SharesBroadcast(sid, rnd, node, tuple(zip([ids[j] for j in senders], cts,
                                                             strict=True)))
        ids, u2, u3 = self._ids, self._u2, self._u3
        if self.stage is Stage.CONSISTENCY:
            return ConsistencyRequest(sid, rnd, node, self._view)
        if cfg.active:
            sigs = self._view_sigs
            return UnmaskRequest(sid, rnd, node, (), (), self._view,
                                 tuple([(ids[j], sigs[j]) for j in self._nbr_order[i] if j in sigs]))
        nb = [j for j in self._nbr_order[i] if j in u2]
        return UnmaskRequest(sid, rnd, node, tuple([ids[j] for j in nb if j in u3]),
                             tuple([ids[j] for j in nb if j not in u3]))

    def broadcast_bytes(self, node: str) -> bytes:
        """``broadcast_for(node).to_bytes()``, byte for byte. The MASKED_INPUT stage's
        broadcast (k share ciphertexts per node, n k per stage) is written straight from
        the routed ciphertexts, without a message object and a tuple per pair."""
        if self.stage is not Stage.MASKED_INPUT:
            return self.broadcast_for(node).to_bytes()
        i = self._broadcast_target(node)
        senders, cts = self._inbox.get(i, ([], []))
        enc = self._encoded_ids
        if enc is None:
            enc = self._encoded_ids = [encoded_id(p) for p in self._ids]
        return shares_broadcast_bytes(self.config.session_id, self.config.round_number, node,
                                      [enc[j] for j in senders], cts)

    def _broadcast_target(self, node: str) -> int:
        self._check_open()
        i = self._node(node)
        if self.stage is Stage.DONE:
            raise WrongStage("the session is done: there is nothing more to broadcast")
        if i not in self._live:
            raise ExcludedNode(f"{node!r} dropped out before stage {self.stage.value}")
        return i

    # ------------------------------------------------------------------ receive

    def receive(self, stage: Stage, from_node: str, msg: Message | bytes) -> None:
        """Accept one client message of ``stage`` from the authenticated ``from_node``.

        Refuses (without changing any state) with a :class:`~orchard.errors.SecAggError`
        subclass that says why: wrong stage, other session or round, a sender that is not
        ``from_node``, a replay, unknown peers, or malformed content.
        """
        self._check_open()
        # Share lists in columns (no tuple per pair), whether bytes or a message came.
        if isinstance(msg, bytes | bytearray | memoryview):
            nbytes, got = len(msg), decode_columns(msg)
        else:
            nbytes, got = 0, as_columns(msg)
        kind = got.cls if isinstance(got, PairColumns) else type(got)
        if stage is not self.stage:
            raise WrongStage(f"message for stage {Stage(stage).value}, the session is in "
                             f"{self.stage.value}")
        expected = _CLIENT_MESSAGE.get(stage)
        if expected is None or not issubclass(kind, expected):
            raise WrongStage(f"stage {stage.value} takes a "
                             f"{expected.__name__ if expected else 'nothing'}, "
                             f"got a {kind.__name__}")
        cfg = self.config
        if got.session_id != cfg.session_id or got.round_number != cfg.round_number:
            raise WrongSession(
                f"message for session {got.session_id.hex()} round {got.round_number}, this "
                f"is session {cfg.session_id.hex()} round {cfg.round_number}: replayed or misrouted")
        if got.node != from_node:
            raise UnknownPeer(f"message claims sender {got.node!r} but came from {from_node!r}")
        i = self._node(from_node)
        if i not in self._live:
            raise ExcludedNode(f"{from_node!r} dropped out before stage {stage.value}")
        if i in self._sent:
            raise DuplicateMessage(f"{from_node!r} already sent in stage {stage.value}; "
                                   f"the first message stands")
        if isinstance(got, AdvertiseKeys):
            self._on_keys(i, got)
        elif isinstance(got, MaskedInput):
            self._on_masked(i, got)
        elif isinstance(got, ConsistencySignature):
            self._view_sigs[i] = got.signature
        else:
            assert isinstance(got, PairColumns)
            if kind is ShareKeys:
                self._on_shares(i, from_node, *got.lists[0])
            else:
                self._on_unmask(i, from_node, *got.lists)
        self._sent.add(i)
        self._measurements["bytes_received"] += nbytes

    def _on_keys(self, i: int, msg: AdvertiseKeys) -> None:
        crypto.load_public(msg.channel_pk)
        crypto.load_public(msg.mask_pk)
        if is_low_order(msg.channel_pk) or is_low_order(msg.mask_pk):
            raise MalformedMessage(f"{msg.sender!r} advertises an X25519 key of small order: every "
                                   "agreement with it would be a value anyone knows")
        if self.config.active:
            self._check_signed(msg)
        if msg.channel_pk == msg.mask_pk or {msg.channel_pk, msg.mask_pk} & self._seen_keys:
            raise DuplicateMessage(f"{msg.sender!r} advertises a public key already in use: "
                                   f"keys must be fresh and distinct")
        self._seen_keys.update((msg.channel_pk, msg.mask_pk))
        self._keys[i] = (msg.channel_pk, msg.mask_pk)
        if self.config.active:
            self._signed[i] = (msg.seed_commitment, msg.credential, msg.signature)

    def _check_signed(self, msg: AdvertiseKeys) -> None:
        if msg.version != 2:
            raise MalformedMessage(f"{msg.sender!r} sends unsigned keys to an active session")
        try:
            key = identity_key(msg.credential, msg.sender, self.root_public_key, self._rosters)
        except CertificateError as err:
            raise MalformedMessage(f"{msg.sender!r}'s credential: {err}") from None
        signed = advertise_message(self.config, msg.sender, msg.channel_pk, msg.mask_pk, msg.seed_commitment)
        if not verify(key, signed, msg.signature):
            raise MalformedMessage(f"{msg.sender!r}'s keys are not signed by the identity key its "
                                   "credential names")

    def _on_shares(self, i: int, sender: str, names: list[str], cts: list[bytes]) -> None:
        expected = self._nbrs[i] & self._keys.keys()
        js = list(map(self._index.get, names))
        recipients = set(js)
        if not recipients <= expected:
            bad = next(r for r, j in zip(names, js, strict=True) if j not in expected)
            raise UnknownPeer(f"{sender!r} sends shares to {bad!r}, which is not one of its "
                              f"neighbours that advertised keys")
        known = cast(list[int], js)  # no None left: every recipient is expected
        id_len = self._id_len
        if self._ct_len is None or set(map(len, cts)) - {self._ct_len}:
            base = self._ct_base + id_len[i]
            for recipient, j, ct in zip(names, known, cts, strict=True):
                if len(ct) != base + id_len[j]:
                    raise MalformedMessage(f"ciphertext {sender!r} -> {recipient!r} has "
                                           f"length {len(ct)}, expected {base + id_len[j]}")
        if len(recipients) != len(known):
            raise DuplicateMessage(f"{sender!r} sends two ciphertexts to the same neighbour")
        if recipients != expected and not self.config.active:
            missing = sorted(self._ids[j] for j in expected - recipients)
            raise MalformedMessage(f"{sender!r} must send shares to every neighbour that "
                                   f"advertised keys; missing {missing}")
        self._outbox[i] = (known, cts)

    def _on_masked(self, i: int, msg: MaskedInput) -> None:
        cfg = self.config
        v = msg.vector
        if v.shape != (cfg.vector_length,) or v.dtype.itemsize != self._dtype.itemsize:
            raise MalformedMessage(f"masked input of {msg.sender!r}: expected "
                                   f"{cfg.vector_length} words of {self._dtype}, got "
                                   f"{v.size} of {v.dtype}")
        if v.size and cfg.modulus_bits < 8 * self._dtype.itemsize and int(v.max()) >> cfg.modulus_bits:
            raise MalformedMessage(f"masked input of {msg.sender!r} has values >= 2^{cfg.modulus_bits}")
        if self._total is None:
            self._total = np.zeros(cfg.vector_length, dtype=self._dtype)
        np.add(self._total, v.astype(self._dtype, copy=False), out=self._total)

    def _on_unmask(self, i: int, sender: str, seed_shares: tuple[list[str], list[bytes]],
                   key_shares: tuple[list[str], list[bytes]]) -> None:
        nb = self._nbrs[i] & self._u2
        get = self._index.get
        staged: list[tuple[dict[int, dict[int, bytes]], list[int], list[bytes]]] = []
        for (names, shares), want, size, store in (
            (seed_shares, nb & self._u3, SELF_MASK_SHARE_BYTES, self._seed_shares),
            (key_shares, nb - self._u3, MASK_KEY_SHARE_BYTES, self._key_shares),
        ):
            if len(set(names)) != len(names):
                raise DuplicateMessage(f"{sender!r} sends two shares for one node")
            owners = list(map(get, names))
            if set(owners) != want and not (self.config.active and set(owners) <= want):
                # (An active holder leaves out owners whose ciphertext failed to open.)
                asked = {self._ids[j] for j in want}
                raise UnknownPeer(f"{sender!r} sends shares for {sorted(set(names) - asked)} "
                                  f"and misses {sorted(asked - set(names))}: not what was asked")
            if set(map(len, shares)) - {size}:
                owner, share = next((o, sh) for o, sh in zip(names, shares, strict=True)
                                    if len(sh) != size)
                raise MalformedMessage(f"share of {owner!r} from {sender!r} is "
                                       f"{len(share)} bytes, expected {size}")
            staged.append((store, cast(list[int], owners), shares))  # all in want: no None
        x = i + 1  # i's Shamir evaluation point
        for store, known, held in staged:
            for j, share in zip(known, held, strict=True):
                store[j][x] = share

    # ------------------------------------------------------------------ close

    def close_stage(self) -> StageReport:
        """End the current stage with whoever has sent; everyone else has dropped out.

        Raises :class:`~orchard.errors.SecAggAbort` (and the session stays aborted) when too
        few nodes are left to reconstruct what the next stages need.
        """
        self._check_open()
        if self.stage is Stage.DONE:
            raise WrongStage("the session is already done")
        stage = self.stage
        sent, live = set(self._sent), set(self._live)
        dropped = live - sent
        alive = set(sent)  # senders that go on to the next stage
        try:
            if stage is Stage.ADVERTISE_KEYS:
                self._prune(alive)
                self._keys = {j: k for j, k in self._keys.items() if j in alive}
                self._peer_keys = {j: PeerKeys(self._ids[j], *k, *self._signed.get(j, (b"", b"", b"")))
                                   for j, k in self._keys.items()}
                self._cert_keys = with_certificates(self._peer_keys, self._certificates)
            elif stage is Stage.SHARE_KEYS:
                self._prune(alive)
                self._u2 = frozenset(alive)
                inbox = self._inbox = {r: ([], []) for r in sorted(alive)}
                for s, (recipients, cts) in self._outbox.items():
                    if s not in alive:
                        continue
                    for r, ct in zip(recipients, cts, strict=True):
                        if r in alive:
                            senders, held = inbox[r]
                            senders.append(s)
                            held.append(ct)
                self._outbox.clear()
            elif stage is Stage.MASKED_INPUT:
                self._u3 = frozenset(sent)
                self._check_reconstructible(self._u3, "will be able to respond")
                self._inbox.clear()
                # One share store per secret the unmasking stage may reveal (a survivor's
                # seed, a dropped node's mask key), so receiving a share is one store.
                self._seed_shares = {u: {} for u in self._u3}
                self._key_shares = {d: {} for d in self._u2 - self._u3}
                if self.config.active:
                    self._view = View(len(self._ids), self._u2, self._u3).to_bytes()
            elif stage is Stage.CONSISTENCY:
                self._check_reconstructible(frozenset(sent), "signed the survivor view")
            else:
                self._unmask(sent)
        except SecAggAbort as err:
            self.stage = Stage.ABORTED
            self.abort_reason = str(err)
            self._seed_shares.clear()  # an aborted session's secrets are of no use to anyone
            self._key_shares.clear()
            crypto.load_private_cached.cache_clear()
            raise
        excluded = sent - alive
        self._live = alive
        self._sent = set()
        self.stage = (_NEXT_ACTIVE if self.config.active else _NEXT)[stage]
        ids = self._ids
        return StageReport(stage, self.stage, tuple(ids[j] for j in sorted(sent)),
                           tuple(ids[j] for j in sorted(dropped)),
                           tuple(ids[j] for j in sorted(excluded)))

    def _prune(self, alive: set[int]) -> None:
        """Remove (in place) nodes left with fewer than t live neighbours: their secrets
        could never be reconstructed. Repeat, since each removal can starve a neighbour."""
        t = self.config.threshold
        changed = True
        while changed:
            changed = False
            for j in sorted(alive):
                if len(self._nbrs[j] & alive) < t:
                    alive.discard(j)
                    changed = True
        if len(alive) < t:
            raise SecAggAbort(f"only {len(alive)} clients are left with enough live neighbours, "
                              f"threshold is {t}")

    def _check_reconstructible(self, holders: frozenset[int], how: str) -> None:
        t = self.config.threshold
        short = []
        for u in sorted(self._u2):
            need = u in self._u3 or bool(self._nbrs[u] & self._u3)
            have = len(self._nbrs[u] & self._u2 & holders)
            if need and have < t:
                short.append(f"{self._ids[u]!r} ({have} holders)")
        if len(self._u3) < t or short:
            raise SecAggAbort(
                f"{len(self._u3)} masked inputs arrived; the secrets of {len(short)} node(s) "
                f"have fewer than t={t} share holders that {how}: "
                + ", ".join(short[:10]) + (" ..." if len(short) > 10 else "")
            )

    def _unmask(self, responders: set[int]) -> None:
        """Round 4 server side: reconstruct b_u of survivors and s_sk of dropped nodes,
        then remove PRG(b_u) and the dropped nodes' pairwise masks from the sum."""
        cfg = self.config
        self._check_reconstructible(frozenset(responders), "responded")
        total = self._total if self._total is not None else np.zeros(cfg.vector_length, self._dtype)
        agreements = 0
        # Survivors' self-mask seeds come from one batched Shamir pass. The dropped nodes'
        # pairwise seeds are handed to the folder as derivations: its threads (or worker
        # processes) run each X25519 agreement (which holds the GIL) between their AES
        # calls, instead of this thread running all of them first while the others wait.
        with MaskFolder(total, threads=self.threads, workers=self.workers) as folder:
            try:
                # A batch of seeds at a time: the first mask thread starts after one batch
                # is reconstructed (a few ms) instead of all of them (~50 ms at n = 1000,
                # with every core idle).
                survivors = sorted(self._u3)
                for lo in range(0, len(survivors), folder.batch):
                    batch = {u: self._seed_shares.get(u, {}) for u in survivors[lo:lo + folder.batch]}
                    for seed in self._recover(batch, SEED_BYTES).values():
                        folder.add(seed, -1)
                # Dropped nodes with a surviving neighbour: their pairwise masks are in the sum.
                dropped = [d for d in sorted(self._u2 - self._u3) if self._nbrs[d] & self._u3]
                keys = self._recover({d: self._key_shares.get(d, {}) for d in dropped}, crypto.KEY_BYTES)
                for d in dropped:
                    # Cached: the mask threads' PairwiseSeeds load the same key again.
                    s_sk = crypto.load_private_cached(keys[d])
                    if crypto.public_bytes(s_sk) != self._keys[d][1]:
                        raise SecAggAbort(f"the mask key reconstructed for {self._ids[d]!r} does "
                                          f"not match its advertised public key: a share was "
                                          f"corrupted")
                    for v in sorted(self._nbrs[d] & self._u3):
                        # v added +PRG(s_vd) if v < d, else -PRG(s_vd): take off the same term.
                        folder.add(crypto.PairwiseSeed(
                            keys[d], self._keys[v][1], cfg.session_id, cfg.round_number,
                            self._ids[d], self._ids[v]), -1 if v < d else 1)
                        agreements += 1
                folder.finish()
            except (NotEnoughShares, MalformedMessage) as err:
                raise SecAggAbort(f"reconstruction failed: {err}") from None
        total &= np.asarray(modulus_mask(cfg.modulus_bits), dtype=self._dtype)
        m = self._measurements
        m["mask_expansions"] = float(folder.expansions)
        m["mask_batches_on_workers"] = float(folder.batches_on_workers)
        m["key_agreements"] = float(agreements)
        m["contributors"] = float(len(self._u3))
        m["dropped_pairwise_removed"] = float(agreements)
        m["offenders"] = float(len(self._offenders))
        self._result = SecAggResult(
            total=total,
            contributors=tuple(self._ids[j] for j in sorted(self._u3)),
            dropped=tuple(p for j, p in enumerate(self._ids) if j not in self._u3),
            measurements=dict(m),
            offenders=tuple(self._ids[j] for j in sorted(self._offenders)),
        )
        self._total = None
        self._seed_shares.clear()
        self._key_shares.clear()
        # The dropped nodes' reconstructed mask keys are of no use past this session: out of
        # the process-wide cache (which spares re-deriving a public key per pairwise seed).
        crypto.load_private_cached.cache_clear()

    def _recover(self, shares: dict[int, dict[int, bytes]], secret_len: int) -> dict[int, bytes]:
        """Each owner's secret from its holders' shares: the t lowest points (semi-honest),
        or every share, checked and checked against the owner's commitment (active)."""
        cfg, t, ids = self.config, self.config.threshold, self._ids
        if not cfg.active:
            got = reconstruct_many_bytes({ids[u]: held for u, held in shares.items()}, t, secret_len)
            return {u: got[ids[u]] for u in shares}
        if secret_len == SEED_BYTES:
            def check(u: int, secret: bytes) -> bool:
                return seed_commitment(cfg, ids[u], secret) == self._signed[u][0]
        else:
            def check(u: int, secret: bytes) -> bool:
                return crypto.public_bytes(crypto.load_private(secret)) == self._keys[u][1]
        got = recover_verified(shares, t, secret_len, check, self._rand)
        for points in got.discarded.values():
            self._offenders.update(x - 1 for x in points)
        if got.failed:
            named = [ids[u] for u in sorted(got.failed)]
            raise SecAggAbort(
                f"the secrets of {named} cannot be recovered ({got.failed[min(got.failed)]}): they "
                f"dealt shares of no committed secret, or too many of their holders lied"
                + (f"; holders whose shares disagreed: {[ids[j] for j in sorted(self._offenders)]}"
                   if self._offenders else ""))
        return got.secrets

    def result(self) -> SecAggResult:
        """The unmasked sum once the UNMASKING stage has closed."""
        self._check_open()
        if self._result is None:
            raise WrongStage(f"no result yet: the session is in stage {self.stage.value}")
        return self._result
