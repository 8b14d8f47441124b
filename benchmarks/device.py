"""The native device client (liborchard_device through `orchard-device`) against the Python
ExecuTorch client, on the same bundle, data, server and run config, in one run.

    python benchmarks/device.py [--quick] [--no-large] [--rounds N] [--repeats N] [--json PATH] [--record]

A TLS root on loopback serves runs of `--rounds` rounds (Shakespeare LoRA, the bundle's
ExecuTorch training program, the 8-bit quantiser as upload codec, downlink deltas on),
each to one client alone: `orchard client start --runtime executorch` (torch blocked in
its process, as on a phone-class device) or `orchard-device`, interleaved `--repeats`
times so both see the same machine. Each client is started and joined before its run
begins, so a round's time is the device's work and the server's, not process start-up.

Measured per kind (medians over repeats): the training step time (the governor's time
inside steps over its steps, from the metrics each client reports), the round's wall
time at the root (median over the run's completed rounds), the client process's peak
RSS (VmHWM), the bytes it sent and received (the root's per-round counts), and the time
from exec to its first successful Join (TLS, enrollment). Ratios are native / Python.

Two bundles: the Shakespeare LoRA task (`--quick`: a small random base, the tests' size;
else the task's own shipped base), and the same task's model larger (`large_` keys; a
random base of 6 layers, d_model 384, over 10M parameters, with its LoRA adapter), where
the native process's peak RSS beyond its program file and the program's planned memory
is its overhead (`large_native_overhead_rss_mib`). `--no-large` skips the second.
`--record` appends the figures (without the per-run lists), with the commit and the
load average, to benchmarks/results/device.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "device"))
import device_native  # noqa: E402

NUM_PARTITIONS = 40
QUICK_PARAMS = dict(base="random", seq_len=16, n_layer=1, n_head=2, d_model=16, lora_rank=4, lora_alpha=8,
                    lora_variant="full")
# The same task's model, larger: a random base of over 10M parameters.
LARGE_PARAMS = dict(base="random", seq_len=80, n_layer=6, n_head=6, d_model=384, lora_variant="full")
PYTHON_CLIENT = textwrap.dedent("""
    import sys
    sys.modules["torch"] = None  # a phone-class Python client: no torch in the process
    from orchard.cli import main
    sys.argv = ["orchard", "client", "start", *sys.argv[1:]]
    main()
""")


class Root:
    """A TLS root on loopback in a thread of its own."""

    def __init__(self, data: Path) -> None:
        from orchard.config import ServerConfig
        from orchard.server.app import start_root

        self.loop = asyncio.new_event_loop()
        cfg = ServerConfig(heartbeat_s=1.0, node_timeout_s=10.0, long_poll_s=2.0)
        self.handle = self.loop.run_until_complete(start_root(data, server_cfg=cfg, start_grace_s=0.2, seed=1))
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.data = data

    def token(self) -> str:
        from orchard.server.store import SQLiteStore

        st = SQLiteStore(self.data / "orchard.db")
        try:
            return st.issue_token("client")
        finally:
            st.close()

    def leave(self, node: str) -> None:
        async def go() -> None:
            self.handle.coordinator.leave(node)

        asyncio.run_coroutine_threadsafe(go(), self.loop).result(10)

    def stop(self) -> None:
        asyncio.run_coroutine_threadsafe(self.handle.stop(0.1), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)


def _wait(pred, timeout: float, what: str) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = pred()
        if got:
            return got
        time.sleep(0.05)
    raise TimeoutError(what)


class PeakRss:
    """A process's peak RSS, polled from /proc/PID/status (VmHWM). Not ru_maxrss: a child
    forked from this (large) Python process keeps the parent's RSS at fork as its maximum
    across exec, which would hide the client's own."""

    def __init__(self, pid: int) -> None:
        self.pid, self.kib = pid, 0
        self._thread = threading.Thread(target=self._poll, daemon=True)
        self._thread.start()

    def _poll(self) -> None:
        path = Path(f"/proc/{self.pid}/status")
        while True:
            try:
                text = path.read_text()
            except OSError:
                return
            for line in text.splitlines():
                if line.startswith("VmHWM:"):
                    self.kib = max(self.kib, int(line.split()[1]))
            if "State:\tZ" in text:
                return
            time.sleep(0.02)

    def mib(self) -> float:
        self._thread.join(5)
        return self.kib / 1024


