"""Suite-wide setup: Triton runs in its interpreter when there is no CUDA device.

TRITON_INTERPRET must be set before any @triton.jit function is defined, so it is set here,
before the test modules import paged_kernels.
"""

from __future__ import annotations

import os

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")
    # The test models are tiny, and the suite shares 2 cores with the server subprocesses it
    # starts: one intra-op thread avoids OpenMP threads spinning against each other.
    torch.set_num_threads(1)
    os.environ.setdefault("OMP_NUM_THREADS", "1")  # engines (and server subprocesses) keep it


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if HAS_CUDA:
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


@pytest.fixture
def device() -> torch.device:
    return torch.device("cuda" if HAS_CUDA else "cpu")
