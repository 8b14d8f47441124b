"""Assemble a running tier: gRPC server, coordinator, and its root runner or upstream link.

``start_root`` and ``start_aggregator`` are what ``orchard server start`` and
``orchard aggregator start`` call, and what the tests and the demo use in-process.
"""

from __future__ import annotations

import asyncio
import ipaddress
import json
import logging
import os
import secrets
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import numpy as np

from orchard import wire
from orchard.config import ServerConfig
from orchard.errors import ConfigError
from orchard.files import atomic_write, private_dir, report_loose
from orchard.link import FleetLink, LinkConfig
from orchard.messages import DroppedUpload
from orchard.server.ackjournal import AckJournal
from orchard.server.aggregator import UpstreamLink
from orchard.server.auth import (
    Authenticator,
    OpenEnrollment,
    StoreAuthenticator,
    UpstreamAuthenticator,
)
from orchard.server.coordinator import Coordinator
from orchard.server.decoding import ClientUpdateDecoder
from orchard.server.droplog import DropLog
from orchard.server.servicer import FleetServicer, add_fleet_servicer
from orchard.server.store import SQLiteStore, Store, hash_token
from orchard.server.tls import TlsPaths, init_certs, server_credentials
from orchard.typing import Role
from orchard.v1 import orchard_pb2_grpc as pbg

log = logging.getLogger("orchard.server")


def is_loopback(host: str) -> bool:
    if host in ("localhost", ""):
        return host == "localhost"
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def check_bind(host: str, insecure: bool) -> None:
    if insecure and not is_loopback(host):
        raise ConfigError(f"--insecure serves without TLS or authentication and may only bind a loopback address "
                          f"(127.0.0.1, ::1, localhost), not {host!r}")


@dataclass
class TierHandle:
    role: str
    server: grpc.aio.Server
    host: str
    port: int
    coordinator: Coordinator
    runner: Any = None  # RootRunner on the root (imported lazily: aggregators never load torch)
    upstream: UpstreamLink | None = None
    store: Store | None = None
    metrics_port: int | None = None
    admin_token: str | None = None
    ca_cert: Path | None = None
    tasks: list[asyncio.Task[None]] = field(default_factory=list)
    log_handlers: list[logging.Handler] = field(default_factory=list)  # removed at stop
    dashboard: Any = None  # orchard.server.dashboard.Dashboard when --dashboard-port is given
    droplog: DropLog | None = None  # the root's record of dropped uploads

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    async def stop(self, grace: float = 1.0) -> None:
        for t in self.tasks:
            t.cancel()
        for hd in self.log_handlers:
            logging.getLogger("orchard.server").removeHandler(hd)
        if self.dashboard is not None:
            await self.dashboard.stop()
        if self.runner is not None:
            await self.runner.close()
        if self.upstream is not None:
            self.upstream.stopped.set()
            await self.upstream.link.close()
        await self.server.stop(grace)
        self.coordinator.shutdown()
        if self.upstream is not None and self.upstream.journal is not None:
            self.upstream.journal.close()
        if self.droplog is not None:
            self.droplog.close()
        if self.store is not None:
            self.store.close()


async def _sweeper(coord: Coordinator, wake: asyncio.Event | None = None) -> None:
    while True:
        await asyncio.sleep(0.25)
        coord.sweep()
        coord.expire_children()
        if wake is not None:
            wake.set()


def _bind(server: grpc.aio.Server, host: str, port: int, creds) -> int:
    addr = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    try:  # grpcio raises RuntimeError when it cannot bind (the check of 0 below stays for a release that returns it)
        bound = server.add_secure_port(addr, creds) if creds is not None else server.add_insecure_port(addr)
    except RuntimeError:
        bound = 0
    if bound == 0:
        raise ConfigError(f"cannot bind {addr}: the port is in use or the address is not local")
    return bound


def _admin_token(store: Store, data_dir: Path) -> str | None:
    """Create the admin token on first start; later starts only know its hash."""
    if store.get_meta("admin_token_hash") is not None:
        return None
    tok = "orc_admin_" + secrets.token_urlsafe(32)
    store.set_meta("admin_token_hash", hash_token(tok))
    atomic_write(data_dir / "admin.token", (tok + "\n").encode())
    return tok


