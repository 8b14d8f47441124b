"""A Ray cluster of two nodes on loopback (``ray.cluster_utils.Cluster``, one CPU each):
``orchard tune --ray-address`` runs the study there as it runs it on local worker
processes, and the simulator's Ray backend, joined through ``RAY_ADDRESS`` as ``orchard
simulate`` joins it, spreads its client jobs over both nodes and ends with the local
backend's model, bit for bit.

The cluster lives in a spawned process of its own (Ray starts its node processes from
the process that builds the cluster; this test process may hold gRPC threads that a fork
catches mid-call), and each client of it runs in a fresh process too.
"""

from __future__ import annotations

import multiprocessing
import os
import subprocess
import sys
from collections.abc import Iterator
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from sim_cases import _deterministic
from tune_cases import sim_table, trials, tune_table, write

from orchard.simulation import SimulationConfig, run_simulation

pytest.importorskip("ray", reason="ray is in the dev extras; install with pip install -e '.[dev]'")
# A cluster of two nodes and several fresh processes that each import torch: about 1 min
# on an idle 2-core host, minutes on a loaded one.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]


def _host_cluster(conn: Any) -> None:
    """Two nodes of one CPU each; sends (address, node ids), shuts down when told."""
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "object_store_memory": 100 << 20,
                                                           "include_dashboard": False})
    try:
        cluster.add_node(num_cpus=1, object_store_memory=100 << 20)
        cluster.wait_for_nodes()
        conn.send((cluster.address, sorted(n.node_id for n in cluster.list_all_nodes())))
        conn.recv()
    finally:
        cluster.shutdown()


@pytest.fixture(scope="module")
def cluster() -> Iterator[tuple[str, list[str]]]:
    ctx = multiprocessing.get_context("spawn")
    here, there = ctx.Pipe()
    host = ctx.Process(target=_host_cluster, args=(there,), daemon=True)
    host.start()
    try:
        if not here.poll(180):
            raise AssertionError("the two-node Ray cluster did not come up within 180 s")
        address, nodes = here.recv()
        assert len(nodes) == 2
        yield address, nodes
    finally:
        here.send(None)
        host.join(60)
        if host.is_alive():
            host.kill()


def _simulate_on(address: str, cfg: SimulationConfig) -> tuple[dict[str, np.ndarray], dict[str, int] | None]:
    os.environ["RAY_ADDRESS"] = address  # what `orchard simulate --backend ray` joins
    report = run_simulation(cfg)
    assert report.status == "completed", report.status
    return report.final_arrays, report.placement


def test_ray_backend_on_two_nodes_equals_local(cluster: tuple[str, list[str]]) -> None:
    address, nodes = cluster
    # Chunks of 4 clients: 3 jobs a round, handed to the 2 actors in turn.
    local = run_simulation(_deterministic(12, aggregators=2, rounds=2, chunk_size=4))
    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        arrays, placement = pool.submit(_simulate_on, address, _deterministic(
            12, aggregators=2, rounds=2, chunk_size=4, backend="ray", workers=2)).result(timeout=300)
    assert placement is not None and sorted(placement) == nodes, (placement, nodes)
    assert all(jobs > 0 for jobs in placement.values()), placement  # both nodes trained clients
    assert sorted(arrays) == sorted(local.final_arrays)
    for k, v in local.final_arrays.items():
        np.testing.assert_array_equal(arrays[k], v, err_msg=f"tensor {k!r} differs")


def _tune(sim: Path, space: Path, out: Path, *extra: str) -> str:
    proc = subprocess.run([sys.executable, "-m", "orchard.cli", "tune", "--config", str(sim), "--space", str(space),
                           "--out", str(out), *extra], capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout + proc.stderr


def test_tune_on_two_nodes_as_on_local_workers(cluster: tuple[str, list[str]], tmp_path: Path) -> None:
    from optuna.trial import TrialState

    from orchard.config import load_toml
    from orchard.simulation.config import simulation_problems

    address, _ = cluster
    sim, space = write(tmp_path, sim_table(rounds=3), tune_table(4, parallel=2))
    ran = {}
    for where, extra in (("local", ()), ("ray", ("--ray-address", address))):
        output = _tune(sim, space, tmp_path / where, *extra)
        ts = trials(tmp_path / where / "study.db")
        ran[where] = sorted(t.state for t in ts if t.state in (TrialState.COMPLETE, TrialState.PRUNED))
        assert not any(t.state in (TrialState.RUNNING, TrialState.WAITING, TrialState.FAIL) for t in ts)
        best = load_toml(tmp_path / where / "best.toml")
        assert simulation_problems(best) == [], where
        if where == "ray":
            # Two trials at once, one CPU a node: both nodes ran trials.
            assert "trials ran on 2 Ray nodes" in " ".join(output.split()), output[-2000:]
    assert len(ran["local"]) == len(ran["ray"]) == 4, ran
