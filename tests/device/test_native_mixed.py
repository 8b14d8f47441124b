"""Python and native clients in one federation over TLS on loopback: a Python root, a
Python aggregator below it, Python clients training through the bundle's ExecuTorch
program and `orchard-device` processes (the native library, over its C ABI) training
through the same program, all in one cohort on Shakespeare LoRA with the 8-bit
quantiser as the upload codec (qsgd) and downlink deltas on.

One case runs one round with one client of each kind: both updates accepted into the
same round. The other runs three rounds with two of each beside a run of four Python
clients on the same partitions, config and seeds: the mixed run's model improves on the
initial one, and its held-out loss is within a tolerance of the Python-only run's (the
native clients draw other batches of the same partitions, so the two runs are close,
not equal). A third runs one round under secure aggregation (SecAgg+, the active
protocol: every client signs its keys with its enrolled device key) with two of each,
float32 uploads, beside the same round without it: the secure round's model equals the
plain round's within the clients' quantisation, so the tier's unmasked sum is the plain
sum of all four updates, the native clients' included. All are in the default suite: on
the tests' small base the federations take seconds (6 s for the second case on a loaded
2-core host); the module's cost is its bundle's export (the native build is shared with
the other device tests)."""

from __future__ import annotations

import asyncio
import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path

import device_native
import grpc
import numpy as np
import pytest

REASON = device_native.skip_reason()
pytestmark = [pytest.mark.skipif(REASON is not None, reason=REASON or ""), pytest.mark.timeout(1200)]

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "integration"))
from fed_harness import FAST, Federation, start_run, wait_status  # noqa: E402

from orchard import wire  # noqa: E402
from orchard.config import (  # noqa: E402
    CodecSpec,
    CohortConfig,
    PrivacyConfig,
    RunConfig,
    SecureAggregationConfig,
)
from orchard.server.store import SQLiteStore  # noqa: E402
from orchard.server.tls import TlsPaths  # noqa: E402
from orchard.trainer import TrainConfig  # noqa: E402

PARAMS = dict(base="random", seq_len=16, n_layer=1, n_head=2, d_model=16, lora_rank=4, lora_alpha=8,
              lora_variant="full")
NUM_PARTITIONS = 40
TRAIN = TrainConfig(steps=8, batch_size=16, learning_rate=0.5, optimizer="sgd")
QSGD8 = CodecSpec(name="qsgd", params={"bits": 8})
FLOAT32 = CodecSpec(name="float32")
# Held-out loss of the mixed run may exceed the Python-only run's by at most this (nats).
TOLERANCE = 0.05


@pytest.fixture(scope="module")
def command() -> Path:
    """The command of $ORCHARD_DEVICE_VARIANT's build (the default build unless told)."""
    return device_native.variant_build().path("orchard-device")


@pytest.fixture(scope="module")
def task():
    from orchard.tasks import get_task

    return get_task("shakespeare", **PARAMS)


