"""Run one fuzz target under atheris (coverage-guided, libFuzzer's engine).

Usage::

    python fuzz/run.py TARGET [libFuzzer flags] [CORPUS_DIR ...]
    python fuzz/run.py --list
    python fuzz/run.py --replay TARGET FILE_OR_DIR ...

libFuzzer writes new inputs into the *first* corpus directory: pass a scratch directory
first and ``fuzz/corpus/TARGET`` after it to leave the committed seeds as they are.
``-runs=N`` bounds the executions, ``-max_total_time=S`` the seconds, ``-timeout=S`` fails
an input that runs longer than S seconds (a hang). ``--replay`` runs inputs once, without
atheris, and prints each one's outcome: how a crash file is turned into a regression test.

With ``ORCHARD_FUZZ_STATS=PATH`` the run keeps ``PATH`` up to date with its counts: the
executions, the slowest execution (wall and CPU seconds) and the size of the input that
took it. The seeds in the corpus directories run once before fuzzing starts (imports,
first-call caches) and are not counted.
"""

from __future__ import annotations

import importlib
import json
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from targets import BY_NAME, TARGETS  # noqa: E402

OneInput = Callable[[bytes], None]


def load(name: str) -> OneInput:
    if name not in BY_NAME:
        raise SystemExit(f"unknown target {name!r}; targets: {', '.join(BY_NAME)}")
    module, func = BY_NAME[name].factory.split(":")
    return getattr(importlib.import_module(module), func)()


def inputs(paths: list[str]) -> list[Path]:
    out: list[Path] = []
    for p in map(Path, paths):
        out += sorted(f for f in p.iterdir() if f.is_file()) if p.is_dir() else [p] if p.is_file() else []
    return out


class Stats:
    """Counts executions and the slowest one; written to a JSON file every few seconds."""

    def __init__(self, target: str, path: str | None, runs: int | None = None) -> None:
        self.target, self.path, self.runs = target, path, runs
        self.execs = 0
        self.slowest_s = self.slowest_cpu_s = 0.0
        self.slowest_len = 0
        self.started = time.time()
        self._written = time.monotonic()

    def wrap(self, one_input: OneInput) -> OneInput:
        perf, cpu = time.perf_counter, time.process_time

        def timed(data: bytes) -> None:
            t0, c0 = perf(), cpu()
            try:
                one_input(data)
            finally:
                dt, dc = perf() - t0, cpu() - c0
                self.execs += 1
                slower = dt > self.slowest_s
                if slower:
                    self.slowest_s, self.slowest_len = dt, len(data)
                self.slowest_cpu_s = max(self.slowest_cpu_s, dc)
                # libFuzzer ends the process without Python's exit handlers: write as we go,
                # and at the last of -runs.
                since = time.monotonic() - self._written
                if self.path and (since > 2.0 or (slower and since > 0.1) or self.execs == self.runs
                                  or sys.exc_info()[0] is not None):
                    self.write()

        return timed

    def write(self) -> None:
        if not self.path:
            return
        self._written = time.monotonic()
        tmp = f"{self.path}.tmp"
        with open(tmp, "w") as f:
            json.dump({"target": self.target, "execs": self.execs, "seconds": round(time.time() - self.started, 1),
                       "slowest_exec_s": round(self.slowest_s, 4), "slowest_exec_cpu_s": round(self.slowest_cpu_s, 4),
                       "slowest_input_bytes": self.slowest_len}, f)
        os.replace(tmp, self.path)


def replay(name: str, paths: list[str]) -> int:
    one_input = load(name)
    bad = 0
    for p in inputs(paths):
        t0 = time.perf_counter()
        try:
            one_input(p.read_bytes())
        except Exception as err:  # noqa: BLE001 - reported, that is the point
            bad += 1
            print(f"{p}: {type(err).__name__}: {err}")
        else:
            print(f"{p}: ok in {time.perf_counter() - t0:.4f}s")
    return 1 if bad else 0


def main(argv: list[str]) -> int:
    if len(argv) < 2 or argv[1] in ("-h", "--help"):
        print(__doc__)
        return 0
    if argv[1] == "--list":
        for t in TARGETS:
            print(f"{t.name:20} {t.about}")
        return 0
    if argv[1] == "--replay":
        return replay(argv[2], argv[3:])
    import atheris

    name, rest = argv[1], argv[2:]
    with atheris.instrument_imports(include=["orchard"]):
        one_input = load(name)
    for seed in inputs([a for a in rest if not a.startswith("-")]):
        one_input(seed.read_bytes())  # warm up: the seeds must pass before fuzzing starts
    runs = [int(a.split("=", 1)[1]) for a in rest if a.startswith("-runs=")]
    stats = Stats(name, os.environ.get("ORCHARD_FUZZ_STATS"), runs[-1] if runs else None)
    atheris.Setup([argv[0], *rest], stats.wrap(one_input))
    atheris.Fuzz()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
