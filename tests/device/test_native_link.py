"""The native client's connection, through the orchard-device command (which uses only
the C ABI), against a real Orchard root over TLS on port 0: a join with the bundle's CA
and token, and each way it must fail with a status and a message and no crash: a
revoked token, an unknown one, another CA, a server nobody answers at, and a damaged
bundle."""

from __future__ import annotations

import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import device_native
import device_vectors
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "integration"))
from fed_harness import BackgroundRoot  # noqa: E402

from orchard.server.app import TierHandle  # noqa: E402
from orchard.server.store import SQLiteStore, hash_token  # noqa: E402
from orchard.server.tls import init_certs  # noqa: E402

REASON = device_native.skip_reason()
pytestmark = [pytest.mark.skipif(REASON is not None, reason=REASON or ""), pytest.mark.timeout(1200)]

# Status codes of include/orchard_device.h (the command exits with them).
STATUS = {"ORCHARD_OK": 0, "ORCHARD_ERR_BUNDLE": 4, "ORCHARD_ERR_INTEGRITY": 5, "ORCHARD_ERR_AUTH": 8,
          "ORCHARD_ERR_UNAVAILABLE": 11, "ORCHARD_ERR_TLS": 12}


# ORCHARD_DEVICE_VARIANT=sanitize runs these against the ASan + UBSan build.
@pytest.fixture(scope="module")
def command() -> Path:
    return device_native.variant_build().path("orchard-device")


def _serve_root(data: Path) -> Iterator[tuple[TierHandle, Path]]:
    srv = BackgroundRoot(data / "root", start_grace_s=5.0, insecure=False)
    yield srv.root, data / "root"
    srv.stop()


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[TierHandle, Path]]:
    yield from _serve_root(tmp_path_factory.mktemp("native-root"))


@pytest.fixture()
def fresh_root(tmp_path: Path) -> Iterator[tuple[TierHandle, Path]]:
    """A root of its own: no node of another test in its pool."""
    yield from _serve_root(tmp_path / "fresh")


def _token(data: Path, revoke: bool = False, device: bool = False) -> str:
    st = SQLiteStore(data / "orchard.db")
    try:
        tok = st.issue_token("client", device=device)
        if revoke:
            assert st.revoke_token(hash_token(tok))
        return tok
    finally:
        st.close()


def _run(command: Path, bundle: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(command), str(bundle), "--attempts", "2", *args], capture_output=True, text=True,
                          timeout=120)


def _bundle(tmp: Path, name: str, address: str, ca: str, token: str) -> Path:
    return device_vectors.connection_bundle(tmp / name, address, ca, token)


def test_join_over_tls_with_the_bundle_token(command: Path, root, tmp_path: Path) -> None:
    handle, data = root
    b = _bundle(tmp_path, "ok", handle.address, Path(handle.ca_cert).read_text(), _token(data))
    res = _run(command, b, "--node-id", "native-7")
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == "joined as native-7"
    assert "native-7" in handle.coordinator.children


def test_enrollment_keeps_the_key_and_credential_owner_only(command: Path, root, tmp_path: Path) -> None:
    """The first join enrolls the device's own Ed25519 key with a one-time device token;
    the credential and certificate come back and are kept beside the key, owner-only, in
    the Python client's layout; a restart with the same data dir resumes the node on its
    credential alone (the token now spent, the bundle's token even replaced by garbage)."""
    from orchard.identity import NodeIdentity, verify_certificate

    handle, data = root
    ca = Path(handle.ca_cert).read_text()
    b = _bundle(tmp_path, "enroll", handle.address, ca, _token(data, device=True))
    state = tmp_path / "device-data"
    res = _run(command, b, "--node-id", "native-enrolled", "--data-dir", str(state))
    assert res.returncode == 0, res.stderr
    ident = state / "identity"
    assert ident.stat().st_mode & 0o777 == 0o700
    for f in ("device.key", "credential.json"):
        assert (ident / f).stat().st_mode & 0o777 == 0o600, f
    assert len((ident / "device.key").read_bytes()) == 32
    kept = NodeIdentity(ident)  # the Python client reads what the native one wrote
    assert kept.enrolled is not None and kept.enrolled.node_id == "native-enrolled"
    assert kept.enrolled.credential.startswith("orc_dev_")
    st = SQLiteStore(data / "orchard.db")
    try:
        root_key = st.signing_key().public_key
        row = st.device("native-enrolled")
    finally:
        st.close()
    assert kept.enrolled.root_public_key == root_key
    cert = verify_certificate(kept.enrolled.certificate, root_key, "native-enrolled")
    assert cert.public_key == kept.public_key == row.public_key
    # The enrollment token is spent; the kept credential carries the restart.
    (b / "enrollment.token").write_text("orc_not-a-real-token")
    again = _run(command, b, "--data-dir", str(state))
    assert again.returncode == 0, again.stderr
    assert again.stdout.strip() == "joined as native-enrolled"
    # Without the data dir the spent token enrolls nothing.
    fresh = _run(command, b, "--node-id", "native-enrolled-2")
    assert fresh.returncode == STATUS["ORCHARD_ERR_AUTH"], fresh.stderr