async def start_root(data_dir: str | Path, *, host: str = "127.0.0.1", port: int = 0, insecure: bool = False,
                     server_cfg: ServerConfig | None = None, tls_dir: str | Path | None = None,
                     metrics_port: int | None = None, start_grace_s: float = 5.0, seed: int | None = None,
                     base_model: str | Path | None = None, dashboard_port: int | None = None,
                     noise_rng: np.random.Generator | None = None) -> TierHandle:
    """The root. ``noise_rng``: where central DP noise (and adaptive clipping's) comes
    from; None (every real root) is the operating system's CSPRNG (``os.urandom``)
    through ``orchard.randomness.SecureGenerator``. Tests that hold a root to a seeded
    simulation pass the simulator's."""
    from orchard.randomness import os_random
    from orchard.server.control import ControlServicer
    from orchard.server.root import RootRunner, warm_up

    check_bind(host, insecure)
    data_dir = Path(data_dir)
    report_loose(data_dir, "the root's data dir", log)
    private_dir(data_dir)
    cfg = (server_cfg or ServerConfig()).model_copy(update={"host": host, "port": port})
    store = SQLiteStore(data_dir / "orchard.db")
    coord = Coordinator("root", cfg, np.random.default_rng(seed), ClientUpdateDecoder(),
                        noise_rng=noise_rng if noise_rng is not None else os_random())
    runner = RootRunner(coord, store, data_dir, cfg, start_grace_s=start_grace_s, base_model=base_model)
    auth: Authenticator
    creds = None
    ca = None
    admin = None
    paths: TlsPaths | None = None
    if insecure:
        auth = OpenEnrollment()
        log.warning("INSECURE: no TLS, open enrollment, no admin token. Loopback development only.")
    else:
        admin = _admin_token(store, data_dir)
        auth = StoreAuthenticator(store, store.get_meta("admin_token_hash") or "")
        paths = TlsPaths.in_dir(tls_dir or data_dir / "tls")
        if not paths.exists():
            if tls_dir is not None:
                raise ConfigError(f"no certificates in {tls_dir}: run `orchard certs init --out {tls_dir}`")
            init_certs(paths.server_cert.parent)
            log.info("created a CA and server certificate in %s", paths.server_cert.parent)
        creds = server_credentials(paths)
        ca = paths.ca_cert

    def on_join(node_id: str, role: Role, token_hash: str, caps: dict[str, str]) -> None:
        # Rows of nodes not seen for as long as the registry keeps a node go (the table stays
        # bounded by the joins of that window: rate-limited, see docs/operating.md).
        store.upsert_node(node_id, role.value, token_hash, caps, time.time() - 10 * cfg.node_timeout_s)

    from orchard.server.runlog import RunLog
    from orchard.server.runlog import attach as attach_runlog

    runlog = RunLog(data_dir)
    server = grpc.aio.server(options=wire.SERVER_GRPC_OPTIONS)
    droplog = DropLog(data_dir / "orchard.db")

    def on_dropped(via: str, dropped: list[DroppedUpload]) -> None:
        # Only runs this root knows: an aggregator's report names its runs, not others'.
        runs = {r for r in {d.run_id for d in dropped} if store.get_run(r) is not None}
        if droplog.record(via, dropped, runs):
            log.info("%s reported %d dropped uploads", via, len(dropped))

    coord.certificates = auth.certificate  # for SecAgg+ clients that read no roster (secure_agg.roster)
    add_fleet_servicer(FleetServicer(coord, auth, on_join=on_join, on_dropped=on_dropped), server)
    pbg.add_ControlServicer_to_server(ControlServicer(runner, auth, runlog), server)
    bound = _bind(server, host, port, creds)
    await server.start()
    h = TierHandle("root", server, host, bound, coord, runner=runner, store=store, admin_token=admin, ca_cert=ca,
                   droplog=droplog)
    runlog_handler, observer = attach_runlog(runner, runlog)
    h.log_handlers.append(runlog_handler)
    h.tasks.append(asyncio.create_task(observer.run()))
    if metrics_port is not None:
        from orchard.server.metrics import serve_metrics

        h.metrics_port = serve_metrics(coord, "root", host, metrics_port)
    if dashboard_port is not None:
        from orchard.server.dashboard import serve_dashboard

        try:
            h.dashboard = await serve_dashboard(runner, auth, host, dashboard_port, paths)
        except OSError as err:
            await h.stop(0)
            raise ConfigError(f"cannot serve the dashboard on {host}:{dashboard_port}: {err.strerror or err}; "
                              "pick another --dashboard-port") from None
    h.tasks.append(asyncio.create_task(_sweeper(coord, runner._wake)))
    await asyncio.get_running_loop().run_in_executor(None, warm_up)
    await runner.resume()
    # Replaced whole, never written in place: tools and scripts poll for this file to know
    # the root is up, and must never read it half written.
    atomic_write(data_dir / "server.json", json.dumps({
        "host": host, "port": bound, "pid": os.getpid(), "tls": not insecure,
        "ca_cert": str(ca) if ca else None, "metrics_port": h.metrics_port,
        "dashboard": f"{h.dashboard.scheme}://{host}:{h.dashboard.port}/" if h.dashboard else None}).encode())
    return h


