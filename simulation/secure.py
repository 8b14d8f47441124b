"""The secure clients of a simulated round: each selected client's side of SecAgg+.

Every selected client of a secure tier holds the client's own
:class:`~orchard.client.secure.SecureParticipant` and answers its session's stages
through the coordinator's ``secagg_now`` (the ``Fleet.SecAgg`` exchange without the
wait): the key stages when the round opens (a real client runs them while it trains),
its masked input when it arrives, the unmasking stage once the masked-input stage ends.
With ``secure_aggregation.scope = "tree"`` the session is the root's, and every tier's
clients answer it.
"""

from __future__ import annotations

import contextlib
import hashlib

import numpy as np

from orchard.client.secure import SecureParticipant, masked_input
from orchard.client.update import train_seed
from orchard.errors import OrchardError, SecAggError
from orchard.messages import TaskAssignment, UploadHeader
from orchard.secure_agg import Stage
from orchard.server.secagg import STAGE_END, SecureCohort
from orchard.simulation.clients import ClientOutput
from orchard.simulation.context import Context
from orchard.simulation.jobs import Arrival
from orchard.simulation.tree import Tier, Tree


class SecureClients:
    """The tiers' secure clients (each tier's ``secure``: participant and task by node)."""

    def __init__(self, ctx: Context, tree: Tree) -> None:
        self._ctx = ctx
        self._tree = tree
        self.root = tree.root

    def enroll(self, leaf: Tier, node: str, a: TaskAssignment) -> None:
        """A selected client's side of its tier's (or the tree's) session, seeded by its task."""
        entropy = hashlib.sha256(f"{self._ctx.seed}/{a.task_id}".encode()).digest()
        leaf.secure[node] = (SecureParticipant(node, entropy), a)

    def session(self, tier: Tier) -> SecureCohort | None:
        """The secure session a tier's clients answer: the tier's own, or with scope "tree"
        the root's (None before it opens, or without secure aggregation)."""
        assert tier.cr is not None
        if tier.cr.tree is not None and self.root.cr is not None:
            return self.root.cr.secure
        return tier.cr.secure

    @staticmethod
    def relays(tier: Tier) -> bool:
        """A tier below the root that relays to the tree's session (no sum of its own)."""
        return tier.cr is not None and tier.cr.tree is not None and tier.parent is not None

    def input_deadline(self, tier: Tier) -> float:
        """The virtual wall time at which the session's masked-input stage ends (server.secagg)."""
        sc = self.session(tier)
        assert sc is not None
        return sc.started_wall + STAGE_END[Stage.MASKED_INPUT] * (sc.deadline_wall - sc.started_wall)

    def _turn(self, tier: Tier, node: str, masked: tuple[UploadHeader, np.ndarray] | None = None) -> bool:
        """Let one client answer what the tier's session asks of it now, as its runtime
        would over ``Fleet.SecAgg`` (``secagg_now`` is the exchange without the wait).
        True if it answered anything."""
        me, t = tier.secure[node]
        stage, message, header = -1, b"", None
        answered = False
        while True:
            r = tier.coord.secagg_now(node, t.run_id, t.round, t.attempt, t.task_id, stage, message, header)
            got = None if (r.done or r.aborted) else me.answer(r.stage, r.broadcast, masked)
            if got is None:
                return answered
            (message, header), stage, answered = got, r.stage, True

    def answer(self, tier: Tier) -> None:
        """The clients that answer a session which moved on: the tier's own, or with scope
        "tree" every tier's."""
        assert tier.cr is not None
        if tier.cr.tree is not None:
            self.answer_all()
        elif tier.secure:
            self._answer_tier(tier)

    def answer_all(self) -> None:
        """Every secure client answers what it can; with scope "tree" the stages of the one
        session move on with the answers of every tier's clients, so go round until none can."""
        tiers = [t for t in self._tree.tiers() if t.secure and t.cr is not None]
        progress = True
        while progress:
            progress = False
            for t in tiers:
                progress |= self._answer_tier(t)

    def _answer_tier(self, tier: Tier) -> bool:
        """Every client of the tier that can answer the session's current stage does, until
        none can (a stage moves on when its last expected answer is in)."""
        assert tier.cr is not None
        progress, any_answer = True, False
        while progress and not tier.cr.closed:
            progress = False
            for node in tier.secure:
                with contextlib.suppress(OrchardError):  # dropped from the session: silent from here on
                    progress |= self._turn(tier, node)
            any_answer |= progress
        return any_answer

    def post_input(self, tier: Tier, a: Arrival, o: ClientOutput) -> None:
        """An arriving client posts its masked input (refused once the stage is over)."""
        assert o.header is not None and tier.cr is not None
        ctx = self._ctx
        me, t = tier.secure[a.node_id]
        seed = train_seed(ctx.run.seed, t.round, a.partition)
        noise_rng = np.random.default_rng([ctx.seed, t.round, t.attempt, a.partition, 0xD9])
        # A simulation is reproducible by design: rounding from the training seed, noise
        # from the run's seed (a deployed client draws both from OS entropy).
        masked = masked_input(ctx.round_cfg, ctx.codec, t, o.header, o.payload, seed, me.participants,
                              noise_rng if ctx.round_cfg.privacy.mode == "distributed" else None,
                              reproducible=True)
        if not self._turn(tier, a.node_id, masked):
            raise SecAggError(f"round {t.round}: the secure cohort no longer takes masked inputs")
        sc = self.session(tier)
        if sc is not None and sc.stage in (Stage.CONSISTENCY, Stage.UNMASKING):
            self.answer(tier)
