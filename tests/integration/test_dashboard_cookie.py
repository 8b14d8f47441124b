"""The dashboard's token leaves the URL after the first load: an HttpOnly, SameSite=Strict,
Secure cookie and a redirect to "/"; later requests authenticate by the cookie alone."""

from __future__ import annotations

import asyncio
import ssl
from http.cookies import SimpleCookie
from pathlib import Path

import aiohttp

from orchard.server.app import start_root
from orchard.server.dashboard import COOKIE


def test_the_token_moves_from_the_url_into_a_cookie(tmp_path: Path) -> None:
    async def main() -> None:
        root = await start_root(tmp_path / "root", dashboard_port=0)
        token = root.admin_token
        ctx = ssl.create_default_context(cafile=str(root.ca_cert))
        base = f"https://localhost:{root.dashboard.port}"  # the root's certificate names localhost
        try:
            async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(ssl=ctx),
                                             cookie_jar=aiohttp.DummyCookieJar()) as http:
                async with http.get(f"{base}/?token={token}", allow_redirects=False) as r:
                    assert r.status == 303 and r.headers["Location"] == "/"
                    assert r.headers["Cache-Control"] == "no-store"
                    assert r.headers["Referrer-Policy"] == "no-referrer"
                    set_cookie = r.headers["Set-Cookie"]
                morsel = SimpleCookie(set_cookie)[COOKIE]
                assert morsel.value == token and morsel["path"] == "/"
                assert morsel["httponly"] and morsel["secure"] and morsel["samesite"] == "Strict", set_cookie
                jar = {"Cookie": f"{COOKIE}={morsel.value}"}
                async with http.get(f"{base}/", headers=jar) as r:
                    assert r.status == 200 and "<html" in (await r.text()).lower()
                async with http.get(f"{base}/api/state", headers=jar) as r:
                    assert r.status == 200 and "run" in await r.json()
                # Without the cookie nothing is served; a wrong token sets no cookie.
                async with http.get(f"{base}/api/state") as r:
                    assert r.status == 401
                async with http.get(f"{base}/?token=orc_admin_wrong", allow_redirects=False) as r:
                    assert r.status == 401 and "Set-Cookie" not in r.headers
                # A token in any other URL is refused: it would stay in logs and history.
                async with http.get(f"{base}/api/state?token={token}") as r:
                    assert r.status == 401
                async with http.get(f"{base}/static/uPlot.iife.min.js?token={token}") as r:
                    assert r.status == 401
        finally:
            await root.stop(0)

    asyncio.run(main())
