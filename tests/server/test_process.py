"""A server process's settings once it has started (server.process)."""

from __future__ import annotations

import gc

import pytest

from orchard.server import process


def test_start_up_objects_are_frozen_and_the_heap_kept(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[bool] = []
    monkeypatch.setattr(process, "keep_freed_memory", lambda: calls.append(True) or True)
    gc.unfreeze()
    try:
        assert gc.get_freeze_count() == 0
        process.tune_server_process()
        assert gc.get_freeze_count() > 0
        assert calls == [True]
    finally:
        gc.unfreeze()
