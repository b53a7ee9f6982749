"""Paged KV-cache maintenance: scatter new K/V by slot, copy blocks (CoW), swap blocks.

Cache layout (one tensor per layer for K and one for V):
    [num_blocks, block_size, num_kv_heads, head_dim], slot = block_id * block_size + offset.
Slot -1 marks a padding token: nothing is written for it.

An fp8 cache stores x / scale with one scale per cache tensor: the write kernel rounds to the
nearest even fp8 value in integer arithmetic (`_fp8_bits`, bit-exact with torch's cast on every
device, Triton's interpreter included) and saturates at the format's largest finite value.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from paged_kernels._utils import (
    FLOAT_DTYPES,
    FP8_FORMATS,
    KV_CACHE_DTYPES,
    check,
    check_kv_scales,
    check_last_dim_contiguous,
    next_pow2,
)

TORCH_TO_TL = {torch.float16: tl.float16, torch.bfloat16: tl.bfloat16, torch.float32: tl.float32}
# Block copies move bytes: an fp8 cache is copied as uint8.
TORCH_TO_TL.update({dtype: tl.uint8 for dtype in FP8_FORMATS})


@triton.jit
def _fp8_bits(x, MAN: tl.constexpr, BIAS: tl.constexpr, FMAX: tl.constexpr):
    """fp32 x -> the uint8 bits of the nearest fp8 value (ties to even), saturated at +-FMAX.

    Format: 1 sign, E exponent (bias BIAS), MAN mantissa bits. Normal results round the fp32
    mantissa to MAN bits (a carry moves into the exponent, as it should); results below the
    smallest normal 2^(1 - BIAS) count steps of 2^(1 - BIAS - MAN) from the implicit-one
    mantissa shifted right. Integer-only, so every device rounds alike."""
    x = tl.minimum(tl.maximum(x, -FMAX), FMAX)
    bits = x.to(tl.int32, bitcast=True)
    sign = (bits >> 24) & 0x80
    mag = bits & 0x7FFFFFFF
    SHIFT: tl.constexpr = 23 - MAN
    half: tl.constexpr = (1 << (SHIFT - 1)) - 1
    normal = ((mag + half + ((mag >> SHIFT) & 1)) >> SHIFT) - ((127 - BIAS) << MAN)
    man = (mag & 0x7FFFFF) | 0x800000
    sub_shift = tl.minimum(SHIFT + (128 - BIAS) - (mag >> 23), 31)
    sub = (man + ((1 << (sub_shift - 1)) - 1) + ((man >> sub_shift) & 1)) >> sub_shift
    out = tl.where(mag < ((128 - BIAS) << 23), sub, normal)
    return (out | sign).to(tl.uint8)


@triton.jit
def _write_kv_cache_kernel(
    key_ptr,  # [num_tokens, num_kv_heads, head_dim]
    value_ptr,  # [num_tokens, num_kv_heads, head_dim]
    key_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    slot_mapping_ptr,  # [num_tokens] int, -1 = padding
    k_inv_scale,  # fp8 only: stored = key * k_inv_scale
    v_inv_scale,
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
    FP8: tl.constexpr,  # caches are uint8 views of fp8 storage
    FP8_MAN: tl.constexpr,
    FP8_BIAS: tl.constexpr,
    FP8_MAX: tl.constexpr,
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
    if FP8:
        k = _fp8_bits(k.to(tl.float32) * k_inv_scale, FP8_MAN, FP8_BIAS, FP8_MAX)
        v = _fp8_bits(v.to(tl.float32) * v_inv_scale, FP8_MAN, FP8_BIAS, FP8_MAX)
    tl.store(key_cache_ptr + cache_off, k.to(key_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(value_cache_ptr + cache_off, v.to(value_cache_ptr.dtype.element_ty), mask=mask)


def check_kv_write(
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    num_tokens: int,
    num_kv_heads: int,
    head_dim: int,
) -> None:
    """The caches and slots a write of `num_tokens` tokens' K/V heads goes to (write_kv_cache,
    rope_qk_'s fused write): shapes, strides and dtypes."""
    check(key_cache.dim() == 4, "key_cache must be [num_blocks, block_size, num_kv_heads, D]")
    check(key_cache.shape == value_cache.shape, "key_cache and value_cache shapes differ")
    check(key_cache.stride() == value_cache.stride(), "key_cache and value_cache strides differ")
    if key_cache.shape[2:] != (num_kv_heads, head_dim):
        raise ValueError(
            f"cache heads/head_dim {tuple(key_cache.shape[2:])} != key's {(num_kv_heads, head_dim)}"
        )
    check(slot_mapping.shape == (num_tokens,), "slot_mapping must be [num_tokens]")
    check(slot_mapping.dtype in (torch.int32, torch.int64), "slot_mapping must be int32/int64")
    check(key_cache.dtype in KV_CACHE_DTYPES, "unsupported dtype")
    check(key_cache.dtype == value_cache.dtype, "key_cache and value_cache dtypes differ")
    check_last_dim_contiguous("key_cache", key_cache)
    check(value_cache.stride(-1) == 1, "value tensors need stride 1")


