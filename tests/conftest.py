"""Shared test settings: one torch thread per process (the CI machine has 2 cores), skip
GPU tests without a GPU, and one ExecuTorch program cache for the session (each distinct
program is still exported once, for real; modules that need the same one share it)."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
import torch

# Before any test module imports grpc, which reads its TLS settings once: the servers the
# tests start accept TLS 1.3 only, as every `orchard` command's do (orchard.tlsversion).
import orchard  # noqa: F401

torch.set_num_threads(1)


@pytest.fixture(scope="session", autouse=True)
def _program_cache(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    from orchard.edge_runtime.et_export import PROGRAM_CACHE_ENV

    before = os.environ.get(PROGRAM_CACHE_ENV)
    base = tmp_path_factory.getbasetemp()
    # Under pytest-xdist (`make test` runs two workers) each worker has its own base
    # directory inside the run's: the workers share the run's cache (entries are
    # written to a temporary name and renamed into place).
    shared = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base
    (shared / "programs").mkdir(parents=True, exist_ok=True)
    os.environ[PROGRAM_CACHE_ENV] = str(shared / "programs")
    yield
    if before is None:
        os.environ.pop(PROGRAM_CACHE_ENV, None)
    else:
        os.environ[PROGRAM_CACHE_ENV] = before


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
