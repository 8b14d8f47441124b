from collections.abc import Iterator

import pytest
import torch


@pytest.fixture(autouse=True)
def _one_torch_thread() -> Iterator[None]:
    # Tiny models on a shared 2-core box: intra-op threads only add contention
    # (a 64-64-10 step is ~40x slower with 2 busy threads than with 1).
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