def _one_run(root: Root, ctl, kind: str, cmd: list[str], node: str, cfg, blob: bytes) -> dict[str, Any]:
    """Start the client, wait until it joined, run `cfg` with it alone, collect."""
    t0 = time.monotonic()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    rss = PeakRss(proc.pid)
    _wait(lambda: node in root.handle.coordinator.children or proc.poll() is not None, 120, f"{node} to join")
    joined_s = time.monotonic() - t0
    if proc.poll() is not None:
        raise RuntimeError(f"{kind} client exited: {proc.stdout.read()}\n{proc.stderr.read()}")
    run_id = ctl.start_run(cfg, blob)
    st = _wait(lambda: (s := ctl.status(run_id))["status"] in ("completed", "failed") and s, 1800, "the run")
    out, err = proc.communicate(timeout=300)
    # Gone from the root's pool before the next run: a departed node still counted live
    # would be selected for the next run's first round and fail that attempt.
    root.leave(node)
    if st["status"] != "completed" or proc.returncode != 0:
        raise RuntimeError(f"{kind}: run {st['status']}, exit status {proc.returncode}:\n{out[-2000:]}\n{err[-4000:]}")
    rounds = [r for r in st["rounds"] if r["status"] == "completed"]  # a retried attempt is not the device's work
    return {"round_s": statistics.median(r["seconds"] for r in rounds),
            "step_s": statistics.median(_step_seconds(kind, r["metrics"]) for r in rounds),
            "peak_rss_mib": rss.mib(),
            "bytes_up": sum(r["bytes_up"] for r in rounds), "bytes_down": sum(r["bytes_down"] for r in rounds),
            "joined_s": joined_s, "loss": [r["metrics"].get("train_loss") for r in rounds]}


def _step_seconds(kind: str, metrics: dict[str, float]) -> float:
    """Seconds per training step: the governor's time inside steps (elapsed less paused)
    over its steps, as the client reported them (one client per run: the round's mean is
    that client's)."""
    need = ("governor_elapsed_s", "governor_paused_s", "governor_steps")
    if any(k not in metrics for k in need) or not metrics["governor_steps"] > 0:
        raise RuntimeError(f"{kind}: the round's metrics lack the governor's step counts: {sorted(metrics)}")
    return (metrics["governor_elapsed_s"] - metrics["governor_paused_s"]) / metrics["governor_steps"]


