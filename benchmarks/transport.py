"""Transport benchmark: one aggregator, N concurrent clients, each pushing a 1 MiB update.

Processes on loopback, all over real gRPC with TLS, as production runs it (a CA and a
server certificate made for the run, one enrollment token per client; ``--insecure`` runs
plaintext instead):

- a root (``orchard server start``) and one aggregator (``orchard aggregator start``)
  below it, each in its own process so that its memory and CPU are its own;
- a load generator: one process, N asyncio coroutines, one TCP connection each. Each
  joins the aggregator and long-polls for the task with the real client link
  (:class:`orchard.link.FleetLink`), pulls the 1 MiB model (chunked) and pushes a 1 MiB
  float32 update (no training: client i sends ``base * scale_of(i)``).

The generator is built to cost the servers' side as little as it can, so that the
servers bound the round: the 16 distinct updates are encoded once each by the client's
own upload builder (:func:`orchard.client.update.build_upload`) and serialised once,
and every client streams the same message objects, with only its header its own; the
first model pull is verified in full (sha256 against the model's hash), every later one
is compared with it byte for byte.

The model is one float32 tensor of 262,144 elements (1 MiB). The run has one round,
cohort target N, no over-selection, so the round closes when the N-th update is folded
at the aggregator and its partial sum is folded at the root. The new global model is
pulled afterwards and compared with ``initial + mean(delta_i)``: the numbers only count
if every update really arrived, was checked and was summed.

Primary figures, at N:

- the servers' CPU seconds per GB ingested: root and aggregator CPU (user + system,
  every thread) from the run's start to the round's end, over the update bytes the
  aggregator took in (GB = 10^9 bytes). The round also sends the model down to every
  client, so the same seconds pay for as many bytes again the other way;
- the aggregator's peak RSS (sampled every 50 ms and the kernel's ``VmHWM``, whichever is
  higher);
- the round's time (the root's own, open to close, from ``status``);
- the generator's CPU seconds over the same span: with the servers', over the core count,
  the least wall time the round could take on this machine.

Baseline, in the same run: the same generator drives the same N connections through the
same pulls and pushes of the same bytes against a bare gRPC Python server (``--sink``:
pre-serialised model chunks out, raw upload messages in, counted and dropped; the tiers'
server options and, with TLS, the same certificate). Its CPU seconds per GB are the floor
of the transport itself over TLS; the servers' figure is reported as a ratio to it
(``server_vs_bare_grpc_tls_cpu_ratio`` in the JSON; target at most 1.5).

Also measured: upload and download MB/s (MB = 10^6 bytes), each process's RSS before
any client connects and with N clients connected and idle, and how the aggregator's and
the root's peak grows from the small run to N: (peak at N - peak at N_small) /
(N - N_small) must stay under a quarter of one update (256 KiB per client); a tier that
kept every client's update (O(clients x model) instead of O(model)) would grow by at
least 1 MiB per client.

Targets (2-core machine, 1,000 clients): servers at most 3 CPU-s per GB, aggregator peak
RSS at most 300 MiB, round at most 10 s.

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

# The model, the load generator and the sink (the child processes' code) live beside this
# script; the names the orchestrator and the tests use stay importable from here.
from transport_load import (  # noqa: E402
    NUMEL,
    TENSOR,
    _sink,
    _verify_model,  # noqa: F401  (the tests check it here)
    base_delta,
    initial_model,
    loadgen_main,
    model_blob,
    run_config,
    scale_of,
)

from orchard import wire  # noqa: E402

ROUND_TARGET_S = 10.0
AGG_RSS_TARGET_MIB = 300.0
CPU_PER_GB_TARGET = 3.0  # root + aggregator CPU seconds per 10^9 update bytes ingested
GROWTH_TARGET_KIB = 256.0  # per extra client; one update is 1024 KiB
STEP_TIMEOUT_S = 240.0
GB = 1e9


# ---------------------------------------------------------------------------- orchestrator


@dataclass
class Row:
    scenario: str  # "orchard" (root + aggregator) or "bare grpc" (the baseline sink)
    clients: int
    participants: int
    failed_clients: int
    correct: bool
    ingested_bytes: int  # update payload bytes delivered
    # CPU seconds (user + system, every thread) from the run's start to the round's end. On a
    # shared machine, their sum over the core count is a floor for the round time.
    server_cpu_seconds: float  # root + aggregator (the sink, for the baseline)
    server_cpu_s_per_gb: float
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
    aggregator_cpu_seconds: float
    root_cpu_seconds: float
    loadgen_cpu_seconds: float
    cpu_floor_seconds: float
    aggregator_join_cpu_seconds: float  # while the N clients joined and long-polled, before the run
    tcp_connections: int
    first_error: str
    run_started_unix: float
    load_average_1m: float  # of the machine at the end of the round: other work skews the times
    rss_timeline: dict[str, list[tuple[float, float]]]  # process -> [(seconds from run start, MiB)]


def _transfers(times: list[dict[str, Any]]) -> tuple[float, float, float, list[str], list[dict[str, Any]], int]:
    """From the generator's per-client records: (upload span s, upload MB/s, download MB/s,
    the errors, the clients whose push completed, the bytes they pushed)."""
    up_span, up = _span_mb_s(times, "push_start", "pushed", "bytes_up")
    _, down = _span_mb_s(times, "task", "pulled", "bytes_down")
    delivered = [t for t in times if "pushed" in t]
    return (up_span, up, down, [t["error"] for t in times if "error" in t], delivered,
            sum(t["bytes_up"] for t in delivered))


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


def _per_gb(cpu_s: float, nbytes: int) -> float:
    return cpu_s / (nbytes / GB) if nbytes else float("nan")


def _generator_usage(lg, work: Path, sampler: _procs.RssSampler) -> tuple[list[dict[str, Any]], float, float]:
    """The generator's per-client times, its CPU seconds from JOINED on, and its peak RSS."""
    usage = json.loads((work / "loadgen.usage").read_text())
    lg_peak = max(sampler.series["loadgen"].peak(), usage["max_rss_bytes"])
    report = json.loads((work / "loadgen.json").read_text())
    return report["clients"], report["round_cpu_seconds"], lg_peak


