"""Secure aggregation: SecAgg+ (Bell et al., 2020) as transport-free state machines, with
the original protocol (Bonawitz et al., 2017) as the complete-graph case.

The server learns the sum of the clients' quantised vectors modulo 2^b and nothing else
about any one of them, while tolerating clients that drop out at any stage up to a
threshold. Nothing here does I/O: a transport (gRPC, the simulator, a test) moves the
messages' bytes.

API
---
Parameters::

    params = choose_parameters(n, dropout_rate, corrupt_fraction=0.05)  # k, t, reasoning
    config = SessionConfig.create(participant_ids, vector_length,
                                  neighbours=params.neighbours, threshold=params.threshold,
                                  round_number=r, entropy=secrets.token_bytes(32))

Server (one per cohort and round; not thread-safe, serialise calls)::

    server = SecAggServer(config)         # workers=: a server's mask worker processes
    server.stage                          # Stage.ADVERTISE_KEYS, ..., DONE or ABORTED
    server.broadcast_for(node) -> Message # what `node` needs to act in the current stage
    server.broadcast_bytes(node) -> bytes # the same in wire form (what a transport sends)
    server.receive(stage, node, msg_or_bytes)   # one client message; refusals raise
    server.pending() -> frozenset[str]    # who may still send in this stage
    server.close_stage() -> StageReport   # at the deadline: go on with whoever sent
    server.result() -> SecAggResult       # .total (uint32 sum mod 2^b), .contributors

Client (one per session)::

    client = SecAggClient(node_id, entropy=secrets.token_bytes(32))
    reply = client.respond(broadcast, vector=None)   # vector: at the MASKED_INPUT stage

Messages are frozen dataclasses with ``to_bytes()`` / ``from_bytes()``; :func:`decode`
parses any of them. Stage by stage (server -> client, then client -> server):

================  ===================  ===============  ==================================
stage             broadcast_for(node)  client reply     what happens
================  ===================  ===============  ==================================
ADVERTISE_KEYS    SessionSetup         AdvertiseKeys    two fresh X25519 public keys (active:
                                                        signed, with certificate and H(b_u))
SHARE_KEYS        KeysBroadcast        ShareKeys        Shamir shares of s_sk and b_u,
                                                        AES-GCM encrypted per neighbour
MASKED_INPUT      SharesBroadcast      MaskedInput      y_u = x_u + masks (mod 2^b)
CONSISTENCY       ConsistencyRequest   Consistency-     active only: the view (U2, U3),
                                       Signature        signed
UNMASKING         UnmaskRequest        UnmaskShares     b-shares of survivors, s_sk-shares
                                                        of dropped neighbours
DONE / ABORTED    --                   --               result() / SecAggAbort
================  ===================  ===============  ==================================

Encoding floats: ``quantize(x, clip, bits, rng)`` -> uint32 in [0, 2^bits);
``dequantize(total, clip, bits, num_summands=len(result.contributors))``;
``check_headroom(n, bits, modulus_bits)`` refuses configurations whose sum could wrap.

Errors (all subclasses of ``orchard.errors.SecAggError``): ``WrongStage``,
``WrongSession`` (other session id or round: replays across rounds), ``DuplicateMessage``
(replay within a stage), ``UnknownPeer``, ``ExcludedNode``, ``MalformedMessage``,
``TamperedCiphertext``, ``NotEnoughShares``; ``SecAggAbort`` when too few clients are
left; ``SecAggConfigError`` (an ``orchard.errors.ConfigError``) for impossible parameters.
A refused message changes no state: the session goes on with the other clients.

Why the masks cancel
--------------------
Each client u draws a self-mask seed b_u and, for each neighbour v, agrees on a pairwise
seed s_uv = HKDF(DH(s_sk_u, s_pk_v)) (Bonawitz §4, round 2). It sends

    y_u = x_u + PRG(b_u) + sum_{v in N(u), v < u} -PRG(s_uv) + sum_{v in N(u), v > u} PRG(s_uv)

with every term in Z_{2^b}. For a pair u < v both present, u adds PRG(s_uv) and v
subtracts it: the pair cancels in sum_u y_u. What is left is sum x_u + sum PRG(b_u) plus
the masks that survivors share with nodes that dropped after sharing keys. In the
unmasking stage survivors reveal their Shamir shares of b_u for every surviving u and of
s_sk_d for every dropped d; the server reconstructs both from t shares each, expands
PRG(b_u) and recomputes s_dv for each surviving neighbour v of d, and subtracts. The
result is exactly sum_{u in U3} x_u mod 2^b, where U3 are the clients whose masked input
arrived (``result.contributors``).

What the server learns
----------------------
Every masked input it sees is uniform in Z_{2^b}: PRG(b_u) is a one-time pad under
AES-CTR's pseudorandomness, whatever x_u is (the tests check this with a chi-square
test). It never learns b_u of a dropped client (its input is not in the sum) nor s_sk_u
of a surviving one, because an honest client reveals, per neighbour, only one of the two
shares, and t is a strict majority of the k neighbours: a server that follows the
protocol cannot gather t shares of both kinds for one client unless more than 2t - k of
that client's neighbours collude with it (Bell et al., 2020, §3.3). A server that lies
about who dropped out can, unless the session is active (see the threat model). With the
neighbour graph connected among honest survivors (the third bound in
:mod:`~orchard.secure_agg.params`), the only function of the inputs it can compute is
their total over the survivors. Threshold t therefore trades two things: a larger t
resists more collusion, a smaller one tolerates more dropped neighbours (k - t per
client); :func:`choose_parameters` picks both from n, the dropout rate and the corrupt
fraction with failure probabilities 2^-20 (correctness) and 2^-40 (privacy), and reports
the reasoning.

Threat model
------------
Two protocols share these classes; ``SessionConfig.active`` picks one (active by default).

*Semi-honest* (``active=False``, message version 1; what the native device client
speaks): the server learns only the survivors' sum if it follows the protocol, against
up to c colluding clients in any neighbourhood with 2t - k > c. It does not hold against
a server that lies: one that tells different clients different dropout stories can
collect both kinds of shares of one client without any of them refusing (the attack in
``tests/secure_agg/test_active_adversary.py``), and keys are not authenticated, so a
relay or the server can substitute them. A bad share silently moves the sum.

*Active* (``active=True``, version 2; Bonawitz et al., 2017, §6, and the malicious
variant of Bell et al., 2020), against a server that deviates arbitrarily, relays that
alter what they forward, and clients that send anything:

- Keys are signed with the device's identity key (``orchard.identity``; the root
  certified it at enrollment) over the keys, H(b_u) and the session config's hash; a
  client checks each neighbour's certificate against the root key of its own
  :class:`ClientPolicy` and treats a neighbour that fails as absent. Instead of a
  certificate a device may carry a roster credential (:mod:`~orchard.secure_agg.roster`):
  the root's signature over the epoch's roster and a Merkle path to its key, so a client
  checks one roster signature and a path of hashes per neighbour. Without a root key
  (nothing enrolled, ``--insecure``) the signatures bind nothing and a relay can
  substitute keys: that case is only as strong as the semi-honest protocol.
- The consistency round (:mod:`~orchard.secure_agg.consistency`): a client reveals
  shares only under the one survivor view it signed and only holding valid signatures on
  it from t of its neighbours, deriving which shares from the view. Against a server
  lying about dropouts, no client's input leaks while 2t - k > c for the colluding
  clients c in every neighbourhood (the argument is in that module).
- The server refuses X25519 keys of small order (in both protocols) and recovers every
  secret from all its shares, drops shares that disagree and names their holders, and
  accepts a secret only if it matches H(b_u) or s_pk (:mod:`~orchard.secure_agg.verify`):
  malicious clients can make a session abort (named) or lose their neighbours, never
  change the sum of the others.
- Clients refuse parameters below their own floors (:class:`ClientPolicy`: n, k, and
  2t - k >= max(1, ceil(gamma k))), whatever the server proposes.

Neither protocol bounds a client's own input: a malicious client can add any vector to
the sum (up to the field, so it can wrap a coordinate); the server can only refuse sums
above n (2^bits - 1) (``orchard.server.secagg``). Preventing it needs a proof of each
input's range (e.g. ACORN, Bell et al., 2023), which is not implemented. The neighbour
graph's seed is drawn by the server, not by commit-reveal with the clients: a server that
tries T seeds and keeps the worst graph for a target raises the privacy bound's 2^-40
to T * 2^-40 per client (union bound), which the bound on c does not cover.
Clients drop their secrets when a session ends; the server drops its shares and the
reconstructed keys it cached.

Cost (n clients, k neighbours, d coordinates): a client does 2k key agreements and k + 1
mask expansions (AES-CTR, several GB/s); a client uploads d words plus O(k) keys and
shares; the server keeps one running sum (O(d)) and, at the end, expands one mask per
survivor and one per (dropped, surviving neighbour) pair.
"""

