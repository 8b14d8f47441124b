"""A live, read-only web dashboard served by the root (``--dashboard-port``, off by default).

What it shows, refreshed every second from one JSON endpoint (``GET /api/state``):
the aggregation tree with live and eligible clients per aggregator, the current
round's progress (selected, delivered, dropped, refused with reasons, or why it waits),
the clients' accuracy and loss, bytes up and down and, once a run reports one, the
privacy budget spent (ε) over rounds as plots, and the list of runs.

Security: it needs the same admin token as the control API, because it shows
everything the control API's status does. A browser opens ``/?token=ADMIN_TOKEN`` once;
the answer sets an HttpOnly, SameSite=Strict cookie (Secure under TLS) and redirects to
``/``, so the token leaves the address bar and history; later requests carry the cookie.
A token in any other URL is refused. Scripts may send ``Authorization: Bearer
ADMIN_TOKEN`` instead. A root
that serves TLS serves the dashboard over HTTPS with the same certificate, so the
token never crosses the network in clear; an ``--insecure`` root binds loopback only.
Every route is GET: nothing on the dashboard changes the federation.

It runs on the root's asyncio loop (aiohttp) and reads the runner, its coordinator and
the store between awaits, like the control API; the page is plain HTML and JavaScript
with uPlot (MIT, vendored in ``dashboard_static/``), so nothing is fetched from the
internet at run time.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from aiohttp import web

from orchard.server import observe
from orchard.server.auth import Authenticator, bearer_token
from orchard.server.root import RootRunner
from orchard.server.tls import TlsPaths, https_context

STATIC = Path(__file__).resolve().parent / "dashboard_static"
COOKIE = "orchard_admin"
_RUNNER: web.AppKey[RootRunner] = web.AppKey("runner", RootRunner)
_AUTH: web.AppKey[Authenticator] = web.AppKey("auth", Authenticator)  # type: ignore[type-abstract]
_SECURE: web.AppKey[bool] = web.AppKey("secure", bool)

REFUSED = ("The Orchard dashboard needs the admin token (the root keeps it in DATA_DIR/admin.token, "
           "owner-only): open /?token=ADMIN_TOKEN, or send 'Authorization: Bearer ADMIN_TOKEN'.\n")


def _token(request: web.Request) -> str | None:
    # A token in the URL counts on the first load of "/" only, which moves it into the
    # cookie at once (``_index``): anywhere else it would be left in logs and history.
    if request.path == "/" and "token" in request.query:
        return request.query["token"]
    return bearer_token(list(request.headers.items())) or request.cookies.get(COOKIE)


@web.middleware
async def _admin_only(request: web.Request, handler: Any) -> web.StreamResponse:
    if not request.app[_AUTH].admin_ok(_token(request)):
        raise web.HTTPUnauthorized(text=REFUSED, headers={"WWW-Authenticate": 'Bearer realm="orchard"'})
    return await handler(request)


async def _index(request: web.Request) -> web.StreamResponse:
    q = request.query.get("token")
    if q is not None:
        # Keep the token out of the address bar, history and proxy logs: set the cookie
        # (out of reach of scripts, never sent by another site, over TLS only under TLS)
        # and come back to "/" without it.
        resp = web.HTTPSeeOther("/", headers={"Cache-Control": "no-store", "Referrer-Policy": "no-referrer"})
        resp.set_cookie(COOKIE, q, httponly=True, samesite="Strict", secure=request.app[_SECURE], path="/")
        raise resp
    return web.FileResponse(STATIC / "index.html", headers={"Cache-Control": "no-store"})


def rounds_series(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    """Completed rounds as columns for the plots (one value per round; None where a
    round did not report a value)."""
    done = [r for r in rounds if r.get("status") == "completed"]

    def metric(r: dict[str, Any], *names: str) -> float | None:
        for n in names:
            # A round with differential privacy records what it spent under "privacy".
            for src in (r, r.get("metrics") or {}, r.get("privacy") or {}):
                v = src.get(n)
                if isinstance(v, int | float) and not isinstance(v, bool):
                    return float(v)
        return None

    held_out = any(metric(r, "accuracy", "eval_accuracy") is not None for r in done)
    return {
        "source": "held-out data" if held_out else "clients' training metrics, weighted means",
        "round": [r["round"] for r in done],
        "accuracy": [metric(r, "accuracy", "eval_accuracy", "train_accuracy") for r in done],
        "loss": [metric(r, "loss", "eval_loss", "train_loss") for r in done],
        "bytes_up": [r.get("bytes_up", 0) for r in done],
        "bytes_down": [r.get("bytes_down", 0) for r in done],
        "participants": [r.get("participants", 0) for r in done],
        "epsilon": [metric(r, "epsilon") for r in done],
    }


def progress(runner: RootRunner) -> dict[str, Any] | None:
    """The open round at the root: selected, delivered, dropped, in flight, refused with
    reasons; or why it waits."""
    r = runner.run
    if r is None or r.current is None:
        return None
    cur = r.current
    out: dict[str, Any] = {"round": cur.get("round"), "attempt": cur.get("attempt"), "phase": cur.get("phase")}
    cr = cur.get("cohort")
    if cr is None:
        out["waiting"] = observe.waiting(runner)
        return out
    a = list(cr.assignments.values())
    out.update(selected=len(a), delivered=sum(x.delivered for x in a), dropped=sum(x.dropped for x in a),
               in_flight=sum(x.in_flight for x in a), updates=cr.received, target=cr.task.target,
               refused=dict(cr.rejected), closed=cr.closed, close_reason=cr.close_reason)
    return out


def state(runner: RootRunner) -> dict[str, Any]:
    st = observe.status(runner)
    runs = [{"run_id": row.run_id, "status": row.status, "task": json.loads(row.config_json).get("task"),
             "completed_rounds": row.completed_rounds, "target_rounds": json.loads(row.config_json).get("rounds"),
             "created": row.created, "error": row.error} for row in runner.store.list_runs(50)]
    return {"run": {k: v for k, v in st.items() if k not in ("rounds", "nodes")},
            "series": rounds_series(st.get("rounds", [])),
            "last_rounds": st.get("rounds", [])[-10:],
            "current": progress(runner), "tree": observe.tree(runner), "runs": runs}


async def _state(request: web.Request) -> web.Response:
    return web.json_response(state(request.app[_RUNNER]), headers={"Cache-Control": "no-store"})


def build_app(runner: RootRunner, auth: Authenticator, secure: bool) -> web.Application:
    app = web.Application(middlewares=[_admin_only])
    app[_RUNNER], app[_AUTH], app[_SECURE] = runner, auth, secure
    app.router.add_get("/", _index)
    app.router.add_get("/api/state", _state)
    app.router.add_static("/static/", STATIC, show_index=False)
    return app


class Dashboard:
    """The running HTTP(S) server; ``stop()`` closes it."""

    def __init__(self, runner: web.AppRunner, port: int, scheme: str) -> None:
        self._runner = runner
        self.port = port
        self.scheme = scheme

    async def stop(self) -> None:
        await self._runner.cleanup()


async def serve_dashboard(runner: RootRunner, auth: Authenticator, host: str, port: int,
                          tls: TlsPaths | None) -> Dashboard:
    """Serve the dashboard on ``host:port`` (0: a free port); HTTPS when ``tls`` is given."""
    ctx = https_context(tls) if tls is not None else None
    app_runner = web.AppRunner(build_app(runner, auth, secure=ctx is not None), access_log=None)
    await app_runner.setup()
    site = web.TCPSite(app_runner, host, port, ssl_context=ctx)
    await site.start()
    bound = port
    server: Any = site._server  # aiohttp exposes the bound sockets (port 0) only here
    if server is not None and getattr(server, "sockets", None):
        bound = server.sockets[0].getsockname()[1]
    return Dashboard(app_runner, int(bound), "https" if ctx else "http")