def _joined(lg, n: int) -> None:
    line = _read_line(lg, STEP_TIMEOUT_S)
    if line.strip() != f"JOINED {n}":
        raise RuntimeError(f"load generator did not report its clients joined (got {line!r})")


def _issue_tokens(root_dir: Path, clients: int) -> tuple[str, Path]:
    """An aggregator token and ``clients`` single-device client tokens in the root's store,
    before it starts (as ``orchard tokens issue`` would); the client tokens go to a file
    for the load generator, one a line."""
    from orchard.server.store import SQLiteStore

    root_dir.mkdir(parents=True, exist_ok=True)
    store = SQLiteStore(root_dir / "orchard.db")
    try:
        agg = store.issue_token("aggregator", "bench-aggregator")
        tokens = [store.issue_token("client", f"bench-{i:05d}", device=True) for i in range(clients)]
    finally:
        store.close()
    path = root_dir.parent / "client-tokens.txt"
    path.write_text("\n".join(tokens) + "\n")
    return agg, path


def run_scenario(n: int, connections: int, work: Path, verbose: bool, profile: bool = False,
                 tls_dir: Path | None = None) -> Row:
    from orchard.ops import ControlClient

    work.mkdir(parents=True, exist_ok=True)
    logs = work if verbose else None
    agg_token, tokens = _issue_tokens(work / "root", n) if tls_dir else (None, None)
    root, root_addr = _procs.start_root(work / "root", {"long_poll_s": 2.0}, log=logs and logs / "root.log",
                                        tls_dir=tls_dir)
    procs = [root]
    try:
        agg, agg_addr = _procs.start_aggregator(root_addr, work / "agg.port", log=logs and logs / "aggregator.log",
                                                tls_dir=tls_dir, token=agg_token)
        procs.append(agg)
        ctl = (ControlClient(root_addr, admin_token=(work / "root" / "admin.token").read_text().strip(),
                             ca_cert=tls_dir / "ca.pem") if tls_dir else ControlClient(root_addr, insecure=True))
        with _procs.RssSampler({"root": root.pid, "aggregator": agg.pid}) as sampler:
            _wait(lambda: any(nd["role"] == "aggregator" for nd in ctl.nodes()), "the aggregator to join the root")
            time.sleep(1.0)
            t_base = time.time()
            cpu_before_joins = _procs.cpu_seconds(agg.pid) or 0.0
            lg = _spawn_loadgen(agg_addr, n, connections, work / "loadgen.json", tls_dir=tls_dir, tokens=tokens)
            procs.append(lg)
            sampler.add("loadgen", lg.pid)
            _joined(lg, n)
            _wait(lambda: _pool_of(ctl) >= n, f"the aggregator to report {n} clients to the root")
            join_cpu = (_procs.cpu_seconds(agg.pid) or 0.0) - cpu_before_joins
            time.sleep(0.5)  # let the connected, idle state settle before it is read
            conns = _connections_to(lg.pid, int(agg_addr.rsplit(":", 1)[1]))
            t_connected = time.time()

            profilers = [_procs.py_spy(p.pid, work / f"{name}.pyspy.txt", rate=200, duration_s=60, threads=True)
                         for name, p in (("aggregator", agg), ("root", root), ("loadgen", lg))] if profile else []
            cpu0 = {name: _procs.cpu_seconds(p.pid) or 0.0 for name, p in (("root", root), ("aggregator", agg))}
            t0 = time.time()
            run_id = ctl.start_run(run_config(n), model_blob())
            # Polled every 100 ms: each status call is root CPU, counted with the servers'. (The
            # round's time is the root's own; the poll only bounds wall_seconds' resolution.)
            st = _wait(lambda: _finished(ctl, run_id), "the round to complete", poll_s=0.1)
            wall = time.time() - t0
            cpu = {name: (_procs.cpu_seconds(p.pid) or 0.0) - cpu0[name] for name, p in
                   (("root", root), ("aggregator", agg))}
            load1 = os.getloadavg()[0]
            for prof in profilers:
                if prof is not None:
                    prof.send_signal(2)  # SIGINT: py-spy writes what it has
                    prof.wait(30)
            lg.communicate(timeout=STEP_TIMEOUT_S)
            peaks = {name: _peak(sampler, name) for name in ("root", "aggregator")}
        times, lg_cpu, lg_peak = _generator_usage(lg, work, sampler)
        rounds = [r for r in st.get("rounds", []) if r.get("round") == 1]
        rec = rounds[-1] if rounds else {}
        correct = st.get("status") == "completed" and _check_global(ctl, run_id, times)
        ctl.close()
    finally:
        for p in reversed(procs):
            _procs.stop(p)
    up_span, up, down, errors, delivered, ingested = _transfers(times)
    agg_s, root_s = sampler.series["aggregator"], sampler.series["root"]
    server_cpu = cpu["aggregator"] + cpu["root"]
    return Row(
        scenario="orchard", clients=n, participants=int(rec.get("participants", 0)), failed_clients=len(errors),
        correct=correct, ingested_bytes=ingested, server_cpu_seconds=server_cpu,
        server_cpu_s_per_gb=_per_gb(server_cpu, ingested),
        round_seconds=float(rec.get("seconds", float("nan"))), wall_seconds=wall, upload_seconds=up_span,
        upload_mb_s=up, download_mb_s=down,
        aggregator_baseline_rss_mib=agg_s.last_before(t_base) / MIB,
        aggregator_connected_rss_mib=agg_s.last_before(t_connected) / MIB,
        aggregator_peak_rss_mib=peaks["aggregator"] / MIB,
        root_baseline_rss_mib=root_s.last_before(t_base) / MIB, root_peak_rss_mib=peaks["root"] / MIB,
        loadgen_peak_rss_mib=lg_peak / MIB, aggregator_cpu_seconds=cpu["aggregator"], root_cpu_seconds=cpu["root"],
        loadgen_cpu_seconds=lg_cpu, cpu_floor_seconds=(server_cpu + lg_cpu) / (os.cpu_count() or 1),
        aggregator_join_cpu_seconds=join_cpu, tcp_connections=conns, first_error=errors[0] if errors else "",
        run_started_unix=t0, load_average_1m=load1, rss_timeline={name: _timeline(sampler.series[name], t0) for name in sampler.series})


