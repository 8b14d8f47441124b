"""Chaos run: a federation on loopback under a seeded schedule of kill -9s and restarts,
then invariants checked from the root's store, its recorded aggregates and the uploads' ids.

The federation: a root (``orchard server start``, ``[server] keep_aggregates = true``), two
aggregators (``orchard aggregator start``, fixed node ids and ports) and ``--clients``
clients (``benchmarks/chaos_client.py``: the real client runtime with a trainer whose
update is the one-hot vector of its own upload's coordinate), each its own process. Runs
follow one another for ``--duration`` seconds, cycling through the modes asked for
(``sync``, ``fedbuff`` (asynchronous, FedBuff), ``secure`` (sync with SecAgg+ per
cohort)); meanwhile a schedule drawn from ``--seed`` sends SIGKILL to a random live
process (root, aggregator or client, weighted) every ``--kill-every`` seconds on average
and restarts it a moment later with the same data dir, node id and port. Each kill is
recorded with what its victim was doing (a client's last phase from its log: training,
uploading or in its SecAgg+ stages, pulling, polling; the root's open round's phase,
"closing" when its target was in: the server step and checkpoint). After the window
every process is brought back, the run in progress is let finish, everything stops,
and the checks run (:func:`check`):

- ``runs_finished``: every run started reached its last round (store: status, rounds);
- ``integer_aggregates`` / ``counts_match_records``: each completed round's recorded
  aggregate ``Σ w·x`` (weight 1 each) is a vector of whole counts, as many as its record's
  participants;
- ``no_double_count``: no coordinate (no upload) is counted twice, in one aggregate or
  across the run's aggregates;
- ``no_phantom_updates``: every counted coordinate is an upload a client made;
- ``every_accepted_update_accounted``: every upload a client saw acknowledged is in
  exactly one aggregate, or the root's store records why it is in none
  (:func:`drop_reason`: its own row among the dropped uploads its aggregator reported,
  ``orchard.server.droplog``, or its attempt failed, was interrupted or stopped). For an
  upload the store says nothing of, what happened near it (kills, the run's end) is
  printed as a diagnostic, never counted as a reason;
- ``replay_equals_final``: the initial checkpoint stepped through every recorded
  aggregate with ``orchard.aggregation.server_step`` equals every checkpoint, the last too;
- ``fds_bounded`` / ``rss_bounded``: no process incarnation that lived ``--min-life-s``
  grew its open file descriptors or resident memory by more than the bounds.

    python benchmarks/chaos.py --duration 600 --mode all --json benchmarks/results/chaos.json  (appends)
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _procs  # noqa: E402  (a sibling helper module, not a package)
from _chaos_checks import check  # noqa: E402
from chaos_client import initial_model  # noqa: E402

HERE = Path(__file__).resolve().parent
FAST = {"heartbeat_s": 1.0, "node_timeout_s": 3.0, "long_poll_s": 1.0}
DEADLINE_S = 10.0
KIND_WEIGHTS = {"client": 0.75, "aggregator": 0.17, "root": 0.08}
# A root restart (imports, store, resume) takes seconds, tens of them on a loaded host: a
# root killed again before its federation found it back would leave no round to fault.
ROOT_GAP_S = 45.0
MODES = ("sync", "fedbuff", "secure")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run_config(mode: str, rounds: int, clients: int):
    from orchard.config import CohortConfig, ModeConfig, RunConfig, SecureAggregationConfig

    target = max(4, clients // 2)
    if mode == "fedbuff":
        return RunConfig(task="digits", rounds=rounds, cohort=CohortConfig(
            target=max(2, clients // 3), over_selection=2.0, deadline_s=DEADLINE_S, min_fraction=0.5,
            max_retries=1000), mode=ModeConfig(kind="async", max_staleness=4, staleness="constant"))
    return RunConfig(task="digits", rounds=rounds, cohort=CohortConfig(
        target=target, over_selection=1.5, deadline_s=DEADLINE_S, min_fraction=0.5, max_retries=1000),
        secure_aggregation=SecureAggregationConfig(enabled=mode == "secure"))


@dataclass
class Kill:
    t: float
    kind: str
    name: str
    phase: str


@dataclass
class Proc:
    """One process the driver supervises: started, killed, restarted with the same command."""

    name: str
    kind: str
    cmd: list[str]
    log: Path
    ready_file: Path | None = None
    popen: subprocess.Popen | None = None
    started: float = 0.0
    incarnations: list[dict[str, Any]] = field(default_factory=list)

    def start(self) -> None:
        if self.ready_file is not None:
            self.ready_file.unlink(missing_ok=True)
        with open(self.log, "ab") as out:
            self.popen = subprocess.Popen(self.cmd, stdout=out, stderr=subprocess.STDOUT)
        self.started = time.time()
        self.incarnations.append({"pid": self.popen.pid, "start": self.started, "samples": []})

    def alive(self) -> bool:
        return self.popen is not None and self.popen.poll() is None

    def up(self) -> bool:
        """Alive and serving: a server that wrote its ready file, a client a second after start."""
        if not self.alive():
            return False
        if self.ready_file is None:
            return time.time() - self.started > 1.0
        if self.kind == "root":
            with contextlib.suppress(OSError, ValueError):
                return json.loads(self.ready_file.read_text()).get("pid") == self.popen.pid  # type: ignore[union-attr]
            return False
        return self.ready_file.is_file()

    def kill(self) -> None:
        assert self.popen is not None
        os.kill(self.popen.pid, signal.SIGKILL)
        self.popen.wait()

    def sample(self, now: float) -> None:
        """Open descriptors and resident bytes, once the incarnation serves (start-up,
        seconds of imports on a loaded host, is not growth)."""
        if not self.up():
            return
        self.incarnations[-1].setdefault("ready", now)
        with contextlib.suppress(psutil.Error):
            p = psutil.Process(self.popen.pid)  # type: ignore[union-attr]
            self.incarnations[-1]["samples"].append((now, p.num_fds(), p.memory_info().rss))

    def last_phase(self) -> str:
        """A client's last phase line in its event log."""
        with contextlib.suppress(OSError), open(self.log.with_suffix(".events"), "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - 4096))
            for line in reversed(f.read().decode(errors="replace").splitlines()):
                with contextlib.suppress(ValueError):
                    ev = json.loads(line)
                    if ev.get("event") == "phase":
                        return str(ev["phase"])
        return "starting"


class Federation:
    """Root, two aggregators and the clients, each a process on a fixed loopback port."""

    def __init__(self, work: Path, clients: int, train_s: float) -> None:
        self.work = work
        py = sys.executable
        root_dir = work / "root"
        root_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        (work / "root.toml").write_text("[server]\n" + "".join(f"{k} = {v!r}\n" for k, v in FAST.items())
                                        + "keep_aggregates = true\n")
        (work / "agg.toml").write_text("[server]\n" + "".join(f"{k} = {v!r}\n" for k, v in FAST.items()))
        self.root_addr = f"127.0.0.1:{free_port()}"
        self.root = Proc("root", "root", [py, "-m", "orchard.cli", "server", "start", "--data-dir", str(root_dir),
                                          "--port", self.root_addr.split(":")[1], "--insecure", "--config",
                                          str(work / "root.toml")], work / "root.log", root_dir / "server.json")
        self.aggs: list[Proc] = []
        agg_addrs = []
        for k in range(2):
            addr = f"127.0.0.1:{free_port()}"
            agg_addrs.append(addr)
            self.aggs.append(Proc(f"agg-{k}", "aggregator", [
                py, "-m", "orchard.cli", "aggregator", "start", "--upstream", self.root_addr, "--port",
                addr.split(":")[1], "--insecure", "--node-id", f"agg-{k}", "--config", str(work / "agg.toml"),
                "--data-dir", str(work / f"agg-{k}"), "--port-file", str(work / f"agg-{k}.port")],
                work / f"agg-{k}.log", work / f"agg-{k}.port"))
        self.clients = [Proc(f"c-{i}", "client", [
            py, str(HERE / "chaos_client.py"), "--server", agg_addrs[i % 2], "--node-id", f"c-{i}", "--index",
            str(i), "--state", str(work / f"c-{i}"), "--log", str(work / f"c-{i}.events"), "--train-s",
            str(train_s)], work / f"c-{i}.log") for i in range(clients)]

    @property
    def procs(self) -> list[Proc]:
        return [self.root, *self.aggs, *self.clients]

    def holder(self, index: int) -> str:
        """The aggregator client ``index`` uploads to."""
        return self.aggs[index % 2].name


def _status(ctl, run_id: str = "") -> dict[str, Any] | None:
    import grpc

    try:
        return ctl.status(run_id) if run_id else ctl.status()
    except grpc.RpcError:
        return None


def _root_phase(st: dict[str, Any] | None) -> str:
    cur = (st or {}).get("current_round") or {}
    if not cur:
        return "between rounds"
    if cur.get("received") is not None and cur.get("target") and cur["received"] >= cur["target"]:
        return "closing (server step, checkpoint)"
    return str(cur.get("phase", "open"))


def _near_close(ctl, wait_s: float = 3.0) -> dict[str, Any] | None:
    """The root's status once its open round is one update short of its target or
    closing (its server step and checkpoint follow), or after ``wait_s``."""
    end, st = time.time() + wait_s, None
    while time.time() < end:
        st = _status(ctl) or st
        cur = (st or {}).get("current_round") or {}
        if cur.get("target") and cur.get("received", 0) >= cur["target"] - 1:
            return st
        time.sleep(0.02)
    return st


def drive(work: Path, duration_s: float, seed: int, clients: int, modes: tuple[str, ...], rounds: int,
          kill_every_s: float, settle_s: float, train_s: float, min_kills: int = 0, say=print) -> dict[str, Any]:
    """Run the federation under the kill schedule for ``duration_s`` (longer, up to three
    times that, until ``min_kills`` were made), let the last run finish, stop everything;
    the raw facts for :func:`check`."""
    from orchard import wire
    from orchard.ops import ControlClient

    fed = Federation(work, clients, train_s)
    rng = random.Random(seed)
    kills: list[Kill] = []
    runs: list[dict[str, Any]] = []
    restart_at: dict[str, float] = {}
    blob = wire.arrays_to_blob(initial_model(clients))
    for p in fed.procs:
        p.start()
    _procs.wait_until(fed.root.up, "the root to start", 300)
    ctl = ControlClient(fed.root_addr, insecure=True)
    _procs.wait_until(lambda: ((_status(ctl) or {}).get("nodes") or {}).get("clients_total", 0) >= clients,
                      "every client to join", 300, poll_s=0.5)
    t0 = time.time()
    next_kill = t0 + rng.expovariate(1.0 / kill_every_s)
    next_sample = next_status = 0.0
    last_status: dict[str, Any] | None = None
    mode_i = 0
    healing = False
    last_root_kill = 0.0
    try:
        while True:
            now = time.time()
            if not healing and now - t0 >= duration_s and (len(kills) >= min_kills or now - t0 >= 3 * duration_s):
                healing, heal_from = True, now
                say(f"chaos window over after {len(kills)} kills; restarting every process, letting the run end")
            for p in fed.procs:  # restarts due (all of them once healing)
                if not p.alive() and (healing or now >= restart_at.get(p.name, 0.0)):
                    p.start()
            if now >= next_status:
                next_status = now + 0.5
                cur = runs[-1] if runs else None
                st = _status(ctl, cur["run_id"]) if cur else _status(ctl)
                if st is not None:
                    last_status = st
                    if cur is not None:
                        cur.update(status=st["status"], completed_rounds=st["completed_rounds"])
                    if (cur is None or st["status"] != "running") and not healing and fed.root.up():
                        mode = modes[mode_i % len(modes)]
                        mode_i += 1
                        cfg = run_config(mode, rounds, clients)
                        with contextlib.suppress(Exception):
                            run_id = ctl.start_run(cfg, blob)
                            runs.append({"run_id": run_id, "mode": mode, "status": "running", "completed_rounds": 0,
                                         "rounds": rounds, "started": time.time()})
                            say(f"[{now - t0:6.1f}s] run {run_id} ({mode}) started")
                    elif healing and cur is not None and st["status"] != "running":
                        break
            if healing and now - heal_from > settle_s:
                say(f"the last run did not end within {settle_s:.0f} s of the window's end")
                break
            if not healing and now >= next_kill:
                next_kill = now + rng.expovariate(1.0 / kill_every_s)
                kind = rng.choices(list(KIND_WEIGHTS), weights=list(KIND_WEIGHTS.values()))[0]
                spared = [k for k in KIND_WEIGHTS if not any(x.kind == k for x in kills)]
                if spared and now - t0 > duration_s / 2:  # every kind is killed at least once
                    kind = spared[0]
                elif kind == "root" and now - last_root_kill < ROOT_GAP_S:
                    kind = "client"
                pool = [p for p in fed.procs if p.kind == kind and p.up()]
                busy = [p for p in pool if p.last_phase() in ("training", "uploading")]
                if busy and rng.random() < 0.5:  # half the clients' kills aimed at one at work
                    pool = busy
                if pool:
                    victim = rng.choice(pool)
                    mode = runs[-1]["mode"] if runs else ""
                    if kind == "root" and rng.random() < 0.5:  # aimed at a round's close
                        last_status = _near_close(ctl) or last_status
                    phase = (_root_phase(last_status) if kind != "client" else victim.last_phase())
                    if phase == "uploading" and mode == "secure":
                        phase = "uploading (SecAgg+ stages)"
                    victim.kill()
                    if kind == "root":
                        last_root_kill = time.time()
                    kills.append(Kill(time.time(), kind, victim.name, phase))
                    restart_at[victim.name] = time.time() + rng.uniform(0.2, 1.5)
            if now >= next_sample:
                next_sample = now + 1.0
                for p in fed.procs:
                    p.sample(now)
            time.sleep(0.05)
        # What the aggregators acknowledged after the last run's last round reaches the root
        # as dropped once they see no round open for a deadline: let them report it.
        end = time.time() + DEADLINE_S + 15.0
        while time.time() < end and any((work / a.name / "acks").glob("*.acks") for a in fed.aggs):
            time.sleep(0.5)
    finally:
        ctl.close()
        for p in fed.procs:
            if p.alive():
                _procs.stop(p.popen)  # type: ignore[arg-type]
    return {"work": str(work), "clients": clients, "runs": runs, "kills": [asdict(k) for k in kills],
            "holders": {str(i): fed.holder(i) for i in range(clients)},
            "incarnations": {p.name: (p.kind, p.incarnations) for p in fed.procs},
            "wall_s": round(time.time() - t0, 1), "window_s": DEADLINE_S + 4 * FAST["node_timeout_s"] + 5.0}


def _commit() -> str:
    with contextlib.suppress(OSError, subprocess.CalledProcessError):
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=HERE, capture_output=True, text=True,
                              check=True).stdout.strip()
    return ""


