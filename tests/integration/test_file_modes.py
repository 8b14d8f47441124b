"""Everything a fresh root, an aggregator and a client write is owner-only (0600 files,
0700 directories) whatever the process umask, the store's -wal and -shm included; a data
dir found open to others is reported at start."""

from __future__ import annotations

import asyncio
import logging
import os
import stat
from pathlib import Path

import pytest
from fed_harness import FAST

from orchard import wire
from orchard.client.launch import ClientOptions, resolve_client, serve_client
from orchard.config import CodecSpec, CohortConfig, RunConfig
from orchard.ops import ControlClient
from orchard.server.app import start_aggregator, start_root
from orchard.tasks import get_task
from orchard.trainer import TrainConfig

EF_TOPK = CodecSpec(name="error_feedback", params={"codec": {"name": "topk", "params": {"fraction": 0.1}}})


def modes(root: Path) -> dict[str, int]:
    """Every path under ``root`` (itself included) with its permission bits."""
    out = {".": stat.S_IMODE(root.stat().st_mode)}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            p = Path(dirpath) / name
            out[str(p.relative_to(root))] = stat.S_IMODE(p.lstat().st_mode)
    return out


def open_to_others(found: dict[str, int], root: Path) -> dict[str, str]:
    bad = {}
    for rel, mode in found.items():
        want = 0o700 if (root / rel).is_dir() else 0o600
        if mode != want:
            bad[rel] = f"{mode:o} (want {want:o})"
    return bad


def test_a_fresh_federation_writes_owner_only(tmp_path: Path) -> None:
    root_dir, agg_dir, client_dir = tmp_path / "root", tmp_path / "agg", tmp_path / "phone" / "state"
    seen: dict[str, dict[str, int]] = {}

    async def main() -> None:
        root = await start_root(root_dir, server_cfg=FAST, start_grace_s=0.1)
        assert root.store is not None and root.ca_cert is not None
        ca = Path(root.ca_cert)
        agg = client_rt = None
        stop = asyncio.Event()
        try:
            agg = await start_aggregator(root.address, token=root.store.issue_token("aggregator"), ca_cert=ca,
                                         tls_dir=root_dir / "tls", server_cfg=FAST, data_dir=agg_dir)
            setup = resolve_client(ClientOptions(server=agg.address, task="digits", token=root.store.issue_token(
                "client"), ca_cert=ca, node_id="phone", state_dir=client_dir))
            client_rt = asyncio.create_task(serve_client(setup, stop=stop))
            cfg = RunConfig(task="digits", rounds=1, codec=EF_TOPK,
                            train=TrainConfig(epochs=1, learning_rate=0.2, batch_size=16),
                            cohort=CohortConfig(target=1, over_selection=1.0, min_fraction=1.0, deadline_s=60))
            ctl = ControlClient(root.address, admin_token=root.admin_token, ca_cert=ca)
            try:
                run_id = await asyncio.to_thread(ctl.start_run, cfg, wire.arrays_to_blob(
                    get_task("digits").initial_arrays(0)))
                for _ in range(1200):
                    if (await asyncio.to_thread(ctl.status, run_id))["status"] != "running":
                        break
                    await asyncio.sleep(0.1)
            finally:
                ctl.close()
            # While the store is open: SQLite's -wal and -shm are there (it removes them at close).
            seen["root"] = modes(root_dir)
        finally:
            stop.set()
            if client_rt is not None:
                await asyncio.gather(client_rt, return_exceptions=True)
            if agg is not None:
                await agg.stop(0.1)
            await root.stop(0.1)

    old = os.umask(0o022)  # a shell's usual umask: the modes must not depend on the caller's
    try:
        asyncio.run(main())
    finally:
        os.umask(old)
    root_seen = seen["root"]
    for name in ("orchard.db", "orchard.db-wal", "orchard.db-shm", "admin.token", "server.json", "tls/ca.pem",
                 "tls/server.key", "identity/root.key"):
        assert name in root_seen, sorted(root_seen)
    assert any(p.startswith("checkpoints/") and p.endswith(".safetensors") for p in root_seen), sorted(root_seen)
    assert any(p.startswith("logs/") and p.endswith(".jsonl") for p in root_seen), sorted(root_seen)
    assert open_to_others(root_seen, root_dir) == {}
    assert open_to_others(modes(root_dir), root_dir) == {}  # after the store closed
    agg_seen = modes(agg_dir)
    assert "identity/device.key" in agg_seen and open_to_others(agg_seen, agg_dir) == {}
    client_seen = modes(client_dir)
    assert "identity/device.key" in client_seen, sorted(client_seen)
    assert any(p.startswith("codec-state-") for p in client_seen), sorted(client_seen)
    assert open_to_others(client_seen, client_dir) == {}
    assert stat.S_IMODE((tmp_path / "phone").stat().st_mode) == 0o700  # a parent it made too


def test_a_loose_data_dir_is_reported_at_start(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    data = tmp_path / "root"
    data.mkdir(mode=0o755)
    os.chmod(data, 0o755)

    async def start_stop() -> None:
        h = await start_root(data, insecure=True)
        await h.stop(0)

    with caplog.at_level(logging.WARNING, logger="orchard.server"):
        asyncio.run(start_stop())
    lines = [r.getMessage() for r in caplog.records if "open to group or others" in r.getMessage()]
    assert len(lines) == 1, [r.getMessage() for r in caplog.records]
    assert str(data) in lines[0] and "(755)" in lines[0] and f"chmod -R go-rwx {data}" in lines[0]
    # It is used as found (the operator's choice), and what Orchard wrote in it is owner-only.
    assert stat.S_IMODE(data.stat().st_mode) == 0o755
    assert stat.S_IMODE((data / "orchard.db").stat().st_mode) == 0o600
    caplog.clear()
    os.chmod(data, 0o700)
    with caplog.at_level(logging.WARNING, logger="orchard.server"):
        asyncio.run(start_stop())
    assert not [r for r in caplog.records if "open to group or others" in r.getMessage()]
