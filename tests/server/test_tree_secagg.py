"""Secure aggregation over the whole tree (``secure_aggregation.scope = "tree"``).

The root owns one SecAgg+ session per round over every client selected anywhere below
it; each tier below reports its roster upward and relays its clients' stage messages
(``ParentUpstream``, as the simulator drives it). Here real inline coordinators, a fake
clock and real ``SecureParticipant``s run whole rounds in trees of random shape, and the
root's unmasked sum is checked against the sum of the field vectors computed here."""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from dataclasses import dataclass, field

import numpy as np
import pytest
from hypothesis import event, given, settings
from hypothesis import strategies as st

from orchard.client.secure import SecureParticipant
from orchard.client.update import build_upload
from orchard.compression import build_codec
from orchard.config import RunConfig, ServerConfig
from orchard.errors import OrchardError, RoundClosedError, SecAggError
from orchard.messages import TaskAssignment, UploadHeader
from orchard.secure_agg import Stage, dequantize
from orchard.secure_agg.stages import stage_index, stage_of
from orchard.server.cohort import CohortRound
from orchard.server.coordinator import Coordinator, ParentUpstream, run_inline
from orchard.server.decoding import ClientUpdateDecoder
from orchard.server.round import RoundTask, task_from_assignment
from orchard.server.secagg import ROSTER_END, STAGE_END, SecureCohort
from orchard.trainer import TrainResult
from orchard.typing import DeviceState, Role, TensorSpec

SCHEMA = (TensorSpec("w", (3,), "float32"), TensorSpec("b", (2,), "float32"))
D = sum(s.numel for s in SCHEMA)
WALL0 = 1_700_000_000.0
DEADLINE_S = 120.0  # well inside the node timeout (600 s): no one times out on the fake clock
# An active session (the default) has the consistency round between masked input and unmasking.
STAGES = (Stage.ADVERTISE_KEYS, Stage.SHARE_KEYS, Stage.MASKED_INPUT, Stage.CONSISTENCY, Stage.UNMASKING)
NEVER = len(STAGES) + 1  # a client that answers every stage and keeps polling to the end


class Clock:
    """One fake clock for a whole tree: monotonic seconds and wall time."""

    def __init__(self) -> None:
        self.t = 0.0

    def mono(self) -> float:
        return self.t

    def wall(self) -> float:
        return WALL0 + self.t

    def to_wall(self, w: float) -> None:
        assert w >= self.wall()
        self.t = w - WALL0


@dataclass(frozen=True)
class Shape:
    clients: int  # direct clients of this tier
    children: tuple[Shape, ...] = ()  # aggregator children


@dataclass
class Tier:
    name: str
    coord: Coordinator
    parent: Tier | None
    children: list[Tier] = field(default_factory=list)
    clients: list[str] = field(default_factory=list)
    assignment: TaskAssignment | None = None  # this tier's task from its parent
    cr: CohortRound | None = None

    def walk(self) -> Iterator[Tier]:
        yield self
        for c in self.children:
            yield from c.walk()


@dataclass
class Client:
    node: str
    tier: Tier
    t: TaskAssignment
    me: SecureParticipant
    header: UploadHeader
    vector: np.ndarray
    limit: int = NEVER  # stage messages it sends before it goes silent for good (NEVER: it does not)
    sent_input: bool = False  # its masked input was taken (the exchange returned)
    end: str = ""  # "done" or "aborted: ..." once an exchange told it the session ended
    errors: list[str] = field(default_factory=list)  # refusals it got (it is silent after one)


def run_config(n: int, bits: int = 16, modulus_bits: int = 32, dropout_rate: float = 0.1,
               deadline_s: float = DEADLINE_S) -> RunConfig:
    """A secure run over the whole tree with target ``n``. Above 16 clients a SecAgg+
    graph of 12 neighbours (t = 8) instead of the complete graph the defaults choose for
    cohorts this small: the same protocol, a fraction of the key agreements."""
    sparse = {"neighbours": 12, "threshold": 0.6} if n > 16 else {}
    return RunConfig(
        cohort={"target": n, "over_selection": 1.0, "deadline_s": deadline_s},
        secure_aggregation={"enabled": True, "scope": "tree", "bits": bits, "modulus_bits": modulus_bits,
                            "dropout_rate": dropout_rate, **sparse})


