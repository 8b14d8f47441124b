"""``benchmarks/simulation.py --profile``: py-spy samples of a case's engine and workers
through the measured rounds, and the table of where a round's CPU went. Kept apart from
the benchmark's cases and report; ``simulation_case.py`` starts and stops the sampling
inside a case's process, ``simulation.py`` prints the table.
"""

from __future__ import annotations

import signal
import subprocess
from pathlib import Path
from typing import Any

import _procs

# py-spy samples the engine and each worker through the measured rounds (not pausing
# them); each sample is put in the first of these components, in this order, that one of
# its frames names (py-spy's qualified function name, e.g. "Dispatch.dispatch"). A sample in
# none of them is "other" (the root's finalize, garbage collection...).
_COMPONENTS: list[tuple[str, tuple[str, ...]]] = [
    ("device models (governor)", ("device_training", "devices_training", "run_devices", "DeviceRuns.results", "DeviceRuns._send",
                                  "DeviceRuns._here", "SimulatedDevice.restore")),
    ("training", ("train_many", "train_group", "client_trainer", "TorchTrainer.fit", "TorchTrainer.train")),
    ("building uploads", ("build_uploads", "build_upload", "deltas_of", "delta_of", "encode_packed_many")),
    ("client jobs, rest", ("run_jobs",)),
    # Jobs out and outputs back: pickling, the pipes, the shared segments.
    ("job transfer", ("PackedOutputs.__init__", "PackedOutputs.unpack", "_Unpacked._arrived", "WorkerPool.pump",
                      "_Worker.send", "_serve.<locals>.reply", "_serve.<locals>.take", "_attached")),
    ("tier folds", ("Coordinator.upload_now", "Coordinator.complete_upload")),
    ("check-in", ("CheckIn.check_in",)),
    ("opening tiers, selection", ("Tree.open_below", "Tree.open_tier", "Tree.report_pools")),
    ("hand-out", ("Dispatch.dispatch",)),
    ("arrivals, rest", ("Arrivals.process",)),
    ("leaving", ("CheckIn.leave",)),
]
_SAMPLE_RATE = 100  # per second


def _is_worker(proc: Any) -> bool:
    """A worker process of the process backend (not multiprocessing's resource tracker)."""
    try:
        cmd = " ".join(proc.cmdline())
    except Exception:  # exited meanwhile
        return False
    return "spawn_main" in cmd


def _start_sampling(pids: dict[str, int], out: Path) -> dict[str, subprocess.Popen[bytes]]:
    out.mkdir(parents=True, exist_ok=True)
    procs = {name: _procs.py_spy(pid, out / f"{name}.txt", rate=_SAMPLE_RATE) for name, pid in pids.items()}
    return {name: p for name, p in procs.items() if p is not None}


# A thread whose innermost frame is one of these is waiting (for a job, an event or a
# free pipe) though the sampler, which does not pause the process, saw it as busy.
_WAITS = {"_wait_ready", "_PollLikeSelector.select", "EpollSelector.select", "Condition.wait", "Queue.get"}
_WAITING = "waiting (sampled as busy)"


def _component(frames: list[str]) -> str:
    names = [f.split(" (", 1)[0] for f in frames]
    if names and names[-1] in _WAITS:
        return _WAITING
    present = set(names)
    for label, keys in _COMPONENTS:
        if any(k in present for k in keys):
            return label
    return "other"


def _stop_sampling(samplers: dict[str, subprocess.Popen[bytes]], out: Path, rounds: int) -> list[dict[str, Any]]:
    """Stop the samplers (a worker's stops by itself when its process exits) and read their
    stacks: CPU seconds per measured round by component, for the engine and the workers."""
    for proc in samplers.values():
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)  # py-spy writes what it has and exits
    seconds: dict[tuple[str, str], float] = {}
    for name, proc in samplers.items():
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
        path = out / f"{name}.txt"
        if not path.is_file():
            continue
        side = "engine" if name == "engine" else "workers"
        for line in path.read_text().splitlines():
            stack, _, n = line.rpartition(" ")
            if stack and n.isdigit():
                key = (_component(stack.split(";")), side)
                seconds[key] = seconds.get(key, 0.0) + int(n) / _SAMPLE_RATE / rounds
    labels = [c for c, _ in _COMPONENTS] + ["other", _WAITING]
    total = sum(v for (c, _), v in seconds.items() if c != _WAITING) or 1.0
    return [{"component": c, "engine_s": round(seconds.get((c, "engine"), 0.0), 3),
             "workers_s": round(seconds.get((c, "workers"), 0.0), 3),
             "share": 0.0 if c == _WAITING else
             round((seconds.get((c, "engine"), 0.0) + seconds.get((c, "workers"), 0.0)) / total, 3)}
            for c in labels]


def _print_profile(r: dict[str, Any]) -> None:
    rows = r.get("profile") or []
    if not rows:
        return
    print(f"where a round's CPU went ({r['path']}, {r['clients_per_round']} per round; py-spy samples of the "
          f"measured rounds, CPU s per round):")
    print(f"  {'component':<32} {'engine':>7} {'workers':>8} {'share':>6}")
    busy = [x for x in rows if x["component"] != _WAITING]
    for row in sorted(busy, key=lambda x: -x["share"]):
        print(f"  {row['component']:<32} {row['engine_s']:>7.2f} {row['workers_s']:>8.2f} {row['share']:>6.0%}")
    eng = sum(x["engine_s"] for x in busy)
    wrk = sum(x["workers_s"] for x in busy)
    print(f"  {'sampled busy in all':<32} {eng:>7.2f} {wrk:>8.2f}")
    for row in rows:
        if row["component"] == _WAITING:
            print(f"  {row['component']:<32} {row['engine_s']:>7.2f} {row['workers_s']:>8.2f}   (not in the shares)")
    cpu, tree = r["cpu_seconds_per_round"], r["tree_cpu_seconds_per_round"]
    print(f"  {'CPU the OS counted':<32} {cpu:>7.2f} {tree - cpu:>8.2f}   (a profiled round took "
          f"{r['seconds_per_round']:.2f} s; a thread blocked on the pipe between the processes is sampled "
          "as busy too, so the sampled seconds and the OS's differ a little)")
