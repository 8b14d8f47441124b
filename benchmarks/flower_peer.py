"""The reference peer for benchmarks/simulation.py: the same workload through Flower's own
simulation engine (``flwr.simulation.run_simulation`` with the Ray backend).

Workload, as the Orchard cases run it: the digits MLP (64-64-10), 20 training examples
per client drawn with replacement under the client's Dirichlet label mix, batch 10, one
local epoch, plain SGD at learning rate 0.1; FedAvg over every client in every round.

- ``ServerApp``: Flower's message-based ``FedAvg`` with ``fraction_train=1.0`` and the
  minimum train and available nodes set to the number of SuperNodes, so every SuperNode
  trains in every round; federated evaluation is off (``fraction_evaluate=0.0``), as it
  is in the Orchard cases.
- ``ClientApp``: loads the global arrays into its MLP, trains one epoch on its partition
  and replies with the new arrays and ``num-examples``. The partition's examples come
  from Orchard's digits task (``task.client_data(partition_id, num_partitions, seed)``);
  that is the only Orchard code on the Flower path, and it runs once per Ray worker
  (the task, with its partition table, is built on a worker's first message and kept).
  The model, batching and optimizer step are plain torch, written here.
- Ray: ``num_cpus`` Ray CPUs (2 by default, the benchmark host's cores) and one CPU per
  client, so that many ``ClientApp`` actors; each worker runs torch on one thread.

Measurements (the first round is warm-up: Ray's actors start and import torch there):

- clients_per_second: replies aggregated in rounds 2..R divided by the wall seconds
  between the end of round 1's aggregation and the end of round R's (timestamps taken
  inside the strategy's ``aggregate_train``), so start-up and shut-down are excluded;
- seconds_per_round: those wall seconds divided by R - 1;
- tree_cpu_seconds_per_round: CPU seconds of the whole process tree (the driver and
  every Ray process) over the same span, per round;
- peak_rss_mib: the peak of a *sampled sum*: every ``sample_s`` seconds a thread in the
  driver adds up the resident set of the driver and all its descendants (Ray's GCS,
  raylet, and the worker processes); the largest sum seen is reported. A sum of RSS
  counts shared pages (torch's libraries, Ray's shared-memory object store) once per
  process that maps them, so it over-states the tree's real footprint;
  ``peak_pss_mib`` (proportional set size, shared pages split between their users,
  sampled less often) is the fairer figure where the kernel provides it.

    python benchmarks/flower_peer.py --clients 1000 --rounds 2 [--out result.json]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time
from typing import Any

# Flower's telemetry and Ray's usage statistics would try the network; neither is wanted
# in a benchmark. Both are read when the packages are imported.
os.environ.setdefault("FLWR_TELEMETRY_ENABLED", "0")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")

import psutil  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from flwr.app import ArrayRecord, Context, Message, MetricRecord, RecordDict  # noqa: E402
from flwr.clientapp import ClientApp  # noqa: E402
from flwr.serverapp import Grid, ServerApp  # noqa: E402
from flwr.serverapp.strategy import FedAvg  # noqa: E402
from torch import nn  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _procs  # noqa: E402  (a sibling helper module, not a package)

LEARNING_RATE = 0.1
BATCH_SIZE = 10
EPOCHS = 1
SAMPLES_PER_CLIENT = 20
SEED = 0
MIB = 1 << 20


def build_model() -> nn.Module:
    """The digits MLP: 64 inputs, 64 hidden units (ReLU), 10 classes."""
    return nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10))


# ---------------------------------------------------------------- ClientApp (Ray workers)

_worker: dict[str, Any] = {}


def _worker_state() -> dict[str, Any]:
    """Per worker process: one torch thread, the digits task (its data and partitions)
    and one model whose parameters each message overwrites."""
    if not _worker:
        torch.set_num_threads(1)
        from orchard.tasks.registry import get_task

        _worker["task"] = get_task("digits", with_replacement=True,
                                   samples_per_client=SAMPLES_PER_CLIENT)
        _worker["model"] = build_model()
    return _worker


client_app = ClientApp()


@client_app.train()
def train(msg: Message, context: Context) -> Message:
    state = _worker_state()
    partition_id = int(context.node_config["partition-id"])
    num_partitions = int(context.node_config["num-partitions"])
    data, _ = state["task"].client_data(partition_id, num_partitions, SEED)
    model: nn.Module = state["model"]
    model.load_state_dict(msg.content["arrays"].to_torch_state_dict())
    model.train()
    opt = torch.optim.SGD(model.parameters(), lr=LEARNING_RATE)
    server_round = int(msg.content["config"]["server-round"])
    gen = torch.Generator().manual_seed(SEED * 1_000_003 + server_round * 100_003 + partition_id)
    n = len(data.y)
    loss_sum = 0.0
    for _ in range(EPOCHS):
        perm = torch.randperm(n, generator=gen)
        for start in range(0, n, BATCH_SIZE):
            idx = perm[start:start + BATCH_SIZE]
            opt.zero_grad(set_to_none=True)
            loss = F.cross_entropy(model(data.x[idx]), data.y[idx])
            loss.backward()
            opt.step()
            loss_sum += float(loss.detach()) * len(idx)
    content = RecordDict({
        "arrays": ArrayRecord(model.state_dict()),
        "metrics": MetricRecord({"num-examples": n, "train_loss": loss_sum / max(n * EPOCHS, 1)}),
    })
    return Message(content=content, reply_to=msg)


# ---------------------------------------------------------------- ServerApp (driver)


def _tree() -> list[psutil.Process]:
    me = psutil.Process()
    with contextlib.suppress(psutil.Error):
        return [me, *me.children(recursive=True)]
    return [me]


def tree_cpu_seconds() -> float:
    """User + system CPU seconds of this process and every live descendant."""
    total = 0.0
    for p in _tree():
        with contextlib.suppress(psutil.Error):
            t = p.cpu_times()
            total += t.user + t.system
    return total


class TreeMemorySampler(_procs.PeriodicSampler):
    """Samples the summed RSS (and, every ``pss_every`` samples, the summed PSS) of this
    process and all its descendants in a daemon thread; keeps the peaks."""

    def __init__(self, period_s: float = 0.25, pss_every: int = 8) -> None:
        super().__init__(period_s, "tree-rss-sampler")
        self.pss_every = pss_every
        self.peak_rss = 0
        self.peak_pss: int | None = None
        self.peak_processes = 0
        self.peak_names: dict[str, int] = {}
        self.samples = 0

    def sample(self) -> None:
        procs = _tree()
        rss = 0
        for p in procs:
            with contextlib.suppress(psutil.Error):
                rss += p.memory_info().rss
        if self.samples % self.pss_every == 0:
            pss = 0
            try:
                for p in procs:
                    with contextlib.suppress(psutil.NoSuchProcess):
                        pss += p.memory_full_info().pss
                self.peak_pss = max(self.peak_pss or 0, pss)
            except (psutil.Error, AttributeError):
                pass  # no PSS here (not Linux, or /proc/PID/smaps unreadable)
        self.samples += 1
        if rss > self.peak_rss:
            self.peak_rss, self.peak_processes = rss, len(procs)
            names: dict[str, int] = {}
            for p in procs:
                with contextlib.suppress(psutil.Error):
                    names[p.name()] = names.get(p.name(), 0) + 1
            self.peak_names = names


class TimedFedAvg(FedAvg):
    """FedAvg that notes, when each round's training replies have been aggregated, the
    wall time, the process tree's CPU time and how many replies it aggregated."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.marks: list[dict[str, float]] = []
        self._started = 0.0

    def configure_train(self, server_round: int, arrays: ArrayRecord, config: Any,
                        grid: Grid) -> Any:
        self._started = time.perf_counter()
        return super().configure_train(server_round, arrays, config, grid)

    def aggregate_train(self, server_round: int, replies: Any) -> Any:
        replies = list(replies)
        out = super().aggregate_train(server_round, replies)
        now = time.perf_counter()
        ok = sum(1 for m in replies if not m.has_error())
        self.marks.append({"round": server_round, "t": now, "cpu": tree_cpu_seconds(),
                           "trained": ok, "failed": len(replies) - ok,
                           "send_to_aggregate_s": now - self._started})
        return out


