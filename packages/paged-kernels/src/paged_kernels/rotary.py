"""Rotary embedding of the q and k heads of a fused qkv projection, in place, in one kernel.

    rope_qk_(qkv, positions, cos, sin, num_q_heads, num_kv_heads, head_dim)
    rope_qk_(..., key_cache=kc, value_cache=vc, slot_mapping=slots)   # + the paged KV write

qkv [T, (Hq + 2 Hkv) * D] holds each token's q heads, then its k heads, then its v heads (the
layout of a QKV projection). The first Hq + Hkv heads are rotated where they lie; v is left
alone. Optionally each of those heads is first RMS-normalised with its own weight row (Qwen3's
q_norm / k_norm; Gemma 3's with their 1 + w and one rounding), with the roundings of
paged_engine's RMSNorm. The torch version of the same
work is a dozen kernels a layer (upcast, gather, products, sums, concatenations, downcast).

The rotation is the float32 one of paged_engine's RotaryEmbedding: for a pair (x1, x2) at
frequency i, o1 = x1 cos_i - x2 sin_i, o2 = x2 cos_i + x1 sin_i, each product rounded on its
own (no fused multiply-add, so the bits are torch's), one rounding to qkv's dtype at the end.
NeoX style pairs element i with i + R/2 (R = rotary dims); GPT-J style pairs 2i with 2i + 1.
Elements past R (partial rotary) pass through (normalised, when the heads are).

Given a layer's paged caches and the step's slots, the same launch also stores each token's
rotated k heads and its v heads in its slot: what write_kv_cache would store from qkv after
the rotation, bit for bit (fp8 caches quantized alike), one kernel a layer fewer.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from paged_kernels._utils import (
    FLOAT_DTYPES,
    FP8_FORMATS,
    INTERPRETED,
    check,
    check_kv_scales,
    next_pow2,
)
from paged_kernels.kv_cache import _fp8_bits, check_kv_write

MAX_ROPE_HEAD_DIM = 256  # the largest head a program rotates (and normalises)


@triton.jit
def _rope_qk_kernel(
    qkv_ptr,  # [T, *] rows; heads [0, NUM_HEADS) rotated in place
    pos_ptr,  # [T] int
    cos_ptr,  # [P, R/2] fp32
    sin_ptr,  # [P, R/2] fp32
    qw_ptr,  # [D] q heads' norm weight, read only if NORM
    kw_ptr,  # [D] k heads' norm weight, read only if NORM
    key_cache_ptr,  # [blocks, block_size, Hkv, D], written only if WRITE_KV (as value_cache)
    value_cache_ptr,
    slot_ptr,  # [T] int, -1: padding (nothing written); read only if WRITE_KV
    k_inv_scale,  # fp8 caches: stored = x * inv_scale
    v_inv_scale,
    stride_t,
    stride_cs,
    stride_kb,  # the caches' block, slot and head strides
    stride_ks,
    stride_kh,
    num_heads,  # q + k heads (rotated)
    num_q_heads,
    eps,
    weight_offset,  # added to both norm weights (Gemma's 1 + w)
    HEAD_DIM: tl.constexpr,
    ROT_HALF: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_H: tl.constexpr,
    NEOX: tl.constexpr,
    NORM: tl.constexpr,
    ROUND_BEFORE_WEIGHT: tl.constexpr,
    WRITE_KV: tl.constexpr,  # programs also cover the v heads: heads [0, num_heads + Hkv)
    CACHE_BLOCK: tl.constexpr,
    FP8: tl.constexpr,  # caches are uint8 views of fp8 storage
    FP8_MAN: tl.constexpr,
    FP8_BIAS: tl.constexpr,
    FP8_MAX: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM
    num_kv_heads = num_heads - num_q_heads
    rotated = (heads < num_heads)[:, None]
    in_row = heads < num_heads + num_kv_heads if WRITE_KV else heads < num_heads
    mask = in_row[:, None] & d_ok[None, :]
    rot = d < 2 * ROT_HALF
    if NEOX:
        first = d < ROT_HALF
        partner = tl.where(first, d + ROT_HALF, d - ROT_HALF)
        freq = tl.where(first, d, d - ROT_HALF)
    else:
        first = (d % 2) == 0
        partner = d ^ 1
        freq = d // 2
    partner = tl.where(rot, partner, d)
    freq = tl.where(rot, freq, 0)
    row = qkv_ptr + t * stride_t + heads[:, None] * HEAD_DIM
    x = tl.load(row + d[None, :], mask=mask, other=0.0)
    dtype = x.dtype
    x = x.to(tl.float32)
    raw = x
    xp = tl.load(row + partner[None, :], mask=mask, other=0.0).to(tl.float32)
    if NORM:
        rstd = tl.rsqrt(tl.sum(x * x, 1) / HEAD_DIM + eps)[:, None]
        is_q = (heads < num_q_heads)[:, None]
        w = tl.where(
            is_q,
            tl.load(qw_ptr + d, mask=d_ok, other=0.0).to(tl.float32)[None, :],
            tl.load(kw_ptr + d, mask=d_ok, other=0.0).to(tl.float32)[None, :],
        )
        wp = tl.where(
            is_q,
            tl.load(qw_ptr + partner, mask=d_ok, other=0.0).to(tl.float32)[None, :],
            tl.load(kw_ptr + partner, mask=d_ok, other=0.0).to(tl.float32)[None, :],
        )
        w, wp = w + weight_offset, wp + weight_offset
        y, yp = x * rstd, xp * rstd
        if ROUND_BEFORE_WEIGHT:  # as RMSNorm in 16 bits: round the normalised row, then scale
            y, yp = y.to(dtype).to(tl.float32), yp.to(dtype).to(tl.float32)
            w, wp = w.to(dtype).to(tl.float32), wp.to(dtype).to(tl.float32)
        x = (y * w).to(dtype).to(tl.float32)  # (Gemma's: the fp32 product, rounded once)
        xp = (yp * wp).to(dtype).to(tl.float32)
    pos = tl.load(pos_ptr + t).to(tl.int64)
    c = tl.load(cos_ptr + pos * stride_cs + freq, mask=rot & d_ok, other=1.0)
    s = tl.load(sin_ptr + pos * stride_cs + freq, mask=rot & d_ok, other=0.0)
    a = x * c[None, :]
    b = xp * s[None, :]
    out = tl.where(rot[None, :], tl.where(first[None, :], a - b, a + b), x)
    out = tl.where(rotated, out, raw).to(dtype)  # v heads as they are
    tl.store(row + d[None, :], out, mask=mask & rotated)
    if WRITE_KV:
        slot = tl.load(slot_ptr + t).to(tl.int64)
        kv = heads - num_q_heads  # k heads 0..Hkv-1, then v heads Hkv..2Hkv-1
        is_k = ((kv >= 0) & (kv < num_kv_heads))[:, None]
        is_v = (kv >= num_kv_heads)[:, None]
        kv = tl.where(kv >= num_kv_heads, kv - num_kv_heads, tl.maximum(kv, 0))
        # slot broadcast first: the interpreter rejects masks built from a scalar bool
        live = mask & (heads[:, None] * 0 + slot >= 0)
        off = (slot // CACHE_BLOCK) * stride_kb + (slot % CACHE_BLOCK) * stride_ks
        off += kv[:, None] * stride_kh + d[None, :]
        k_val = out
        v_val = out
        if FP8:
            k_val = _fp8_bits(out.to(tl.float32) * k_inv_scale, FP8_MAN, FP8_BIAS, FP8_MAX)
            v_val = _fp8_bits(out.to(tl.float32) * v_inv_scale, FP8_MAN, FP8_BIAS, FP8_MAX)
        elt = key_cache_ptr.dtype.element_ty
        tl.store(key_cache_ptr + off, k_val.to(elt), mask=live & is_k)
        tl.store(value_cache_ptr + off, v_val.to(elt), mask=live & is_v)


def rope_qk_(
    qkv: torch.Tensor,  # [T, W], W >= (num_q_heads + 2 * num_kv_heads) * head_dim
    positions: torch.Tensor,  # [T] int
    cos: torch.Tensor,  # [P, R/2] fp32
    sin: torch.Tensor,  # [P, R/2] fp32
    num_q_heads: int,
    num_kv_heads: int,
    head_dim: int,
    *,
    is_neox_style: bool = True,
    q_weight: torch.Tensor | None = None,  # [head_dim]: RMS-normalise q heads first
    k_weight: torch.Tensor | None = None,  # [head_dim]: and k heads, with eps
    eps: float = 1e-6,
    weight_offset: float = 0.0,
    round_before_weight: bool | None = None,
    key_cache: torch.Tensor | None = None,  # [blocks, block_size, Hkv, D]: write K/V there
    value_cache: torch.Tensor | None = None,
    slot_mapping: torch.Tensor | None = None,  # [T] int, -1: padding (nothing written)
    k_scale: float = 1.0,  # fp8 caches: stored = x / scale
    v_scale: float = 1.0,
) -> torch.Tensor:
    """Rotate (after normalising, with weights) the q and k heads of `qkv` in place; returns
    qkv. Positions index the cos/sin tables (R = 2 * cos.shape[1] rotary dims, R <= head_dim);
    the caller keeps them inside the tables. The norms round as `rms_norm` with the same
    `weight_offset` and `round_before_weight` does (False: Gemma's q/k norms). With the caches
    and slots, each token's rotated k heads and its v heads also go to its slot, as
    `write_kv_cache(k, v, key_cache, value_cache, slot_mapping, ...)` after it would."""
    if qkv.dtype not in FLOAT_DTYPES:
        raise ValueError(f"unsupported qkv dtype {qkv.dtype}")
    check(qkv.dim() == 2 and qkv.stride(1) == 1, "qkv must be [T, W] with contiguous rows")
    if not (0 < head_dim <= MAX_ROPE_HEAD_DIM):
        raise ValueError(f"head_dim {head_dim} not in 1..{MAX_ROPE_HEAD_DIM}")
    num_heads = num_q_heads + num_kv_heads
    check(num_q_heads > 0 and num_kv_heads > 0, "num_q_heads and num_kv_heads must be positive")
    if qkv.shape[1] < (num_heads + num_kv_heads) * head_dim:
        raise ValueError(
            f"qkv rows of {qkv.shape[1]} cannot hold {num_q_heads} + 2 x {num_kv_heads} heads "
            f"of {head_dim}"
        )
    check(positions.shape == (qkv.shape[0],), "positions must be [T]")
    check(not positions.dtype.is_floating_point, "positions must be integers")
    check(cos.dtype == torch.float32 and sin.dtype == torch.float32, "cos / sin must be fp32")
    check(cos.dim() == 2 and cos.shape == sin.shape, "cos and sin must be [P, R/2] alike")
    check(cos.stride(1) == 1 and sin.stride() == cos.stride(), "cos / sin rows must be dense")
    rot_half = cos.shape[1]
    if not (0 < 2 * rot_half <= head_dim):
        raise ValueError(f"{2 * rot_half} rotary dims for head_dim {head_dim}")
    norm = q_weight is not None or k_weight is not None
    weights = []
    if norm:
        check(q_weight is not None and k_weight is not None, "pass both q_weight and k_weight")
        for name, w in (("q_weight", q_weight), ("k_weight", k_weight)):
            assert w is not None
            if w.shape != (head_dim,):
                raise ValueError(f"{name} must be [{head_dim}]")
            if w.device != qkv.device:
                raise ValueError(f"{name} on {w.device}, qkv on {qkv.device}")
            weights.append(w.contiguous())
    for name, t in (("positions", positions), ("cos", cos), ("sin", sin)):
        if t.device != qkv.device:
            raise ValueError(f"{name} on {t.device}, qkv on {qkv.device}")
    write = key_cache is not None or value_cache is not None or slot_mapping is not None
    if write:
        check(
            key_cache is not None and value_cache is not None and slot_mapping is not None,
            "a KV write needs key_cache, value_cache and slot_mapping",
        )
        assert key_cache is not None and value_cache is not None and slot_mapping is not None
        check_kv_write(key_cache, value_cache, slot_mapping, qkv.shape[0], num_kv_heads, head_dim)
        check_kv_scales(key_cache.dtype, k_scale, v_scale)
        for name, t in (("key_cache", key_cache), ("value_cache", value_cache)):
            if t.device != qkv.device:
                raise ValueError(f"{name} on {t.device}, qkv on {qkv.device}")
        if slot_mapping.device != qkv.device:
            raise ValueError(f"slot_mapping on {slot_mapping.device}, qkv on {qkv.device}")
    if qkv.shape[0] == 0:
        return qkv
    fp8 = FP8_FORMATS.get(key_cache.dtype) if key_cache is not None else None
    if fp8 is not None:  # stored as bits: the kernel rounds itself
        assert value_cache is not None
        key_cache, value_cache = key_cache.view(torch.uint8), value_cache.view(torch.uint8)
    man, bias, fmax = fp8 or (0, 0, 0.0)
    covered = num_heads + (num_kv_heads if write else 0)
    block_d = next_pow2(head_dim)
    # A few heads a program on a GPU; the interpreter runs programs one by one: one a token.
    block_h = next_pow2(covered)
    if not INTERPRETED:
        block_h = min(block_h, max(1, 2048 // block_d))
    cache = key_cache if key_cache is not None else qkv  # (unread without a write)
    _rope_qk_kernel[(qkv.shape[0], triton.cdiv(covered, block_h))](
        qkv,
        positions,
        cos,
        sin,
        weights[0] if norm else cos,  # unread without NORM
        weights[1] if norm else cos,
        cache,
        value_cache if value_cache is not None else qkv,
        slot_mapping if slot_mapping is not None else positions,
        1.0 / k_scale,
        1.0 / v_scale,
        qkv.stride(0),
        cos.stride(0),
        cache.stride(0) if write else 0,
        cache.stride(1) if write else 0,
        cache.stride(2) if write else 0,
        num_heads,
        num_q_heads,
        float(eps),
        float(weight_offset),
        HEAD_DIM=head_dim,
        ROT_HALF=rot_half,
        BLOCK_D=block_d,
        BLOCK_H=block_h,
        NEOX=is_neox_style,
        NORM=norm,
        ROUND_BEFORE_WEIGHT=qkv.dtype != torch.float32 and round_before_weight is not False,
        WRITE_KV=write,
        CACHE_BLOCK=cache.shape[1] if write else 1,
        FP8=fp8 is not None,
        FP8_MAN=man,
        FP8_BIAS=bias,
        FP8_MAX=fmax,
        num_warps=1 if INTERPRETED else 4,
        enable_fp_fusion=False,  # torch rounds each product: no fused multiply-add
    )
    return qkv
