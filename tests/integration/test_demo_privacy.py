"""`orchard demo --secure-aggregation --dp-epsilon`: distributed DP in one secure session
over the whole tree, real processes on loopback, epsilon in the report."""

from __future__ import annotations

import io
from pathlib import Path

from rich.console import Console

from orchard.demo import DemoSpec, run_demo


def test_demo_distributed_dp_runs_one_session_over_the_tree(tmp_path: Path) -> None:
    console = Console(record=True, width=200, file=io.StringIO())
    rep = run_demo(DemoSpec(rounds=2, aggregators=2, clients=4, out=tmp_path / "demo", secure_aggregation=True,
                            dp_epsilon=8.0, insecure=True), console)
    # Four clients a round: the demo says what the noise does to so small a cohort.
    assert "DP pays off with hundreds to thousands of clients a round" in " ".join(console.export_text().split())
    assert rep["status"] == "completed" and rep["secure_scope"] == "tree"
    assert [r["participants"] for r in rep["rounds"]] == [4, 4]
    # Every round's clients, each counted at its own aggregator (the relays below the root's session).
    assert all(sum(r["tier_participants"].values()) == 4 and len(r["tier_participants"]) == 2 for r in rep["rounds"])
    assert 0 < rep["privacy"]["epsilon"] <= 8.0 and rep["privacy"]["accountant_delta"] == 1e-5
    # The clamped noise shares' part of delta is reported too, and the whole stays <= 1 / population.
    assert 1e-5 < rep["privacy"]["delta"] <= 1 / rep["privacy"]["population"]
