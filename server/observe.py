"""Read-only views of a live root for operators: the control API's status and the dashboard.

Nothing here changes round state: each function reads the runner, its coordinator and
the store on the server's event loop and returns plain JSON-able dicts.
"""

from __future__ import annotations

import math
from typing import Any

from orchard.server.root import RootRunner
from orchard.typing import Role


def waiting(runner: RootRunner) -> dict[str, Any] | None:
    """Why the current round has not opened yet, or None when it is not waiting.

    The root opens a round once ``target`` clients are eligible, or, after its start
    grace, once ``ceil(min_fraction * target)`` are (``RootRunner._wait_capacity``):
    this says which of the two it waits for and how many it has."""
    r = runner.run
    if r is None or r.current is None or r.current.get("cohort") is not None:
        return None
    cohort = r.config.cohort
    need = math.ceil(cohort.target * cohort.min_fraction)
    live, eligible = runner.coord.capacity(r.config)
    if eligible < need:
        message = (f"{eligible} eligible clients, round needs {need} (min_fraction {cohort.min_fraction:g} × "
                   f"target {cohort.target}): waiting")
    else:
        message = (f"{eligible} eligible clients of the {cohort.target} targeted: opening with at least {need} "
                   f"after the {runner.start_grace_s:g} s start grace")
    return {"eligible": eligible, "live": live, "needed": need, "target": cohort.target,
            "min_fraction": cohort.min_fraction, "message": message}


def status(runner: RootRunner, run_id: str = "") -> dict[str, Any]:
    """The runner's status, with the wait explained when the current round waits for clients."""
    st = runner.status(run_id)
    personal = personalization(st.get("rounds") or [])
    if personal:
        st["personalization"] = personal
    cur = st.get("current_round")
    if cur is not None:
        w = waiting(runner)
        if w is not None:
            cur["waiting"] = w
    return st


def personalization(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    """The devices' own evaluation of the global and their personal adapter in the latest
    round that carries it: mean and 10th percentile across devices (read from the round's
    histogram, ``orchard.personal_metrics``); empty when no round does."""
    from orchard.personal_metrics import summary

    for r in reversed(rounds):
        got = summary(r.get("metrics") or {})
        if got:
            return {"round": r.get("round"), **got}
    return {}


def tree(runner: RootRunner) -> dict[str, Any]:
    """The aggregation tree as the root sees it: each child with its live and eligible
    counts (an aggregator reports its pool; a client counts as one), under the root's."""
    coord = runner.coord
    cfg = runner.run.config if runner.run is not None else None
    live_total, eligible_total = coord.capacity(cfg)
    children = []
    for c in coord.children.values():
        live = coord.live(c)
        # Eligible: what a round may select there now (waiting for work and eligible).
        elig = coord.registry.selectable(c, cfg) if live else 0
        size = (c.pool_size if c.role is Role.AGGREGATOR else 1) if live else 0
        children.append({"node_id": c.node_id, "role": c.role.value, "live": live, "clients": size,
                         "eligible": elig})
    children.sort(key=lambda n: (n["role"] != "aggregator", n["node_id"]))
    return {"node_id": coord.name, "role": "root", "clients": live_total, "eligible": eligible_total,
            "children": children}
