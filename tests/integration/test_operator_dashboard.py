"""The root's web dashboard in a real headless Chromium (Debian's `chromium`, driven by
Playwright): it loads against a live federation, its round counter advances, its plots
draw, and nothing is served without the admin token."""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path
from typing import Any

import pytest
from operator_harness import LiveRoot

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
        "--disable-component-update", "--disable-sync", "--no-first-run"]

pytestmark = [
    pytest.mark.skipif(not Path(CHROMIUM).is_file(),
                       reason="no Chromium on this machine (Debian: apt-get install chromium); .ci/run installs it"),
    pytest.mark.timeout(180),
]


@pytest.fixture()
def live(tmp_path):
    r = LiveRoot(tmp_path / "root", clients=4, aggregators=2, dashboard_port=0)
    yield r
    r.stop()


def painted(page, plot_id: str) -> int:
    """Non-transparent pixels that uPlot drew on the plot's canvas (axes, grid and series)."""
    return page.evaluate("""(id) => {
        const c = document.querySelector('#' + id + ' canvas');
        if (!c) return 0;
        const d = c.getContext('2d').getImageData(0, 0, c.width, c.height).data;
        let n = 0;
        for (let i = 3; i < d.length; i += 4) if (d[i] > 0) n++;
        return n;
    }""", plot_id)



def _watch_rounds(page: Any, rounds: int, timeout_s: float, every_s: float) -> list[int]:
    """The round counter's successive values until it shows ``rounds`` on a completed run."""
    seen: list[int] = []
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        v = int(page.locator("#round-counter").get_attribute("data-round") or 0)
        if not seen or v != seen[-1]:
            seen.append(v)
        if v == rounds and page.locator("#run-status").inner_text() == "completed":
            break
        time.sleep(every_s)
    return seen

def test_dashboard_in_chromium(live) -> None:
    playwright = pytest.importorskip("playwright.sync_api", reason="the playwright package is a dev dependency")
    url = f"https://127.0.0.1:{live.root.dashboard.port}/"
    with playwright.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=ARGS)
        try:
            ctx = browser.new_context(ignore_https_errors=True, viewport={"width": 1280, "height": 900})
            # Without the token, or with a wrong one, nothing is served.
            for path in ("", "api/state", "static/uPlot.iife.min.js", "?token=orc_admin_wrong"):
                resp = ctx.request.get(url + path, max_redirects=0)
                assert resp.status == 401, (path, resp.status)
                assert "needs the admin token" in resp.text()
            resp = ctx.request.get(url + "api/state", headers={"Authorization": "Bearer orc_admin_wrong"})
            assert resp.status == 401
            # Read-only: no method but GET is routed.
            resp = ctx.request.post(url + "api/state", headers={"Authorization": f"Bearer {live.admin}"})
            assert resp.status == 405

            page = ctx.new_page()
            page.goto(url + "?token=" + live.admin)
            assert page.url == url, "the token is moved from the address bar into a cookie"
            page.wait_for_function("document.getElementById('run-status').textContent === 'idle'")
            tree = page.locator("#tree").inner_text()
            assert "aggregator-0" in tree and "aggregator-1" in tree and "4 clients" in tree

            rounds = 12
            run_id = live.start_run(rounds=rounds, target=4)
            seen = _watch_rounds(page, rounds, timeout_s=120, every_s=0.1)
            assert seen[-1] == rounds, seen
            assert len(seen) >= 2 and seen == sorted(seen), f"the counter should advance: {seen}"
            assert page.locator("#run-id").inner_text() == run_id
            page.wait_for_function(f"document.body.dataset.rounds === '{rounds}'")
            assert page.evaluate("plots['plot-accuracy'].u.data[0].length") == rounds
            assert page.evaluate("plots['plot-bytes'].u.data[1].every(v => v > 0)")
            for plot_id in ("plot-accuracy", "plot-bytes"):
                assert painted(page, plot_id) > 2000, plot_id
            # No run here reports ε: its plot stays hidden until one does.
            assert page.locator("#epsilon-section").is_hidden()
            assert run_id in page.locator("#runs").inner_text()
            assert page.locator("#error").inner_text() == ""
            shot = os.environ.get("ORCHARD_DASHBOARD_SCREENSHOT")
            if shot:
                page.screenshot(path=shot, full_page=True)
        finally:
            browser.close()


@pytest.mark.slow
def test_dashboard_on_the_demo(tmp_path) -> None:
    """The same page against `orchard demo`: a root, two aggregators and four clients as
    separate processes over TLS."""
    import json
    import signal
    import subprocess
    import sys

    playwright = pytest.importorskip("playwright.sync_api", reason="the playwright package is a dev dependency")
    out = tmp_path / "demo"
    rounds = 15
    log = open(tmp_path / "demo.log", "w")  # noqa: SIM115 - closed below
    demo = subprocess.Popen([sys.executable, "-m", "orchard.cli", "demo", "--rounds", str(rounds), "--aggregators",
                             "2", "--clients", "4", "--out", str(out), "--dashboard-port", "0", "--linger", "15"],
                            stdout=log, stderr=subprocess.STDOUT, env=dict(os.environ, OMP_NUM_THREADS="1"))
    try:
        info_path = out / "root" / "server.json"
        end = time.monotonic() + 120
        while not info_path.is_file() and time.monotonic() < end:
            assert demo.poll() is None, (tmp_path / "demo.log").read_text()
            time.sleep(0.2)
        url = json.loads(info_path.read_text())["dashboard"]
        token = (out / "root" / "admin.token").read_text().strip()
        with playwright.sync_playwright() as p:
            browser = p.chromium.launch(executable_path=CHROMIUM, args=ARGS)
            try:
                ctx = browser.new_context(ignore_https_errors=True)
                assert ctx.request.get(url + "api/state").status == 401
                page = ctx.new_page()
                page.goto(url + "?token=" + token)
                seen = _watch_rounds(page, rounds, timeout_s=240, every_s=0.05)
                assert seen[-1] == rounds and seen == sorted(seen) and len(seen) >= 2, seen
                tree = page.locator("#tree").inner_text()
                assert "aggregator-0" in tree and "aggregator-1" in tree
                page.wait_for_function(f"document.body.dataset.rounds === '{rounds}'")
                for plot_id in ("plot-accuracy", "plot-bytes"):
                    assert painted(page, plot_id) > 2000, plot_id
            finally:
                browser.close()
        assert demo.wait(120) == 0, (tmp_path / "demo.log").read_text()[-3000:]
    finally:
        if demo.poll() is None:
            demo.send_signal(signal.SIGINT)  # the demo stops its processes on the way out
            demo.wait(60)
        log.close()
