"""``benchmarks/transport.py`` at a few clients: the round and the bare gRPC baseline both
run, every update is checked into the global model, and the generator's shortcuts (one
verified pull, the rest compared byte for byte) refuse what they should."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

from orchard import wire
from orchard.v1 import orchard_pb2 as pb

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "transport.py"
_spec = importlib.util.spec_from_file_location("transport_benchmark", SCRIPT)
assert _spec is not None and _spec.loader is not None
transport = importlib.util.module_from_spec(_spec)  # the benchmark script, loaded for its pieces
sys.modules[_spec.name] = transport  # its dataclasses look their module up there
_spec.loader.exec_module(transport)


def test_the_benchmark_checks_the_round_and_measures_the_baseline(tmp_path: Path) -> None:
    out = tmp_path / "transport.json"
    res = subprocess.run([sys.executable, str(SCRIPT), "--small", "2", "--clients", "24", "--json", str(out)],
                         capture_output=True, text=True, timeout=300)
    assert out.is_file(), res.stderr[-3000:]  # it exits 1 when a target fails, as a few clients do
    got = json.loads(out.read_text())
    small, big, base = got["rows"]
    assert [r["scenario"] for r in got["rows"]] == ["orchard", "orchard", "bare grpc"]
    assert big["correct"] and big["participants"] == 24 and big["failed_clients"] == 0
    assert base["correct"] and base["participants"] == 24
    assert big["ingested_bytes"] == base["ingested_bytes"] > 24 * (1 << 20)  # the same bytes, all of them (24 clients: the bare sink then uses several ticks of the kernel's CPU clock, never 0)
    assert got["server_cpu_s_per_gb"] > 0 and got["baseline_cpu_s_per_gb"] > 0
    assert got["cpu_per_gb_vs_baseline"] == pytest.approx(got["server_cpu_s_per_gb"] / got["baseline_cpu_s_per_gb"])
    # TLS by default, as production runs: each client enrolled with its own token, and the
    # baseline is bare gRPC over the same TLS.
    assert got["tls"] and got["server_vs_bare_grpc_tls_cpu_ratio"] == got["cpu_per_gb_vs_baseline"]
    ok = {t["target"]: t["ok"] for t in got["targets"]}
    assert ok["every update arrived and the global model is their mean"]
    assert "servers' CPU per GB ingested" in res.stdout and "bare grpc" in res.stdout


def _pulled(blob: bytes, chunk: int) -> list[bytes]:
    sha = wire.sha256_hex(blob)
    return [pb.Chunk(data=d, offset=off, total_bytes=len(blob), blob_sha256=sha).SerializeToString()
            for off, d in wire.iter_chunks(blob, chunk)]


def test_the_reference_pull_is_verified_in_full() -> None:
    blob = transport.model_blob()
    sha = wire.sha256_hex(blob)
    assert transport._verify_model(_pulled(blob, 1 << 20), sha) == len(blob)
    bad = bytearray(blob)
    bad[len(bad) // 2] ^= 1
    with pytest.raises(RuntimeError, match="sha256"):
        transport._verify_model(_pulled(bytes(bad), 1 << 20), sha)
    msgs = _pulled(blob, 1 << 20)
    with pytest.raises(RuntimeError, match="offset"):
        transport._verify_model(msgs[1:], sha)


def test_the_global_check_sees_a_missing_update() -> None:
    """The reference check is the mean over the clients that delivered: a global model that
    lacks one of them (or counts one twice) fails it."""

    class Ctl:
        def __init__(self, scales: list[float]) -> None:
            mean = sum(scales) / len(scales)
            self.blob = wire.arrays_to_blob({transport.TENSOR: transport.initial_model()
                                             + transport.base_delta() * transport.np.float32(mean)})

        def pull_global(self, run_id: str) -> bytes:
            return self.blob

    times = [{"pushed": 1.0} for _ in range(4)]
    scales = [transport.scale_of(i) for i in range(4)]
    assert transport._check_global(Ctl(scales), "r", times)
    assert not transport._check_global(Ctl(scales[:3]), "r", times)
    assert not transport._check_global(Ctl([*scales, scales[0]]), "r", times)