def count_clients(s: Shape) -> int:
    return s.clients + sum(count_clients(c) for c in s.children)


@st.composite
def shapes(draw: st.DrawFn, max_depth: int = 2) -> Shape:
    """A tree below the root: up to ``max_depth`` aggregator levels (uneven: a branch may
    stop early), fanout 1-3, 3-6 clients per lowest tier, and 0-2 direct clients beside
    the aggregators of a tier that has them (the root's included)."""
    uneven = draw(st.booleans())

    def tier(level: int) -> Shape:
        if level == 0:
            return Shape(draw(st.integers(3, 6)))
        kids = tuple(tier(draw(st.integers(0, level - 1)) if uneven else level - 1)
                     for _ in range(draw(st.integers(1, 3))))
        return Shape(draw(st.integers(0, 2)), kids)

    return tier(draw(st.integers(0, max_depth)))


def build(shape: Shape, clock: Clock, seed: int) -> Tier:
    """Inline coordinators for ``shape``: aggregators joined to their parents, clients to
    their tiers; pool sizes reported bottom-up (as the simulator's _report_pools)."""

    def make(name: str, parent: Tier | None, s: Shape) -> Tier:
        coord = Coordinator(name, ServerConfig(node_timeout_s=600), np.random.default_rng(seed),
                            ClientUpdateDecoder(), monotonic=clock.mono, wall=clock.wall, inline=True)
        t = Tier(name, coord, parent)
        for i, k in enumerate(s.children):
            child = make(f"{name}.{i}", t, k)
            coord.join(child.name, Role.AGGREGATOR, "tok", DeviceState(charging=True))
            t.children.append(child)
        for i in range(s.clients):
            node = f"{name}-c{i}"
            coord.join(node, Role.CLIENT, "tok", DeviceState())
            t.clients.append(node)
        return t

    root = make("root", None, shape)
    for t in reversed(list(root.walk())):
        if t.parent is not None:
            size, elig = t.coord.capacity()
            t.parent.coord.touch(t.name, pool_size=size, pool_eligible=elig)
    return root


def root_task(cfg: RunConfig, clock: Clock) -> RoundTask:
    return RoundTask(run_id="run", round=1, attempt=0, config=cfg, config_json=cfg.model_dump_json(),
                     model_blob=b"model", model_hash="h", schema=SCHEMA,
                     deadline_unix=clock.wall() + cfg.cohort.deadline_s,
                     target=cfg.cohort.target, shared_seed=7)


def open_below(parent: Tier, cfg: RunConfig, skip: frozenset[str] = frozenset()) -> None:
    """As the simulator's _open_below: each tier opens its parent's assignment with a
    ParentUpstream, opens the tiers below it, then reports its roster."""
    for t in parent.children:
        if t.name in skip:
            continue
        a = parent.coord.assign(t.name)
        assert a is not None, f"{t.name} was not selected"
        t.assignment = a
        t.cr = t.coord.open_round(task_from_assignment(a, b"model", cfg),
                                  upstream=ParentUpstream(parent.coord, t.name, a))
        open_below(t, cfg, skip)
        run_inline(t.coord.send_roster(t.cr))


def open_tree(root: Tier, cfg: RunConfig, clock: Clock, skip: frozenset[str] = frozenset()) -> None:
    root.cr = root.coord.open_round(root_task(cfg, clock))
    open_below(root, cfg, skip)