def test_a_certificate_from_another_root_key_is_refused(command: Path, root, tmp_path: Path) -> None:
    """A bundle that names the root's certificate key refuses a server that signs with another."""
    from orchard.identity import SigningKey

    handle, data = root
    b = _bundle(tmp_path, "pinned", handle.address, Path(handle.ca_cert).read_text(), _token(data, device=True))
    device_vectors._rewrite_config(b, root_public_key=SigningKey.generate().public_key.hex())
    res = _run(command, b, "--node-id", "native-pinned")
    assert res.returncode == STATUS["ORCHARD_ERR_AUTH"], res.stderr
    assert "another root key than the bundle names" in res.stderr


@pytest.mark.parametrize("token", ["revoked", "unknown"])
def test_refused_token(command: Path, root, tmp_path: Path, token: str) -> None:
    handle, data = root
    tok = _token(data, revoke=True) if token == "revoked" else "orc_not-a-real-token"
    b = _bundle(tmp_path, token, handle.address, Path(handle.ca_cert).read_text(), tok)
    res = _run(command, b, "--node-id", f"intruder-{token}")
    assert res.returncode == STATUS["ORCHARD_ERR_AUTH"], res.stderr
    assert "ORCHARD_ERR_AUTH" in res.stderr and "token" in res.stderr
    assert f"intruder-{token}" not in handle.coordinator.children


def test_wrong_ca(command: Path, root, tmp_path: Path) -> None:
    handle, data = root
    other_ca = init_certs(tmp_path / "other-tls").ca_cert
    b = _bundle(tmp_path, "wrong-ca", handle.address, Path(other_ca).read_text(), _token(data))
    res = _run(command, b)
    assert res.returncode == STATUS["ORCHARD_ERR_TLS"], res.stderr
    assert "ca.pem" in res.stderr


def test_unreachable_server(command: Path, root, tmp_path: Path) -> None:
    handle, data = root
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    b = _bundle(tmp_path, "unreachable", f"127.0.0.1:{port}", Path(handle.ca_cert).read_text(), _token(data))
    res = _run(command, b)
    assert res.returncode == STATUS["ORCHARD_ERR_UNAVAILABLE"], res.stderr
    assert "unreachable" in res.stderr


def test_damaged_bundle(command: Path, root, tmp_path: Path) -> None:
    handle, data = root
    b = _bundle(tmp_path, "damaged", handle.address, Path(handle.ca_cert).read_text(), _token(data))
    (b / "adapter.safetensors").write_bytes(b"truncated")
    res = _run(command, b)
    assert res.returncode == STATUS["ORCHARD_ERR_INTEGRITY"], res.stderr
    assert "adapter.safetensors has sha256" in res.stderr


def test_native_client_serves_rounds(command: Path, fresh_root, tmp_path: Path) -> None:
    """Two rounds of a LoRA run (a small random base, so the program exports in seconds)
    served by the native client alone: each round's update accepted, the run completed;
    round 2's model comes as a downlink delta from round 1's, rebuilt and hash-checked
    by the native client (8-bit codes for float32; on this small model the payload
    headers and scales make it about 45 % of the model's bytes, not 25 %)."""
    import json
    import time

    import numpy as np

    from orchard import wire
    from orchard.config import CohortConfig, RunConfig
    from orchard.edge_runtime.task_bundle import write_task_bundle
    from orchard.ops import ControlClient
    from orchard.tasks import get_task
    from orchard.trainer import TrainConfig

    handle, data = fresh_root
    task = get_task("shakespeare", **{**device_vectors.SMALL_TASK, "lora_variant": "full"})
    arrays = task.initial_arrays(0)
    b = tmp_path / "lora-bundle"
    write_task_bundle(b, task=task, server_address=handle.address, global_arrays=arrays, ca_cert=handle.ca_cert,
                      enrollment_token=_token(data), micro_batch=4)
    chars = json.loads((b / "tokenizer.json").read_text())["chars"]
    g = np.random.default_rng(5)
    (tmp_path / "text.txt").write_text("".join(g.choice(chars, size=2000)))
    cfg = RunConfig(task="shakespeare", task_params=task.params, rounds=2,
                    cohort=CohortConfig(target=1, min_fraction=1.0),
                    train=TrainConfig(batch_size=8, steps=3, learning_rate=0.5), downlink_delta=True)
    admin = (data / "admin.token").read_text().strip()
    with ControlClient(handle.address, admin_token=admin, ca_cert=handle.ca_cert) as ctl:
        ctl.start_run(cfg, wire.arrays_to_blob(arrays))
        res = _run(command, b, "--data", str(tmp_path / "text.txt"), "--rounds", "2", "--wait", "120",
                   "--node-id", "native-lora")
        assert res.returncode == 0, res.stdout + res.stderr
        lines = [ln for ln in res.stdout.splitlines() if ln.startswith("round")]
        assert len(lines) == 2 and all("uploaded steps=3" in ln for ln in lines), res.stdout
        down = [int(ln.split("bytes_down=")[1].split()[0]) for ln in lines]
        full = len(wire.arrays_to_blob(arrays))
        assert down[0] == full, (down, full)
        assert 0 < down[1] - down[0] < full * 0.6, (down, full)  # the delta, not the model
        deadline = time.monotonic() + 60
        while (st := ctl.status())["status"] not in ("completed", "failed") and time.monotonic() < deadline:
            time.sleep(0.5)
    assert st["status"] == "completed", st
    assert [r["participants"] for r in st["rounds"]] == [1, 1], st
