"""write_kv_cache / copy_blocks / swap_blocks against the torch references."""

from __future__ import annotations

import pytest
import torch

from paged_kernels import (
    copy_blocks,
    ref_copy_blocks,
    ref_write_kv_cache,
    swap_blocks,
    write_kv_cache,
)

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def _cache(num_blocks, block_size, heads, head_dim, dtype, device):
    return torch.randn(num_blocks, block_size, heads, head_dim, device=device).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    ("block_size", "heads", "head_dim"), [(16, 2, 64), (32, 3, 80), (8, 1, 96)]
)
@pytest.mark.parametrize("slot_dtype", [torch.int64, torch.int32])
def test_write_kv_cache(seed, device, dtype, block_size, heads, head_dim, slot_dtype):
    num_blocks, num_tokens = 24, 50
    key_cache = _cache(num_blocks, block_size, heads, head_dim, dtype, device)
    value_cache = _cache(num_blocks, block_size, heads, head_dim, dtype, device)
    # Strided inputs, as when K and V are views into one fused QKV projection.
    kv = torch.randn(num_tokens, 2, heads, head_dim, device=device).to(dtype)
    key, value = kv[:, 0], kv[:, 1]
    slots = torch.randperm(num_blocks * block_size, device=device)[:num_tokens]
    slots[torch.rand(num_tokens, device=device) < 0.3] = -1  # padding tokens
    slots = slots.to(slot_dtype)
    before_k, before_v = key_cache.clone(), value_cache.clone()
    ref_k, ref_v = key_cache.clone(), value_cache.clone()

    write_kv_cache(key, value, key_cache, value_cache, slots)
    ref_write_kv_cache(key, value, ref_k, ref_v, slots)

    assert torch.equal(key_cache, ref_k)
    assert torch.equal(value_cache, ref_v)
    # Slots not named by a valid token (incl. every -1 token) stay untouched.
    written = torch.zeros(num_blocks * block_size, dtype=torch.bool, device=device)
    written[slots[slots >= 0].long()] = True
    flat = (num_blocks * block_size, heads, head_dim)
    assert torch.equal(key_cache.view(flat)[~written], before_k.view(flat)[~written])
    assert torch.equal(value_cache.view(flat)[~written], before_v.view(flat)[~written])


def test_write_kv_cache_rejects_bad_shapes(device):
    cache = torch.zeros(4, 16, 2, 64, device=device)
    key = torch.zeros(3, 2, 64, device=device)
    with pytest.raises(ValueError, match="slot_mapping"):
        write_kv_cache(key, key, cache, cache, torch.zeros(4, dtype=torch.int64, device=device))
    with pytest.raises(ValueError, match="head"):
        write_kv_cache(key[:, :1], key[:, :1], cache, cache, torch.zeros(3, dtype=torch.int64))


@pytest.mark.parametrize("dtype", DTYPES)
def test_copy_blocks_many_layers(seed, device, dtype):
    num_layers, num_blocks = 5, 32
    keys = [_cache(num_blocks, 16, 2, 64, dtype, device) for _ in range(num_layers)]
    values = [_cache(num_blocks, 16, 2, 64, dtype, device) for _ in range(num_layers)]
    perm = torch.randperm(num_blocks)
    mapping = torch.stack([perm[:6], perm[6:12]], dim=1)  # disjoint src and dst
    ref_keys = [k.clone() for k in keys]
    ref_values = [v.clone() for v in values]

    copy_blocks(keys, values, mapping)
    ref_copy_blocks(ref_keys, ref_values, mapping)

    for got, want in zip(keys + values, ref_keys + ref_values):
        assert torch.equal(got, want)


def test_copy_blocks_of_caches_without_values(device):
    """A latent cache (MLA) is its own value cache: its layers are passed as keys only."""
    latents = [_cache(12, 16, 1, 40, torch.float32, device) for _ in range(3)]
    want = [c.clone() for c in latents]
    mapping = torch.tensor([[1, 7], [4, 9]])
    copy_blocks(latents, [], mapping)
    ref_copy_blocks(want, [], mapping)
    for got, ref in zip(latents, want, strict=True):
        assert torch.equal(got, ref)
    with pytest.raises(ValueError, match="one value cache per key cache"):
        copy_blocks(latents, latents[:1], mapping)


def test_copy_blocks_empty_and_mismatch(device):
    cache = torch.zeros(4, 16, 2, 64, device=device)
    copy_blocks([cache], [cache.clone()], torch.zeros(0, 2, dtype=torch.int64))
    with pytest.raises(ValueError, match="block shape"):
        other = torch.zeros(4, 8, 2, 64, device=device)
        copy_blocks([cache], [other], torch.tensor([[0, 1]]))


def _check_swap(src, dst):
    mapping = torch.tensor([[0, 3], [5, 1], [2, 2]])
    want = dst.clone()
    for s, d in mapping.tolist():
        want[d] = src[s].to(want.device)
    swap_blocks(src, dst, mapping)
    if dst.is_cuda or src.is_cuda:
        torch.cuda.synchronize()  # non-blocking DMA into pinned memory
    assert torch.equal(dst.cpu(), want.cpu())


def test_swap_blocks_cpu(seed):
    _check_swap(torch.randn(6, 16, 2, 64), torch.randn(4, 16, 2, 64))


@pytest.mark.gpu
@pytest.mark.parametrize("direction", ["out", "in"])
def test_swap_blocks_gpu_pinned(seed, direction):
    gpu = torch.randn(6, 16, 2, 64, device="cuda", dtype=torch.bfloat16)
    cpu = torch.randn(6, 16, 2, 64, dtype=torch.bfloat16).pin_memory()
    if direction == "out":
        _check_swap(gpu, cpu)
    else:
        _check_swap(cpu, gpu)
