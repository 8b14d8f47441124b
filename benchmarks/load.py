"""Load benchmark: how many connected devices one aggregator holds, and a round among them.

For each device count N (doubling, from ``--sizes``), on loopback, in a fresh federation:

- a root (``orchard server start``) and one aggregator (``orchard aggregator start``)
  below it, each its own process, with the servers' default timings (long poll 20 s,
  heartbeat 4 s, node timeout 12 s), plaintext (``--insecure``: the transport benchmark
  measures TLS; here every device would otherwise enroll a key at the root first);
- ``--generators`` device generators (``benchmarks/load_gen.py``), each playing its share
  of the N devices with the real client link, many device sessions multiplexed over a
  few TCP connections (``--per-connection`` devices a connection): they join, then
  long-poll for work, as idle phones do.

Measured at each N, once every device has joined and the root sees the pool:

- ``aggregator_rss_mib`` with N devices connected and idle, against its RSS before any
  joined: ``aggregator_kib_per_device``;
- the aggregator's CPU over an idle window (``--idle-s``) over the polls it answered in
  it: ``aggregator_cpu_us_per_poll`` (an idle device's long poll is its liveness
  message: it comes back every long-poll period, as a heartbeat would), and the
  aggregator's CPU a second while N devices idle;
- a round of ``--selected`` devices chosen among the N (each heartbeats once, pulls the
  model, pushes its update through the client's own upload builder): whether it closes
  (``round_closed``), and its time as the root records it.

The run stops at the first N that breaks (devices that could not join, the pool not
reached, the round not closed, the aggregator above 1 GiB, or a step's timeout), and
says how it broke: that N is the breaking point, the N before it the most this machine
held. Targets: 10,000 devices connected within 1 GiB of aggregator RSS, and the
1,000-device round closes.

    python benchmarks/load.py [--sizes 1250 2500 5000 10000 20000] [--selected 1000] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _procs  # noqa: E402  (a sibling helper module, not a package)
from _procs import MIB  # noqa: E402
from load_gen import model_blob, run_config  # noqa: E402

RSS_LIMIT_MIB = 1024.0
TARGET_DEVICES = 10_000
GEN = Path(__file__).resolve().parent / "load_gen.py"


@dataclass
class Row:
    devices: int
    joined: int = 0
    pool_reached: bool = False
    aggregator_baseline_rss_mib: float = 0.0
    aggregator_rss_mib: float = 0.0
    aggregator_kib_per_device: float = 0.0
    aggregator_peak_rss_mib: float = 0.0
    idle_seconds: float = 0.0
    idle_polls: int = 0
    aggregator_idle_cpu_seconds: float = 0.0
    aggregator_cpu_us_per_poll: float = float("nan")
    aggregator_idle_cpu_per_second: float = float("nan")
    selected: int = 0
    round_closed: bool = False
    round_seconds: float = float("nan")
    round_participants: int = 0
    generator_failures: int = 0
    first_error: str = ""
    broke: str = ""  # how this N broke ("" where it held)
    join_seconds: float = 0.0
    load_average_1m: float = 0.0
    generators: list[dict[str, Any]] = field(default_factory=list)


def _line(p: subprocess.Popen, prefix: str, timeout_s: float) -> str:
    """The next line of ``p``'s stdout that starts with ``prefix`` (the others are skipped)."""
    import selectors

    assert p.stdout is not None
    sel = selectors.DefaultSelector()
    sel.register(p.stdout, selectors.EVENT_READ)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if sel.select(timeout=1.0):
            line = p.stdout.readline()
            if not line:
                raise RuntimeError(f"the generator exited ({p.poll()}) before printing {prefix}")
            if line.startswith(prefix):
                return line[len(prefix):].strip()
    raise TimeoutError(f"no {prefix} line from the generator within {timeout_s:.0f} s")


def _stats(gens: list[subprocess.Popen]) -> list[dict[str, Any]]:
    for g in gens:
        assert g.stdin is not None
        g.stdin.write("STATS\n")
        g.stdin.flush()
    return [json.loads(_line(g, "STATS ", 60)) for g in gens]


