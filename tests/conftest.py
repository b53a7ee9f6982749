"""Suite-wide setup: Triton runs in its interpreter when there is no CUDA device.

TRITON_INTERPRET must be set before any @triton.jit function is defined, so it is set here,
before the test modules import paged_kernels.
"""

from __future__ import annotations

import gc
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
    # Engines of tiny models on CPU: a 1 GiB pool (the default) is ~10^5 blocks, whose
    # bookkeeping was most of an engine's start. 1/4 GiB still holds the default model's
    # 8k-token context with room to spare.
    os.environ.setdefault("PAGED_CPU_KVCACHE_SPACE", "0.25")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if HAS_CUDA:
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


# Engine tests keep several engines alive at once (a mode against the plain engine, HF beside
# them): on a GPU each test engine takes this share of the device unless the test says
# otherwise, not vLLM's 0.9, which leaves no room for a second. Their models are tiny.
TEST_GPU_SHARE = 0.1


@pytest.fixture(autouse=True)
def _test_gpu_share(monkeypatch: pytest.MonkeyPatch) -> None:
    if not HAS_CUDA:
        return
    from paged_engine.config import EngineConfig

    build = EngineConfig.from_kwargs.__func__

    def from_kwargs(cls, **kwargs):
        kwargs.setdefault("gpu_memory_utilization", TEST_GPU_SHARE)
        return build(cls, **kwargs)

    monkeypatch.setattr(EngineConfig, "from_kwargs", classmethod(from_kwargs))


# A finished engine is reference cycles (requests <-> sequences, workers <-> runners) holding
# its weights and the KV blocks it wrote (and a test's transformers reference beside it); only
# a full collection frees it, and with the heap of transformers' modules those run seldom: the
# suite's two workers reached 10-13 GiB each (a CI worker was killed on the 24 GiB machine).
# After a test that grew the process by GC_AFTER_GROWTH since the last collection, collect.
GC_AFTER_GROWTH = 1 << 30
_rss_after_gc = [0]


def _rss() -> int:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:  # no procfs: collect after every test that might have grown
        return _rss_after_gc[0] + GC_AFTER_GROWTH


@pytest.hookimpl(trylast=True)
def pytest_runtest_teardown(item: pytest.Item) -> None:
    if _rss() - _rss_after_gc[0] >= GC_AFTER_GROWTH:
        gc.collect()
        _rss_after_gc[0] = _rss()


@pytest.fixture
def device() -> torch.device:
    return torch.device("cuda" if HAS_CUDA else "cpu")


# The engine's refusals that only a GPU machine meets: more ranks than it has GPUs (tensor /
# pipeline parallel tests run as gloo processes on CPU, and on GPUs where there are enough),
# and the CPU-only options (int8 / fp16 weight-only kernels, torch.compile). On a GPU machine a
# test that meets one is skipped with the engine's reason, not failed.
_GPU_REFUSALS = ("GPUs on this node, but", "runs on the CPU only")


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item):
    try:
        return (yield)
    except ValueError as exc:
        if HAS_CUDA and any(why in str(exc) for why in _GPU_REFUSALS):
            pytest.skip(f"not on this machine: {exc}")
        raise