def dispatch(root: Tier, cfg: RunConfig, rng: np.random.Generator, skip: frozenset[str] = frozenset()) -> list[Client]:
    """Every selected client gets its assignment, a header built by build_upload and a
    random field vector in [0, 2^bits)."""
    codec = build_codec(cfg.codec)
    bits = cfg.secure_aggregation.bits
    out = []
    for tier in root.walk():
        if tier.name in skip or (tier.parent is not None and tier.cr is None):
            continue
        for node in tier.clients:
            t = tier.coord.assign(node)
            assert t is not None, f"{node} was not selected"
            tier.coord.count_bytes_down(len(b"model"))  # its model download, as the simulator counts it
            w = int(rng.integers(1, 50))
            res = TrainResult(arrays={}, weight=float(w), num_examples=w, num_steps=1)
            delta = {s.name: np.zeros(s.shape, np.float32) for s in t.schema}
            header, _, _ = build_upload(t, cfg, cfg.train, codec, node, delta, res, seed=0, states=None)
            vector = rng.integers(0, 1 << bits, size=D, dtype=np.uint64).astype(np.uint32)
            entropy = hashlib.sha256(f"{node}/{rng.integers(1 << 30)}".encode()).digest()
            out.append(Client(node, tier, t, SecureParticipant(node, entropy), header, vector))
    return out


def turn(c: Client) -> bool:
    """Let one client answer what the session asks of it now (as the simulator's
    _secure_turn), unless it has gone silent or heard the end. True if it sent anything."""
    if c.end or c.errors or len(c.me.answered) >= c.limit:
        return False
    t, stage, message, header, answered = c.t, -1, b"", None, False
    while True:
        r = c.tier.coord.secagg_now(c.node, t.run_id, t.round, t.attempt, t.task_id, stage, message, header)
        if message and stage_of(stage) is Stage.MASKED_INPUT:
            c.sent_input = True
        if r.done or r.aborted:
            c.end = "done" if r.done else f"aborted: {r.aborted}"
            return answered
        if len(c.me.answered) >= c.limit:
            return answered
        got = c.me.answer(r.stage, r.broadcast, (c.header, c.vector))
        if got is None:
            return answered
        (message, header), stage, answered = got, r.stage, True


def answer_all(clients: list[Client]) -> None:
    """Every client answers what it can, round after round, until none can."""
    progress = True
    while progress:
        progress = False
        for c in clients:
            try:
                progress |= turn(c)
            except OrchardError as err:  # refused, or its round closed: silent from here on
                c.errors.append(type(err).__name__)


def session(root: Tier) -> SecureCohort:
    assert root.cr is not None and root.cr.secure is not None, "the root opened no session"
    return root.cr.secure


def stage_end(sc: SecureCohort, stage: Stage) -> float:
    return sc.started_wall + STAGE_END[stage] * (sc.deadline_wall - sc.started_wall)


def expected_sum(clients: list[Client], modulus_bits: int) -> np.ndarray:
    total = np.zeros(D, dtype=object)
    for c in clients:
        total = total + c.vector.astype(object)
    return total % (1 << modulus_bits)


def check_done(root: Tier, clients: list[Client], cfg: RunConfig) -> None:
    """The root's session is DONE: its sum is exactly the contributors' vectors', the
    contributors are exactly the clients whose masked input was taken, and the root's
    round closed with them as its participants (by tier)."""
    sc = session(root)
    assert sc.stage is Stage.DONE, sc.abort_reason
    res = sc.server.result()
    sent = sorted(c.node for c in clients if c.sent_input)
    assert sorted(res.contributors) == sent
    contributors = [c for c in clients if c.sent_input]
    sa = cfg.secure_aggregation
    want = expected_sum(contributors, sa.modulus_bits)
    assert [int(x) for x in res.total] == [int(x) for x in want]
    assert root.cr is not None and root.cr.closed
    out = root.coord.outcome(root.cr)
    n = len(contributors)
    assert out.partial.count == n
    by_tier: dict[str, int] = {}
    for c in contributors:
        by_tier[c.tier.name] = by_tier.get(c.tier.name, 0) + 1
    assert {k: v for k, v in out.tier_participants.items() if v} == by_tier
    assert sum(out.tier_participants.values()) == n
    assert out.partial.weight == sum(min(c.header.weight, sa.weight_scale) for c in contributors)
    flat = dequantize(np.asarray([int(x) for x in want], np.uint64), sa.clip, sa.bits, n) * sa.weight_scale
    got = np.concatenate([np.asarray(out.partial.sums[s.name], np.float64).ravel() for s in SCHEMA])
    np.testing.assert_array_equal(got, flat)