from __future__ import annotations

from orchard.secure_agg import errors, messages
from orchard.secure_agg.active import ClientPolicy, SessionIdentity
from orchard.secure_agg.client import SecAggClient
from orchard.secure_agg.consistency import ConsistencyRequest, ConsistencySignature, View
from orchard.secure_agg.errors import *  # noqa: F403
from orchard.secure_agg.graph import NeighbourGraph
from orchard.secure_agg.messages import *  # noqa: F403
from orchard.secure_agg.params import SecAggParameters, choose_parameters, parameters_from_config
from orchard.secure_agg.prg import expand_mask
from orchard.secure_agg.quantize import check_headroom, dequantize, quantize
from orchard.secure_agg.server import SecAggResult, SecAggServer, StageReport

# The errors and the messages are exported whole: their modules' __all__ is the one list.
__all__ = [
    *errors.__all__,
    *messages.__all__,
    "ClientPolicy",
    "ConsistencyRequest",
    "ConsistencySignature",
    "SessionIdentity",
    "View",
    "NeighbourGraph",
    "SecAggClient",
    "SecAggParameters",
    "SecAggResult",
    "SecAggServer",
    "StageReport",
    "check_headroom",
    "choose_parameters",
    "dequantize",
    "expand_mask",
    "parameters_from_config",
    "quantize",
]
