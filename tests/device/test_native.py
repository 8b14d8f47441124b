"""liborchard_device's own tests (device/tests, run by ctest), built here with CMake.

Skipped, with the reason, where the native toolchain is absent; `.ci/run` installs it,
so in CI they run. The sanitizer build runs the same tests under ASan and UBSan.
"""

from __future__ import annotations

import subprocess

import device_native
import pytest

REASON = device_native.skip_reason()
pytestmark = pytest.mark.skipif(REASON is not None, reason=REASON or "")


def _build(variant: str, **kw: object) -> device_native.Build:
    try:
        return device_native.build(variant, **kw)  # type: ignore[arg-type]
    except subprocess.CalledProcessError as err:
        pytest.fail(f"building device/ ({variant}) failed:\n{err.stdout}\n{err.stderr}")


@pytest.fixture(scope="module")
def native() -> device_native.Build:
    return _build("default")


def _ctest(b: device_native.Build) -> None:
    res = device_native.ctest(b)
    assert res.returncode == 0, res.stdout[-6000:] + res.stderr[-2000:]
    assert "tests passed" in res.stdout, res.stdout


def test_ctest(native: device_native.Build) -> None:
    _ctest(native)


def test_ctest_under_sanitizers() -> None:
    _ctest(_build("sanitize", sanitize=True, build_type="Debug"))
