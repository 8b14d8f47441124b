"""Each run's log, kept by the root under ``DATA_DIR/logs/RUN_ID.jsonl``.

One JSON object per line: ``t`` (unix seconds), ``level`` and ``message`` (and
``event: "run_end"`` on the line that closes a run's log). Two sources
write to it:

- the root's own log records (the ``orchard.server.root`` logger at INFO and above,
  every other ``orchard.server`` logger at WARNING and above) while a run is active;
- a :class:`RunObserver` that watches the runner between rounds and writes what an
  operator asks about: the run starting, a round waiting for clients (and why), a
  round opening with its selection, and each attempt's outcome (participants,
  dropped, refused with reasons, bytes, metrics).

Readers page through a log by byte offset (``read``), so ``orchard run logs --follow``
asks only for what is new. A line is written whole under a lock, and a reader returns
only complete lines, so a reader never sees half a record.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import threading
import time
from pathlib import Path
from typing import Any

from orchard.errors import UnknownRunError
from orchard.files import open_append
from orchard.server.root import RootRunner

# Run ids are made by the root (run-YYYYmmdd-HHMMSS-xxxxxx); anything else never names a file.
_RUN_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
MAX_PAGE_BYTES = 256 << 10


class RunLog:
    """Appends to and reads the per-run log files under ``DATA_DIR/logs``."""

    def __init__(self, data_dir: Path) -> None:
        self.dir = Path(data_dir) / "logs"
        self._lock = threading.Lock()

    def path(self, run_id: str) -> Path:
        if not _RUN_ID.match(run_id):
            raise UnknownRunError(f"{run_id!r} is not a run id (see `orchard run list`)")
        return self.dir / f"{run_id}.jsonl"

    def write(self, run_id: str, level: str, message: str, t: float | None = None, event: str = "") -> None:
        rec: dict[str, Any] = {"t": round(time.time() if t is None else t, 3), "level": level, "message": message}
        if event:
            rec["event"] = event  # "run_end": the last line a run's log gets (followers stop there)
        line = json.dumps(rec)
        with self._lock, open_append(self.path(run_id)) as f:  # owner-only, as the whole data dir
            f.write(line + "\n")

    def read(self, run_id: str, after: int = 0, max_bytes: int = MAX_PAGE_BYTES) -> tuple[list[str], int]:
        """Complete lines from byte offset ``after`` (at most about ``max_bytes``), and the
        offset to continue from."""
        p = self.path(run_id)
        if after < 0:
            raise UnknownRunError(f"log offset must be >= 0, got {after}")
        if not p.is_file():
            return [], after
        with open(p, "rb") as f:
            f.seek(after)
            data = f.read(max(1, max_bytes))
        end = data.rfind(b"\n")
        if end < 0:
            return [], after
        chunk = data[:end + 1]
        return chunk.decode("utf-8", errors="replace").splitlines(), after + len(chunk)


class RunLogHandler(logging.Handler):
    """Copies the root's log records into the active run's log."""

    def __init__(self, runlog: RunLog, runner: RootRunner) -> None:
        super().__init__(logging.INFO)
        self.runlog = runlog
        self.runner = runner

    def emit(self, record: logging.LogRecord) -> None:
        run = self.runner.run
        if run is None:
            return
        if record.levelno < logging.WARNING and record.name != "orchard.server.root":
            return
        try:
            msg = record.getMessage()
            if record.exc_info and record.exc_info[1] is not None:
                msg += f" ({type(record.exc_info[1]).__name__}: {record.exc_info[1]})"
            self.runlog.write(run.run_id, record.levelname.lower(), msg, record.created)
        except Exception:  # a log must never take the server down
            self.handleError(record)


def _summary(r: dict[str, Any]) -> str:
    """One line for a finished attempt, from its round record in the store."""
    head = f"round {r['round']} attempt {r['attempt']} {r['status']}"
    parts = [f"{r.get('participants', 0)} updates of {r.get('selected', 0)} selected",
             f"{r.get('dropped', 0)} dropped"]
    rejected = r.get("rejected") or {}
    if rejected:
        parts.append("refused: " + ", ".join(f"{why} ×{n}" for why, n in rejected.items()))
    parts.append(f"bytes up {r.get('bytes_up', 0)}, down {r.get('bytes_down', 0)}")
    if r.get("closed_because"):
        parts.append(f"closed: {r['closed_because']}")
    metrics = r.get("metrics") or {}
    if metrics:
        parts.append(", ".join(f"{k} {v:.4g}" for k, v in sorted(metrics.items())))
    if r.get("reason"):
        parts.append(r["reason"])
    return f"{head}: " + "; ".join(parts)


class RunObserver:
    """Watches the runner and writes round events to the active run's log.

    It only reads: the runner's current round and the store's round records. It polls
    (every ``interval_s``) rather than hooking the run loop, so the round logic stays
    as it is. Openings and outcomes come from the store's records, so none is missed
    however short a round; a wait for clients shorter than one interval may go unlogged."""

    def __init__(self, runlog: RunLog, runner: RootRunner, interval_s: float = 0.25) -> None:
        self.runlog = runlog
        self.runner = runner
        self.interval_s = interval_s
        self.since = time.time()
        self._run_id: str | None = None
        self._opened: set[tuple[int, int]] = set()
        self._logged: set[tuple[int, int]] = set()
        self._last_wait = ""
        self._ended = False

    def _attach(self, run_id: str) -> None:
        self._run_id = run_id
        self._last_wait = ""
        row = self.runner.store.get_run(run_id)
        # The runner holds only a run it started or resumed in this process, so its
        # closing line is this process's to write, even when the run ended (a short run)
        # before the first look.
        self._ended = False
        run = self.runner.run
        if row is not None and row.created >= self.since and run is not None:
            self._opened, self._logged = set(), set()
            cfg = run.config
            self.runlog.write(run_id, "info", f"run {run_id} started: task {cfg.task}, {cfg.rounds} rounds, "
                              f"{cfg.cohort.target} clients per round, codec {cfg.codec.name}, "
                              f"secure aggregation {cfg.secure_aggregation.enabled}", row.created)
        else:
            # A run this process resumed: what happened before the restart was logged then.
            seen = {(r["round"], r["attempt"]) for r in self.runner.store.rounds(run_id)}
            self._opened = set(seen)
            self._logged = set(seen)
            self.runlog.write(run_id, "info", f"run {run_id} resumed by the root after round "
                              f"{row.completed_rounds if row else 0}")

    def step(self) -> None:
        from orchard.server.observe import waiting

        run = self.runner.run
        if run is None:
            return
        if run.run_id != self._run_id:
            self._attach(run.run_id)
        rid = run.run_id
        for r in self.runner.store.rounds(rid):
            key = (r["round"], r["attempt"])
            if key not in self._opened:
                self._opened.add(key)
                self._last_wait = ""
                self.runlog.write(rid, "info", f"round {key[0]} attempt {key[1]} opened: {r.get('selected', 0)} "
                                  f"selected for a target of {run.config.cohort.target}, deadline "
                                  f"{run.config.cohort.deadline_s:g} s", r["started"])
            if r["status"] != "running" and key not in self._logged:
                self._logged.add(key)
                self.runlog.write(rid, "info" if r["status"] == "completed" else "warning", _summary(r),
                                  r.get("finished"))
        row = self.runner.store.get_run(rid)
        if row is not None and row.status != "running" and not self._ended:
            self._ended = True
            self.runlog.write(rid, "info" if row.status == "completed" else "warning",
                              f"run {rid} {row.status} after {row.completed_rounds} rounds"
                              + (f": {row.error}" if row.error else ""), event="run_end")
        cur = run.current
        w = waiting(self.runner) if cur is not None else None
        if cur is not None and w is not None and w["message"] != self._last_wait:
            self._last_wait = w["message"]
            self.runlog.write(rid, "info", f"round {cur['round']} attempt {cur['attempt']}: {w['message']}")

    async def run(self) -> None:
        log = logging.getLogger("orchard.server.runlog")
        while True:
            try:
                self.step()
            except Exception:  # keep observing; the run itself is unaffected
                log.exception("run log observer")
            await asyncio.sleep(self.interval_s)


def attach(runner: RootRunner, runlog: RunLog) -> tuple[RunLogHandler, RunObserver]:
    """Start keeping run logs for ``runner``: returns the handler (installed on the
    ``orchard.server`` logger; remove it at shutdown) and the observer (run its ``run()``
    as a task)."""
    handler = RunLogHandler(runlog, runner)
    # Records reach the handler as far as the loggers' levels let them (INFO with the
    # server's default --verbose); round events come from the observer either way.
    logging.getLogger("orchard.server").addHandler(handler)
    return handler, RunObserver(runlog, runner)