async def start_aggregator(upstream: str, *, host: str = "127.0.0.1", port: int = 0, insecure: bool = False,
                           token: str | None = None, ca_cert: str | Path | None = None,
                           tls_dir: str | Path | None = None, node_id: str = "",
                           server_cfg: ServerConfig | None = None, metrics_port: int | None = None,
                           seed: int | None = None, data_dir: str | Path | None = None) -> TierHandle:
    """An aggregator tier. ``data_dir``: where it keeps its identity (node id, credential,
    certificate, owner-only), so that a restart resumes the same node and its rounds."""
    check_bind(host, insecure)
    cfg = (server_cfg or ServerConfig()).model_copy(update={"host": host, "port": port})
    identity_dir = journal = None
    if data_dir is not None:
        report_loose(data_dir, "the aggregator's data dir", log)
        identity_dir = private_dir(data_dir) / "identity"
        journal = AckJournal(Path(data_dir) / "acks")  # what it acknowledged and has not forwarded
    link = FleetLink(LinkConfig(target=upstream, role=Role.AGGREGATOR, token=token,
                                ca_cert=Path(ca_cert) if ca_cert else None, insecure=insecure, node_id=node_id,
                                identity_dir=identity_dir))
    await link.join()
    coord = Coordinator(link.node_id, cfg, np.random.default_rng(seed), ClientUpdateDecoder())
    auth: Authenticator = OpenEnrollment() if insecure else UpstreamAuthenticator(link.verify_token)
    creds = None
    if not insecure:
        if tls_dir is None:
            raise ConfigError("an aggregator serves TLS: pass --tls-dir with server.pem/server.key "
                              "(from `orchard certs init`), or --insecure for loopback development")
        creds = server_credentials(TlsPaths.in_dir(tls_dir))
    coord.certificates = auth.certificate  # for SecAgg+ clients that read no roster (secure_agg.roster)
    server = grpc.aio.server(options=wire.SERVER_GRPC_OPTIONS)
    add_fleet_servicer(FleetServicer(coord, auth, verify_token_upstream=None if insecure else link.verify_token,
                                     on_dropped=(lambda _via, d: journal.relay(d)) if journal else None), server)
    bound = _bind(server, host, port, creds)
    await server.start()
    up = UpstreamLink(coord, link, journal)
    h = TierHandle("aggregator", server, host, bound, coord, upstream=up)
    if metrics_port is not None:
        from orchard.server.metrics import serve_metrics

        h.metrics_port = serve_metrics(coord, "aggregator", host, metrics_port)
    h.tasks.append(asyncio.create_task(_sweeper(coord)))
    h.tasks.append(asyncio.create_task(up.run()))
    return h