def check_relays(root: Tier, clients: list[Client]) -> None:
    """A tier below the root that heard the session's end closed on it and counts the
    contributors attached to it (the others stay open until the next round or their
    deadline: in-process, only the relays that carried the last message hear the end)."""
    sc = session(root)
    contributed = set(sc.server.result().contributors) if sc.stage is Stage.DONE else set()
    for t in root.walk():
        if t.parent is None or t.cr is None or t.cr.tree is None or t.cr.tree.final is None:
            continue
        assert t.cr.closed
        if sc.stage is Stage.DONE:
            assert t.cr.close_reason == "the round's secure session finished at the root"
            assert t.cr.tier_participants.get(t.name, 0) == sum(1 for c in clients
                                                                if c.tier is t and c.node in contributed)
        else:
            assert t.cr.close_reason.startswith("the round's secure session aborted at the root")


def run_round(shape: Shape, seed: int, cfg: RunConfig) -> tuple[Tier, list[Client], Clock]:
    clock = Clock()
    root = build(shape, clock, seed)
    open_tree(root, cfg, clock)
    rng = np.random.default_rng(seed)
    clients = dispatch(root, cfg, rng)
    rng.shuffle(clients)  # the order in which clients answer each pass
    return root, clients, clock


# ---------------------------------------------------------------------- properties


@settings(max_examples=25, deadline=None)
@given(shape=shapes(), seed=st.integers(0, 2**32 - 1), bits=st.sampled_from([8, 16, 24]),
       modulus_bits=st.sampled_from([32, 40]))
def test_relayed_sum_equals_the_flat_sum_in_any_tree(shape: Shape, seed: int, bits: int, modulus_bits: int) -> None:
    n = count_clients(shape)
    event(f"{n // 10 * 10}-{n // 10 * 10 + 9} clients")
    cfg = run_config(n, bits=bits, modulus_bits=modulus_bits)
    root, clients, _ = run_round(shape, seed, cfg)
    sc = session(root)
    assert sorted(sc.participants) == sorted(c.node for c in clients)  # every roster is in
    answer_all(clients)
    assert all(c.sent_input for c in clients)
    check_done(root, clients, cfg)
    assert root.cr is not None and root.cr.close_reason == "target reached"
    # The only refusals: polls that came after the root's round closed.
    assert {e for c in clients for e in c.errors} <= {RoundClosedError.__name__}
    check_relays(root, clients)
    for t in root.walk():  # the tiers below only relay: no session, nothing summed
        if t.parent is not None:
            assert t.cr is not None and t.cr.secure is None and t.cr.received == 0 and t.cr.secure_sum is None
    # What every tier sent down (5 bytes a client here) reached the root's record with
    # the relayed exchanges, once, beside what the session itself broadcast.
    out = root.coord.outcome(root.cr)
    assert out.bytes_down == len(b"model") * n + sc.bytes_down


