"""Shared test settings: one torch thread per process (the CI machine has 2 cores), skip
GPU tests without a GPU, and one ExecuTorch program cache for the session (each distinct
program is still exported once, for real; modules that need the same one share it)."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
import torch

torch.set_num_threads(1)


@pytest.fixture(scope="session", autouse=True)
def _program_cache(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    from orchard.edge_runtime.et_export import PROGRAM_CACHE_ENV

    before = os.environ.get(PROGRAM_CACHE_ENV)
    os.environ[PROGRAM_CACHE_ENV] = str(tmp_path_factory.mktemp("programs"))
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
