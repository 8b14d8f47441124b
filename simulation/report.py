"""What a simulation writes: ``rounds.jsonl`` (a line per round as it ends), ``report.json``
(the demo's round schema plus throughput, simulated time and peak memory) and three PNG
plots.

Throughput is counted as ``benchmarks/simulation.py`` counts it: clients trained per wall
second of the rounds (evaluation excluded), and, apart, over the rounds after the first
(``warm_clients_per_second``), since round 1 also pays for first allocations and, with
worker processes, for the workers' first jobs: the benchmark's figure is that one.
"""

from __future__ import annotations

import json
import resource
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

# Per-round fields that depend on the host (wall time), not on the seed.
WALL_FIELDS = ("seconds", "cpu_seconds", "eval_seconds", "clients_per_second", "phase_seconds")
# Report fields that depend on the host.
HOST_FIELDS = ("clients_per_second", "warm_clients_per_second", "total_seconds", "peak_rss_mib", "placement", "out",
               "plots")


@dataclass
class SimulationReport:
    """Per-round records and totals. ``rounds[i]`` has at least the demo's keys: round,
    participants, accuracy, loss, bytes_up, bytes_down, seconds (wall), plus
    simulated_seconds and the simulator's own counts."""

    task: str
    population: int
    clients_per_round: int
    aggregators: list[int]
    codec: str
    secure_aggregation: bool
    backend: str
    vectorized: bool
    rounds: list[dict[str, Any]] = field(default_factory=list)
    clients_per_second: float = 0.0
    total_seconds: float = 0.0
    simulated_seconds: float = 0.0
    final_accuracy: float | None = None
    final_loss: float | None = None
    failed_attempts: int = 0
    status: str = "completed"
    privacy: dict[str, Any] | None = None  # with DP on: epsilon spent, delta, noise multiplier
    # With [run.personalization]: each evaluated device's accuracy of the global and its
    # personal adapter on its own held-out data, mean and 10th percentile (simulation.personal).
    personalization: dict[str, Any] | None = None
    # Peak resident set in MiB (peak_rss_mib()): "engine", this process; "largest_child",
    # the largest child process's, which with the process backend is a worker's.
    peak_rss_mib: dict[str, float] | None = None
    # With the Ray backend: client jobs run on each node of the cluster (by Ray node id).
    placement: dict[str, int] | None = None
    # [simulation.attack] kind "canary": how often each canary device's update was folded.
    canary_folds: dict[int, int] | None = None
    out: str | None = None
    plots: list[str] = field(default_factory=list)
    # The global model after the last round (not serialised).
    final_arrays: dict[str, Any] = field(default_factory=dict, repr=False)

    def to_dict(self) -> dict[str, Any]:
        arrays, self.final_arrays = self.final_arrays, {}
        try:
            d = asdict(self)
        finally:
            self.final_arrays = arrays
        d.pop("final_arrays")
        d["warm_clients_per_second"] = self.warm_clients_per_second()
        return d

    def warm_clients_per_second(self) -> float | None:
        """Clients trained per wall second over the rounds after the first (evaluation
        excluded): what ``benchmarks/simulation.py`` reports after its warm-up round. None
        with fewer than two rounds."""
        rows = self.rounds[1:]
        seconds = sum(r.get("seconds") or 0.0 for r in rows)
        if not rows or seconds <= 0:
            return None
        return round(sum(r.get("trained", 0) for r in rows) / seconds, 1)

    def seed_dependent(self) -> dict[str, Any]:
        """Everything but host timings: equal for equal seeds."""
        d = self.to_dict()
        for k in HOST_FIELDS:
            d.pop(k)
        d["rounds"] = [{k: v for k, v in r.items() if k not in WALL_FIELDS} for r in d["rounds"]]
        return d


def append_round(path: Path, row: dict[str, Any]) -> None:
    with path.open("a") as f:
        f.write(json.dumps(row, sort_keys=True) + "\n")


def peak_rss_mib() -> dict[str, float]:
    """This process's peak resident set, and the largest peak of its child processes
    that have ended and been waited for (the backend's workers, once it closed), in MiB."""
    scale = 1 / 2**20 if sys.platform == "darwin" else 1 / 1024  # ru_maxrss: bytes on macOS, KiB on Linux
    return {"engine": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * scale, 1),
            "largest_child": round(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * scale, 1)}


def write_report(report: SimulationReport, out: Path) -> None:
    """Write ``report.json`` and the plots; the peaks of memory are read here, after the run
    (its workers closed), when the report does not carry them yet."""
    out.mkdir(parents=True, exist_ok=True)
    if report.peak_rss_mib is None:
        report.peak_rss_mib = peak_rss_mib()
    report.plots = [str(p) for p in plot(report.rounds, out, report.task)]
    (out / "report.json").write_text(json.dumps(report.to_dict(), indent=2))


def plot(rows: list[dict[str, Any]], out: Path, title: str) -> list[Path]:
    """accuracy.png, bytes.png and participation.png against the round number."""
    from orchard import plots

    paths = []
    for name, draw in (("accuracy", lambda ax: plots.accuracy(ax, rows, f"{title}: global model")),
                       ("bytes", lambda ax: plots.bytes_on_the_wire(ax, rows, "bytes on the wire (all tiers)")),
                       ("participation", lambda ax: plots.participation(ax, rows))):
        fig, (ax,) = plots.subplots()
        draw(ax)
        paths.append(plots.save(fig, out / f"{name}.png"))
    return paths
