"""Paged KV-cache maintenance: scatter new K/V by slot, copy blocks (CoW), swap blocks.

Cache layout (one tensor per layer for K and one for V):
    [num_blocks, block_size, num_kv_heads, head_dim], slot = block_id * block_size + offset.
Slot -1 marks a padding token: nothing is written for it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from paged_kernels._utils import FLOAT_DTYPES, check, check_last_dim_contiguous, next_pow2

TORCH_TO_TL = {torch.float16: tl.float16, torch.bfloat16: tl.bfloat16, torch.float32: tl.float32}


@triton.jit
def _write_kv_cache_kernel(
    key_ptr,  # [num_tokens, num_kv_heads, head_dim]
    value_ptr,  # [num_tokens, num_kv_heads, head_dim]
    key_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    slot_mapping_ptr,  # [num_tokens] int, -1 = padding
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_cb,  # cache strides (K and V caches share them)
    stride_cs,
    stride_ch,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEADS_P2: tl.constexpr,
    HEAD_DIM_P2: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
):
    # One program per token: all of its kv heads at once.
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    heads = tl.arange(0, HEADS_P2)[:, None]
    dims = tl.arange(0, HEAD_DIM_P2)[None, :]
    # slot broadcast to a tensor first: the interpreter rejects masks built from a scalar bool.
    mask = (heads < NUM_KV_HEADS) & (dims < HEAD_DIM) & (heads * 0 + slot >= 0)
    block = slot // BLOCK_SIZE
    cache_off = block * stride_cb + (slot % BLOCK_SIZE) * stride_cs + heads * stride_ch + dims
    k = tl.load(key_ptr + token * stride_kt + heads * stride_kh + dims, mask=mask)
    v = tl.load(value_ptr + token * stride_vt + heads * stride_vh + dims, mask=mask)
    tl.store(key_cache_ptr + cache_off, k.to(key_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(value_cache_ptr + cache_off, v.to(value_cache_ptr.dtype.element_ty), mask=mask)


def write_kv_cache(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    slot_mapping: torch.Tensor,  # [num_tokens] int32/int64, -1 = padding (skipped)
) -> None:
    """Scatter each token's K/V into its cache slot; slots of -1 are left untouched."""
    check(key.dim() == 3 and key.shape == value.shape, "key/value must be equal [T, H_kv, D]")
    check(key_cache.dim() == 4, "key_cache must be [num_blocks, block_size, num_kv_heads, D]")
    check(key_cache.shape == value_cache.shape, "key_cache and value_cache shapes differ")
    check(key_cache.stride() == value_cache.stride(), "key_cache and value_cache strides differ")
    num_tokens, num_kv_heads, head_dim = key.shape
    check(
        key_cache.shape[2:] == (num_kv_heads, head_dim),
        f"cache heads/head_dim {tuple(key_cache.shape[2:])} != key's {(num_kv_heads, head_dim)}",
    )
    check(slot_mapping.shape == (num_tokens,), "slot_mapping must be [num_tokens]")
    check(slot_mapping.dtype in (torch.int32, torch.int64), "slot_mapping must be int32/int64")
    check(key.dtype in FLOAT_DTYPES and key_cache.dtype in FLOAT_DTYPES, "unsupported dtype")
    devices = {t.device for t in (key, value, key_cache, value_cache, slot_mapping)}
    check(len(devices) == 1, f"all tensors must be on one device, got {devices}")
    for name, t in (("key", key), ("value", value), ("key_cache", key_cache)):
        check_last_dim_contiguous(name, t)
    check(value.stride(-1) == 1 and value_cache.stride(-1) == 1, "value tensors need stride 1")
    if num_tokens == 0:
        return
    _write_kv_cache_kernel[(num_tokens,)](
        key,
        value,
        key_cache,
        value_cache,
        slot_mapping,
        key.stride(0),
        key.stride(1),
        value.stride(0),
        value.stride(1),
        key_cache.stride(0),
        key_cache.stride(1),
        key_cache.stride(2),
        NUM_KV_HEADS=num_kv_heads,
        HEAD_DIM=head_dim,
        HEADS_P2=next_pow2(num_kv_heads),
        HEAD_DIM_P2=next_pow2(head_dim),
        BLOCK_SIZE=key_cache.shape[1],
    )


