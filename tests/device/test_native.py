"""liborchard_device's own tests (device/tests, run by ctest), built here with CMake.

Skipped, with the reason, where the native toolchain is absent; `.ci/run` installs it,
so in CI they run. The sanitizer build runs the same tests under ASan and UBSan; it is a
second whole build (a few minutes on two cores), so it runs with the slow tests
(`make test-all`). A build on a machine shared with other work can take longer than
pytest's default timeout: these tests allow 20 minutes.
"""

from __future__ import annotations

from pathlib import Path

import device_native
import device_vectors
import pytest

REASON = device_native.skip_reason()
pytestmark = [pytest.mark.skipif(REASON is not None, reason=REASON or ""), pytest.mark.timeout(1200)]


@pytest.fixture(scope="module")
def native() -> device_native.Build:
    return device_native.build_or_fail("default")


@pytest.fixture(scope="module")
def vectors(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Test vectors from the Python package, written for this run (device_vectors.py)."""
    return device_vectors.write_all(tmp_path_factory.mktemp("device-vectors"))


def _ctest(b: device_native.Build, vectors: Path) -> None:
    res = device_native.ctest(b, env={"ORCHARD_DEVICE_VECTORS": str(vectors)})
    assert res.returncode == 0, res.stdout[-6000:] + res.stderr[-2000:]
    assert "tests passed" in res.stdout, res.stdout


def test_ctest(native: device_native.Build, vectors: Path) -> None:
    _ctest(native, vectors)


@pytest.mark.slow
def test_ctest_under_sanitizers(vectors: Path) -> None:
    _ctest(device_native.build_or_fail("sanitize", sanitize=True, build_type="Debug"), vectors)