def chaos(duration_s: float, seed: int, clients: int, modes: tuple[str, ...], rounds: int, kill_every_s: float,
          settle_s: float = 120.0, train_s: float = 0.3, work: Path | None = None, min_kills: int = 0,
          say=print) -> dict[str, Any]:
    """One chaos run end to end: the JSON the benchmark writes (see the module doc)."""
    with contextlib.ExitStack() as stack:
        if work is None:
            work = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="orchard-chaos-")))
        facts = drive(work, duration_s, seed, clients, modes, rounds, kill_every_s, settle_s, train_s, min_kills, say)
        (work / "facts.json").write_text(json.dumps(facts))  # what check() read, to look into
        out = check(facts)
    out.update(commit=_commit(), command=" ".join([Path(sys.executable).name, *sys.argv]),
               load_average=[round(x, 2) for x in os.getloadavg()], seed=seed, clients=clients, modes=list(modes),
               duration_s=duration_s, kill_every_s=kill_every_s, wall_s=facts["wall_s"])
    return out


def table(out: dict[str, Any]) -> str:
    lines = [f"{'kills':<28}{out['kills']:>8}"]
    lines += [f"  {k:<26}{v:>8}" for k, v in sorted(out["kills_by_kind"].items())]
    lines += [f"  {k:<40}{v:>6}" for k, v in sorted(out["kills_by_phase"].items())]
    lines.append(f"{'rounds finished':<28}{out['rounds_finished']:>8}")
    lines.append(f"{'updates counted':<28}{out['updates_counted']:>8}")
    lines.append(f"{'double counted':<28}{out['double_counted']:>8}")
    lines.append(f"{'dropped with a reason':<28}{sum(out['dropped_with_reason'].values()):>8}")
    lines += [f"  {k:<40}{v:>6}" for k, v in sorted(out["dropped_with_reason"].items())]
    lines.append(f"{'lost without a reason':<28}{out['lost_without_reason']:>8}")
    lines += [f"  {'near: ' + k:<40}{v:>6}" for k, v in sorted(out["lost_diagnostics"].items())]
    lines.append(f"{'recorded dropped, counted':<28}{sum(out['recorded_dropped_but_counted'].values()):>8}")
    lines += [f"  {k:<40}{v:>6}" for k, v in sorted(out["recorded_dropped_but_counted"].items())]
    lines += [f"{'invariant ' + k:<44}{'ok' if v else 'FAILED'}" for k, v in out["invariants"].items()]
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--duration", type=float, default=600.0, help="seconds of kills (then the last run ends)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--clients", type=int, default=12)
    ap.add_argument("--mode", choices=[*MODES, "all"], default="all")
    ap.add_argument("--rounds", type=int, default=5, help="rounds per run (runs follow one another)")
    ap.add_argument("--kill-every", type=float, default=2.5, help="mean seconds between kills")
    ap.add_argument("--min-kills", type=int, default=0, help="extend the window (up to 3x) until this many kills")
    ap.add_argument("--settle", type=float, default=180.0, help="seconds the last run may take after the window")
    ap.add_argument("--work", type=Path, default=None, help="keep the processes' data and logs here")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    if args.clients < 12:
        ap.error("--clients: the chaos run needs at least 12 clients")
    modes = MODES if args.mode == "all" else (args.mode,)
    out = chaos(args.duration, args.seed, args.clients, modes, args.rounds, args.kill_every, args.settle,
                work=args.work, min_kills=args.min_kills)
    print(table(out))
    if args.json:  # appended: the file holds every sitting's JSON, oldest first
        args.json.parent.mkdir(parents=True, exist_ok=True)
        old = json.loads(args.json.read_text()) if args.json.is_file() else []
        args.json.write_text(json.dumps([*(old if isinstance(old, list) else [old]), out], indent=2) + "\n")
    return 0 if out["invariants_ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