@triton.jit
def _copy_blocks_kernel(
    cache_ptrs_ptr,  # [num_caches] int64 base addresses (every layer's K cache, then V)
    block_mapping_ptr,  # [num_pairs, 2] int64 (src, dst)
    BLOCK_NUMEL: tl.constexpr,  # elements in one cache block
    CHUNK: tl.constexpr,
    DTYPE: tl.constexpr,
):
    # grid: (num_pairs, num_caches, cdiv(BLOCK_NUMEL, CHUNK)); each program copies one chunk.
    pair = tl.program_id(0)
    cache = tl.program_id(1)
    chunk = tl.program_id(2)
    base = tl.load(cache_ptrs_ptr + cache).to(tl.pointer_type(DTYPE))
    src = tl.load(block_mapping_ptr + 2 * pair).to(tl.int64)
    dst = tl.load(block_mapping_ptr + 2 * pair + 1).to(tl.int64)
    offs = chunk * CHUNK + tl.arange(0, CHUNK)
    mask = offs < BLOCK_NUMEL
    x = tl.load(base + src * BLOCK_NUMEL + offs, mask=mask)
    tl.store(base + dst * BLOCK_NUMEL + offs, x, mask=mask)


def copy_blocks(
    key_caches: list[torch.Tensor],  # per layer [num_blocks, block_size, num_kv_heads, head_dim]
    value_caches: list[torch.Tensor],  # per layer, same shape
    block_mapping: torch.Tensor,  # [num_pairs, 2] int, (src, dst) rows
) -> None:
    """Copy block src -> dst in every layer's K and V cache, all layers in one launch.

    Every cache must be contiguous with the same dtype, device and block shape. A dst must not
    also be a src in the same call (copies run concurrently).
    """
    caches = [*key_caches, *value_caches]
    check(len(key_caches) == len(value_caches), "need one value cache per key cache")
    check(block_mapping.dim() == 2 and block_mapping.shape[1] == 2, "block_mapping: [P, 2]")
    if not caches or block_mapping.shape[0] == 0:
        return
    first = caches[0]
    for c in caches:
        check(c.dim() == 4 and c.is_contiguous(), "caches must be contiguous 4-d tensors")
        check(c.shape[1:] == first.shape[1:], "all caches must share the block shape")
        check(c.dtype == first.dtype and c.device == first.device, "dtype/device mismatch")
    check(first.dtype in FLOAT_DTYPES, f"unsupported cache dtype {first.dtype}")
    device = first.device
    mapping = block_mapping.to(device=device, dtype=torch.int64).contiguous()
    ptrs = torch.tensor([c.data_ptr() for c in caches], dtype=torch.int64, device=device)
    block_numel = first[0].numel()
    chunk = min(4096, next_pow2(block_numel))
    grid = (mapping.shape[0], len(caches), triton.cdiv(block_numel, chunk))
    _copy_blocks_kernel[grid](
        ptrs, mapping, BLOCK_NUMEL=block_numel, CHUNK=chunk, DTYPE=TORCH_TO_TL[first.dtype]
    )


def swap_blocks(
    src_cache: torch.Tensor,  # [num_src_blocks, ...] e.g. a GPU cache
    dst_cache: torch.Tensor,  # [num_dst_blocks, ...] e.g. a pinned CPU cache (or the reverse)
    block_mapping: torch.Tensor,  # [num_pairs, 2] int (src, dst); best kept on the CPU
) -> None:
    """Copy blocks between devices (a DMA per pair, non-blocking when pinned memory allows)."""
    check(src_cache.shape[1:] == dst_cache.shape[1:], "src/dst caches differ in block shape")
    check(src_cache.dtype == dst_cache.dtype, "src/dst caches differ in dtype")
    check(block_mapping.dim() == 2 and block_mapping.shape[1] == 2, "block_mapping: [P, 2]")
    non_blocking = src_cache.device.type != dst_cache.device.type
    for src, dst in block_mapping.tolist():
        dst_cache[dst].copy_(src_cache[src], non_blocking=non_blocking)
