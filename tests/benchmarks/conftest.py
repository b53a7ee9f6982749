"""Benchmark code on a tiny random model: every function runs, no timing is checked."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:  # `benchmarks` is a top-level package of the repo, not installed
    sys.path.insert(0, str(ROOT))


@pytest.fixture(scope="session")
def tiny_spec(tmp_path_factory: pytest.TempPathFactory):
    from benchmarks.models import from_dir
    from paged_engine.testing import write_tiny_model

    path = write_tiny_model(tmp_path_factory.mktemp("bench-model") / "tiny-qwen3", "qwen3")
    return from_dir(Path(path), "cpu")


@pytest.fixture
def tiny_workload(tiny_spec):
    from benchmarks.workloads import nano_vllm

    return nano_vllm(3, (8, 24), (3, 6), max_token_id=tiny_spec.vocab_size - 1)


@pytest.fixture(autouse=True)
def one_torch_thread():
    """As the CPU benchmarks run (see run_all --cpu-threads); restored afterwards."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
