"""Run fuzz targets one after another (``make fuzz``) and report what each did.

Each target runs in its own process under ``nice`` for ``--runs`` executions from its seed
corpus (new inputs go to a scratch corpus under ``--work``, never into ``fuzz/corpus``),
with libFuzzer's ``-timeout`` failing any input that runs longer than ``--timeout``
seconds. Prints a table; with ``--record``, appends the campaign to
``benchmarks/results/fuzz.json`` (commit, command, host, per-target figures).

Usage: ``python fuzz/campaign.py [--runs N] [--timeout S] [--targets a,b] [--record]``
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(HERE))

from targets import BY_NAME, TARGETS  # noqa: E402

RESULTS = REPO / "benchmarks" / "results" / "fuzz.json"


def run_target(name: str, runs: int, timeout_s: float, work: Path, nice: int, max_time: int) -> dict:
    d = work / name
    (d / "corpus").mkdir(parents=True, exist_ok=True)
    for old in d.glob("stats.json"):
        old.unlink()
    cmd = ["nice", "-n", str(nice), sys.executable, str(HERE / "run.py"), name, f"-runs={runs}",
           f"-timeout={timeout_s:g}", f"-artifact_prefix={d}/", "-print_final_stats=1"]
    if max_time:
        cmd.append(f"-max_total_time={max_time}")
    cmd += [str(d / "corpus"), str(HERE / "corpus" / name)]
    env = {**os.environ, "ORCHARD_FUZZ_STATS": str(d / "stats.json")}
    t0 = time.time()
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
    wall = time.time() - t0
    (d / "log.txt").write_text(proc.stdout + proc.stderr)
    out = proc.stdout + proc.stderr
    execs = _last_int(r"stat::number_of_executed_units:\s*(\d+)", out)
    if execs is None:
        execs = _last_int(r"Done (\d+) runs", out) or _last_int(r"#(\d+)\s", out) or 0
    stats = json.loads((d / "stats.json").read_text()) if (d / "stats.json").exists() else {}
    crashes = sorted(p.name for p in d.glob("crash-*"))
    errors = re.findall(r"^(\w+(?:Error|Bug|Exception)?: .*)$", out.split("Uncaught Python exception", 1)[-1],
                        re.M) if "Uncaught Python exception" in out else []
    hangs = sorted(p.name for p in d.glob("timeout-*"))
    fuzz_s = stats.get("seconds") or wall
    return {"target": name, "execs": execs, "reached_runs": execs >= runs, "seconds": round(fuzz_s, 1),
            "exec_per_s": round(execs / fuzz_s) if fuzz_s else None,
            # A crash whose input file was not written (the process ended first) still counts.
            "crashes": max(len(crashes), 1 if errors else 0), "hangs": len(hangs), "artifacts": crashes + hangs,
            "error": errors[0][:300] if errors else None,
            "slowest_exec_s": stats.get("slowest_exec_s"), "slowest_exec_cpu_s": stats.get("slowest_exec_cpu_s"),
            "returncode": proc.returncode, "corpus_files": len(list((d / "corpus").iterdir()))}


def _last_int(pattern: str, text: str) -> int | None:
    found = re.findall(pattern, text)
    return int(found[-1]) if found else None


def _commit() -> str:
    try:
        return subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=1_000_000)
    ap.add_argument("--timeout", type=float, default=1.0, help="seconds after which one input is a hang")
    ap.add_argument("--max-time", type=int, default=0, help="stop a target after this many seconds (0: no limit)")
    ap.add_argument("--targets", default=",".join(t.name for t in TARGETS))
    ap.add_argument("--work", type=Path, default=REPO / "build" / "fuzz")
    ap.add_argument("--nice", type=int, default=15)
    ap.add_argument("--record", action="store_true", help=f"append the campaign to {RESULTS.relative_to(REPO)}")
    args = ap.parse_args(argv[1:])
    names = [n for n in args.targets.split(",") if n]
    unknown = [n for n in names if n not in BY_NAME]
    if unknown:
        ap.error(f"unknown targets {unknown}; targets: {', '.join(BY_NAME)}")
    print(f"{'target':20} {'execs':>10} {'exec/s':>8} {'crashes':>7} {'hangs':>5} {'slowest s':>9}")
    rows = []
    for name in names:
        r = run_target(name, args.runs, args.timeout, args.work, args.nice, args.max_time)
        rows.append(r)
        print(f"{name:20} {r['execs']:>10} {r['exec_per_s'] or 0:>8} {r['crashes']:>7} {r['hangs']:>5} "
              f"{r['slowest_exec_s'] or 0:>9.4f}", flush=True)
    if args.record:
        record = {"commit": _commit(), "date": time.strftime("%Y-%m-%d"),
                  "command": "python fuzz/campaign.py " + " ".join(argv[1:]),
                  "host": f"{platform.node()} {platform.machine()} {os.cpu_count()} cpus, python "
                          f"{platform.python_version()}", "runs_asked": args.runs, "timeout_s": args.timeout,
                  "targets": rows}
        history = json.loads(RESULTS.read_text()) if RESULTS.exists() else []
        RESULTS.write_text(json.dumps([*history, record], indent=2) + "\n")
    return 1 if any(r["crashes"] or r["hangs"] or r["returncode"] for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