def _server_app(rounds: int, strategy: TimedFedAvg, result: dict[str, Any]) -> ServerApp:
    app = ServerApp()

    @app.main()
    def main(grid: Grid, context: Context) -> None:
        torch.manual_seed(SEED)
        model = build_model()
        res = strategy.start(grid=grid, initial_arrays=ArrayRecord(model.state_dict()),
                             num_rounds=rounds)
        result["arrays"] = res.arrays

    return app


def _final_accuracy(arrays: ArrayRecord | None) -> float | None:
    """Accuracy of the final global model on the digits task's held-out test pool."""
    if arrays is None:
        return None
    from orchard.tasks.registry import get_task

    test = get_task("digits", with_replacement=True, samples_per_client=SAMPLES_PER_CLIENT).test_data
    model = build_model()
    model.load_state_dict(arrays.to_torch_state_dict())
    with torch.no_grad():
        return float((model(test.x).argmax(-1) == test.y).float().mean())


def run_flower(clients: int, measured_rounds: int = 2, ray_cpus: int = 2,
               sample_s: float = 0.25) -> dict[str, Any]:
    """Run ``measured_rounds + 1`` FedAvg rounds over ``clients`` SuperNodes (all of them
    train in every round) and measure the rounds after the first."""
    import flwr
    import ray
    from flwr.simulation import run_simulation

    if measured_rounds < 1:
        raise ValueError("measured_rounds must be >= 1 (the first round is warm-up)")
    torch.set_num_threads(1)
    rounds = measured_rounds + 1
    strategy = TimedFedAvg(fraction_train=1.0, fraction_evaluate=0.0, min_train_nodes=clients,
                           min_evaluate_nodes=0, min_available_nodes=clients)
    result: dict[str, Any] = {}
    backend_config = {
        "client_resources": {"num_cpus": 1, "num_gpus": 0.0},
        "init_args": {"num_cpus": ray_cpus, "num_gpus": 0},
    }
    t0 = time.perf_counter()
    with TreeMemorySampler(period_s=sample_s) as mem:
        run_simulation(server_app=_server_app(rounds, strategy, result), client_app=client_app,
                       num_supernodes=clients, backend_name="ray", backend_config=backend_config)
    total = time.perf_counter() - t0
    marks = strategy.marks
    if len(marks) != rounds:
        raise RuntimeError(f"Flower ran {len(marks)} of {rounds} rounds")
    measured = marks[1:]
    secs = marks[-1]["t"] - marks[0]["t"]
    cpu = marks[-1]["cpu"] - marks[0]["cpu"]
    trained = sum(m["trained"] for m in measured)
    return {
        "path": "flower",
        "engine": f"flwr {flwr.__version__}, ray {ray.__version__} (run_simulation, Ray backend)",
        "clients_per_round": clients,
        "population": clients,
        "ray_cpus": ray_cpus,
        **_procs.throughput(measured, trained, secs),
        "failed_per_round": sum(m["failed"] for m in measured) / len(measured),
        "cpu_clients_per_second": None,  # the Orchard column is engine-process CPU; see tree_*
        "tree_cpu_clients_per_second": round(trained / cpu, 1) if cpu > 0 else None,
        "cpu_seconds_per_round": None,
        "tree_cpu_seconds_per_round": round(cpu / len(measured), 3),
        "send_to_aggregate_seconds": [round(m["send_to_aggregate_s"], 3) for m in marks],
        "warmup_round_seconds": round(marks[0]["send_to_aggregate_s"], 3),
        "simulated_seconds_per_round": None,
        "peak_rss_mib": round(mem.peak_rss / MIB, 1),
        "peak_rss_is": f"sampled sum over the process tree every {sample_s} s "
                       f"({mem.peak_processes} processes at the peak)",
        "processes_at_peak": mem.peak_names,
        "peak_pss_mib": round(mem.peak_pss / MIB, 1) if mem.peak_pss else None,
        "worker_peak_rss_mib": None,
        "total_seconds": round(total, 2),
        "final_accuracy": _final_accuracy(result.get("arrays")),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--clients", type=int, default=1000, help="SuperNodes, all trained every round")
    ap.add_argument("--rounds", type=int, default=2, help="measured rounds (after one warm-up round)")
    ap.add_argument("--ray-cpus", type=int, default=2)
    ap.add_argument("--out", default=None, help="write the result row here as JSON (else stdout)")
    a = ap.parse_args()
    row = run_flower(a.clients, a.rounds, a.ray_cpus)
    if a.out:
        with open(a.out, "w") as f:
            json.dump(row, f)
    else:
        print(json.dumps(row))


if __name__ == "__main__":
    # Run through the importable module, not ``__main__``: Ray ships the ClientApp to its
    # workers by reference, so they import this file by name (Flower puts the driver's
    # sys.path, which has this folder first, on the workers' PYTHONPATH).
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import flower_peer

    flower_peer.main()