@settings(max_examples=25, deadline=None)
@given(shape=shapes(), seed=st.integers(0, 2**32 - 1), data=st.data())
def test_dropouts_sum_exactly_the_inputs_that_got_in(shape: Shape, seed: int, data: st.DataObject) -> None:
    n = count_clients(shape)
    cfg = run_config(n, dropout_rate=0.2)
    root, clients, clock = run_round(shape, seed, cfg)
    k = data.draw(st.integers(0, max(1, n // 5)), label="dropped")
    for c in data.draw(st.lists(st.sampled_from(clients), min_size=k, max_size=k, unique_by=lambda c: c.node),
                       label="who"):
        # 0: never answers; 1: after its keys; 2: after its shares; 3: after its masked input
        c.limit = data.draw(st.integers(0, 3), label=f"{c.node} stops after")
    answer_all(clients)
    sc = session(root)
    for stage in STAGES:  # each stage still waiting for someone closes at its deadline
        if sc.finished:
            break
        if sc.stage is not stage:
            continue
        clock.to_wall(max(clock.wall(), stage_end(sc, stage)))
        for t in root.walk():
            t.coord.sweep()
        answer_all(clients)
    assert sc.finished and root.cr is not None and root.cr.closed
    event(f"{'someone dropped' if k else 'nobody dropped'}: {sc.stage.value}")
    event(f"{'sparse' if sc.neighbours < n - 1 else 'complete'} graph")
    assert all(c.limit >= 3 for c in clients if c.sent_input)
    if sc.stage is Stage.DONE:
        check_done(root, clients, cfg)
    else:
        assert k > 0, f"nobody dropped, yet the session aborted: {sc.abort_reason}"
        out = root.coord.outcome(root.cr)
        assert any(r.startswith("secure aggregation") for r in out.rejected), out.rejected
        assert out.partial.count == 0 and out.partial.weight == 0.0
        assert not any(out.tier_participants.values())
        assert all(np.all(v == 0) for v in out.partial.sums.values())
    check_relays(root, clients)


# ---------------------------------------------------------------------- refusals


def two_aggregators(seed: int = 0) -> tuple[Tier, list[Client], Clock, RunConfig]:
    """root -> aggregators root.0 and root.1, three clients each, the session open."""
    cfg = run_config(6)
    root, clients, clock = run_round(Shape(0, (Shape(3), Shape(3))), seed, cfg)
    return root, clients, clock, cfg


def relayed(root: Tier, via: Tier, node: str, stage: int, message: bytes, bytes_down: int = 0) -> None:
    a = via.assignment
    assert a is not None
    run_inline(root.coord.secagg_relayed(via.name, a.run_id, a.round, a.attempt, a.task_id, node, stage, message,
                                         None, 0.0, bytes_down))


def snapshot(root: Tier) -> tuple:
    sc = session(root)
    assert root.cr is not None
    return (sc.stage, sorted(sc.server.pending()), sc.bytes_up, sc.bytes_down, root.cr.bytes_down,
            dict(root.cr.tree.route) if root.cr.tree else None, dict(root.cr.rejected))


def test_a_relayed_exchange_for_a_client_outside_the_relays_roster_is_refused() -> None:
    root, clients, _, cfg = two_aggregators()
    a0, a1 = root.children
    theirs = next(c for c in clients if c.tier is a1)
    # Its real first message (its keys), as its own tier would relay it ...
    r = a1.coord.secagg_now(theirs.node, theirs.t.run_id, theirs.t.round, theirs.t.attempt, theirs.t.task_id,
                            -1, b"", None)
    got = theirs.me.answer(r.stage, r.broadcast)
    assert got is not None
    message = got[0]
    before = snapshot(root)
    # ... relayed by the other aggregator, or for a node in no roster: refused, nothing changes.
    for via, node, msg in ((a0, theirs.node, message), (a0, "ghost", b""), (a1, "ghost", message)):
        with pytest.raises(SecAggError, match="roster"):
            relayed(root, via, node, r.stage, msg, bytes_down=100)
        assert snapshot(root) == before
    # Through its own aggregator the same message is taken (it was not taken before).
    relayed(root, a1, theirs.node, r.stage, message)
    assert theirs.node not in session(root).server.pending()
    answer_all(clients)
    check_done(root, clients, cfg)


def test_a_second_roster_from_the_same_aggregator_is_refused() -> None:
    cfg = run_config(9)
    clock = Clock()
    root = build(Shape(0, (Shape(3), Shape(3), Shape(3))), clock, 0)
    root.cr = root.coord.open_round(root_task(cfg, clock))
    assigned = {t.name: root.coord.assign(t.name) for t in root.children}

    def roster(via: str, nodes: list[str]) -> None:
        a = assigned[via]
        assert a is not None
        run_inline(root.coord.secagg_roster(via, a.run_id, a.round, a.attempt, a.task_id, nodes, [via] * len(nodes)))

    tree = root.cr.tree
    assert tree is not None
    roster("root.0", ["root.0-c0", "root.0-c1", "root.0-c2"])
    # The same roster again (a retry whose reply was lost) changes nothing and is no error;
    # another one, while the other rosters are still coming, is refused.
    roster("root.0", ["root.0-c2", "root.0-c0", "root.0-c1"])
    for nodes in (["root.0-c0"], ["z0", "z1"], ["root.0-c0", "root.0-c1", "root.0-c2", "z0"]):
        with pytest.raises(SecAggError, match="already reported"):
            roster("root.0", nodes)
    assert tree.route == dict.fromkeys(["root.0-c0", "root.0-c1", "root.0-c2"], "root.0")
    assert tree.waiting == {"root.1", "root.2"} and root.cr.secure is None
    # A client another aggregator already named is refused too; root.1 may then report.
    with pytest.raises(SecAggError, match="twice"):
        roster("root.1", ["root.1-c0", "root.0-c1"])
    assert "root.1" in tree.waiting and "root.1-c0" not in tree.route
    roster("root.1", ["root.1-c0", "root.1-c1", "root.1-c2"])
    roster("root.2", ["root.2-c0", "root.2-c1", "root.2-c2"])
    sc = session(root)
    assert len(sc.participants) == 9
    # And once the session is open (the same roster again still changes nothing).
    with pytest.raises(SecAggError, match="already reported"):
        roster("root.2", ["root.2-c3"])
    roster("root.2", ["root.2-c0", "root.2-c1", "root.2-c2"])
    assert len(tree.route) == 9 and sorted(sc.participants) == sorted(tree.route)


@pytest.mark.parametrize(("nodes", "tiers", "why"), [
    (["root.0-c0", "root.0-c1"], ["root.0"], "one tier per client"),
    (["root.0-c0", "root.0-c0"], ["root.0", "root.0"], "names a client twice"),
])
def test_a_malformed_roster_is_refused_and_changes_nothing(nodes: list[str], tiers: list[str], why: str) -> None:
    cfg = run_config(6)
    clock = Clock()
    root = build(Shape(0, (Shape(3), Shape(3))), clock, 0)
    root.cr = root.coord.open_round(root_task(cfg, clock))
    a = root.coord.assign("root.0")
    assert a is not None and root.cr.tree is not None
    with pytest.raises(SecAggError, match=why):
        run_inline(root.coord.secagg_roster("root.0", a.run_id, a.round, a.attempt, a.task_id, nodes, tiers))
    assert root.cr.tree.route == {} and "root.0" in root.cr.tree.waiting


# ---------------------------------------------------------------------- the roster deadline


def test_the_root_opens_at_the_roster_deadline_without_a_silent_aggregator() -> None:
    cfg = run_config(11)
    clock = Clock()
    # Two direct clients at the root beside three aggregators; root.2 never reports.
    root = build(Shape(2, (Shape(3), Shape(3), Shape(3))), clock, 0)
    silent = frozenset({"root.2"})
    open_tree(root, cfg, clock, skip=silent)
    assert root.cr is not None and root.cr.tree is not None
    clients = dispatch(root, cfg, np.random.default_rng(0), skip=silent)
    assert len(clients) == 8
    answer_all(clients)  # polls only: no session yet
    assert root.cr.secure is None and not any(c.me.answered for c in clients)
    deadline = root.cr.tree.roster_deadline
    assert deadline == pytest.approx(WALL0 + ROSTER_END * DEADLINE_S)
    clock.to_wall(deadline - 0.5)
    root.coord.sweep()
    assert root.cr.secure is None
    clock.to_wall(deadline)
    root.coord.sweep()
    sc = session(root)
    assert sorted(sc.participants) == sorted(c.node for c in clients)
    assert sc.started_wall == deadline and sc.deadline_wall == root.cr.task.deadline_unix
    # Its roster, late, is refused; its clients are in no session.
    late = root.children[2]
    a = root.coord.assign(late.name)
    assert a is not None
    late.cr = late.coord.open_round(task_from_assignment(a, b"model", cfg), upstream=ParentUpstream(root.coord,
                                                                                                     late.name, a))
    with pytest.raises(SecAggError, match="roster deadline"):
        run_inline(late.coord.send_roster(late.cr))
    answer_all(clients)
    check_done(root, clients, cfg)
    out = root.coord.outcome(root.cr)
    assert root.cr.assignments["root.2"].dropped and "root.2" not in out.tier_participants
    assert out.tier_participants == {"root": 2, "root.0": 3, "root.1": 3}


# ---------------------------------------------------------------------- mended defects


def test_a_refused_relayed_message_leaves_the_byte_count_alone() -> None:
    cfg = run_config(3)
    root, clients, _ = run_round(Shape(0, (Shape(3),)), 0, cfg)
    assert root.cr is not None
    leaf, c = root.children[0], clients[0]
    t = c.t
    with pytest.raises(SecAggError):  # not a message of the session: refused by the root's session
        leaf.coord.secagg_now(c.node, t.run_id, t.round, t.attempt, t.task_id,
                              stage_index(Stage.ADVERTISE_KEYS), b"not a message", None)
    answer_all(clients)
    check_done(root, clients, cfg)
    sc = session(root)
    # The leaf sent 5 bytes to each of its 3 clients; the root must record them once.
    assert root.coord.outcome(root.cr).bytes_down == len(b"model") * 3 + sc.bytes_down


def test_a_relay_two_tiers_down_takes_masked_inputs_until_the_roots_stage_ends() -> None:
    cfg = run_config(3, deadline_s=30.0)
    root, clients, clock = run_round(Shape(0, (Shape(0, (Shape(3),)),)), 0, cfg)
    for c in clients:
        c.limit = 2  # keys and shares now, the masked inputs late in the stage
    answer_all(clients)
    sc = session(root)
    assert sc.stage is Stage.MASKED_INPUT
    clock.to_wall(stage_end(sc, Stage.MASKED_INPUT) - 0.3)  # the root's stage is still open
    for t in root.walk():
        t.coord.sweep()
    for c in clients:
        c.limit = NEVER
    answer_all(clients)
    assert not any(c.errors for c in clients if not c.sent_input), {c.node: c.errors for c in clients}
    check_done(root, clients, cfg)


def test_a_middle_tier_reports_at_its_roster_deadline_without_a_silent_child() -> None:
    """root -> root.0 -> {root.0.0, root.0.1 (silent)}, and root.1: root.0 reports what it
    has at its own roster deadline (half the root's), so root.0.0's clients are in the
    session; root.0.1's late roster is refused."""
    cfg = run_config(9)
    clock = Clock()
    root = build(Shape(0, (Shape(0, (Shape(3), Shape(3))), Shape(3))), clock, 0)
    silent = frozenset({"root.0.1"})
    open_tree(root, cfg, clock, skip=silent)
    middle = root.children[0]
    assert middle.cr is not None and middle.cr.tree is not None and root.cr is not None
    assert middle.cr.tree.waiting == {"root.0.1"} and root.cr.tree is not None and root.cr.tree.waiting == {"root.0"}
    clients = dispatch(root, cfg, np.random.default_rng(1), skip=silent)
    assert len(clients) == 6
    assert middle.cr.tree.roster_deadline < root.cr.tree.roster_deadline
    clock.to_wall(middle.cr.tree.roster_deadline)
    middle.coord.sweep()  # reports root.0.0's clients: every roster is in, the root opens
    sc = session(root)
    assert sorted(sc.participants) == sorted(c.node for c in clients)
    late = middle.children[1]
    a = middle.coord.assign(late.name)
    assert a is not None
    late.cr = late.coord.open_round(task_from_assignment(a, b"model", cfg),
                                    upstream=ParentUpstream(middle.coord, late.name, a))
    with pytest.raises(SecAggError, match="already reported"):
        run_inline(late.coord.send_roster(late.cr))
    answer_all(clients)
    check_done(root, clients, cfg)


def test_a_client_asking_after_the_end_hears_how_it_ended() -> None:
    """Once the root closed on the session's end, a relay's client that polls again is told
    the session is done (not that the round closed), through every relay."""
    cfg = run_config(6)
    root, clients, _ = run_round(Shape(0, (Shape(3), Shape(3))), 0, cfg)
    answer_all(clients)
    check_done(root, clients, cfg)
    assert root.cr is not None and root.cr.closed
    for c in clients:
        t = c.t
        r = c.tier.coord.secagg_now(c.node, t.run_id, t.round, t.attempt, t.task_id, -1, b"", None)
        assert r.done and not r.aborted and r.broadcast == b""
    for leaf in root.children:
        assert leaf.cr is not None and leaf.cr.closed and "finished at the root" in leaf.cr.close_reason
