"""Test vectors for liborchard_device, written by the Python package itself.

The native tests (device/tests) replay these: the same inputs must give the same bytes
(codecs, SecAgg+ messages) and the same decisions (device policy) as Orchard's Python
code gives here. They are written fresh for every test run, so they follow the Python
code as it changes; nothing is copied by hand.

    python tests/device/device_vectors.py DIR
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
from dp_vectors import dp_vectors
from safetensors.numpy import load_file, save_file
from secagg_vectors import secagg_vectors

from orchard.client.update import upload_rng
from orchard.compression import build_codec
from orchard.compression.update import encode_packed
from orchard.edge_runtime import bundle as bundle_mod
from orchard.edge_runtime import et_program
from orchard.edge_runtime.clock import VirtualClock
from orchard.edge_runtime.governor import Governor
from orchard.edge_runtime.policy import DevicePolicy, evaluate
from orchard.errors import AuthError, ConfigError, IntegrityError
from orchard.typing import DeviceState


def _hex_f32(x: np.ndarray) -> str:
    return np.ascontiguousarray(x, dtype="<f4").tobytes().hex()


def numpy_random_vectors() -> dict[str, Any]:
    """SeedSequence words and PCG64 draws, to pin the generator the quantiser uses."""
    cases = []
    for entropy in ([0], [1, 0xC0DEC], [2**31 - 2, 0xC0DEC], [123456789, 2**40 + 5]):
        rng = np.random.default_rng(entropy)
        words: list[int] = []
        for v in entropy:  # numpy's coercion of each int: 32-bit words, low first
            words += [0] if v == 0 else [(v >> (32 * i)) & 0xFFFFFFFF for i in range((v.bit_length() + 31) // 32)]
        state = np.random.SeedSequence(entropy).generate_state(8, np.uint32)
        cases.append({
            "entropy_words": words,
            "state_words": [int(w) for w in state],
            "next64": [int(v) for v in np.random.default_rng(entropy).bit_generator.random_raw(5)],
            "floats": _hex_f32(rng.random(7, dtype=np.float32)),
        })
    spawned = np.random.SeedSequence(entropy=99, spawn_key=(7,)).generate_state(2, np.uint32)
    return {"cases": cases, "spawn": {"entropy": 99, "key": [7], "state_words": [int(w) for w in spawned]}}


def codec_vectors() -> list[dict[str, Any]]:
    """Payloads of compression.encode_packed with upload_rng(seed), as the client sends them."""
    g = np.random.default_rng(20261128)
    out: list[dict[str, Any]] = []
    tiny = np.float32(2.0**-20)
    specials = np.array([0.0, -0.0, 1.0, -1.0, 65504.0, -65519.0, 2.0**-24, 2.0**-25, 3 * 2.0**-25,
                         2.0**-14 - 2.0**-25, 1.0 + 2.0**-11, 1.0 + 3 * 2.0**-11, 6.1e-5, 1e-8, 1e-30,
                         tiny], dtype=np.float32)
    specs: list[dict[str, Any]] = [
        {"name": "float32"},
        {"name": "float16"},
        {"name": "qsgd"},
        {"name": "qsgd", "params": {"bits": 8, "block": 64}},
        {"name": "qsgd", "params": {"bits": 4, "block": 7}},
        {"name": "qsgd", "params": {"bits": 2}},
        {"name": "qsgd", "params": {"bits": 1, "block": 3}},
        {"name": "qsgd", "params": {"bits": 8, "scale": 0.05}},
    ]
    for i, spec in enumerate(specs):
        tensors = {
            "layer.0.lora_A": (g.standard_normal((4, 33)) * 0.02).astype(np.float32),
            "layer.0.lora_B": (g.standard_normal((33, 4)) * 10.0 ** g.integers(-6, 1)).astype(np.float32),
            "bias": g.uniform(-1e-3, 1e-3, size=(5,)).astype(np.float32),
            "specials": specials.copy() if spec["name"] != "qsgd" else specials[:4].copy(),
            "empty": np.zeros((0, 3), np.float32),
            "scalar_blocks": np.full((2, 2, 3), 1e-37, np.float32),
        }
        names = list(tensors)
        seed = int(g.integers(0, 2**31 - 1))
        payload, sizes, _ = encode_packed(build_codec(spec), tensors, names, upload_rng(seed), None, 0)
        out.append({
            "case": i, "spec": spec, "seed": seed,
            "tensors": [{"name": n, "shape": list(tensors[n].shape), "values": _hex_f32(tensors[n])} for n in names],
            "payload": payload.hex(), "sizes": list(sizes),
        })
    return out


ADAPTER = {
    "h.0.attn.c_attn.lora_A.weight": np.full((4, 32), 0.01, np.float32),
    "h.0.attn.c_attn.lora_B.weight": np.zeros((96, 4), np.float32),
}


def _write_bundle(root: Path, server_address: str = "localhost:1", ca_pem: str | None = None,
                  token: str = "secret-token") -> None:
    """A bundle that passes every check the Python client makes before it loads the
    program (which is not an ExecuTorch program here: these cases are about refusals
    and the connection)."""
    root.mkdir(parents=True)
    (root / "model.onnx").write_bytes(b"not a model: only its digest is checked here")
    (root / "adapter.onnx_adapter").write_bytes(b"adapter in onnx runtime's format")
    save_file(ADAPTER, str(root / "adapter.safetensors"), metadata={"adapter_version": "0"})
    (root / "ca.pem").write_text(ca_pem or "-----BEGIN CERTIFICATE-----\nMIIB\n-----END CERTIFICATE-----\n")
    (root / "enrollment.token").write_text(token + "\n")
    os.chmod(root / "enrollment.token", 0o600)
    (root / et_program.PROGRAM_FILE).write_bytes(b"program bytes")
    manifest = et_program.TrainingManifest(
        program=bundle_mod.BundleFile(name=et_program.PROGRAM_FILE,
                                      sha256=bundle_mod.file_sha256(root / et_program.PROGRAM_FILE)),
        task="shakespeare", lora_variant="lora", lora_rank=4, micro_batch=2, seq_len=8, vocab_size=65,
        inputs=(et_program.TensorDecl(name="idx", dtype="int64", shape=(2, 8)),
                et_program.TensorDecl(name="targets", dtype="int64", shape=(2, 8)),
                et_program.TensorDecl(name="row_weight", dtype="float32", shape=(2,))),
        gradients_start=2, parameters_start=4,
        parameters=tuple(et_program.TensorDecl(name=k.replace("lora_A.", "lora_A.default.")
                                               .replace("lora_B.", "lora_B.default."),
                                               dtype="float32", shape=v.shape) for k, v in ADAPTER.items()),
        loss="mean token cross-entropy", executorch_version="test", base_sha256="0" * 64)
    (root / et_program.MANIFEST_FILE).write_text(manifest.model_dump_json(indent=2))
    _rewrite_config(root, server_address=server_address)


def connection_bundle(root: Path, server_address: str, ca_pem: str, token: str) -> Path:
    """A bundle for connection tests: the server's address, its CA and a token."""
    _write_bundle(root, server_address, ca_pem, token)
    return root