def write_kv_cache(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    slot_mapping: torch.Tensor,  # [num_tokens] int32/int64, -1 = padding (skipped)
    *,
    k_scale: float = 1.0,  # fp8 caches: stored = key / k_scale
    v_scale: float = 1.0,
) -> None:
    """Scatter each token's K/V into its cache slot; slots of -1 are left untouched. An fp8
    cache gets the values quantized (see the module docstring)."""
    check(key.dim() == 3 and key.shape == value.shape, "key/value must be equal [T, H_kv, D]")
    num_tokens, num_kv_heads, head_dim = key.shape
    check_kv_write(key_cache, value_cache, slot_mapping, num_tokens, num_kv_heads, head_dim)
    check(key.dtype in FLOAT_DTYPES, "unsupported dtype")
    check_kv_scales(key_cache.dtype, k_scale, v_scale)
    devices = {t.device for t in (key, value, key_cache, value_cache, slot_mapping)}
    if len(devices) != 1:
        raise ValueError(f"all tensors must be on one device, got {devices}")
    for name, t in (("key", key), ("value", value)):
        check_last_dim_contiguous(name, t)
    if num_tokens == 0:
        return
    fp8 = FP8_FORMATS.get(key_cache.dtype)
    if fp8 is not None:  # stored as bits: the kernel rounds itself
        key_cache, value_cache = key_cache.view(torch.uint8), value_cache.view(torch.uint8)
    man, bias, fmax = fp8 or (0, 0, 0.0)
    _write_kv_cache_kernel[(num_tokens,)](
        key,
        value,
        key_cache,
        value_cache,
        slot_mapping,
        1.0 / k_scale,
        1.0 / v_scale,
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
        FP8=fp8 is not None,
        FP8_MAN=man,
        FP8_BIAS=bias,
        FP8_MAX=fmax,
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
    value_caches: list[torch.Tensor],  # per layer, same shape; [] where K and V share a tensor
    block_mapping: torch.Tensor,  # [num_pairs, 2] int, (src, dst) rows
) -> None:
    """Copy block src -> dst in every layer's K and V cache, all layers in one launch.

    Every cache must be contiguous with the same dtype, device and block shape. A dst must not
    also be a src in the same call (copies run concurrently).
    """
    caches = [*key_caches, *value_caches]
    check(
        len(value_caches) in (0, len(key_caches)),
        "need one value cache per key cache (or none: keys and values in one tensor)",
    )
    check(block_mapping.dim() == 2 and block_mapping.shape[1] == 2, "block_mapping: [P, 2]")
    if not caches or block_mapping.shape[0] == 0:
        return
    first = caches[0]
    for c in caches:
        check(c.dim() == 4 and c.is_contiguous(), "caches must be contiguous 4-d tensors")
        check(c.shape[1:] == first.shape[1:], "all caches must share the block shape")
        check(c.dtype == first.dtype and c.device == first.device, "dtype/device mismatch")
    check(first.dtype in KV_CACHE_DTYPES, f"unsupported cache dtype {first.dtype}")
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
