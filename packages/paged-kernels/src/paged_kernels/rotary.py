"""Rotary embedding of the q and k heads of a fused qkv projection, in place, in one kernel.

    rope_qk_(qkv, positions, cos, sin, num_q_heads, num_kv_heads, head_dim)

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
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from paged_kernels._utils import FLOAT_DTYPES, INTERPRETED, check, next_pow2

MAX_ROPE_HEAD_DIM = 256  # the largest head a program rotates (and normalises)


@triton.jit
def _rope_qk_kernel(
    qkv_ptr,  # [T, *] rows; heads [0, NUM_HEADS) rotated in place
    pos_ptr,  # [T] int
    cos_ptr,  # [P, R/2] fp32
    sin_ptr,  # [P, R/2] fp32
    qw_ptr,  # [D] q heads' norm weight, read only if NORM
    kw_ptr,  # [D] k heads' norm weight, read only if NORM
    stride_t,
    stride_cs,
    num_heads,  # q + k heads
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
):
    t = tl.program_id(0).to(tl.int64)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM
    mask = (heads < num_heads)[:, None] & d_ok[None, :]
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
    tl.store(row + d[None, :], out.to(dtype), mask=mask)


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
) -> torch.Tensor:
    """Rotate (after normalising, with weights) the q and k heads of `qkv` in place; returns
    qkv. Positions index the cos/sin tables (R = 2 * cos.shape[1] rotary dims, R <= head_dim);
    the caller keeps them inside the tables. The norms round as `rms_norm` with the same
    `weight_offset` and `round_before_weight` does (False: Gemma's q/k norms)."""
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
    if qkv.shape[0] == 0:
        return qkv
    block_d = next_pow2(head_dim)
    # A few heads a program on a GPU; the interpreter runs programs one by one: one a token.
    block_h = next_pow2(num_heads)
    if not INTERPRETED:
        block_h = min(block_h, max(1, 2048 // block_d))
    _rope_qk_kernel[(qkv.shape[0], triton.cdiv(num_heads, block_h))](
        qkv,
        positions,
        cos,
        sin,
        weights[0] if norm else cos,  # unread without NORM
        weights[1] if norm else cos,
        qkv.stride(0),
        cos.stride(0),
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
        num_warps=1 if INTERPRETED else 4,
        enable_fp_fusion=False,  # torch rounds each product: no fused multiply-add
    )
    return qkv
