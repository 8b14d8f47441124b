"""The dashboard's JSON endpoint without a browser: the token rule and a waiting round."""

from __future__ import annotations

import json
import ssl
import time
import urllib.error
import urllib.request

import pytest
from operator_harness import LiveRoot


def get(url: str, ca, token: str | None = None):
    ctx = ssl.create_default_context(cafile=str(ca))
    req = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"} if token else {})
    return urllib.request.urlopen(req, context=ctx, timeout=10)


def test_state_needs_the_token_and_explains_a_wait(tmp_path) -> None:
    live = LiveRoot(tmp_path / "root", clients=3, dashboard_port=0)
    try:
        url = f"https://localhost:{live.root.dashboard.port}/api/state"  # the root's certificate names localhost
        with pytest.raises(urllib.error.HTTPError) as e:
            get(url, live.ca)
        assert e.value.code == 401
        with pytest.raises(urllib.error.HTTPError) as e:
            get(url, live.ca, "orc_admin_wrong")
        assert e.value.code == 401
        live.start_run(rounds=1, target=10)  # 3 clients, ceil(0.5 x 10) = 5 needed
        end = time.monotonic() + 30
        while True:
            st = json.load(get(url, live.ca, live.admin))
            cur = st["current"] or {}
            if cur.get("waiting") or time.monotonic() > end:
                break
            time.sleep(0.1)
        assert cur["waiting"]["message"] == "3 eligible clients, round needs 5 (min_fraction 0.5 × target 10): waiting"
        assert st["run"]["status"] == "running" and st["tree"]["eligible"] == 3
        assert [c["node_id"] for c in st["tree"]["children"]] == ["client-0", "client-1", "client-2"]
        assert json.loads((tmp_path / "root" / "server.json").read_text())["dashboard"].startswith("https://")
    finally:
        live.stop()


def test_a_taken_dashboard_port_is_refused(tmp_path) -> None:
    import asyncio
    import socket

    from orchard.errors import ConfigError
    from orchard.server.app import start_root

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        taken = s.getsockname()[1]

        async def main() -> None:
            with pytest.raises(ConfigError, match=f"cannot serve the dashboard on 127.0.0.1:{taken}"):
                await start_root(tmp_path / "root", dashboard_port=taken)

        asyncio.run(main())


def test_series_show_epsilon_only_when_a_run_reports_it() -> None:
    from orchard.server.dashboard import rounds_series

    rounds = [{"round": 1, "status": "completed", "bytes_up": 5, "bytes_down": 7, "participants": 2,
               "metrics": {"train_accuracy": 0.5, "train_loss": 1.0}},
              {"round": 2, "status": "failed", "metrics": {}},
              {"round": 2, "status": "completed", "bytes_up": 6, "bytes_down": 8, "participants": 3,
               "metrics": {"train_accuracy": 0.6, "train_loss": 0.9, "epsilon": 0.7}}]
    s = rounds_series(rounds)
    assert s["round"] == [1, 2] and s["accuracy"] == [0.5, 0.6] and s["loss"] == [1.0, 0.9]
    assert s["bytes_up"] == [5, 6] and s["epsilon"] == [None, 0.7]
    assert s["source"] == "clients' training metrics, weighted means"
    assert rounds_series([{**rounds[0], "accuracy": 0.9}])["source"] == "held-out data"
    assert rounds_series(rounds[:1])["epsilon"] == [None]


def test_epsilon_is_read_from_a_rounds_privacy_record() -> None:
    from orchard.server.dashboard import rounds_series
    from orchard.tracking import round_scalars

    rec = {"round": 1, "status": "completed", "privacy": {"epsilon": 0.42, "delta": 1e-5, "clip_norm": 1.0}}
    assert rounds_series([rec])["epsilon"] == [0.42]
    assert round_scalars(rec)["privacy/epsilon"] == 0.42