def bench_case(params: dict[str, Any], rounds: int, repeats: int, steps: int) -> dict[str, Any]:
    """One bundle: both client kinds, interleaved, on one root."""
    from orchard import wire
    from orchard.config import CodecSpec, CohortConfig, RunConfig
    from orchard.edge_runtime.et_program import load_training_program
    from orchard.edge_runtime.task_bundle import write_task_bundle
    from orchard.ops import ControlClient
    from orchard.tasks import get_task
    from orchard.trainer import TrainConfig

    native = device_native.build("default").path("orchard-device")
    task = get_task("shakespeare", **params)
    tmp = Path(tempfile.mkdtemp(prefix="orchard-device-bench-"))
    root = Root(tmp / "root")
    try:
        bundle = tmp / "bundle"
        write_task_bundle(bundle, task=task, server_address=root.handle.address, ca_cert=root.handle.ca_cert,
                          enrollment_token=root.token(), micro_batch=8)
        program_bytes = (bundle / "train.pte").stat().st_size
        planned_bytes = load_training_program(bundle).planned_bytes
        base_parameters = sum(p.numel() for p in task.build_model(0).parameters() if not p.requires_grad)
        train, test = task.client_data(0, NUM_PARTITIONS, 0)
        np.savez(tmp / "data.npz", x=train.x.numpy(), y=train.y.numpy(), test_x=test.x.numpy(), test_y=test.y.numpy())
        chars = json.loads((bundle / "tokenizer.json").read_text())["chars"]
        # The same partition as text, for the native client, which cuts it as a device does.
        ids = np.concatenate([train.x.numpy().reshape(-1), test.x.numpy().reshape(-1)])
        (tmp / "data.txt").write_text("".join(chars[int(i)] for i in ids))
        cfg = RunConfig(task="shakespeare", task_params=task.params, rounds=rounds, seed=1,
                        codec=CodecSpec(name="qsgd", params={"bits": 8}), downlink_delta=True,
                        train=TrainConfig(steps=steps, batch_size=16, learning_rate=0.5),
                        cohort=CohortConfig(target=1, over_selection=1.0, min_fraction=1.0, deadline_s=600.0))
        blob = wire.arrays_to_blob(task.initial_arrays(1))
        results: dict[str, list[dict[str, Any]]] = {"python": [], "native": []}
        admin = (tmp / "root" / "admin.token").read_text().strip()
        with ControlClient(root.handle.address, admin_token=admin, ca_cert=root.handle.ca_cert) as ctl:
            for rep in range(repeats):
                for kind in ("native", "python") if rep % 2 else ("python", "native"):
                    node = f"{kind}-{rep}"
                    if kind == "python":
                        cmd = [sys.executable, "-c", PYTHON_CLIENT, "--bundle", str(bundle), "--runtime", "executorch",
                               "--data", str(tmp / "data.npz"), "--max-tasks", str(rounds), "--node-id", node]
                    else:
                        cmd = [str(native), str(bundle), "--data", str(tmp / "data.txt"), "--rounds", str(rounds),
                               "--node-id", node]
                    results[kind].append(_one_run(root, ctl, kind, cmd, node, cfg, blob))
    finally:
        root.stop()

    def med(kind: str, key: str) -> float:
        return float(statistics.median(r[key] for r in results[kind]))

    out: dict[str, Any] = {"rounds": rounds, "repeats": repeats, "steps": steps, "task_params": dict(task.params),
                           "base_parameters": base_parameters, "program_bytes": program_bytes,
                           "planned_bytes": planned_bytes, "runs": results}
    for key in ("step_s", "round_s", "peak_rss_mib", "bytes_up", "bytes_down"):
        out[f"python_{key}"], out[f"native_{key}"] = med("python", key), med("native", key)
    out["native_vs_python_step_time_ratio"] = out["native_step_s"] / out["python_step_s"]
    out["native_vs_python_round_time_ratio"] = out["native_round_s"] / out["python_round_s"]
    out["native_vs_python_peak_rss_ratio"] = out["native_peak_rss_mib"] / out["python_peak_rss_mib"]
    out["native_vs_python_bytes_up_ratio"] = out["native_bytes_up"] / out["python_bytes_up"]
    out["native_vs_python_bytes_down_ratio"] = out["native_bytes_down"] / out["python_bytes_down"]
    out["native_cold_start_seconds"] = med("native", "joined_s")
    out["python_cold_start_seconds"] = med("python", "joined_s")
    # What the process holds beyond the program file and the memory the program plans.
    out["native_overhead_rss_mib"] = out["native_peak_rss_mib"] - (program_bytes + planned_bytes) / 2**20
    out["native_library_bytes"] = sum(p.stat().st_size for p in (native.parent / "liborchard_device.so.1",
                                                                 native) if p.exists())
    return out


