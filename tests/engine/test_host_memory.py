"""The CPU KV cache's lazily zeroed host memory (worker/host_memory.py): zeros without writing
them, pages committed only where written, given back (and zero again) by `release`; an
engine's CPU cache is such memory and holds only the blocks its steps wrote."""

from __future__ import annotations

import sys

import pytest
import torch

from paged_engine import LLM, SamplingParams
from paged_engine.testing import write_tiny_model
from paged_engine.worker import host_memory

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="reads /proc/self/pagemap")
MiB = 1 << 20


def test_zeroed_memory_is_committed_where_written_and_released():
    t = host_memory.zeroed((64, MiB // 4), torch.float32)  # 64 MiB
    storage = t.untyped_storage()
    assert host_memory.is_lazy(storage) and not host_memory.is_lazy(
        torch.zeros(4).untyped_storage()
    )
    assert t.shape == (64, MiB // 4) and t.dtype == torch.float32
    assert int(t.count_nonzero()) == 0 and host_memory.resident_bytes(storage) == 0  # reads: no
    t[3].fill_(2.0)
    t[40, :10] = 1.5
    assert MiB <= host_memory.resident_bytes(storage) <= MiB + 2 * 4096 + 2 * MiB  # + huge pages
    assert host_memory.release(storage)
    assert host_memory.resident_bytes(storage) == 0 and int(t.count_nonzero()) == 0
    assert not host_memory.release(torch.ones(3).untyped_storage())  # others: untouched
    fp8 = host_memory.zeroed((2, 3, 5), torch.float8_e4m3fn)
    assert fp8.shape == (2, 3, 5) and fp8.float().abs().sum() == 0
    assert host_memory.zeroed((0, 4), torch.float16).shape == (0, 4)


def test_an_engines_cpu_cache_holds_only_what_it_wrote(tmp_path):
    path = write_tiny_model(tmp_path / "llama", "llama", seed=0)
    llm = LLM(str(path), dtype="float32", cpu_kv_cache_gib=0.25)
    caches = llm.llm_engine.model_runner.kv_tensors()
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage() for t in caches}.values()
    assert all(host_memory.is_lazy(s) for s in storages)
    assert sum(s.nbytes() for s in storages) >= 0.2 * 2**30
    params = SamplingParams(temperature=0.0, max_tokens=8)
    out = llm.generate([{"prompt_token_ids": [5, 6, 7, 8, 9]}], params, use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 8
    # 13 tokens: one block a layer written (its pages, plus huge-page rounding at most)
    assert 0 < sum(host_memory.resident_bytes(s) for s in storages) < 2**25
