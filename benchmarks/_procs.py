"""Helpers for benchmarks that run Orchard tiers as separate processes and measure them.

A root and an aggregator started here are the real ``orchard`` CLI commands in child
processes (``--insecure`` on loopback), so their memory and CPU are their own and can
be read from the kernel. :class:`RssSampler` samples resident memory every few tens of
milliseconds in a thread; the kernel's own high-water mark (``VmHWM``) is read as well,
because a sampler can miss a peak that lasts less than its period.
"""

from __future__ import annotations

import abc
import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Self

import psutil

MIB = 1 << 20


def vm_hwm_bytes(pid: int) -> int | None:
    """The kernel's peak resident set of ``pid`` (Linux ``VmHWM``), or None where unavailable."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024  # reported in kB
    except OSError:
        return None
    return None


@dataclass
class Series:
    pid: int
    samples: list[tuple[float, int]] = field(default_factory=list)  # (time.time(), rss bytes)

    def peak(self, since: float = 0.0, until: float = float("inf")) -> int:
        return max((r for t, r in self.samples if since <= t <= until), default=0)

    def last_before(self, t: float) -> int:
        before = [r for s, r in self.samples if s <= t]
        return before[-1] if before else 0


def throughput(measured: list[Any], trained: int, secs: float) -> dict[str, Any]:
    """The figures a simulation row states over its measured rounds, written once so the
    Orchard engine's rows and the Flower peer's compare: ``trained`` clients in ``secs``
    wall seconds."""
    n = len(measured)
    return {"rounds": n, "trained_per_round": trained / n, "clients_per_second": round(trained / secs, 1),
            "seconds_per_round": round(secs / n, 3)}


class PeriodicSampler(abc.ABC):
    """Calls :meth:`sample` every ``period_s`` seconds in a daemon thread for as long as
    its ``with`` block runs; a subclass says what one sample is."""

    def __init__(self, period_s: float, name: str) -> None:
        self.period_s = period_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    @abc.abstractmethod
    def sample(self) -> None:
        """Take one sample (called from the sampler's thread)."""

    def _run(self) -> None:
        while not self._stop.is_set():
            self.sample()
            self._stop.wait(self.period_s)

    def __enter__(self) -> Self:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


class RssSampler(PeriodicSampler):
    """Samples the RSS of named processes every ``period_s`` seconds in a daemon thread."""

    def __init__(self, pids: dict[str, int], period_s: float = 0.05) -> None:
        super().__init__(period_s, "rss-sampler")
        self.series = {name: Series(pid) for name, pid in pids.items()}
        self._procs = {name: psutil.Process(pid) for name, pid in pids.items()}

    def add(self, name: str, pid: int) -> None:
        self._procs[name] = psutil.Process(pid)
        self.series[name] = Series(pid)

    def sample(self) -> None:
        now = time.time()
        for name, p in list(self._procs.items()):
            with contextlib.suppress(psutil.Error):
                self.series[name].samples.append((now, p.memory_info().rss))


def _write_server_toml(path: Path, settings: dict[str, float | int]) -> Path:
    path.write_text("[server]\n" + "".join(f"{k} = {v!r}\n" for k, v in settings.items()))
    return path


def _wait_for(cond, proc: subprocess.Popen, what: str, timeout_s: float = 60.0):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        got = cond()
        if got:
            return got
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited with code {proc.returncode} during start-up")
        time.sleep(0.05)
    raise RuntimeError(f"{what} did not start within {timeout_s:.0f} s")


def start_root(data_dir: Path, server: dict[str, float | int] | None = None,
               log: Path | None = None, tls_dir: Path | None = None) -> tuple[subprocess.Popen, str]:
    """``orchard server start --port 0`` with ``--tls-dir tls_dir`` (enrollment tokens then
    needed: issue them into ``data_dir``'s store first), or ``--insecure`` without one;
    returns the process and HOST:PORT."""
    data_dir.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "orchard.cli", "server", "start", "--data-dir", str(data_dir), "--port", "0",
           *(["--tls-dir", str(tls_dir)] if tls_dir else ["--insecure"])]
    if server:
        cmd += ["--config", str(_write_server_toml(data_dir.parent / "root-server.toml", server))]
    out = open(log, "wb") if log else subprocess.DEVNULL  # noqa: SIM115 - the child owns it
    p = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
    info_path = data_dir / "server.json"

    def ready() -> dict | None:
        if not info_path.is_file():
            return None
        with contextlib.suppress(ValueError):
            info = json.loads(info_path.read_text())
            return info if info.get("pid") == p.pid else None
        return None

    info = _wait_for(ready, p, "root")
    return p, f"{info['host']}:{info['port']}"


def start_aggregator(upstream: str, port_file: Path, log: Path | None = None, tls_dir: Path | None = None,
                     token: str | None = None) -> tuple[subprocess.Popen, str]:
    """``orchard aggregator start --upstream ... --port 0``, over TLS with ``tls_dir``'s CA and
    certificate and an aggregator ``token``, or ``--insecure``; returns the process and HOST:PORT."""
    port_file.unlink(missing_ok=True)
    tls = (["--tls-dir", str(tls_dir), "--ca-cert", str(tls_dir / "ca.pem"), "--token", str(token)] if tls_dir
           else ["--insecure"])
    cmd = [sys.executable, "-m", "orchard.cli", "aggregator", "start", "--upstream", upstream, "--port", "0",
           *tls, "--port-file", str(port_file)]
    out = open(log, "wb") if log else subprocess.DEVNULL  # noqa: SIM115
    p = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
    port = _wait_for(lambda: port_file.is_file() and port_file.read_text().strip(), p, "aggregator")
    return p, f"127.0.0.1:{port}"


def wait_until(cond, what: str, timeout_s: float, poll_s: float = 0.1):
    """``cond()``'s first truthy value, asked every ``poll_s``; TimeoutError naming ``what``
    after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        got = cond()
        if got:
            return got
        time.sleep(poll_s)
    raise TimeoutError(f"timed out after {timeout_s:.0f} s waiting for {what}")


def stop(p: subprocess.Popen, timeout_s: float = 20.0) -> None:
    """SIGTERM (the CLI stops gracefully), then SIGKILL if it does not exit."""
    if p.poll() is not None:
        return
    p.send_signal(signal.SIGTERM)
    try:
        p.wait(timeout_s)
    except subprocess.TimeoutExpired:
        os.kill(p.pid, signal.SIGKILL)
        p.wait()


def cpu_seconds(pid: int) -> float | None:
    """User + system CPU seconds of a live process (its threads included)."""
    try:
        t = psutil.Process(pid).cpu_times()
    except psutil.Error:
        return None
    return t.user + t.system


def py_spy(pid: int, out: Path, *, rate: int, duration_s: float | None = None,
           threads: bool = False) -> subprocess.Popen | None:
    """py-spy (if installed) records ``pid``'s Python stacks without pausing it, as raw
    collapsed stacks in ``out``, until ``duration_s`` or a SIGINT (it then writes what it
    has); None, with a line on stderr, where py-spy is not installed."""
    import shutil

    exe = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
    if not Path(exe).is_file():
        print("--profile needs py-spy (pip install py-spy); not profiling", file=sys.stderr)
        return None
    cmd = [exe, "record", "--pid", str(pid), "--format", "raw", "--nonblocking", "--rate", str(rate),
           "--output", str(out)]
    if threads:
        cmd.append("--threads")
    if duration_s is not None:
        cmd += ["--duration", str(int(duration_s))]
    return subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
