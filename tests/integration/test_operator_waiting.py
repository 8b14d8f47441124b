"""A round that waits for clients says why, in `run status` and in the status JSON."""

from __future__ import annotations

import json

from fed_harness import BackgroundRoot, Federation, add_clients
from typer.testing import CliRunner

from orchard import wire
from orchard.cli import app
from orchard.config import CohortConfig, RunConfig
from orchard.ops import ControlClient
from orchard.tasks import get_task


def test_waiting_round_explains_itself(tmp_path) -> None:
    bg = BackgroundRoot(tmp_path / "root", start_grace_s=30.0)
    fed = Federation()
    try:
        addr = bg.root.address

        async def clients() -> None:
            await add_clients(fed, addr, [0, 1, 2], 3)

        bg.call(clients())
        cfg = RunConfig(task="digits", rounds=1, cohort=CohortConfig(target=10, min_fraction=0.8))
        with ControlClient(addr, insecure=True) as ctl:
            import time

            end = time.monotonic() + 30
            while ctl.status()["nodes"]["clients_total"] < 3 and time.monotonic() < end:
                time.sleep(0.05)
            run_id = ctl.start_run(cfg, wire.arrays_to_blob(get_task("digits").initial_arrays(0)))
            want = "3 eligible clients, round needs 8 (min_fraction 0.8 × target 10): waiting"
            while time.monotonic() < end:
                cur = ctl.status(run_id).get("current_round") or {}
                if cur.get("waiting", {}).get("message") == want:
                    break
                time.sleep(0.05)
            assert cur["waiting"] == {"eligible": 3, "live": 3, "needed": 8, "target": 10, "min_fraction": 0.8,
                                      "message": want}
        res = CliRunner().invoke(app, ["run", "status", "--server", addr, "--insecure"])
        assert res.exit_code == 0, res.output
        assert want in res.output
        res = CliRunner().invoke(app, ["run", "status", "--server", addr, "--insecure", "--json"])
        assert json.loads(res.output)["current_round"]["waiting"]["needed"] == 8
    finally:
        bg.call(fed.stop())
        bg.stop()