def _rewrite_config(root: Path, **changes: Any) -> None:
    """client.json naming the current digests of the bundle's files."""
    def named(name: str) -> bundle_mod.BundleFile:
        return bundle_mod.BundleFile(name=name, sha256=bundle_mod.file_sha256(root / name))

    old = root / "client.json"
    address = json.loads(old.read_text())["server_address"] if old.is_file() else "localhost:1"
    config = bundle_mod.ClientBundleConfig(
        server_address=address, model=named("model.onnx"), input_name="idx", output_name="logits",
        adapter_onnx=named("adapter.onnx_adapter"), adapter_safetensors=named("adapter.safetensors"),
        adapter_version=0, ca_cert="ca.pem", enrollment_token="enrollment.token",
        training_program=named(et_program.MANIFEST_FILE))
    data = json.loads(config.model_dump_json())
    data.update(changes)
    (root / "client.json").write_text(json.dumps(data, indent=2))


def _edit_manifest(root: Path, edit: Callable[[dict[str, Any]], None]) -> None:
    path = root / et_program.MANIFEST_FILE
    data = json.loads(path.read_text())
    edit(data)
    path.write_text(json.dumps(data))
    _rewrite_config(root)  # a consistent bundle whose manifest is wrong, not a swapped file


def python_refusal(root: Path) -> tuple[str, str]:
    """What the Python client says of the bundle at ``root`` before it loads the program:
    the error class ("" when it passes) and message."""
    try:
        b = bundle_mod.read_bundle(root)
        b.enrollment_token()
        if b.config.ca_cert is not None and b"BEGIN CERTIFICATE" not in (root / b.config.ca_cert).read_bytes():
            raise bundle_mod.BundleError(f"{root / b.config.ca_cert} is not a PEM certificate")
        manifest = et_program.read_manifest(root)
        program = root / manifest.program.name
        if not program.is_file():
            raise et_program.TrainingProgramError(f"{program} is missing")
        digest = bundle_mod.file_sha256(program)
        if digest != manifest.program.sha256:
            raise et_program.TrainingProgramError(
                f"{program} has sha256 {digest}, {et_program.MANIFEST_FILE} expects {manifest.program.sha256}")
        if [d.name for d in manifest.inputs] != list(et_program.INPUT_NAMES):
            raise et_program.TrainingProgramError(f"{root / et_program.MANIFEST_FILE} declares other inputs")
        et_program._check_adapter(manifest, root / et_program.MANIFEST_FILE, load_file(str(root / "adapter.safetensors")))
    except (bundle_mod.BundleError, IntegrityError, AuthError, ConfigError) as err:
        return type(err).__name__, str(err)
    return "", ""


