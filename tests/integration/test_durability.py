"""kill -9 of the root in the middle of a round; a restart with the same --data-dir
continues from the last completed round, and clients reconnect by themselves."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from fed_harness import Federation, add_clients

from orchard import wire
from orchard.config import CohortConfig, RunConfig
from orchard.ops import ControlClient
from orchard.tasks import get_task


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start_root_process(data: Path, port: int) -> subprocess.Popen:
    cfg = data.parent / "server.toml"
    cfg.write_text("[server]\nheartbeat_s = 1.0\nnode_timeout_s = 5.0\nlong_poll_s = 1.0\n")
    p = subprocess.Popen([sys.executable, "-m", "orchard.cli", "server", "start", "--data-dir", str(data),
                          "--port", str(port), "--insecure", "--config", str(cfg)],
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        info = data / "server.json"
        if info.is_file() and json.loads(info.read_text()).get("pid") == p.pid:
            return p
        assert p.poll() is None, "root exited during start-up"
        time.sleep(0.1)
    raise AssertionError("root did not start")


class RootProcess:
    """``orchard server start`` as a process on a port of its own (insecure), which a test
    kills (-9) and starts again on the same data directory and port."""

    def __init__(self, data: Path) -> None:
        self.data = data
        self.port = free_port()
        self.addr = f"127.0.0.1:{self.port}"
        self.proc = start_root_process(data, self.port)
        self.ctl = ControlClient(self.addr, insecure=True)

    def kill_and_restart(self) -> None:
        os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.wait(10)
        self.proc = start_root_process(self.data, self.port)

    def stop(self) -> None:
        self.ctl.close()
        self.proc.send_signal(signal.SIGTERM)
        self.proc.wait(20)


class SlowTrainer:
    def __init__(self, inner, seconds: float) -> None:
        self.inner, self.seconds = inner, seconds

    def train(self, arrays, config):
        time.sleep(self.seconds)
        return self.inner.train(arrays, config)

    def evaluate(self, arrays, config):
        return self.inner.evaluate(arrays, config)


def test_kill_minus_9_mid_round_then_resume(tmp_path: Path) -> None:
    data = tmp_path / "root"
    root = RootProcess(data)
    addr, ctl = root.addr, root.ctl
    task = get_task("digits")

    async def main() -> dict:
        fed = Federation()
        await add_clients(fed, addr, [0, 1], 2, wrap=lambda t: SlowTrainer(t, 0.6), max_backoff_s=1.0)
        cfg = RunConfig(task="digits", rounds=4, cohort=CohortConfig(target=2, over_selection=1.0, deadline_s=30))
        await asyncio.to_thread(ctl.start_run, cfg, wire.arrays_to_blob(task.initial_arrays(0)))
        # Wait for round 1 to complete and round 2 to be under way, then kill -9.
        while True:
            st = await asyncio.to_thread(ctl.status)
            if st["completed_rounds"] >= 1 and (st.get("current_round") or {}).get("phase") == "training":
                break
            await asyncio.sleep(0.05)
        ck1 = (data / "checkpoints" / st["run_id"] / "round-000001.safetensors").read_bytes()
        root.kill_and_restart()
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            try:
                st = await asyncio.to_thread(ctl.status)
            except Exception:
                await asyncio.sleep(0.2)
                continue
            if st["status"] != "running":
                break
            await asyncio.sleep(0.2)
        for t in fed.client_tasks:
            t.cancel()
        await asyncio.gather(*fed.client_tasks, return_exceptions=True)
        st["ck1_unchanged"] = ck1 == (data / "checkpoints" / st["run_id"] / "round-000001.safetensors").read_bytes()
        return st

    try:
        st = asyncio.run(main())
    finally:
        root.stop()
    assert st["status"] == "completed" and st["completed_rounds"] == 4, st
    completed = [r["round"] for r in st["rounds"] if r["status"] == "completed"]
    assert completed == [1, 2, 3, 4]
    assert any(r["status"] == "interrupted" and r["round"] == 2 for r in st["rounds"]), st["rounds"]
    assert st["ck1_unchanged"]
