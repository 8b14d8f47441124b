"""DP-FTRL's participation bound, as the selection enforces it: each device takes part in
at most ``privacy.max_participations`` round attempts of a run, each at least
``privacy.min_separation`` rounds after its previous one (Kairouz et al. 2021, §4: the
accountant, ``orchard.aggregation.ftrl``, charges for exactly this).

Every tier that selects clients keeps one (``Registry.participation``): the gRPC root and
aggregators, and the simulator's in-process tiers, which are the same coordinators, so
the bound has one implementation. A device counts when it is handed an assignment
(``Coordinator.new_assignment``), whether or not its update arrives: a device picked in
an attempt that fails, or for a retry of the same round, has used a participation, and
two attempts of one round are 0 rounds apart, so a device takes part in one attempt of a
round at most (rounds apart are at least as many tree leaves apart). A device is its node
id: a root binds a node id to its first credential (``orchard.server.tier.registry``).

Runs other than DP-FTRL record nothing and refuse no one. A root journals the state
(:meth:`to_json`, through :attr:`ParticipationBound.journal`) with its tree noise before
any selected device can take its task: after selection, and again after each client that
fills an unused slot once the round is open (``Coordinator.assign``), before it is handed
its task. A participation the journal missed would be forgotten by a restarted root, and
the device could be selected past its bound.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from orchard.errors import ConfigError


class ParticipationBound:
    def __init__(self) -> None:
        self.run_id = ""
        self.max_participations: int | None = None
        self.min_separation = 1
        self.round = 0  # the round the last begun attempt belongs to
        self._seen: dict[str, tuple[int, int]] = {}  # node id -> (participations, last round)
        # Where the counts are kept durably, (run id, state) -> None: a root's charge log;
        # None (the simulator, an aggregator) keeps them in memory only.
        self.journal: Callable[[str, str], None] | None = None
        self._unjournaled = False  # a participation recorded since the journal last wrote

    @property
    def active(self) -> bool:
        return self.max_participations is not None

    def begin(self, run_id: str, rnd: int, privacy: Any) -> None:
        """An attempt of round ``rnd`` of ``run_id`` opens; ``privacy``: its ``PrivacyConfig``.
        A new run starts from no participations."""
        if run_id != self.run_id:
            self.run_id, self._seen = run_id, {}
        if privacy.bounds_participation:
            self.max_participations, self.min_separation = privacy.max_participations, privacy.min_separation
        else:
            self.max_participations, self.min_separation = None, 1
        self.round = rnd

    def allows(self, node_id: str, rnd: int | None = None) -> bool:
        """Whether ``node_id`` may take part in round ``rnd`` (None: the round begun last)."""
        if self.max_participations is None:
            return True
        seen = self._seen.get(node_id)
        if seen is None:
            return True
        count, last = seen
        return count < self.max_participations and (self.round if rnd is None else rnd) - last >= self.min_separation

    def record(self, node_id: str) -> None:
        """``node_id`` was handed an assignment in the round begun last."""
        if self.max_participations is None:
            return
        if not self.allows(node_id):
            # Selection asks allows() first; reaching here means a path skipped it.
            raise ConfigError(f"{node_id} is past DP-FTRL's participation bound in round {self.round}; the "
                              "selection must not hand it an assignment")
        count = self._seen.get(node_id, (0, 0))[0]
        self._seen[node_id] = (count + 1, self.round)
        self._unjournaled = True

    def flush(self) -> None:
        """Journal the counts if a participation was recorded since they were last journaled.
        Called once selection is done and after each fill-in, before the selected devices can
        take their tasks; a no-op without a journal."""
        if self.journal is not None and self._unjournaled:
            self.journal(self.run_id, self.to_json())
        self._unjournaled = False

    def participations(self, node_id: str) -> int:
        return self._seen.get(node_id, (0, 0))[0]

    def to_json(self) -> str:
        return json.dumps({"run_id": self.run_id, "seen": self._seen}, separators=(",", ":"))

    def restore(self, text: str) -> None:
        """Take back a journaled state (a restarted root), refusing a malformed one."""
        try:
            data = json.loads(text)
            seen = {str(k): (int(v[0]), int(v[1])) for k, v in data["seen"].items()}
            run_id = str(data["run_id"])
        except (ValueError, KeyError, TypeError, IndexError) as err:
            raise ConfigError(f"the journaled participation bound cannot be read ({err}); it was written by "
                              "this root before a round opened: restore the data dir from a backup") from None
        self.run_id, self._seen, self._unjournaled = run_id, seen, False