@pytest.fixture(scope="module")
def bundle(task, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The program and adapter every client uses; each federation writes its own CA and
    token into a copy (`_bundle_for`)."""
    from orchard.edge_runtime.task_bundle import write_task_bundle

    path = tmp_path_factory.mktemp("mixed-native") / "bundle"
    write_task_bundle(path, task=task, server_address="unused:1", micro_batch=8)
    return path


def _bundle_for(template: Path, dest: Path, ca: Path, token: str) -> Path:
    import shutil

    shutil.copytree(template, dest)
    shutil.copy(ca, dest / "ca.pem")
    (dest / "enrollment.token").write_text(token + "\n")
    os.chmod(dest / "enrollment.token", 0o600)
    cfg = json.loads((dest / "client.json").read_text())
    cfg.update(ca_cert="ca.pem", enrollment_token="enrollment.token")
    (dest / "client.json").write_text(json.dumps(cfg))
    return dest


def _partition_text(task, k: int, chars: list[str]) -> str:
    """Partition k's own text (its train then its test windows), for a native client:
    the same data its Python counterpart trains on, cut by the device as it cuts text."""
    train, test = task.client_data(k, NUM_PARTITIONS, 0)
    ids = np.concatenate([train.x.numpy().reshape(-1), test.x.numpy().reshape(-1)])
    return "".join(chars[int(i)] for i in ids)


@dataclass
class Outcome:
    status: dict
    final: dict[str, np.ndarray]
    native_stdout: list[str]
    python_reports: dict[str, list]


async def _federation(tmp: Path, task, template: Path, command: Path, *, python: list[int], native: list[int],
                      rounds: int, secure: bool = False, codec: CodecSpec = QSGD8, modulus_bits: int = 32,
                      privacy: PrivacyConfig | None = None, weighting: str = "examples") -> Outcome:
    from orchard.client.runtime import ClientRuntime
    from orchard.edge_runtime.et_trainer import DeviceData, executorch_trainer_factory
    from orchard.link import FleetLink, LinkConfig
    from orchard.ops import ControlClient
    from orchard.server.app import start_aggregator, start_root
    from orchard.typing import Role

    data = tmp / "root"
    root = await start_root(data, server_cfg=FAST, start_grace_s=0.5, seed=1)
    fed = Federation(root)
    procs: list[asyncio.subprocess.Process] = []
    try:
        ca = TlsPaths.in_dir(data / "tls").ca_cert
        st = SQLiteStore(data / "orchard.db")
        try:
            agg_token, token = st.issue_token("aggregator"), st.issue_token("client")
        finally:
            st.close()
        agg = await start_aggregator(root.address, token=agg_token, ca_cert=ca, tls_dir=data / "tls",
                                     server_cfg=FAST, seed=1)
        fed.aggregators.append(agg)
        for k in python:
            train, test = task.client_data(k, NUM_PARTITIONS, 0)
            factory = executorch_trainer_factory(template, DeviceData(train.x.numpy(), train.y.numpy()),
                                                 DeviceData(test.x.numpy(), test.y.numpy()), seed=k)
            link = FleetLink(LinkConfig(target=agg.address, role=Role.CLIENT, token=token, ca_cert=ca,
                                        node_id=f"python-{k}", max_backoff_s=2.0))
            rt = ClientRuntime(link, factory, partition_id=k)
            fed.clients.append(rt)
            fed.client_tasks.append(asyncio.create_task(rt.run()))
        if native:
            b = _bundle_for(template, tmp / "native-bundle", ca, token)
            chars = json.loads((b / "tokenizer.json").read_text())["chars"]
            for k in native:
                text = tmp / f"native-{k}.txt"
                text.write_text(_partition_text(task, k, chars))
                procs.append(await asyncio.create_subprocess_exec(
                    str(command), str(b), "--server", agg.address, "--data", str(text), "--rounds", str(rounds),
                    "--wait", "300", "--node-id", f"native-{k}", "--data-dir", str(tmp / f"native-{k}"),
                    stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE))
        cfg = RunConfig(task="shakespeare", task_params=PARAMS, rounds=rounds, seed=1, train=TRAIN,
                        codec=codec, downlink_delta=codec == QSGD8,
                        secure_aggregation=SecureAggregationConfig(enabled=secure, modulus_bits=modulus_bits),
                        privacy=privacy or PrivacyConfig(),
                        cohort=CohortConfig(target=len(python) + len(native), over_selection=1.0, min_fraction=1.0,
                                            deadline_s=180.0, weighting=weighting))
        await start_run(root, cfg, insecure=False)
        status = await wait_status(root, lambda s: s.get("status") in ("completed", "failed"), 600)
        outs = []
        for p in procs:
            out, err = await asyncio.wait_for(p.communicate(), 120)
            outs.append(out.decode() + err.decode())
            assert p.returncode == 0, outs[-1]
            assert not device_native.sanitizer_reports(outs[-1]), outs[-1]
        ctl = ControlClient(root.address, admin_token=root.admin_token, ca_cert=root.ca_cert)
        try:
            final = wire.blob_to_arrays(await asyncio.to_thread(ctl.pull_global))
        finally:
            ctl.close()
        return Outcome(status, final, outs, {c.link.node_id: c.reports for c in fed.clients})
    finally:
        for p in procs:
            if p.returncode is None:
                p.kill()
                await p.wait()
        await fed.stop()


def _check_both_kinds_served(out: Outcome, python: list[int], native: list[int], rounds: int,
                             private: bool = False) -> None:
    """Every round completed with every client's update; ``private``: under DP the Python
    client reports no step count (only the native client's own output says it trained)."""
    st = out.status
    assert st["status"] == "completed" and st["completed_rounds"] == rounds, st
    assert all(r["participants"] == len(python) + len(native) for r in st["rounds"]), st["rounds"]
    for k in python:
        done = [r for r in out.python_reports[f"python-{k}"] if r.accepted]
        assert len(done) == rounds and all(private or r.num_steps == TRAIN.steps for r in done), out.python_reports
    for text in out.native_stdout:
        lines = [ln for ln in text.splitlines() if ln.startswith("round")]
        assert len(lines) == rounds and all(f"uploaded steps={TRAIN.steps}" in ln for ln in lines), text


def test_python_and_native_clients_share_a_round(tmp_path: Path, task, bundle: Path, command: Path) -> None:
    out = asyncio.run(_federation(tmp_path, task, bundle, command, python=[0], native=[1], rounds=1))
    _check_both_kinds_served(out, [0], [1], 1)


def test_a_mixed_federation_learns_as_a_python_one_does(tmp_path: Path, task, bundle: Path, command: Path) -> None:
    mixed = asyncio.run(_federation(tmp_path / "mixed", task, bundle, command, python=[0, 1], native=[2, 3],
                                    rounds=3))
    _check_both_kinds_served(mixed, [0, 1], [2, 3], 3)
    alone = asyncio.run(_federation(tmp_path / "python", task, bundle, command, python=[0, 1, 2, 3], native=[],
                                    rounds=3))
    _check_both_kinds_served(alone, [0, 1, 2, 3], [], 3)
    before = task.evaluate(task.initial_arrays(1))["loss"]
    after_mixed, after_python = task.evaluate(mixed.final)["loss"], task.evaluate(alone.final)["loss"]
    assert after_mixed < before - 0.05, (before, after_mixed)
    assert after_mixed <= after_python + TOLERANCE, (after_mixed, after_python)


def _apart(a: Outcome, b: Outcome, task) -> tuple[float, float]:
    """How far apart two runs' models are, and how far the second moved from the initial one."""
    initial = task.initial_arrays(1)
    moved = max(float(np.max(np.abs(b.final[k] - initial[k]))) for k in b.final)
    apart = max(float(np.max(np.abs(a.final[k] - b.final[k]))) for k in b.final)
    return apart, moved


def test_native_clients_take_part_in_secure_rounds(tmp_path: Path, task, bundle: Path, command: Path) -> None:
    """Three secure rounds, two clients of each kind, against the same rounds without
    secure aggregation."""
    secure = asyncio.run(_federation(tmp_path / "secure", task, bundle, command, python=[0, 1], native=[2, 3],
                                     rounds=3, secure=True, codec=FLOAT32))
    _check_both_kinds_served(secure, [0, 1], [2, 3], 3)
    plain = asyncio.run(_federation(tmp_path / "plain", task, bundle, command, python=[0, 1], native=[2, 3],
                                    rounds=3, codec=FLOAT32))
    _check_both_kinds_served(plain, [0, 1], [2, 3], 3)
    apart, moved = _apart(secure, plain, task)
    # Each client rounds its weighted update to 16 bits over [-clip, clip] = [-1, 1]: at
    # most 2 / (2^16 - 1) each, times S / sum(w) = 1000 / 512 in the tier's mean, a round;
    # three rounds, each training from a model that far apart.
    assert moved > 1e-2, moved
    assert apart < 3e-3, (apart, moved)


QSGD8_FIXED = CodecSpec(name="qsgd", params={"bits": 8, "scale": 0.5})


def test_native_clients_alone_in_secure_rounds_with_a_codec(tmp_path: Path, task, bundle: Path,
                                                            command: Path) -> None:
    """Native clients only, secure aggregation over a 48-bit field (64-bit words) with a
    field-linear codec (qsgd 8-bit at a fixed scale), against the same rounds in the clear."""
    secure = asyncio.run(_federation(tmp_path / "secure", task, bundle, command, python=[], native=[0, 1, 2],
                                     rounds=2, secure=True, codec=QSGD8_FIXED, modulus_bits=48))
    _check_both_kinds_served(secure, [], [0, 1, 2], 2)
    plain = asyncio.run(_federation(tmp_path / "plain", task, bundle, command, python=[], native=[0, 1, 2],
                                    rounds=2, codec=QSGD8_FIXED))
    _check_both_kinds_served(plain, [], [0, 1, 2], 2)
    apart, moved = _apart(secure, plain, task)
    assert moved > 1e-2, moved
    assert apart < 3e-3, (apart, moved)


def test_native_clients_in_a_secure_round_with_central_differential_privacy(tmp_path: Path, task, bundle: Path,
                                                                            command: Path) -> None:
    """Central DP under secure aggregation, two clients of each kind (each client's
    bounded rounding, the root's noise). With a clip no update reaches and a tiny noise
    multiplier, the round's model is the plain round's (uniform weights) within the noise:
    every native client encoded on the session's grid, or the tier's decoded sum would be
    off by far more."""
    privacy = PrivacyConfig(mode="central", noise_multiplier=1e-4, clip_norm=10.0, population=100)
    dp = asyncio.run(_federation(tmp_path / "dp", task, bundle, command, python=[0, 1], native=[2, 3], rounds=1,
                                 secure=True, codec=FLOAT32, privacy=privacy, weighting="uniform"))
    _check_both_kinds_served(dp, [0, 1], [2, 3], 1, private=True)
    plain = asyncio.run(_federation(tmp_path / "plain", task, bundle, command, python=[0, 1], native=[2, 3],
                                    rounds=1, codec=FLOAT32, weighting="uniform"))
    _check_both_kinds_served(plain, [0, 1], [2, 3], 1)
    apart, moved = _apart(dp, plain, task)
    # The noise on the mean: z C / n = 2.5e-4 a coordinate; a few thousand coordinates.
    assert moved > 1e-2, moved
    assert apart < 3e-3, (apart, moved)


def test_native_clients_in_a_secure_round_with_distributed_differential_privacy(tmp_path: Path, task,
                                                                                bundle: Path,
                                                                                command: Path) -> None:
    """Distributed DP (each client's discrete Gaussian share) over a 48-bit field (64-bit
    words), two clients of each kind: every update of both kinds is in the round's sum.
    The noise that the ledger accepts here (its reported delta counts what clamping the
    shares adds, which a tiny noise multiplier makes unbounded: that run is refused, with
    the message checked below) is far above an update, so this case checks the session,
    not the values: the native DP encoding is held to the Python package's bytes by the
    vectors of ``device/tests/test_dp.cpp``."""
    tiny = PrivacyConfig(mode="distributed", noise_multiplier=1e-4, clip_norm=10.0, population=100)
    with pytest.raises(grpc.RpcError) as refused:
        asyncio.run(_federation(tmp_path / "tiny", task, bundle, command, python=[0], native=[1], rounds=1,
                                secure=True, codec=FLOAT32, privacy=tiny, weighting="uniform", modulus_bits=48))
    assert "raise privacy.noise_multiplier" in refused.value.details(), refused.value.details()
    privacy = PrivacyConfig(mode="distributed", noise_multiplier=0.5, clip_norm=10.0, population=100)
    dp = asyncio.run(_federation(tmp_path / "dp", task, bundle, command, python=[0, 1], native=[2, 3], rounds=1,
                                 secure=True, codec=FLOAT32, privacy=privacy, weighting="uniform",
                                 modulus_bits=48))
    _check_both_kinds_served(dp, [0, 1], [2, 3], 1, private=True)


@pytest.mark.slow
def test_secure_participation_under_sanitizers(tmp_path: Path, task, bundle: Path) -> None:
    """The ASan + UBSan build of `orchard-device` in secure rounds (three native clients,
    two rounds, distributed DP over a 48-bit field, so the DP encoding and 64-bit masks
    run too): no sanitizer report, every update in the sum."""
    command = device_native.variant_build("sanitize").path("orchard-device")
    privacy = PrivacyConfig(mode="distributed", noise_multiplier=0.5, clip_norm=10.0, population=100)
    out = asyncio.run(_federation(tmp_path, task, bundle, command, python=[], native=[0, 1, 2], rounds=2,
                                  secure=True, codec=QSGD8_FIXED, privacy=privacy, weighting="uniform",
                                  modulus_bits=48))
    _check_both_kinds_served(out, [], [0, 1, 2], 2, private=True)