def bench(quick: bool, rounds: int, repeats: int, large: bool, large_rounds: int, large_repeats: int) -> dict[str, Any]:
    out = bench_case(QUICK_PARAMS if quick else {"lora_variant": "full"}, rounds, repeats, 8 if quick else 20)
    out["quick"] = quick
    if large:
        big = bench_case(LARGE_PARAMS, large_rounds, large_repeats, 8)
        out.update({f"large_{k}": v for k, v in big.items()})
    out["load_average"] = list(os.getloadavg())
    out["peak_rss_self_mib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return out


ROWS = [("step time (s, median)", "step_s", "{:.4f}"), ("round time (s, median)", "round_s", "{:.3f}"),
        ("peak RSS (MiB)", "peak_rss_mib", "{:.1f}"), ("bytes up (run)", "bytes_up", "{:,.0f}"),
        ("bytes down (run)", "bytes_down", "{:,.0f}"), ("exec to joined (s)", "cold_start_seconds", "{:.3f}")]


def print_table(r: dict[str, Any], prefix: str = "") -> None:
    print(f"{'':26} {'python':>14} {'native':>14} {'native/python':>14}")
    for label, key, fmt in ROWS:
        p, n = r[f"{prefix}python_{key}"], r[f"{prefix}native_{key}"]
        print(f"{label:26} {fmt.format(p):>14} {fmt.format(n):>14} {n / p:>14.3f}")
    print(f"{r[prefix + 'rounds']} rounds x {r[prefix + 'repeats']} repeats per client kind, "
          f"{r[prefix + 'steps']} steps a round, base of {r[prefix + 'base_parameters']:,} parameters, "
          f"task params {r[prefix + 'task_params']}")
    print(f"program {r[prefix + 'program_bytes'] / 2**20:.1f} MiB, planned memory "
          f"{r[prefix + 'planned_bytes'] / 2**20:.1f} MiB: native overhead {r[prefix + 'native_overhead_rss_mib']:.1f} MiB; "
          f"library + command {r[prefix + 'native_library_bytes'] / 2**20:.1f} MiB on disk")


RESULTS = ROOT / "benchmarks" / "results" / "device.json"


def record(r: dict[str, Any], command: str, path: Path = RESULTS) -> dict[str, Any]:
    """Append ``r``'s figures to the results history at ``path``; returns the entry."""
    commit = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True).stdout.strip()
    entry = {"commit": commit, "command": command, "host": "2-core development host shared with other work",
             **{k: v for k, v in r.items() if k not in ("runs", "large_runs")}}
    history = json.loads(path.read_text()) if path.exists() else []
    history.append(entry)
    path.write_text(json.dumps(history, indent=1) + "\n")
    return entry


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--no-large", action="store_true", help="skip the larger-base bundle")
    ap.add_argument("--rounds", type=int, default=None)
    ap.add_argument("--repeats", type=int, default=None)
    ap.add_argument("--large-rounds", type=int, default=2)
    ap.add_argument("--large-repeats", type=int, default=2)
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--record", action="store_true", help=f"append the figures to {RESULTS.relative_to(ROOT)}")
    a = ap.parse_args()
    reason = device_native.skip_reason()
    if reason is not None:
        sys.exit(f"cannot build the native client: {reason}")
    r = bench(a.quick, a.rounds or (2 if a.quick else 3), a.repeats or (1 if a.quick else 2), not a.no_large,
              a.large_rounds, a.large_repeats)
    print_table(r)
    if "large_rounds" in r:
        print("\nlarger base:")
        print_table(r, "large_")
    print(f"load average {r['load_average'][0]:.2f} {r['load_average'][1]:.2f} {r['load_average'][2]:.2f}")
    if a.json is not None:
        a.json.write_text(json.dumps(r, indent=2))
    if a.record:
        record(r, " ".join([".venv/bin/python", "benchmarks/device.py", *sys.argv[1:]]))


if __name__ == "__main__":
    main()