def run_baseline(n: int, connections: int, work: Path, tls_dir: Path | None = None) -> Row:
    """The same generator, connections, pulls and pushes against the bare gRPC sink."""
    import subprocess

    work.mkdir(parents=True, exist_ok=True)
    port_file = work / "sink.port"
    sink = subprocess.Popen([sys.executable, str(Path(__file__).resolve()), "--sink", str(port_file),
                             *(["--tls-dir", str(tls_dir)] if tls_dir else [])])
    procs = [sink]
    try:
        port = _wait(lambda: port_file.is_file() and port_file.read_text().strip(), "the sink to listen", 60)
        addr = f"127.0.0.1:{port}"
        with _procs.RssSampler({"sink": sink.pid}) as sampler:
            time.sleep(0.5)
            t_base = time.time()
            lg = _spawn_loadgen(addr, n, connections, work / "loadgen.json", baseline=True, tls_dir=tls_dir)
            procs.append(lg)
            sampler.add("loadgen", lg.pid)
            _joined(lg, n)
            time.sleep(0.5)
            conns = _connections_to(lg.pid, int(port))
            t_connected = time.time()
            cpu0 = _procs.cpu_seconds(sink.pid) or 0.0
            t0 = time.time()
            assert lg.stdin is not None
            lg.stdin.write("GO\n")
            lg.stdin.flush()
            lg.wait(STEP_TIMEOUT_S)
            wall = time.time() - t0
            cpu = (_procs.cpu_seconds(sink.pid) or 0.0) - cpu0
            load1 = os.getloadavg()[0]
            peak = _peak(sampler, "sink")
        times, lg_cpu, lg_peak = _generator_usage(lg, work, sampler)
    finally:
        for p in reversed(procs):
            _procs.stop(p)
    up_span, up, down, errors, delivered, ingested = _transfers(times)
    s = sampler.series["sink"]
    nan = float("nan")
    return Row(
        scenario="bare grpc", clients=n, participants=len(delivered), failed_clients=len(errors),
        correct=len(delivered) == n, ingested_bytes=ingested, server_cpu_seconds=cpu,
        server_cpu_s_per_gb=_per_gb(cpu, ingested), round_seconds=wall, wall_seconds=wall, upload_seconds=up_span,
        upload_mb_s=up, download_mb_s=down, aggregator_baseline_rss_mib=s.last_before(t_base) / MIB,
        aggregator_connected_rss_mib=s.last_before(t_connected) / MIB, aggregator_peak_rss_mib=peak / MIB,
        root_baseline_rss_mib=nan, root_peak_rss_mib=nan, loadgen_peak_rss_mib=lg_peak / MIB,
        aggregator_cpu_seconds=cpu, root_cpu_seconds=0.0, loadgen_cpu_seconds=lg_cpu,
        cpu_floor_seconds=(cpu + lg_cpu) / (os.cpu_count() or 1), aggregator_join_cpu_seconds=nan,
        tcp_connections=conns,
        first_error=errors[0] if errors else "", run_started_unix=t0, load_average_1m=load1,
        rss_timeline={name: _timeline(sampler.series[name], t0) for name in sampler.series})


