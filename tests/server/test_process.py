"""A server process's allocator and collector settings (server.process)."""

from __future__ import annotations

import gc
import platform

import pytest

from orchard.server import process


def test_the_environment_s_own_allocator_settings_are_kept(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MALLOC_TRIM_THRESHOLD_", "131072")
    assert process.keep_freed_memory() is False


@pytest.mark.skipif(platform.system() != "Linux" or platform.libc_ver()[0] != "glibc", reason="glibc only")
def test_glibc_takes_both_thresholds(monkeypatch: pytest.MonkeyPatch) -> None:
    for k in ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_"):
        monkeypatch.delenv(k, raising=False)
    assert process.keep_freed_memory() is True
    monkeypatch.setattr(process.platform, "libc_ver", lambda: ("musl", "1.2"))
    assert process.keep_freed_memory() is False  # another C library: nothing is changed


def test_start_up_objects_are_frozen() -> None:
    gc.unfreeze()
    try:
        process.tune_server_process()
        assert gc.get_freeze_count() > 0
    finally:
        gc.unfreeze()
