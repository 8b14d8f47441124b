"""The JNI binding (device/jni/) on the JVM: a Java program loads liborchard_device_jni,
has a damaged bundle refused with the library's status and message, feeds the device
state through a Java callback, and runs one training step through the bundle's
ExecuTorch program (device/jni/test/OrchardDeviceTest.java). Skipped, with the reason,
without a JDK (`apt-get install default-jdk-headless`) or the native toolchain."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import device_native
import device_vectors
import numpy as np
import pytest

REASON = device_native.skip_reason()
if REASON is None and (shutil.which("javac") is None or shutil.which("java") is None):
    REASON = "no JDK (javac, java): apt-get install default-jdk-headless"
pytestmark = [pytest.mark.skipif(REASON is not None, reason=REASON or ""), pytest.mark.timeout(1200)]

JNI = device_native.SOURCE / "jni"


def test_java_drives_a_bundle_check_and_a_training_step(tmp_path: Path) -> None:
    from orchard.edge_runtime.task_bundle import write_task_bundle
    from orchard.tasks import get_task

    build = device_native.build_or_fail()
    if not build.path("liborchard_device_jni.so").is_file():
        pytest.fail("javac is here but CMake built no liborchard_device_jni.so (JDK headers not found?)")
    task = get_task("shakespeare", **{**device_vectors.SMALL_TASK, "lora_variant": "full"})
    bundle = tmp_path / "bundle"
    write_task_bundle(bundle, task=task, server_address="127.0.0.1:1", micro_batch=4)
    damaged = tmp_path / "damaged"
    shutil.copytree(bundle, damaged)
    (damaged / "adapter.safetensors").write_bytes(b"truncated")
    chars = json.loads((bundle / "tokenizer.json").read_text())["chars"]
    text = tmp_path / "text.txt"
    text.write_text("".join(np.random.default_rng(1).choice(chars, size=600)))
    classes = tmp_path / "classes"
    sources = [*(JNI / "java").rglob("*.java"), JNI / "test" / "OrchardDeviceTest.java"]
    res = subprocess.run(["javac", "-d", str(classes), *map(str, sources)], capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
    res = subprocess.run(["java", f"-Djava.library.path={build.directory}", "-cp", str(classes), "OrchardDeviceTest",
                          str(bundle), str(damaged), str(text)], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0 and res.stdout.rstrip().endswith("PASSED"), res.stdout + res.stderr
    assert "damaged bundle: ORCHARD_ERR_INTEGRITY" in res.stdout and "adapter.safetensors" in res.stdout
    assert "ok one training step: steps=1" in res.stdout