def run_size(n: int, selected: int, generators: int, per_connection: int, idle_s: float, work: Path) -> Row:
    from orchard.ops import ControlClient

    row = Row(devices=n, selected=min(selected, n))
    work.mkdir(parents=True, exist_ok=True)
    root, root_addr = _procs.start_root(work / "root", log=work / "root.log")
    procs = [root]
    gens: list[subprocess.Popen] = []
    try:
        agg, agg_addr = _procs.start_aggregator(root_addr, work / "agg.port", log=work / "aggregator.log")
        procs.append(agg)
        ctl = ControlClient(root_addr, insecure=True)
        with _procs.RssSampler({"aggregator": agg.pid}) as sampler:
            _procs.wait_until(lambda: any(nd["role"] == "aggregator" for nd in ctl.nodes()), "the aggregator to join", 60)
            time.sleep(1.0)
            row.aggregator_baseline_rss_mib = sampler.series["aggregator"].last_before(time.time()) / MIB
            t0 = time.monotonic()
            share = -(-n // generators)
            for g in range(generators):
                first, count = g * share, min(share, n - g * share)
                if count <= 0:
                    break
                conns = max(1, -(-count // per_connection))
                gens.append(subprocess.Popen([sys.executable, str(GEN), agg_addr, str(first), str(count), str(conns)],
                                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                             env={**os.environ, "OMP_NUM_THREADS": "1"}))
            join_timeout = 120 + n / 20
            row.joined = sum(int(_line(g, "JOINED ", join_timeout)) for g in gens)
            row.join_seconds = time.monotonic() - t0
            if row.joined < n:
                stats = _stats(gens)
                row.first_error = next((s["first_error"] for s in stats if s["first_error"]), "")
                row.broke = f"{n - row.joined} of {n} devices could not join ({row.first_error})"
                return row
            try:
                _procs.wait_until(lambda: _pool(ctl) >= n, f"the root to see a pool of {n}", 120)
                row.pool_reached = True
            except TimeoutError:
                row.broke = f"the root saw a pool of {_pool(ctl)}, not {n}, 120 s after every device joined"
                return row
            # Idle: every device long-polls. Settle one long-poll period, then measure a window.
            time.sleep(5.0)
            before = _stats(gens)
            cpu0, w0 = _procs.cpu_seconds(agg.pid) or 0.0, time.monotonic()
            time.sleep(idle_s)
            cpu1, w1 = _procs.cpu_seconds(agg.pid) or 0.0, time.monotonic()
            after = _stats(gens)
            row.aggregator_rss_mib = sampler.series["aggregator"].last_before(time.time()) / MIB
            row.aggregator_kib_per_device = (row.aggregator_rss_mib - row.aggregator_baseline_rss_mib) * 1024 / n
            row.idle_seconds = w1 - w0
            row.idle_polls = sum(a["polls"] for a in after) - sum(b["polls"] for b in before)
            row.aggregator_idle_cpu_seconds = cpu1 - cpu0
            row.aggregator_idle_cpu_per_second = row.aggregator_idle_cpu_seconds / row.idle_seconds
            if row.idle_polls:
                row.aggregator_cpu_us_per_poll = row.aggregator_idle_cpu_seconds / row.idle_polls * 1e6
            # A round of `selected` among them.
            run_id = ctl.start_run(run_config(row.selected), model_blob())
            try:
                st = _procs.wait_until(lambda: (lambda s: s if s["status"] != "running" else None)(ctl.status(run_id)),
                           "the round to close", 300 + n / 50, poll_s=0.5)
            except TimeoutError as err:
                row.broke = str(err)
                st = ctl.status(run_id)
            rec = next((r for r in st.get("rounds", []) if r.get("round") == 1), {})
            row.round_closed = st.get("status") == "completed"
            row.round_seconds = float(rec.get("seconds", float("nan")))
            row.round_participants = int(rec.get("participants", 0))
            if not row.round_closed and not row.broke:
                row.broke = f"the round of {row.selected} did not close: run {st.get('status')}, " \
                            f"{row.round_participants} participants"
            row.aggregator_peak_rss_mib = sampler.series["aggregator"].peak() / MIB
            if row.aggregator_peak_rss_mib > RSS_LIMIT_MIB and not row.broke:
                row.broke = f"aggregator peak RSS {row.aggregator_peak_rss_mib:.0f} MiB > {RSS_LIMIT_MIB:.0f} MiB"
            row.generators = _stats(gens)
            row.generator_failures = sum(s["failed"] for s in row.generators)
            row.first_error = next((s["first_error"] for s in row.generators if s["first_error"]), "")
            row.load_average_1m = os.getloadavg()[0]
        ctl.close()
    except (TimeoutError, RuntimeError) as err:
        row.broke = row.broke or f"{type(err).__name__}: {err}"
    finally:
        for g in gens:
            if g.poll() is None and g.stdin is not None:
                try:
                    g.stdin.write("STOP\n")
                    g.stdin.flush()
                except OSError:
                    pass
        for g in gens:
            try:
                g.wait(30)
            except subprocess.TimeoutExpired:
                g.kill()
        for p in reversed(procs):
            _procs.stop(p)
    return row


def _pool(ctl) -> int:
    return sum(nd.get("pool_eligible", 0) for nd in ctl.nodes() if nd["role"] == "aggregator")


def _fmt(rows: list[Row]) -> str:
    head = (f"{'devices':>8} {'joined':>7} {'agg MiB':>8} {'KiB/dev':>8} {'us/poll':>8} {'idle cpu/s':>10} "
            f"{'round':>6} {'round s':>8} {'joins s':>8}  broke")
    lines = [head]
    for r in rows:
        lines.append(f"{r.devices:>8} {r.joined:>7} {r.aggregator_rss_mib:>8.0f} {r.aggregator_kib_per_device:>8.1f} "
                     f"{r.aggregator_cpu_us_per_poll:>8.0f} {r.aggregator_idle_cpu_per_second:>10.3f} "
                     f"{'closed' if r.round_closed else 'NO':>6} {r.round_seconds:>8.2f} {r.join_seconds:>8.1f}  "
                     f"{r.broke or '-'}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", type=int, nargs="+", default=[1250, 2500, 5000, 10000, 20000],
                    help="device counts, ascending; the run stops at the first that breaks")
    ap.add_argument("--selected", type=int, default=1000, help="devices in the round (at most N)")
    ap.add_argument("--generators", type=int, default=2, help="device generator processes")
    ap.add_argument("--per-connection", type=int, default=50, help="device sessions a TCP connection carries")
    ap.add_argument("--idle-s", type=float, default=30.0, help="the idle window measured (s)")
    ap.add_argument("--json", metavar="PATH", help="write the results here")
    ap.add_argument("--keep", metavar="DIR", help="run in DIR and keep the servers' logs there")
    args = ap.parse_args(argv)
    rows: list[Row] = []
    with tempfile.TemporaryDirectory(prefix="orchard-load-") as tmp:
        work = Path(args.keep) if args.keep else Path(tmp)
        for n in sorted(args.sizes):
            print(f"N = {n} ...", file=sys.stderr, flush=True)
            rows.append(run_size(n, args.selected, args.generators, args.per_connection, args.idle_s, work / f"n{n}"))
            print(_fmt(rows[-1:]).splitlines()[1], file=sys.stderr, flush=True)
            if rows[-1].broke:
                break
    print(_fmt(rows))
    held = [r for r in rows if not r.broke]
    most = max((r.devices for r in held), default=0)
    broke = next((r for r in rows if r.broke), None)
    at_target = next((r for r in rows if r.devices == TARGET_DEVICES), None)
    ok = bool(at_target and not at_target.broke and at_target.round_closed
              and at_target.aggregator_peak_rss_mib <= RSS_LIMIT_MIB)
    print(f"\nheld: {most} devices; breaking point: "
          f"{f'{broke.devices} ({broke.broke})' if broke else 'not reached at the sizes tried'}")
    print(f"target: {TARGET_DEVICES} devices within {RSS_LIMIT_MIB:.0f} MiB and the {args.selected}-device round "
          f"closes: {'PASS' if ok else 'FAIL'}")
    if args.json:
        Path(args.json).write_text(json.dumps({
            "connected_devices": at_target.joined if at_target else most,
            "aggregator_peak_rss_mib": at_target.aggregator_peak_rss_mib if at_target else None,
            "round_closed": bool(at_target and at_target.round_closed),
            "most_devices_held": most,
            "breaking_point_devices": broke.devices if broke else None,
            "breaking_point_how": broke.broke if broke else None,
            "target_met": ok, "rows": [asdict(r) for r in rows],
        }, indent=1))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