def _timeline(s: _procs.Series, t0: float, step_s: float = 0.25) -> list[tuple[float, float]]:
    """The peak of each ``step_s`` window, from ``t0`` on (keeps the JSON small)."""
    out: dict[int, float] = {}
    for t, r in s.samples:
        if t >= t0:
            k = int((t - t0) / step_s)
            out[k] = max(out.get(k, 0.0), r / MIB)
    return [(round(k * step_s, 2), round(v, 1)) for k, v in sorted(out.items())]


def _spawn_loadgen(target: str, n: int, connections: int, report: Path, baseline: bool = False,
                   tls_dir: Path | None = None, tokens: Path | None = None):
    import subprocess

    cmd = [sys.executable, str(Path(__file__).resolve()), "--loadgen", target, "--clients", str(n),
           "--connections", str(min(connections, n) if connections else n), "--report", str(report)]
    if tls_dir:
        cmd += ["--tls-dir", str(tls_dir)]
    if tokens:
        cmd += ["--tokens", str(tokens)]
    if baseline:
        cmd.append("--baseline")
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stdin=subprocess.PIPE, text=True)


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
    return _procs.wait_until(cond, what, timeout_s, poll_s)


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
    cols = [("scenario", "scenario", "{}"), ("clients", "clients", "{:d}"), ("done", "participants", "{:d}"),
            ("fail", "failed_clients", "{:d}"), ("ok", "correct", "{}"),
            ("srv cpu s/GB", "server_cpu_s_per_gb", "{:.2f}"), ("srv cpu s", "server_cpu_seconds", "{:.2f}"),
            ("agg peak", "aggregator_peak_rss_mib", "{:.0f}"), ("round s", "round_seconds", "{:.2f}"),
            ("lg cpu s", "loadgen_cpu_seconds", "{:.2f}"),
            ("agg cpu s", "aggregator_cpu_seconds", "{:.2f}"), ("root cpu s", "root_cpu_seconds", "{:.2f}"),
            ("wall s", "wall_seconds", "{:.2f}"), ("up MB/s", "upload_mb_s", "{:.0f}"),
            ("down MB/s", "download_mb_s", "{:.0f}"), ("agg base", "aggregator_baseline_rss_mib", "{:.0f}"),
            ("agg conn", "aggregator_connected_rss_mib", "{:.0f}"), ("root peak", "root_peak_rss_mib", "{:.0f}"),
            ("lg peak", "loadgen_peak_rss_mib", "{:.0f}"), ("cpu floor s", "cpu_floor_seconds", "{:.1f}"),
            ("agg join cpu s", "aggregator_join_cpu_seconds", "{:.2f}"),
            ("tcp", "tcp_connections", "{:d}"), ("load", "load_average_1m", "{:.1f}")]
    cells = [[h for h, _, _ in cols]] + [[f.format(getattr(r, k)) for _, k, f in cols] for r in rows]
    widths = [max(len(c[i]) for c in cells) for i in range(len(cols))]
    lines = ["  ".join(c.rjust(w) for c, w in zip(row, widths, strict=True)) for row in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    notes = ("srv = root + aggregator (bare grpc: the sink, in the aggregator's columns); GB = 10^9 update bytes "
             "ingested; RSS in MiB; MB = 10^6 bytes; lg = load generator; cpu s = CPU from the run's start to the "
             "round's end (bare grpc: to the last upload; its round s is that span);",
             f"cpu floor = (srv + lg cpu s) / {os.cpu_count()} cores, the least wall time those processes could "
             "take here; agg join cpu s = the aggregator's CPU while the clients joined and long-polled, before "
             "the run; load = the machine's 1-minute load average as the round ended")
    return "\n".join(lines + list(notes))


def _ratio(a: float, b: float) -> float:
    """a / b, or NaN when b is zero: a tiny run (a few clients) can finish inside one tick of
    the kernel's CPU clock, and a baseline of 0 CPU-seconds has no ratio."""
    return a / b if b > 0 else float("nan")


TLS_RATIO_TARGET = 1.5  # servers' CPU per GB over bare gRPC's, both over TLS


def targets(small: Row, big: Row, base: Row, tls: bool = False) -> list[dict[str, Any]]:
    extra = max(big.clients - small.clients, 1)
    agg_growth = (big.aggregator_peak_rss_mib - small.aggregator_peak_rss_mib) * 1024 / extra
    root_growth = (big.root_peak_rss_mib - small.root_peak_rss_mib) * 1024 / extra
    ok = big.correct and big.failed_clients == 0
    ratio = _ratio(big.server_cpu_s_per_gb, base.server_cpu_s_per_gb)
    vs_bare = [{"target": "servers' CPU per GB against bare gRPC, both over TLS",
                "limit": f"<= {TLS_RATIO_TARGET}x", "measured": f"{ratio:.2f}x", "ok": ok and ratio <= TLS_RATIO_TARGET}]
    return [*(vs_bare if tls else []),
        {"target": f"servers' CPU per GB ingested (N={big.clients})", "limit": f"<= {CPU_PER_GB_TARGET:.0f} s/GB",
         "measured": f"{big.server_cpu_s_per_gb:.2f} s/GB ({ratio:.2f}x bare gRPC's {base.server_cpu_s_per_gb:.2f})",
         "ok": ok and big.server_cpu_s_per_gb <= CPU_PER_GB_TARGET},
        {"target": f"aggregator peak RSS (N={big.clients})", "limit": f"<= {AGG_RSS_TARGET_MIB:.0f} MiB",
         "measured": f"{big.aggregator_peak_rss_mib:.0f} MiB", "ok": big.aggregator_peak_rss_mib <= AGG_RSS_TARGET_MIB},
        {"target": f"round closes (N={big.clients})", "limit": f"<= {ROUND_TARGET_S:.0f} s",
         "measured": f"{big.round_seconds:.2f} s (generator {big.loadgen_cpu_seconds:.1f} CPU-s)",
         "ok": ok and big.round_seconds <= ROUND_TARGET_S},
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
        {"target": "the baseline delivered every upload", "limit": "yes",
         "measured": f"{base.participants}/{base.clients}", "ok": base.correct},
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
    ap.add_argument("--baseline", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--report", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--sink", metavar="PORT_FILE", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--insecure", action="store_true",
                    help="plaintext gRPC (no TLS, no tokens) for the servers and the baseline alike")
    ap.add_argument("--tls-dir", type=Path, help=argparse.SUPPRESS)  # the child processes' CA and certificate
    ap.add_argument("--tokens", type=Path, help=argparse.SUPPRESS)  # the load generator's tokens, one a line
    args = ap.parse_args(argv)
    if args.sink:
        asyncio.run(_sink(args.sink, args.tls_dir))
        return 0
    if args.loadgen:
        import resource

        loadgen_main(args.loadgen, args.clients, args.connections or args.clients, args.report, STEP_TIMEOUT_S,
                     args.baseline, args.tls_dir / "ca.pem" if args.tls_dir else None,
                     args.tokens.read_text().split() if args.tokens else None)
        ru = resource.getrusage(resource.RUSAGE_SELF)
        args.report.with_suffix(".usage").write_text(json.dumps(
            {"cpu_seconds": ru.ru_utime + ru.ru_stime, "max_rss_bytes": ru.ru_maxrss * 1024}))  # Linux: kB
        return 0
    n = 100 if args.quick else args.clients
    with tempfile.TemporaryDirectory(prefix="orchard-transport-") as tmp:
        work = Path(args.keep) if args.keep else Path(tmp)
        tls_dir = None
        if not args.insecure:
            from orchard.server.tls import init_certs

            tls_dir = init_certs(work / "tls", hosts=["127.0.0.1", "localhost"]).ca_cert.parent
        rows = []
        for k in (args.small, n):
            print(f"running N={k} ...", file=sys.stderr, flush=True)
            rows.append(run_scenario(k, args.connections, work / f"n{k}", verbose=bool(args.keep),
                                     profile=args.profile and k == n, tls_dir=tls_dir))
        print(f"running the bare gRPC baseline, N={n} ...", file=sys.stderr, flush=True)
        rows.append(run_baseline(n, args.connections, work / f"baseline{n}", tls_dir=tls_dir))
    print(_fmt(rows))
    small, big, base = rows
    tg = targets(small, big, base, tls=not args.insecure)
    print()
    w = max(len(t["target"]) for t in tg)
    for t in tg:
        print(f"{t['target']:<{w}}  {t['limit']:>12}  {t['measured']:>42}  {'PASS' if t['ok'] else 'FAIL'}")
    for r in rows:
        if r.first_error:
            print(f"{r.scenario} N={r.clients}: {r.failed_clients} clients failed; first: {r.first_error}")
    if args.json:
        Path(args.json).write_text(json.dumps({
            "server_cpu_s_per_gb": big.server_cpu_s_per_gb, "aggregator_peak_rss_mib": big.aggregator_peak_rss_mib,
            "round_seconds": big.round_seconds, "loadgen_cpu_seconds": big.loadgen_cpu_seconds,
            "baseline_cpu_s_per_gb": base.server_cpu_s_per_gb,
            "cpu_per_gb_vs_baseline": _ratio(big.server_cpu_s_per_gb, base.server_cpu_s_per_gb),
            "tls": not args.insecure,
            **({} if args.insecure else {
                "server_vs_bare_grpc_tls_cpu_ratio": _ratio(big.server_cpu_s_per_gb, base.server_cpu_s_per_gb)}),
            "wall_seconds": big.wall_seconds, "upload_mb_s": big.upload_mb_s, "download_mb_s": big.download_mb_s,
            "root_peak_rss_mib": big.root_peak_rss_mib, "clients": big.clients,
            "update_bytes": NUMEL * 4, "rows": [asdict(r) for r in rows], "targets": tg,
        }, indent=2))
    return 0 if all(t["ok"] for t in tg) else 1


if __name__ == "__main__":
    sys.exit(main())
