"""Transport benchmark: one aggregator, N concurrent clients, each pushing a 1 MiB update.

Three processes on loopback, all over real gRPC (``--insecure``):

- a root (``orchard server start``) and one aggregator (``orchard aggregator start``)
  below it, each in its own process so that its memory and CPU are its own;
- a load generator: one process, N asyncio coroutines, each a real
  :class:`orchard.link.FleetLink` client that joins the aggregator, long-polls for the
  task, pulls the 1 MiB model (chunked, sha256-checked), builds a 1 MiB float32 delta
  (no training: ``base * scale_i`` with a fixed seed), encodes it with
  :func:`orchard.client.update.build_upload` and the float32 codec, and pushes it.

The model is one float32 tensor of 262,144 elements (1 MiB). The run has one round,
cohort target N, no over-selection, so the round closes when the N-th update is folded
at the aggregator and its partial sum is folded at the root. The new global model is
pulled afterwards and compared with ``initial + mean(delta_i)``: the numbers only count
if every update really arrived.

Measured per N:

- round_seconds: the root's own round time (open to close, from ``status``), which
  includes the aggregator pulling the task, N pulls, N uploads and the partial sum;
  wall_seconds: ``start_run`` to ``completed`` as seen by the operator;
- upload MB/s: N x 1 MiB / (first upload start .. last upload accepted), download MB/s
  the same over the model pulls (MB = 10^6 bytes);
- resident memory of each process: a baseline before any client connects, with N
  clients connected and idle, and the peak (sampled every 50 ms and the kernel's
  ``VmHWM``, whichever is higher);
- CPU seconds of each process over the scenario.

Targets (2-core machine): the round closes in at most 15 s with 1,000 clients, the
aggregator's peak RSS is at most 500 MiB, and memory grows with clients only by
per-connection state. The last is checked against the small run of the same benchmark:
(peak at N - peak at N_small) / (N - N_small) must stay under a quarter of one update
(256 KiB per client). A tier that kept every client's update (O(clients x model)
instead of O(model)) would grow by at least 1 MiB per client.

    python benchmarks/transport.py [--clients 1000] [--small 10] [--quick] [--json PATH]

``--quick`` runs N = 100. Every step has a timeout; the benchmark stops by itself.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _procs  # noqa: E402  (a sibling helper module, not a package)
from _procs import MIB  # noqa: E402

from orchard import wire  # noqa: E402
from orchard.config import CodecSpec, CohortConfig, RunConfig  # noqa: E402

NUMEL = 262_144  # float32 elements: 1 MiB
TENSOR = "w"
SEED = 7
ROUND_TARGET_S = 15.0
AGG_RSS_TARGET_MIB = 500.0
GROWTH_TARGET_KIB = 256.0  # per extra client; one update is 1024 KiB
STEP_TIMEOUT_S = 240.0


# ---------------------------------------------------------------------------- the update each client sends


def base_delta() -> np.ndarray:
    return (np.random.default_rng(SEED).standard_normal(NUMEL) * 1e-3).astype(np.float32)


def initial_model() -> np.ndarray:
    return np.random.default_rng(SEED + 1).standard_normal(NUMEL).astype(np.float32)


def scale_of(i: int) -> float:
    """Client i sends ``base * scale_of(i)``: distinct updates with a known mean."""
    return 1.0 + (i % 16) / 16.0


# ---------------------------------------------------------------------------- load generator (child process)


def _make_link(i: int, target: str, connection: int):
    """A FleetLink whose channel carries an extra channel argument naming its TCP connection.

    gRPC shares one TCP connection among all channels whose arguments are equal (its
    global subchannel pool), so N FleetLinks in one process would otherwise be N HTTP/2
    streams on a single connection. Devices each have their own connection; links that
    name the same ``connection`` share one.
    """
    from orchard import link as link_mod
    from orchard.typing import Role

    # A distinct channel argument per connection index: gRPC would otherwise share one TCP
    # connection among all channels of this process.
    return link_mod.FleetLink(link_mod.LinkConfig(target=target, role=Role.CLIENT, insecure=True,
                                                  node_id=f"bench-{i:05d}", max_backoff_s=2.0,
                                                  channel_options=(("orchard.bench.connection", connection),)))


async def _one_client(i: int, target: str, connection: int, base: np.ndarray, t: dict[str, float],
                      joined: asyncio.Queue) -> None:
    from orchard.client.update import build_upload
    from orchard.compression import build_codec
    from orchard.messages import TaskAssignment
    from orchard.trainer import TrainResult

    link = _make_link(i, target, connection)
    try:
        await link.join()
        t["joined"] = time.time()
        joined.put_nowait(i)
        while True:
            got = await link.poll()
            if isinstance(got, TaskAssignment):
                break
        t["task"] = time.time()
        blob = await link.pull_model(got.model_hash)
        t["pulled"] = time.time()
        if len(blob) < NUMEL * 4:
            raise RuntimeError(f"model blob of {len(blob)} bytes is smaller than the tensor")
        cfg = RunConfig.model_validate_json(got.config_json)
        delta = {TENSOR: base * np.float32(scale_of(i))}
        result = TrainResult(arrays={}, weight=1.0, num_examples=1, num_steps=1)
        header, payload, _ = build_upload(got, cfg, cfg.train, build_codec(cfg.codec), link.node_id, delta, result,
                                          seed=i, states=None)
        t["push_start"] = time.time()
        await link.push_update(header, payload)
        t["pushed"] = time.time()
        t["bytes_up"] = len(payload)
        t["bytes_down"] = len(blob)
    finally:
        await link.close()


async def _loadgen(target: str, n: int, connections: int, timeout_s: float) -> dict[str, Any]:
    base = base_delta()
    times: list[dict[str, Any]] = [{} for _ in range(n)]
    joined: asyncio.Queue[int] = asyncio.Queue()

    async def guarded(i: int) -> None:
        try:
            await asyncio.wait_for(_one_client(i, target, i % connections, base, times[i], joined), timeout_s)
        except Exception as err:  # reported per client; the benchmark counts failures
            times[i]["error"] = f"{type(err).__name__}: {err}"[:300]
            if "joined" not in times[i]:
                joined.put_nowait(i)  # a client that failed before joining must not stall the start

    tasks = [asyncio.create_task(guarded(i)) for i in range(n)]
    for _ in range(n):
        await joined.get()
    # The orchestrator waits for this line before it starts the run; CPU from here on is the round's.
    cpu_joined = time.process_time()
    print(f"JOINED {n}", flush=True)
    await asyncio.gather(*tasks)
    return {"clients": times, "round_cpu_seconds": time.process_time() - cpu_joined}


def loadgen_main(target: str, n: int, connections: int, report: Path, timeout_s: float) -> None:
    report.write_text(json.dumps(asyncio.run(_loadgen(target, n, connections, timeout_s))))


# ---------------------------------------------------------------------------- orchestrator


@dataclass
class Row:
    clients: int
    participants: int
    failed_clients: int
    correct: bool
    round_seconds: float
    wall_seconds: float
    upload_seconds: float
    upload_mb_s: float
    download_mb_s: float
    aggregator_baseline_rss_mib: float
    aggregator_connected_rss_mib: float
    aggregator_peak_rss_mib: float
    root_baseline_rss_mib: float
    root_peak_rss_mib: float
    loadgen_peak_rss_mib: float
    # CPU seconds from the run's start to the round's end. On a shared machine, their sum over
    # the core count is a floor for the round time whatever the code does.
    aggregator_cpu_seconds: float
    root_cpu_seconds: float
    loadgen_cpu_seconds: float
    cpu_floor_seconds: float
    tcp_connections: int
    first_error: str
    run_started_unix: float
    load_average_1m: float  # of the machine at the end of the round: other work skews the times
    rss_timeline: dict[str, list[tuple[float, float]]]  # process -> [(seconds from run start, MiB)]


def _span_mb_s(times: list[dict[str, Any]], start: str, end: str, nbytes: str) -> tuple[float, float]:
    done = [t for t in times if end in t]
    if not done:
        return 0.0, 0.0
    span = max(t[end] for t in done) - min(t[start] for t in done)
    total = sum(t[nbytes] for t in done)
    return span, (total / 1e6 / span if span > 0 else 0.0)


def _peak(sampler: _procs.RssSampler, name: str) -> int:
    s = sampler.series[name]
    return max(s.peak(), _procs.vm_hwm_bytes(s.pid) or 0)


def _connections_to(pid: int, port: int) -> int:
    import psutil

    try:
        conns = psutil.Process(pid).net_connections(kind="tcp")
    except psutil.Error:
        return -1
    return sum(1 for c in conns if c.raddr and c.raddr.port == port and c.status == psutil.CONN_ESTABLISHED)


def _start_profiler(pid: int, out: Path, seconds: float):
    """py-spy (if installed) samples ``pid``'s Python threads; collapsed stacks land in ``out``."""
    import shutil
    import subprocess

    exe = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
    if not Path(exe).is_file():
        print("--profile needs py-spy (pip install py-spy); not profiling", file=sys.stderr)
        return None
    return subprocess.Popen([exe, "record", "--pid", str(pid), "--format", "raw", "--threads", "--nonblocking",
                             "--rate", "200", "--duration", str(int(seconds)), "--output", str(out)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def run_scenario(n: int, connections: int, work: Path, verbose: bool, profile: bool = False) -> Row:
    from orchard.ops import ControlClient

    work.mkdir(parents=True, exist_ok=True)
    logs = work if verbose else None
    root, root_addr = _procs.start_root(work / "root", {"long_poll_s": 2.0}, log=logs and logs / "root.log")
    procs = [root]
    try:
        agg, agg_addr = _procs.start_aggregator(root_addr, work / "agg.port", log=logs and logs / "aggregator.log")
        procs.append(agg)
        ctl = ControlClient(root_addr, insecure=True)
        with _procs.RssSampler({"root": root.pid, "aggregator": agg.pid}) as sampler:
            _wait(lambda: any(nd["role"] == "aggregator" for nd in ctl.nodes()), "the aggregator to join the root")
            time.sleep(1.0)
            t_base = time.time()
            report = work / "loadgen.json"
            lg = _spawn_loadgen(agg_addr, n, connections, report)
            procs.append(lg)
            sampler.add("loadgen", lg.pid)
            line = _read_line(lg, STEP_TIMEOUT_S)
            if line.strip() != f"JOINED {n}":
                raise RuntimeError(f"load generator did not report its clients joined (got {line!r})")
            _wait(lambda: _pool_of(ctl) >= n, f"the aggregator to report {n} clients to the root")
            time.sleep(0.5)  # let the connected, idle state settle before it is read
            conns = _connections_to(lg.pid, int(agg_addr.rsplit(":", 1)[1]))
            t_connected = time.time()

            blob = wire.arrays_to_blob({TENSOR: initial_model()})
            cfg = RunConfig(task="digits", rounds=1, evaluate_every=0, codec=CodecSpec(name="float32"),
                            cohort=CohortConfig(target=n, over_selection=1.0, min_fraction=1.0, deadline_s=120.0,
                                                max_retries=0, weighting="uniform"))
            profilers = [_start_profiler(p.pid, work / f"{name}.pyspy.txt", 60) for name, p in
                         (("aggregator", agg), ("root", root), ("loadgen", lg))] if profile else []
            cpu0 = {name: _procs.cpu_seconds(p.pid) or 0.0 for name, p in (("root", root), ("aggregator", agg))}
            t0 = time.time()
            run_id = ctl.start_run(cfg, blob)
            st = _wait(lambda: _finished(ctl, run_id), "the round to complete", poll_s=0.02)
            wall = time.time() - t0
            load1 = os.getloadavg()[0]
            for prof in profilers:
                if prof is not None:
                    prof.send_signal(2)  # SIGINT: py-spy writes what it has
                    prof.wait(30)
            lg_out, _ = lg.communicate(timeout=STEP_TIMEOUT_S)
            cpu = {name: (_procs.cpu_seconds(p.pid) or 0.0) - cpu0[name] for name, p in
                   (("root", root), ("aggregator", agg))}
            peaks = {name: _peak(sampler, name) for name in ("root", "aggregator")}
        usage = json.loads((work / "loadgen.usage").read_text())
        lg_peak = max(sampler.series["loadgen"].peak(), usage["max_rss_bytes"])
        lg_report = json.loads(report.read_text())
        times, lg_cpu = lg_report["clients"], lg_report["round_cpu_seconds"]
        rounds = [r for r in st.get("rounds", []) if r.get("round") == 1]
        rec = rounds[-1] if rounds else {}
        correct = st.get("status") == "completed" and _check_global(ctl, run_id, times)
        ctl.close()
    finally:
        for p in reversed(procs):
            _procs.stop(p)
    up_span, up = _span_mb_s(times, "push_start", "pushed", "bytes_up")
    _, down = _span_mb_s(times, "task", "pulled", "bytes_down")
    errors = [t["error"] for t in times if "error" in t]
    agg_s, root_s = sampler.series["aggregator"], sampler.series["root"]
    return Row(
        clients=n, participants=int(rec.get("participants", 0)), failed_clients=len(errors), correct=correct,
        round_seconds=float(rec.get("seconds", float("nan"))), wall_seconds=wall, upload_seconds=up_span,
        upload_mb_s=up, download_mb_s=down,
        aggregator_baseline_rss_mib=agg_s.last_before(t_base) / MIB,
        aggregator_connected_rss_mib=agg_s.last_before(t_connected) / MIB,
        aggregator_peak_rss_mib=peaks["aggregator"] / MIB,
        root_baseline_rss_mib=root_s.last_before(t_base) / MIB, root_peak_rss_mib=peaks["root"] / MIB,
        loadgen_peak_rss_mib=lg_peak / MIB, aggregator_cpu_seconds=cpu["aggregator"], root_cpu_seconds=cpu["root"],
        loadgen_cpu_seconds=lg_cpu, cpu_floor_seconds=(cpu["aggregator"] + cpu["root"] + lg_cpu) / (os.cpu_count() or 1),
        tcp_connections=conns, first_error=errors[0] if errors else "",
        run_started_unix=t0, load_average_1m=load1, rss_timeline={name: _timeline(sampler.series[name], t0) for name in sampler.series})


def _timeline(s: _procs.Series, t0: float, step_s: float = 0.25) -> list[tuple[float, float]]:
    """The peak of each ``step_s`` window, from ``t0`` on (keeps the JSON small)."""
    out: dict[int, float] = {}
    for t, r in s.samples:
        if t >= t0:
            k = int((t - t0) / step_s)
            out[k] = max(out.get(k, 0.0), r / MIB)
    return [(round(k * step_s, 2), round(v, 1)) for k, v in sorted(out.items())]


def _spawn_loadgen(target: str, n: int, connections: int, report: Path):
    import subprocess

    cmd = [sys.executable, str(Path(__file__).resolve()), "--loadgen", target, "--clients", str(n),
           "--connections", str(min(connections, n) if connections else n), "--report", str(report)]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)


def _read_line(p, timeout_s: float) -> str:
    import selectors

    sel = selectors.DefaultSelector()
    sel.register(p.stdout, selectors.EVENT_READ)
    if not sel.select(timeout_s):
        raise RuntimeError(f"load generator printed nothing within {timeout_s:.0f} s")
    return p.stdout.readline()


def _pool_of(ctl) -> int:
    return sum(nd.get("pool_eligible", 0) for nd in ctl.nodes() if nd["role"] == "aggregator")


def _finished(ctl, run_id: str) -> dict[str, Any] | None:
    st = ctl.status(run_id)
    return st if st["status"] != "running" or st["completed_rounds"] >= 1 else None


def _wait(cond, what: str, timeout_s: float = STEP_TIMEOUT_S, poll_s: float = 0.1):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        got = cond()
        if got:
            return got
        time.sleep(poll_s)
    raise RuntimeError(f"timed out after {timeout_s:.0f} s waiting for {what}")


def _check_global(ctl, run_id: str, times: list[dict[str, Any]]) -> bool:
    """FedAvg with uniform weights and lr 1: global = initial + mean of the delivered deltas."""
    delivered = [i for i, t in enumerate(times) if "pushed" in t]
    if not delivered:
        return False
    got = wire.blob_to_arrays(ctl.pull_global(run_id))[TENSOR]
    mean_scale = float(np.mean([scale_of(i) for i in delivered]))
    want = initial_model() + base_delta() * np.float32(mean_scale)
    return bool(np.allclose(got, want, rtol=0, atol=1e-6))


# ---------------------------------------------------------------------------- report


def _fmt(rows: list[Row]) -> str:
    cols = [("clients", "clients", "{:d}"), ("done", "participants", "{:d}"), ("fail", "failed_clients", "{:d}"),
            ("ok", "correct", "{}"), ("round s", "round_seconds", "{:.2f}"), ("wall s", "wall_seconds", "{:.2f}"),
            ("up MB/s", "upload_mb_s", "{:.0f}"), ("down MB/s", "download_mb_s", "{:.0f}"),
            ("agg base", "aggregator_baseline_rss_mib", "{:.0f}"),
            ("agg conn", "aggregator_connected_rss_mib", "{:.0f}"),
            ("agg peak", "aggregator_peak_rss_mib", "{:.0f}"), ("root base", "root_baseline_rss_mib", "{:.0f}"),
            ("root peak", "root_peak_rss_mib", "{:.0f}"), ("lg peak", "loadgen_peak_rss_mib", "{:.0f}"),
            ("agg cpu s", "aggregator_cpu_seconds", "{:.1f}"), ("root cpu s", "root_cpu_seconds", "{:.1f}"),
            ("lg cpu s", "loadgen_cpu_seconds", "{:.1f}"),
            ("cpu floor s", "cpu_floor_seconds", "{:.1f}"), ("tcp", "tcp_connections", "{:d}"),
            ("load", "load_average_1m", "{:.1f}")]
    cells = [[h for h, _, _ in cols]] + [[f.format(getattr(r, k)) for _, k, f in cols] for r in rows]
    widths = [max(len(c[i]) for c in cells) for i in range(len(cols))]
    lines = ["  ".join(c.rjust(w) for c, w in zip(row, widths, strict=True)) for row in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    notes = ("RSS in MiB; MB = 10^6 bytes; lg = load generator; cpu s = CPU from the run's start to the round's end;",
             f"cpu floor = (agg + root + lg cpu s) / {os.cpu_count()} cores, the least wall time those processes "
             "could take here;", "load = the machine's 1-minute load average as the round ended")
    return "\n".join(lines + [" ".join(notes[:1]), " ".join(notes[1:])])


def targets(small: Row, big: Row) -> list[dict[str, Any]]:
    extra = max(big.clients - small.clients, 1)
    agg_growth = (big.aggregator_peak_rss_mib - small.aggregator_peak_rss_mib) * 1024 / extra
    root_growth = (big.root_peak_rss_mib - small.root_peak_rss_mib) * 1024 / extra
    ok = big.correct and big.failed_clients == 0
    return [
        {"target": f"round closes (N={big.clients})", "limit": f"<= {ROUND_TARGET_S:.0f} s",
         "measured": f"{big.round_seconds:.2f} s", "ok": ok and big.round_seconds <= ROUND_TARGET_S},
        {"target": f"aggregator peak RSS (N={big.clients})", "limit": f"<= {AGG_RSS_TARGET_MIB:.0f} MiB",
         "measured": f"{big.aggregator_peak_rss_mib:.0f} MiB", "ok": big.aggregator_peak_rss_mib <= AGG_RSS_TARGET_MIB},
        {"target": f"aggregator growth per client ({small.clients} -> {big.clients})",
         "limit": f"< {GROWTH_TARGET_KIB:.0f} KiB", "measured": f"{agg_growth:.0f} KiB "
         f"(peak ratio {big.aggregator_peak_rss_mib / small.aggregator_peak_rss_mib:.2f})",
         "ok": agg_growth < GROWTH_TARGET_KIB},
        {"target": f"root growth per client ({small.clients} -> {big.clients})",
         "limit": f"< {GROWTH_TARGET_KIB:.0f} KiB", "measured": f"{root_growth:.0f} KiB "
         f"(peak ratio {big.root_peak_rss_mib / small.root_peak_rss_mib:.2f})",
         "ok": root_growth < GROWTH_TARGET_KIB},
        {"target": "every update arrived and the global model is their mean", "limit": "yes",
         "measured": f"{big.participants}/{big.clients}, correct={big.correct}", "ok": ok},
    ]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--clients", type=int, default=1000, help="clients in the main scenario")
    ap.add_argument("--small", type=int, default=10, help="clients in the memory baseline scenario")
    ap.add_argument("--quick", action="store_true", help="N = 100")
    ap.add_argument("--connections", type=int, default=0,
                    help="TCP connections the clients share (default: one per client, like real devices)")
    ap.add_argument("--json", metavar="PATH", help="write the results here")
    ap.add_argument("--keep", metavar="DIR", help="run in DIR and keep the server logs there")
    ap.add_argument("--profile", action="store_true",
                    help="with --keep: py-spy the root and the aggregator during the main round (collapsed stacks)")
    ap.add_argument("--loadgen", metavar="TARGET", help=argparse.SUPPRESS)
    ap.add_argument("--report", type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.loadgen:
        import resource

        loadgen_main(args.loadgen, args.clients, args.connections or args.clients, args.report, STEP_TIMEOUT_S)
        ru = resource.getrusage(resource.RUSAGE_SELF)
        args.report.with_suffix(".usage").write_text(json.dumps(
            {"cpu_seconds": ru.ru_utime + ru.ru_stime, "max_rss_bytes": ru.ru_maxrss * 1024}))  # Linux: kB
        return 0
    n = 100 if args.quick else args.clients
    with tempfile.TemporaryDirectory(prefix="orchard-transport-") as tmp:
        work = Path(args.keep) if args.keep else Path(tmp)
        rows = []
        for k in (args.small, n):
            print(f"running N={k} ...", file=sys.stderr, flush=True)
            rows.append(run_scenario(k, args.connections, work / f"n{k}", verbose=bool(args.keep),
                                     profile=args.profile and k == n))
    print(_fmt(rows))
    tg = targets(rows[0], rows[1])
    print()
    w = max(len(t["target"]) for t in tg)
    for t in tg:
        print(f"{t['target']:<{w}}  {t['limit']:>10}  {t['measured']:>28}  {'PASS' if t['ok'] else 'FAIL'}")
    for r in rows:
        if r.first_error:
            print(f"N={r.clients}: {r.failed_clients} clients failed; first: {r.first_error}")
    big = rows[1]
    if args.json:
        Path(args.json).write_text(json.dumps({
            "round_seconds": big.round_seconds, "aggregator_peak_rss_mib": big.aggregator_peak_rss_mib,
            "wall_seconds": big.wall_seconds, "upload_mb_s": big.upload_mb_s, "download_mb_s": big.download_mb_s,
            "root_peak_rss_mib": big.root_peak_rss_mib, "clients": big.clients,
            "update_bytes": NUMEL * 4, "rows": [asdict(r) for r in rows], "targets": tg,
        }, indent=2))
    return 0 if all(t["ok"] for t in tg) else 1


if __name__ == "__main__":
    sys.exit(main())