# Python's error class -> the status the library returns for the same bundle.
STATUS_OF = {"": "ORCHARD_OK", "IntegrityError": "ORCHARD_ERR_INTEGRITY", "BundleError": "ORCHARD_ERR_BUNDLE",
             "TrainingProgramError": "ORCHARD_ERR_PROGRAM", "AuthError": "ORCHARD_ERR_AUTH",
             "ConfigError": "ORCHARD_ERR_BUNDLE"}


def bundle_vectors(directory: Path) -> list[dict[str, Any]]:
    """A good bundle and damaged copies, each with the Python client's verdict and the
    file its message names (the native message must name it too)."""
    def flip_byte(name: str) -> Callable[[Path], None]:
        def damage(root: Path) -> None:
            data = bytearray((root / name).read_bytes())
            data[len(data) // 2] ^= 0x01
            (root / name).write_bytes(bytes(data))
        return damage

    def rank(m: dict[str, Any]) -> None:
        m["parameters"][0]["shape"] = [8, 32]

    def rename(m: dict[str, Any]) -> None:
        m["parameters"][1]["name"] = "h.0.mlp.c_fc.lora_B.default.weight"

    def inputs(m: dict[str, Any]) -> None:
        m["inputs"] = m["inputs"][:2]

    def version(m: dict[str, Any]) -> None:
        m["format_version"] = 7

    cases: dict[str, tuple[Callable[[Path], None], str]] = {
        "good": (lambda root: None, ""),
        "adapter_changed": (flip_byte("adapter.safetensors"), "adapter.safetensors"),
        "model_changed": (flip_byte("model.onnx"), "model.onnx"),
        "model_missing": (lambda root: (root / "model.onnx").unlink(), "model.onnx"),
        "program_truncated": (lambda root: (root / "train.pte").write_bytes(b"prog"), "train.pte"),
        "manifest_swapped": (flip_byte(et_program.MANIFEST_FILE), et_program.MANIFEST_FILE),
        "manifest_other_rank": (lambda root: _edit_manifest(root, rank), et_program.MANIFEST_FILE),
        "manifest_other_model": (lambda root: _edit_manifest(root, rename), et_program.MANIFEST_FILE),
        "manifest_inputs": (lambda root: _edit_manifest(root, inputs), et_program.MANIFEST_FILE),
        "manifest_format": (lambda root: _edit_manifest(root, version), et_program.MANIFEST_FILE),
        "token_readable": (lambda root: os.chmod(root / "enrollment.token", 0o644), "enrollment.token"),
        "ca_not_pem": (lambda root: ((root / "ca.pem").write_text("hello"), _rewrite_config(root)), "ca.pem"),
        "config_format": (lambda root: _rewrite_config(root, format_version=2), "client.json"),
        "config_not_json": (lambda root: (root / "client.json").write_text("{"), "client.json"),
        "no_config": (lambda root: (root / "client.json").unlink(), "client.json"),
    }
    out = []
    for name, (damage, names_file) in cases.items():
        root = directory / "bundles" / name
        shutil.rmtree(root, ignore_errors=True)
        _write_bundle(root)
        damage(root)
        error, message = python_refusal(root)
        if names_file and names_file not in message:
            raise AssertionError(f"{name}: the Python message does not name {names_file}: {message}")
        if (error == "") != (name == "good"):
            raise AssertionError(f"{name}: the Python client says {error or 'nothing'}: {message}")
        out.append({"case": name, "dir": str(root), "status": STATUS_OF[error], "python_error": error,
                    "python_message": message, "names_file": names_file})
    return out


def _state_json(s: DeviceState) -> dict[str, Any]:
    return {"battery_percent": s.battery_percent, "charging": s.charging, "temperature_c": s.temperature_c,
            "unmetered_network": s.unmetered_network, "idle": s.idle, "energy_j": s.extra.get("energy_j")}


class _Scripted:
    """A device whose n-th reading is ``states[n]`` (the last one repeats)."""

    def __init__(self, states: list[DeviceState]) -> None:
        self.states = states
        self.reads = 0

    def read(self) -> DeviceState:
        s = self.states[min(self.reads, len(self.states) - 1)]
        self.reads += 1
        return s


def _run_governor(policy: DevicePolicy, states: list[DeviceState], step_s: float, units: float,
                  wall_origin: float, max_loops: int = 400) -> dict[str, Any]:
    """The Python governor over scripted states: every before_step's answer, the clock
    and the readings taken, then the report."""
    device, clock = _Scripted(states), VirtualClock(0.0, wall_origin)
    gov = Governor(device, policy, clock)
    events = []
    for _ in range(max_loops):
        ok = gov.before_step()
        events.append({"run": ok, "t": clock.monotonic(), "reads": device.reads})
        if not ok:
            break
        clock.advance(step_s)
        gov.after_step(units)
    r = gov.report()
    return {
        "policy": json.loads(policy.model_dump_json()), "states": [_state_json(x) for x in states],
        "step_s": step_s, "units": units, "wall_origin": wall_origin, "max_loops": max_loops, "events": events,
        "report": {"steps_done": r.steps_done, "stop_reason": r.stop_reason.value if r.stop_reason else "",
                   "elapsed_s": r.elapsed_s, "active_s": r.active_s, "paused_s": r.paused_s, "energy_j": r.energy_j,
                   "max_temperature_c": r.max_temperature_c, "min_battery_percent": r.min_battery_percent,
                   "duty": r.duty, "work_units": r.work_units},
    }


def policy_vectors() -> dict[str, Any]:
    """Device policy decisions: eligibility of single states, and whole governed runs
    (state sequence -> every before_step decision and the report)."""
    g = np.random.default_rng(43)
    maybe = [None, True, False]

    def random_state(i: int, temp: float, battery: float, counter: float | None, flaky: float = 0.1) -> DeviceState:
        """``flaky``: how often the network or idleness reading is not a plain True."""
        extra = {} if counter is None else {"energy_j": counter}
        return DeviceState(battery_percent=None if g.random() < 0.05 else round(battery, 3),
                           charging=maybe[int(g.integers(0, 3))] if g.random() < 0.1 else (g.random() < 0.3),
                           temperature_c=None if g.random() < 0.05 else round(temp, 3),
                           unmetered_network=True if g.random() >= flaky else maybe[int(g.integers(0, 3))],
                           idle=True if g.random() >= flaky else maybe[int(g.integers(0, 3))], extra=extra)

    def random_policy() -> DevicePolicy:
        window = None
        if g.random() < 0.2:
            tz = ["UTC", "+05:30", "-08:00"][int(g.integers(0, 3))]
            window = {"start": f"{int(g.integers(0, 24)):02d}:{int(g.integers(0, 60)):02d}",
                      "end": f"{int(g.integers(0, 24)):02d}:{int(g.integers(0, 60)):02d}", "tz": tz}
        return DevicePolicy.model_validate({
            "eligibility": {"min_battery_percent": float(g.uniform(5, 40)), "allow_on_battery": bool(g.random() < 0.8),
                            "max_temperature_c": float(g.uniform(38, 48)), "require_unmetered": bool(g.random() < 0.5),
                            "require_idle": bool(g.random() < 0.5)},
            "window": window,
            "budget": {"energy_j": None if g.random() < 0.6 else float(g.uniform(5, 200)),
                       "time_s": None if g.random() < 0.5 else float(g.uniform(5, 300)),
                       "max_steps": None if g.random() < 0.2 else int(g.integers(1, 60))},
            "pacing": {"hard_ceiling_c": None if g.random() < 0.5 else float(g.uniform(40, 50)),
                       "throttle_band_c": float(g.uniform(0.5, 8)), "min_duty": float(g.uniform(0.05, 1)),
                       "cooldown_quantum_s": float(g.uniform(0.2, 5)), "max_cooldown_s": float(g.uniform(0, 60)),
                       "prior_rise_c": float(g.uniform(0, 2)), "prior_drop_percent": float(g.uniform(0, 2)),
                       "safety_factor": float(g.uniform(1, 2)), "history": int(g.integers(1, 20)),
                       "joules_per_unit": None if g.random() < 0.5 else float(g.uniform(0.1, 3))},
        })

    eligibility = []
    for _ in range(300):
        policy = random_policy()
        state = random_state(0, float(g.uniform(30, 50)), float(g.uniform(0, 100)), None)
        wall = float(g.uniform(1.7e9, 1.8e9))
        d = evaluate(state, policy, wall)
        eligibility.append({"policy": json.loads(policy.model_dump_json()), "state": _state_json(state), "wall": wall,
                            "eligible": d.eligible, "codes": [r.code for r in d.reasons]})

    runs = []
    for _ in range(120):
        policy = random_policy()
        if policy.budget.energy_j is not None and policy.pacing.joules_per_unit is None:
            counter: float | None = 0.0
        else:
            counter = None if g.random() < 0.7 else 0.0
        temp, battery, states = float(g.uniform(25, 44)), float(g.uniform(15, 100)), []
        heat, drain = float(g.uniform(-0.2, 1.5)), float(g.uniform(-0.5, 2.0))
        for i in range(int(g.integers(1, 120))):
            states.append(random_state(i, temp, battery, counter, flaky=0.01))
            temp += heat * float(g.uniform(0, 1)) - (0.8 if g.random() < 0.2 else 0)
            battery = min(100.0, max(0.0, battery - drain * float(g.uniform(0, 1))))
            if counter is not None:
                counter += float(g.uniform(0, 4)) if g.random() < 0.95 else -50.0  # a wrap now and then
        runs.append(_run_governor(policy, states, step_s=float(g.uniform(0.1, 6)), units=float(g.integers(1, 9)),
                                  wall_origin=float(g.uniform(1.7e9, 1.8e9))))
    # Hand-written cases for each way a run ends.
    heating = [DeviceState(80.0, False, 38.0 + 0.7 * i, True, True) for i in range(200)]
    runs.append(_run_governor(DevicePolicy(), heating, 2.0, 4.0, 1.75e9))
    draining = [DeviceState(30.0 - 1.5 * i, False, 30.0, True, True) for i in range(40)]
    runs.append(_run_governor(DevicePolicy(), draining, 1.0, 1.0, 1.75e9))
    unplugged = [DeviceState(90.0, i < 6, 30.0, True, True) for i in range(20)]
    runs.append(_run_governor(DevicePolicy.model_validate({"eligibility": {"allow_on_battery": False}}),
                              unplugged, 1.0, 1.0, 1.75e9))
    steady = [DeviceState(None, None, None, True, True)]
    runs.append(_run_governor(DevicePolicy.model_validate({"budget": {"time_s": 10.0}}), steady, 3.0, 1.0, 1.75e9))
    runs.append(_run_governor(DevicePolicy.model_validate({"budget": {"max_steps": 5}}), steady, 0.5, 2.0, 1.75e9))
    return {"eligibility": eligibility, "runs": runs, "windows": window_vectors(), "zoneinfo_dir": zoneinfo_dir()}


ZONES = ("Europe/Paris", "America/New_York", "Australia/Sydney", "Asia/Kolkata", "America/Sao_Paulo",
         "Pacific/Chatham", "Europe/London", "Africa/Casablanca", "UTC")


def zoneinfo_dir() -> str:
    """Where Python's zoneinfo finds the zones (its TZPATH, else the tzdata package): the
    native test reads the same files, so the two agree on a host without /usr/share/zoneinfo."""
    import importlib.resources
    import zoneinfo

    for d in zoneinfo.TZPATH:
        if all((Path(d) / z).is_file() for z in ZONES if z != "UTC"):
            return d
    return str(importlib.resources.files("tzdata") / "zoneinfo")


def window_vectors() -> list[dict[str, Any]]:
    """Daily windows in IANA zones (the system's zoneinfo, as Python's zoneinfo reads it):
    contains and next_start at times around daylight-time changes and past 2037, where
    the zone's table ends and its TZ rule takes over."""
    import datetime as dt

    from orchard.edge_runtime.policy import DailyWindow

    g = np.random.default_rng(44)
    out = []
    for zone in ZONES:
        for start, end in (("01:00", "06:00"), ("23:00", "02:30"), ("02:30", "03:15"), ("09:00", "17:00")):
            w = DailyWindow(start=start, end=end, tz=zone)
            # Spread over 1990-2060, and dense around late March and late October.
            times = [float(g.integers(631152000, 2840140800)) for _ in range(12)]
            for year in (2024, 2031, 2045):
                for month_day in ((3, 9), (3, 30), (4, 6), (10, 6), (10, 27), (11, 3)):
                    base = dt.datetime(year, *month_day, tzinfo=dt.UTC).timestamp()
                    times += [base + float(g.integers(-86400, 86400)) for _ in range(2)]
            out += [{"window": {"start": start, "end": end, "tz": zone}, "wall": t, "contains": w.contains(t),
                     "next_start": w.next_start(t)} for t in times]
    return out


# A small random base keeps each export to seconds (as tests/edge_runtime/test_et_trainer.py).
SMALL_TASK = dict(base="random", seq_len=16, n_layer=1, n_head=2, d_model=16, lora_rank=4, lora_alpha=8)


def training_vectors(directory: Path) -> dict[str, Any]:
    """Local training through a real exported ExecuTorch program by the Python device
    trainer; the native trainer must give the same result. Needs torch and executorch
    (to export the program), so it is written only where the training test runs."""
    from orchard.edge_runtime.et_program import load_training_program
    from orchard.edge_runtime.et_trainer import DeviceData, ExecuTorchTrainer
    from orchard.edge_runtime.task_bundle import write_task_bundle
    from orchard.seeds import derive_seed
    from orchard.tasks import get_task
    from orchard.trainer import TrainConfig

    g = np.random.default_rng(11)
    out: dict[str, Any] = {
        "derive_seed": [{"parts": p, "bits": b, "seed": derive_seed(*p, bits=b)}
                        for p, b in (([0, 0], 63), ([1, 2], 31), ([2**64 - 1, 5, 7], 63), ([123], 64))],
        "permutations": [{"seed": s, "n": n, "perm": np.random.default_rng(s).permutation(n).tolist()}
                         for s, n in ((0, 10), (2**40 + 3, 97), (9, 2), (77, 1000))],
        "runs": [],
    }
    cases = {"ffa_one_batch": ("ffa", {"batch_size": 32, "epochs": 2}, 9),
             "full_permuted_fedprox": ("full", {"batch_size": 4, "epochs": 2, "proximal_mu": 0.1}, 13),
             "full_momentum_steps": ("full", {"batch_size": 5, "steps": 5, "momentum": 0.9, "weight_decay": 0.01}, 11)}
    for case, (variant, train, rows) in cases.items():
        task = get_task("shakespeare", **{**SMALL_TASK, "lora_variant": variant})
        path = directory / "programs" / variant  # one export per variant
        if not (path / "client.json").is_file():
            write_task_bundle(path, task=task, server_address="h:1", micro_batch=4)
        program = load_training_program(path)
        t = program.seq_len
        x = g.integers(0, 65, size=(rows, t)).astype(np.int64)
        y = g.integers(0, 65, size=(rows, t)).astype(np.int64)
        glob = {n: (0.05 * g.standard_normal(p.shape)).astype(np.float32)
                for n, p in zip(program.names, program.manifest.parameters, strict=True)}
        cfg = TrainConfig(learning_rate=0.5, seed=int(g.integers(0, 2**31)), **train)
        trainer_seed = int(g.integers(0, 2**31))
        r = ExecuTorchTrainer(program, DeviceData(x, y), seed=trainer_seed).train(glob, cfg)
        out["runs"].append({
            "case": case, "bundle": str(path), "rows": rows, "seq_len": t, "x": x.ravel().tolist(),
            "y": y.ravel().tolist(), "global": {k: _hex_f32(v) for k, v in glob.items()},
            "run_config": {"train": {**train, "learning_rate": 0.5, "seed": cfg.seed}}, "trainer_seed": trainer_seed,
            "result": {"arrays": {k: _hex_f32(v) for k, v in r.arrays.items()}, "num_steps": r.num_steps,
                       "num_examples": r.num_examples, "weight": r.weight,
                       "train_loss": r.metrics["train_loss"], "train_accuracy": r.metrics["train_accuracy"]},
        })
    (directory / "train.json").write_text(json.dumps(out))
    return out


def downlink_vectors() -> list[dict[str, Any]]:
    """Model deltas as a tier serves them (server.downlink.encode_delta_reply): the base,
    the delta and the sha256 and bytes of the model the node must rebuild from them."""
    from orchard import wire
    from orchard.server.downlink import encode_delta_reply

    g = np.random.default_rng(11)
    out = []
    for shapes in ({"b.weight": (5000,), "a.lora_A": (3, 4), "c": (1,)}, {"w": (4096, 2), "v": (7,)}):
        base = {k: g.standard_normal(s).astype(np.float32) for k, s in shapes.items()}
        target = {k: v + 0.01 * g.standard_normal(v.shape).astype(np.float32) for k, v in base.items()}
        base_blob, target_blob = wire.arrays_to_blob(base), wire.arrays_to_blob(target)
        got = encode_delta_reply(base_blob, wire.sha256_hex(base_blob), target_blob, wire.sha256_hex(target_blob))
        assert got is not None
        reply, result = got
        out.append({"base": base_blob.hex(), "delta": reply.blob.hex(), "encoding": reply.encoding,
                    "result_sha256": reply.result_sha256, "result": result.hex()})
    return out


def write_all(directory: str | Path) -> Path:
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    (d / "numpy_random.json").write_text(json.dumps(numpy_random_vectors()))
    (d / "codec.json").write_text(json.dumps(codec_vectors()))
    (d / "bundle.json").write_text(json.dumps(bundle_vectors(d)))
    (d / "policy.json").write_text(json.dumps(policy_vectors()))
    (d / "secagg.json").write_text(json.dumps(secagg_vectors()))
    (d / "dp.json").write_text(json.dumps(dp_vectors()))
    (d / "downlink.json").write_text(json.dumps(downlink_vectors()))
    training_vectors(d)
    return d


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    print(write_all(sys.argv[1]))
