"""Building liborchard_device (device/) for its tests and benchmarks.

One CMake build directory per variant under ``device/build/`` (ignored by git): the
default build, and ``sanitize`` (ASan + UBSan). A build holds an exclusive lock on its
directory, so two test processes never write one build tree at once. :func:`missing`
says what of the toolchain is absent, so callers can skip with that reason.
"""

from __future__ import annotations

import fcntl
import importlib.util
import os
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SOURCE = ROOT / "device"
BUILD_ROOT = SOURCE / "build"
# The CI machine has 2 cores; other test workers share them.
JOBS = os.environ.get("ORCHARD_DEVICE_JOBS", "2")

# Debian packages that provide what device/CMakeLists.txt finds (.ci/run installs them).
PACKAGES = "cmake g++ pkg-config libssl-dev nlohmann-json3-dev libgrpc++-dev protobuf-compiler-grpc libprotobuf-dev"


def executorch_cmake_dir() -> Path | None:
    """The executorch wheel's CMake package (found, not imported), if it ships one."""
    spec = importlib.util.find_spec("executorch")
    if spec is None or not spec.submodule_search_locations:
        return None
    d = Path(next(iter(spec.submodule_search_locations))) / "share" / "cmake"
    return d if (d / "executorch-config.cmake").is_file() and (d.parent.parent / "lib" / "libexecutorch.so").is_file() \
        else None


def missing() -> list[str]:
    """What is absent to build the library: empty when it can be built here."""
    out = [tool for tool in ("cmake", "ctest", "pkg-config") if shutil.which(tool) is None]
    if executorch_cmake_dir() is None:
        out.append("the executorch wheel's C++ runtime (pip install 'orchard-fl[executorch]')")
    if shutil.which(os.environ.get("CXX", "c++")) is None and shutil.which("g++") is None:
        out.append("a C++17 compiler (g++)")
    if shutil.which("pkg-config") is not None:
        for module in ("openssl", "nlohmann_json", "grpc++", "protobuf"):
            if subprocess.run(["pkg-config", "--exists", module], capture_output=True).returncode != 0:
                out.append(f"{module} (pkg-config)")
    if shutil.which("protoc") is None or shutil.which("grpc_cpp_plugin") is None:
        out.append("protoc and grpc_cpp_plugin")
    return out


def skip_reason() -> str | None:
    gone = missing()
    if not gone:
        return None
    return f"the native toolchain lacks {', '.join(gone)} (apt-get install {PACKAGES})"


@dataclass(frozen=True)
class Build:
    directory: Path

    def path(self, name: str) -> Path:
        return self.directory / name


def build(variant: str = "default", *, sanitize: bool = False, build_type: str = "RelWithDebInfo") -> Build:
    """Configure and build ``variant``; raises CalledProcessError with the
    compiler's output when the build fails."""
    directory = BUILD_ROOT / variant
    directory.mkdir(parents=True, exist_ok=True)
    with open(directory / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        # Configured every time (quick once cached): a directory configured before an
        # option was added gets it.
        _run(["cmake", "-S", str(SOURCE), "-B", str(directory), f"-DCMAKE_BUILD_TYPE={build_type}",
              f"-DORCHARD_DEVICE_SANITIZE={'ON' if sanitize else 'OFF'}", f"-Dexecutorch_DIR={executorch_cmake_dir()}"])
        _run(["cmake", "--build", str(directory), "-j", JOBS])
    return Build(directory)


def build_or_fail(variant: str = "default", *, sanitize: bool = False, build_type: str = "RelWithDebInfo") -> Build:
    """:func:`build` for a test: a failed build fails the calling test with the compiler's output."""
    import pytest

    try:
        return build(variant, sanitize=sanitize, build_type=build_type)
    except subprocess.CalledProcessError as err:
        pytest.fail(f"building device/ ({variant}) failed:\n{err.stdout}\n{err.stderr}")


# ORCHARD_DEVICE_VARIANT=sanitize: the device tests that run the command run the ASan +
# UBSan build (`make device-sanitize`).
VARIANT = os.environ.get("ORCHARD_DEVICE_VARIANT", "default")
# What a sanitizer writes when it finds something (each also fails the process).
SANITIZER_REPORTS = ("ERROR: AddressSanitizer", "ERROR: LeakSanitizer", "runtime error:", "UndefinedBehaviorSanitizer")


def variant_build(variant: str | None = None) -> Build:
    """The build of ``variant`` (default: $ORCHARD_DEVICE_VARIANT) for a test, through
    :func:`build_or_fail`: "sanitize" is the ASan + UBSan Debug build, anything else a
    RelWithDebInfo build of that name."""
    v = variant or VARIANT
    if v == "sanitize":
        return build_or_fail("sanitize", sanitize=True, build_type="Debug")
    return build_or_fail(v)


def sanitizer_reports(output: str) -> list[str]:
    """The lines of ``output`` in which a sanitizer reported something."""
    return [ln for ln in output.splitlines() if any(r in ln for r in SANITIZER_REPORTS)]


def ctest(b: Build, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ctest", "--test-dir", str(b.directory), "--output-on-failure", "-j", JOBS],
                          capture_output=True, text=True, env={**os.environ, **(env or {})})


def _run(cmd: list[str]) -> None:
    res = subprocess.run(cmd, capture_output=True, text=True)
    if res.returncode != 0:
        raise subprocess.CalledProcessError(res.returncode, cmd, res.stdout[-4000:], res.stderr[-4000:])
