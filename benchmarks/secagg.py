"""Benchmark SecAgg+ (orchard.secure_agg) against plain aggregation of the same vectors.

For each (n, d, dropout) every client runs the real protocol, stage by stage. The server
writes each stage's broadcasts one after another; in the key and unmasking stages (small
messages) the clients answer and the server then takes the answers one after another,
as it does when its clients answer from their own machines. ``--interleave`` runs each
server call right after its client's work instead, where the simulated client's work on
the same core clears the server's caches (about 0.3 s more server time at n = 1,000). Each masked input goes
straight into the server as its client makes it, so memory stays O(d). Dropouts
happen after the key-sharing stage (the costliest point for the server: it must remove
the dropped clients' pairwise masks). Reported per configuration:

- server_seconds: time inside the server (decoding uploads, broadcasts, accumulation,
  closing stages, reconstruction and unmasking); unmask_seconds is the part spent closing
  the last stage (reconstructing seeds and keys, key agreements, expanding and removing
  every mask), the only part that runs on several cores: its CPU (the server process's
  and its mask workers') over its wall time says how many cores it really got;
- the server's mask workers (``MaskWorkers``, one process per core, ``--mask-workers``;
  0 expands the masks on the server's own threads) are started once, before the first
  session, as a tier starts them with its first large session and keeps them:
  workers_start_seconds is that start (with one small fold, so that the first session
  does not wait for their imports), reported and not in server_seconds;
- client_seconds: mean time per client inside its protocol steps (decoding broadcasts,
  key agreement, Shamir, encryption, mask expansion, encoding its replies);
- bytes_expansion: bytes a client uploads / bytes of its quantised uint32 vector (4 d);
- overhead_ratio: server_seconds / seconds to sum the same quantised vectors plainly
  (measured in the same run, on the same vectors);
- keystream bound: the server must expand one AES-128-CTR mask of d words per survivor
  (its self mask) and per (dropped node, surviving neighbour) pair; mask_bytes counts
  them from the server's own measurement (mask_expansions x d x 4). The bound is
  mask_bytes / (keystream GB/s of one core x cores), with the keystream speed measured
  in the same run by the same ``cryptography`` call the PRG makes, into a preallocated
  buffer; bound_ratio = server_seconds / bound (1.0 would be pure keystream on every
  core and nothing else). bound_cpu_ratio = server_cpu_seconds / (mask_bytes / GB/s of
  one core) compares CPU time with CPU time, which a loaded host disturbs less;
- fold floor: the server does not only expand each mask, it adds it into the sum. The
  floor of that is the mask folder itself (``MaskFolder``, one thread, a d-word
  accumulator, a batch of seeds, its own chunking) measured in the same run on one core
  in CPU time: fold_bound = mask_bytes / (fold GB/s of one core x cores), fold_ratio =
  server_seconds / fold_bound. keystream/fold is what the additions alone cost on this
  host; what the server spends above fold_bound is key agreements, Shamir
  reconstruction, the masked inputs' own sum, the other stages and imperfect overlap.

Times are wall-clock (perf_counter); the *_cpu_seconds columns are CPU time over the
same spans (the process's for the server, whose mask threads run inside its spans; the
thread's for a client), which is what to compare on a shared, loaded machine.

    python benchmarks/secagg.py [--quick] [--json PATH] [--n 1000 --d 1000000 --dropout 0.1]
                                [--mask-workers P] [--threads T] [--repeat R]

``--repeat R`` runs every configuration R times in a row (same vectors, same keys) and
then prints each one's median server time and bound ratio: on a shared host one run's
wall time moves by 5-10%.

``--compare-adversary`` runs every configuration twice in a row, with the same vectors
and keys: the semi-honest protocol (version 1) and the active one (signed keys checked
against the root, the consistency round, verified shares; the clients hold identity keys
the root vouched for and the root's key, as enrolled devices do). ``--credentials``
says how the root vouches: ``roster`` (default; one signed roster over every client's
key, each client holding its Merkle path: a client checks the roster's signature once,
in its session, and a path per neighbour) or ``certificate`` (one root certificate per
client, checked per neighbour). Each client starts with nothing cached, so the figures
are a first session's. The JSON is then an
object: the rows, and per configuration ``active_vs_semi_honest_server_time_ratio``
(server seconds, active / semi-honest; also its CPU-time ratio) and
``active_client_extra_seconds`` (mean client CPU seconds, active - semi-honest: the
client's thread time in its protocol steps, which other work on a shared host moves
far less than wall time; the wall-clock difference is ``active_client_extra_wall_seconds``),
with the host's load average before and after, since a shared host's load moves wall
times (and, less, CPU times: a loaded core runs each instruction slower).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import sys
import time
from dataclasses import asdict, dataclass

import numpy as np
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes

from orchard.identity import SigningKey, certify
from orchard.secure_agg import (
    ClientPolicy,
    SecAggClient,
    SecAggServer,
    SessionConfig,
    SessionIdentity,
    Stage,
    choose_parameters,
    decode,
)
from orchard.secure_agg.prg import DEFAULT_CHUNK_BYTES, SEED_BYTES, MaskFolder, available_cores
from orchard.secure_agg.roster import build_roster
from orchard.server.maskworkers import MaskWorkers

STAGES = (Stage.ADVERTISE_KEYS, Stage.SHARE_KEYS, Stage.MASKED_INPUT, Stage.UNMASKING)
ACTIVE_STAGES = (Stage.ADVERTISE_KEYS, Stage.SHARE_KEYS, Stage.MASKED_INPUT, Stage.CONSISTENCY, Stage.UNMASKING)
BITS = 16  # quantisation bits: 1000 * 2^16 < 2^32, so the sum never wraps


@dataclass
class Row:
    n: int
    d: int
    dropout: float
    neighbours: int
    threshold: int
    contributors: int
    server_seconds: float
    client_seconds: float
    client_seconds_max: float
    plain_seconds: float
    server_cpu_seconds: float
    unmask_seconds: float  # of server_seconds: closing the last stage (seeds and masks)
    unmask_cpu_seconds: float
    client_cpu_seconds: float
    plain_cpu_seconds: float
    bytes_expansion: float
    download_bytes: float
    overhead_ratio: float
    threads: int
    cores: int
    mask_bytes: float
    keystream_gbps_per_core: float
    keystream_bound_seconds: float
    bound_ratio: float
    bound_cpu_ratio: float
    correct: bool
    fold_gbps_per_core: float = 0.0
    fold_bound_seconds: float = 0.0
    fold_ratio: float = float("nan")
    mask_workers: int = 0  # worker processes that expanded the server's masks (0: its threads)
    mask_batches_on_workers: int = 0
    workers_start_seconds: float = 0.0  # once per server process, before any session
    adversary: str = "semi_honest"  # the protocol: "semi_honest" (version 1) or "active"
    credentials: str = ""  # active: "roster" or "certificate" (how clients vouch for peers' keys)


def _entropy(label: str) -> bytes:
    return hashlib.sha256(label.encode()).digest()


def keystream_gbps(seconds: float = 0.3, repeats: int = 3) -> float:
    """AES-128-CTR keystream, GB/s on one core: the call the PRG makes (``update_into``
    of zeros into a preallocated buffer), one chunk of the mask folder at a time. Bytes
    over the thread's CPU time, best of ``repeats`` runs of ``seconds`` each, so a loaded
    host (whose other processes steal wall time, not CPU time) still gives the core's speed.
    """
    nbytes = DEFAULT_CHUNK_BYTES
    zeros, out = bytes(nbytes), bytearray(nbytes + 15)
    best = 0.0
    for r in range(repeats):
        update = Cipher(algorithms.AES(bytes([r + 1]) * 16), modes.CTR(bytes(16))).encryptor().update_into
        done, c0, t0 = 0, time.thread_time(), time.perf_counter()
        while time.perf_counter() - t0 < seconds:
            for _ in range(64):
                update(zeros, out)
            done += 64 * nbytes
        best = max(best, done / (time.thread_time() - c0) / 1e9)
    return best


def fold_gbps(words: int = 1 << 20, seeds: int = 32, repeats: int = 3) -> float:
    """Mask bytes folded per CPU second on one core by the server's own folder
    (:class:`MaskFolder`, one thread): AES-128-CTR keystream and the add into a
    ``words``-word uint32 accumulator, chunk by chunk as it folds a session's masks. Best
    of ``repeats`` runs of ``seeds`` masks each (thread CPU time, as keystream_gbps)."""
    best = 0.0
    acc = np.ones(words, dtype=np.uint32)  # written now: no first-touch page faults in the timing
    for r in range(repeats):
        c0 = time.thread_time()
        with MaskFolder(acc, threads=1) as folder:
            for i in range(seeds):
                folder.add(hashlib.sha256(b"fold/%d/%d" % (r, i)).digest()[:SEED_BYTES], 1 if i % 2 else -1)
            folder.finish()
        best = max(best, seeds * words * 4 / (time.thread_time() - c0) / 1e9)
    return best


def start_workers(processes: int) -> tuple[MaskWorkers, float]:
    """The server process's mask workers, started and warmed up (a small fold, so the
    first session does not wait for them to import); returns them and the seconds that
    took, which a server pays once when it starts, not per session."""
    t0 = time.perf_counter()
    workers = MaskWorkers(processes)
    acc = np.zeros(1 << 12, dtype=np.uint32)
    with MaskFolder(acc, batch=1, workers=workers) as folder:
        for i in range(2 * processes):
            folder.add(hashlib.sha256(b"warm/%d" % i).digest()[:SEED_BYTES])
        folder.finish()
    return workers, time.perf_counter() - t0


_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def _child_cpu(pids: list[int]) -> float:
    """CPU seconds (user + system) the live processes ``pids`` have used (Linux /proc;
    0 elsewhere, where the server's CPU columns then leave its workers out)."""
    total = 0.0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += (int(fields[11]) + int(fields[12])) / _TICKS
    return total


def certified_clients(ids: list[str], seed: int, credentials: str = "roster",
                      ) -> tuple[bytes, dict[str, tuple[SessionIdentity, ClientPolicy]]]:
    """Each client's identity key vouched for by one root, and the policy that checks peers
    against that root (what enrollment gives a device: made once, not per session).
    ``credentials``: "roster" (one signed roster of epoch 1 over every client's key, each
    client holding its Merkle path, :mod:`orchard.secure_agg.roster`) or "certificate"
    (one root certificate per client)."""
    root = SigningKey.from_bytes(_entropy(f"root/{seed}"))
    keys = {p: SigningKey.from_bytes(_entropy(f"device/{seed}/{p}")) for p in ids}
    if credentials == "roster":
        _, creds = build_roster(root, 1, {p: k.public_key for p, k in keys.items()})
        policy = ClientPolicy(root_public_key=root.public_key, min_roster_epoch=1)
    else:
        creds = {p: certify(root, p, k.public_key, 1) for p, k in keys.items()}
        policy = ClientPolicy(root_public_key=root.public_key)
    return root.public_key, {p: (SessionIdentity(keys[p], creds[p]), policy) for p in ids}


def run_one(n: int, d: int, dropout: float, *, corrupt_fraction: float, gbps: float,
            threads: int | None = None, seed: int = 0, interleave: bool = False, fold: float = 0.0,
            active: bool = False, credentials: str = "roster",
            workers: MaskWorkers | None = None) -> Row:
    params = choose_parameters(n, dropout, corrupt_fraction=corrupt_fraction)
    ids = [f"client-{i:05d}" for i in range(n)]
    config = SessionConfig.create(ids, d, neighbours=params.neighbours,
                                  threshold=params.threshold, round_number=1,
                                  entropy=_entropy(f"session/{seed}/{n}/{d}/{dropout}"), active=active)
    rng = np.random.default_rng(seed)
    dropped = set(rng.choice(config.participants, size=int(round(dropout * n)), replace=False))
    root, trust = certified_clients(ids, seed, credentials) if active else (None, {})
    server = SecAggServer(config, threads=threads, workers=workers, root_public_key=root)
    clients = {p: SecAggClient(p, entropy=_entropy(f"client/{seed}/{p}"), identity=trust[p][0] if active else None,
                               policy=trust[p][1] if active else None) for p in ids}
    client_time = dict.fromkeys(ids, 0.0)
    upload = dict.fromkeys(ids, 0)
    download = dict.fromkeys(ids, 0)
    server_time = plain_time = server_cpu = plain_cpu = unmask_time = unmask_cpu = 0.0
    client_cpu = dict.fromkeys(ids, 0.0)
    # Server spans take the process's CPU time (the server's mask threads run inside them;
    # nothing else runs then), client spans the thread's. The mask workers run only while
    # a stage closes: their CPU time is read around those spans (outside the clock's).
    pids = workers.pids if workers is not None else []
    clock, cpu, pcpu = time.perf_counter, time.thread_time, time.process_time
    plain = np.zeros(d, dtype=np.uint32)

    for stage in ACTIVE_STAGES if config.active else STAGES:
        nodes = [p for p in sorted(server.pending())
                 if not (stage is Stage.MASKED_INPUT and p in dropped)]
        bcasts: dict[str, bytes] = {}
        if not interleave:  # the stage's broadcasts, one after another
            t0, c0 = clock(), pcpu()
            bcasts = {p: server.broadcast_bytes(p) for p in nodes}
            server_time += clock() - t0
            server_cpu += pcpu() - c0
        if stage is not Stage.MASKED_INPUT and not interleave:
            # Small messages: the clients answer, then the server takes the answers one
            # after another, as it does when its clients answer from their own machines.
            replies = {}
            for p in nodes:
                t2, c2 = clock(), cpu()
                replies[p] = clients[p].respond(decode(bcasts[p]), None).to_bytes()
                client_time[p] += clock() - t2
                client_cpu[p] += cpu() - c2
                upload[p] += len(replies[p])
                download[p] += len(bcasts[p])
            t0, c0 = clock(), pcpu()
            for p in nodes:
                server.receive(stage, p, replies[p])
            server_time += clock() - t0
            server_cpu += pcpu() - c0
        else:  # client by client: masked inputs always, every stage with interleave
            for node in nodes:
                t0, c0 = clock(), pcpu()
                bcast = server.broadcast_bytes(node) if interleave else bcasts[node]
                t1, c1 = clock(), pcpu()
                vector = None
                if stage is Stage.MASKED_INPUT:
                    vector = rng.integers(0, 1 << BITS, size=d, dtype=np.uint32)
                t2, c2 = clock(), cpu()
                reply = clients[node].respond(decode(bcast), vector).to_bytes()
                t3, c3, p3 = clock(), cpu(), pcpu()
                server.receive(stage, node, reply)
                t4, p4 = clock(), pcpu()
                if vector is not None:
                    np.add(plain, vector, out=plain)  # the baseline: plain aggregation
                    plain_time += clock() - t4
                    plain_cpu += pcpu() - p4
                server_time += (t1 - t0) + (t4 - t3)
                server_cpu += (c1 - c0) + (p4 - p3)
                client_time[node] += t3 - t2
                client_cpu[node] += c3 - c2
                upload[node] += len(reply)
                download[node] += len(bcast)
        w0 = _child_cpu(pids)
        t0, c0 = clock(), pcpu()
        server.close_stage()
        t1, c1 = clock(), pcpu()
        c1 += _child_cpu(pids) - w0
        server_time += t1 - t0
        server_cpu += c1 - c0
        if stage is Stage.UNMASKING:
            unmask_time, unmask_cpu = t1 - t0, c1 - c0
        if stage is Stage.MASKED_INPUT:
            clients = {p: c for p, c in clients.items() if p not in dropped}  # free state

    result = server.result()
    survivors = [p for p in ids if p not in dropped]
    times = [client_time[p] for p in survivors]
    mask_bytes = result.measurements["mask_expansions"] * d * 4
    cores = available_cores()
    bound = mask_bytes / (gbps * 1e9 * cores)
    return Row(
        n=n, d=d, dropout=dropout, neighbours=params.neighbours, threshold=params.threshold,
        contributors=len(result.contributors),
        server_seconds=server_time,
        client_seconds=float(np.mean(times)),
        client_seconds_max=float(np.max(times)),
        plain_seconds=plain_time,
        server_cpu_seconds=server_cpu,
        unmask_seconds=unmask_time,
        unmask_cpu_seconds=unmask_cpu,
        client_cpu_seconds=float(np.mean([client_cpu[p] for p in survivors])),
        plain_cpu_seconds=plain_cpu,
        bytes_expansion=float(np.mean([upload[p] for p in survivors])) / (4 * d),
        download_bytes=float(np.mean([download[p] for p in survivors])),
        overhead_ratio=server_time / plain_time,
        threads=server.threads,
        cores=cores,
        mask_bytes=mask_bytes,
        keystream_gbps_per_core=gbps,
        keystream_bound_seconds=bound,
        bound_ratio=server_time / bound if bound else float("nan"),
        bound_cpu_ratio=server_cpu / (bound * cores) if bound else float("nan"),
        correct=bool(np.array_equal(result.total, plain)),
        fold_gbps_per_core=fold,
        fold_bound_seconds=mask_bytes / (fold * 1e9 * cores) if fold else 0.0,
        fold_ratio=server_time * fold * 1e9 * cores / mask_bytes if fold and mask_bytes else float("nan"),
        mask_workers=len(pids),
        mask_batches_on_workers=int(result.measurements.get("mask_batches_on_workers", 0)),
        adversary="active" if active else "semi_honest",
        credentials=credentials if active else "",
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="small configurations only")
    ap.add_argument("--json", metavar="PATH", help="write one JSON row per configuration")
    ap.add_argument("--n", type=int, nargs="*", help="cohort sizes (default 100 1000)")
    ap.add_argument("--d", type=int, nargs="*", help="vector lengths (default 1e5 1e6)")
    ap.add_argument("--dropout", type=float, nargs="*", help="dropout rates (default 0 0.1 0.3)")
    ap.add_argument("--threads", type=int, default=None,
                    help="server mask-expansion threads, when it has no mask workers (default: every core)")
    ap.add_argument("--mask-workers", type=int, default=None, metavar="P",
                    help="mask worker processes the server starts once (default: one per core; "
                         "0: expand masks on the server's own threads)")
    ap.add_argument("--interleave", action="store_true",
                    help="every stage client by client (each server call right after its client's work), "
                         "as before the key and unmasking stages were taken in a batch")
    ap.add_argument("--repeat", type=int, default=1, help="runs of every configuration (medians printed)")
    ap.add_argument("--corrupt-fraction", type=float, default=0.05,
                    help="fraction of clients assumed to collude with the server (sets k, t)")
    ap.add_argument("--active", action="store_true", help="run the active protocol (default: semi-honest)")
    ap.add_argument("--credentials", choices=("roster", "certificate"), default="roster",
                    help="active: how the root vouches for clients' identity keys (default: one signed "
                         "roster and a Merkle path each; certificate: one root certificate each)")
    ap.add_argument("--compare-adversary", action="store_true",
                    help="each configuration with the semi-honest and then the active protocol; JSON: the ratios")
    args = ap.parse_args(argv)
    ns = args.n or ([20, 100] if args.quick else [100, 1000])
    ds = args.d or ([10_000] if args.quick else [100_000, 1_000_000])
    drops = args.dropout if args.dropout is not None else [0.0, 0.1, 0.3]

    gbps = keystream_gbps()
    fold = fold_gbps()
    print(f"AES-128-CTR keystream: {gbps:.2f} GB/s per core (CPU time), {available_cores()} "
          f"core(s) available; the mask folder (keystream and add, one thread): {fold:.2f} GB/s per core, "
          f"{gbps / fold:.2f}x the keystream's time")
    processes = available_cores() if args.mask_workers is None else args.mask_workers
    workers, started = start_workers(processes) if processes > 0 else (None, 0.0)
    print(f"server mask workers: {processes} process(es), started in {started:.2f} s (once per server process)"
          if workers is not None else "server mask workers: none; masks expand on the server's threads")
    load_before = os.getloadavg()
    try:
        rows = _runs(args, ns, ds, drops, gbps, fold, workers, started)
    finally:
        if workers is not None:
            workers.close()
    out: object = [asdict(r) for r in rows]
    if args.compare_adversary:
        out = compare(rows, load_before, os.getloadavg())
        for c in out["comparisons"]:
            print(f"n={c['n']} d={c['d']} dropout={c['dropout']:g}: active / semi-honest server time "
                  f"{c['active_vs_semi_honest_server_time_ratio']:.3f} (cpu {c['active_vs_semi_honest_server_cpu_ratio']:.3f}), "
                  f"client cpu +{c['active_client_extra_seconds'] * 1e3:.1f} ms "
                  f"(wall +{c['active_client_extra_wall_seconds'] * 1e3:.1f} ms); load average "
                  f"{out['load_average_before']} -> {out['load_average_after']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)
    return 0 if all(r.correct for r in rows) else 1


def compare(rows: list[Row], load_before: tuple[float, ...], load_after: tuple[float, ...]) -> dict[str, object]:
    """The active protocol against the semi-honest one, configuration by configuration
    (medians over repeats). With one configuration its figures are also at the top level."""
    comparisons = []
    for key in dict.fromkeys((r.n, r.d, r.dropout) for r in rows):
        semi = [r for r in rows if (r.n, r.d, r.dropout) == key and r.adversary == "semi_honest"]
        act = [r for r in rows if (r.n, r.d, r.dropout) == key and r.adversary == "active"]

        def med(rs: list[Row], f: str) -> float:
            return statistics.median(getattr(r, f) for r in rs)

        comparisons.append({
            "n": key[0], "d": key[1], "dropout": key[2],
            "active_vs_semi_honest_server_time_ratio": med(act, "server_seconds") / med(semi, "server_seconds"),
            "active_vs_semi_honest_server_cpu_ratio": med(act, "server_cpu_seconds") / med(semi, "server_cpu_seconds"),
            "active_client_extra_seconds": med(act, "client_cpu_seconds") - med(semi, "client_cpu_seconds"),
            "active_client_extra_wall_seconds": med(act, "client_seconds") - med(semi, "client_seconds"),
            "semi_honest_server_seconds": med(semi, "server_seconds"), "active_server_seconds": med(act, "server_seconds"),
            "semi_honest_client_seconds": med(semi, "client_seconds"), "active_client_seconds": med(act, "client_seconds"),
        })
    out: dict[str, object] = {"load_average_before": [round(v, 2) for v in load_before],
                              "load_average_after": [round(v, 2) for v in load_after],
                              "comparisons": comparisons, "rows": [asdict(r) for r in rows]}
    if len(comparisons) == 1:
        out.update({k: v for k, v in comparisons[0].items() if k.startswith("active_")})
    return out


def _runs(args: argparse.Namespace, ns: list[int], ds: list[int], drops: list[float], gbps: float,
          fold: float, workers: MaskWorkers | None, started: float) -> list[Row]:
    rows = []
    header = (f"{'n':>5} {'d':>9} {'drop':>5} {'k':>4} {'t':>4} {'server s':>9} {'(cpu)':>8} "
              f"{'unmask s':>8} {'(cpu)':>6} {'bound s':>8} {'x bound':>8} {'(cpu)':>6} {'x fold':>7} "
              f"{'client s':>9} {'(cpu)':>7} {'client max':>10} {'plain s':>8} {'overhead':>9} "
              f"{'bytes x':>8} {'ok':>3}")
    print(header)
    print("-" * len(header))
    configs = [(n, d, p) for n in ns for d in ds for p in drops]
    for n, d, p in configs:
        modes = (False, True) if args.compare_adversary else (args.active,)
        for r in (run_one(n, d, p, corrupt_fraction=args.corrupt_fraction, gbps=gbps, threads=args.threads,
                          interleave=args.interleave, fold=fold, workers=workers, active=active,
                          credentials=args.credentials)
                  for _ in range(max(1, args.repeat)) for active in modes):
            r.workers_start_seconds = started
            rows.append(r)
            print(f"{r.n:>5} {r.d:>9} {r.dropout:>5.2f} {r.neighbours:>4} {r.threshold:>4} {r.adversary[:4]:>4} "
                  f"{r.server_seconds:>9.3f} {r.server_cpu_seconds:>8.3f} "
                  f"{r.unmask_seconds:>8.3f} {r.unmask_cpu_seconds:>6.2f} "
                  f"{r.keystream_bound_seconds:>8.3f} {r.bound_ratio:>7.2f}x "
                  f"{r.bound_cpu_ratio:>5.2f}x {r.fold_ratio:>6.2f}x "
                  f"{r.client_seconds:>9.4f} {r.client_cpu_seconds:>7.4f} "
                  f"{r.client_seconds_max:>10.4f} {r.plain_seconds:>8.4f} "
                  f"{r.overhead_ratio:>8.1f}x {r.bytes_expansion:>8.4f} "
                  f"{'yes' if r.correct else 'NO':>3}", flush=True)
    if args.repeat > 1:
        print(f"medians of {args.repeat} runs:")
        for n, d, p in configs:
            mine = [r for r in rows if (r.n, r.d, r.dropout) == (n, d, p) and r.adversary == rows[-1].adversary]
            print(f"  n={n} d={d} dropout={p:g}: server "
                  f"{statistics.median(r.server_seconds for r in mine):.3f} s, "
                  f"{statistics.median(r.bound_ratio for r in mine):.2f}x the keystream bound, "
                  f"{statistics.median(r.fold_ratio for r in mine):.2f}x the fold floor, client "
                  f"{statistics.median(r.client_seconds for r in mine):.4f} s")
    return rows


if __name__ == "__main__":
    sys.exit(main())
