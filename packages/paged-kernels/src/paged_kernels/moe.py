"""Mixture-of-experts MLPs as two grouped GEMMs over expert-sorted slots, with no host sync.

    y_t = sum over the k choices j of w_tj * down_e (act(gate_e x_t, up_e x_t)),  e = e_tj

    act   silu       silu(g) * u                                     (Llama-style experts)
          gelu_tanh  gelu(g) * u, tanh approximation                 (Gemma 4)
          gelu       gelu(g) * u, the exact (erf) GELU                   (Grok-1)
          swigluoai  (clamp(u, -L, L) + 1) * g' * sigmoid(alpha * g'),  g' = min(g, L)  (gpt-oss)
          relu2      relu(u)^2, not gated: no gate_e, gate_up is up alone  (Nemotron-H)

Each projection may carry a per-expert bias (gpt-oss), added to the fp32 accumulator before the
activation (gate_up) or before the routing weight (down).

A token's k choices are its slots s = t * k + j (S = T * k of them). `align_moe_blocks` sorts
the slots by expert on the device and pads every expert's group to a multiple of BLOCK_M, so
each BLOCK_M block of the sorted list belongs to one expert (eN: a slot routed to expert N):

    sorted_slot_ids   | e0 e0 e0 S | e1 S S S | e3 e3 e3 e3 | e3 S S S | S ...   (S = padding)
    block_expert_ids  |     0      |    1     |      3      |    3     | -1 ...
    num_used_blocks   4

At most ceil((S + min(E, S) * (BLOCK_M - 1)) / BLOCK_M) blocks are used (every non-empty
group wastes under BLOCK_M rows), a bound set by T, k, E and BLOCK_M alone: all buffers have
static shapes and nothing is read on the host, so a CUDA graph can capture the whole MoE.

`_moe_gemm_kernel` runs one BLOCK_M block x one BLOCK_N tile of output columns per program
(programs past the used blocks exit at once): it gathers its slots' input rows, multiplies by
its expert's weight [N, K] (fp32 accumulator) and writes each row to its slot's row of the
output. Launched twice:

    gate_up   rows of x (slot // k) @ gate_up[e]^T (+ bias), act fused -> act [S, I] (x.dtype)
              (gated: a gate and an up accumulator per tile, over rows n and I + n of gate_up)
    down      rows of act (slot) @ down[e]^T (+ bias), times w_tj       -> ys  [S, H] (float32)

and y = ys.view(T, k, H).sum(1) in float32, rounded once to x's dtype: no atomics, so the
result is deterministic.

Weights are in x's dtype, or both projections in one quantized format, decoded as the GEMMs load
them: FP8 (cast, a scale per row on the finished sums); MXFP4 or int4, whose bytes [E, N, K/2]
hold two 4-bit codes (even k in the low nibble) with a per-32 group scale [E, N, K/32] (int4
also a low [E, N, K/32]): each loaded tile of bytes [BLOCK_K/2, BLOCK_N] decodes into the
weights at its even and at its odd K positions, multiplied by the even and the odd columns of a.

    MXFP4  w = E2M1(code) * 2^(scale - 127)          exact in x's dtype
    int4   w = code * scale + low, code in 0..15     in fp32, then rounded to x's dtype
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from paged_kernels._dot import round_bf16
from paged_kernels._utils import FLOAT_DTYPES, check, check_last_dim_contiguous, is_interpreter
from paged_kernels.reference import (
    SILU,
    Fp8Weight,
    Int4Weight,
    MoeActivation,
    Mxfp4Weight,
    check_moe_activation,
    check_mxfp4,
)


class MoeBlocks(NamedTuple):
    """The slots sorted by expert, padded to BLOCK_M-row single-expert blocks (device tensors)."""

    sorted_slot_ids: torch.Tensor  # [max_blocks * BLOCK_M] int32; S (= T * k) marks padding
    block_expert_ids: torch.Tensor  # [max_blocks] int32; -1 past the used blocks
    num_used_blocks: torch.Tensor  # [1] int32


class MoeTiles(NamedTuple):
    """One config for both GEMMs: BLOCK_M is shared with the alignment."""

    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int


def max_moe_blocks(num_slots: int, num_experts: int, block_m: int) -> int:
    """Blocks that can be used at most: each non-empty group pads fewer than block_m rows."""
    return -(-(num_slots + min(num_experts, num_slots) * (block_m - 1)) // block_m)


def align_moe_blocks(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> MoeBlocks:
    """topk_ids [T, k] (each in [0, E)) -> the slots grouped into single-expert blocks.

    Torch ops with shapes set by (T, k, E, block_m) only, and no host read: capturable in a
    CUDA graph. Within an expert, slots keep their ascending order (a stable sort).
    """
    num_slots = topk_ids.numel()
    device = topk_ids.device
    max_blocks = max_moe_blocks(num_slots, num_experts, block_m)
    experts_sorted, order = torch.sort(topk_ids.reshape(-1), stable=True)
    expert_range = torch.arange(num_experts, dtype=experts_sorted.dtype, device=device)
    group_start = torch.searchsorted(experts_sorted, expert_range)  # [E] into the sorted slots
    group_end = torch.searchsorted(experts_sorted, expert_range, right=True)
    blocks = (group_end - group_start + block_m - 1) // block_m  # [E] blocks of each expert
    block_end = blocks.cumsum(0)
    block_start = block_end - blocks
    # Sorted position p of expert e goes to row (p - group_start[e]) of e's first block.
    rank = torch.arange(num_slots, device=device) - group_start[experts_sorted]
    dest = block_start[experts_sorted] * block_m + rank
    sorted_slot_ids = torch.full(
        (max_blocks * block_m,), num_slots, dtype=torch.int32, device=device
    )
    sorted_slot_ids.scatter_(0, dest, order.to(torch.int32))  # distinct destinations
    block_ids = torch.arange(max_blocks, dtype=block_end.dtype, device=device)
    block_expert = torch.searchsorted(block_end, block_ids, right=True)  # E past the used ones
    block_expert = torch.where(block_expert < num_experts, block_expert, -1).to(torch.int32)
    return MoeBlocks(sorted_slot_ids, block_expert, block_end[-1:].to(torch.int32))


def choose_moe_tiles(num_slots: int, num_experts: int, dtype: torch.dtype) -> MoeTiles:
    """The tile config by dtype and slots per expert (no autotuning; not yet timed on a GPU).

    Few slots per expert (decode) make the GEMMs weight-bound: 16-row blocks (tl.dot's minimum)
    waste the least padding and long K steps stream the weights. Prefill-size groups take
    64-row blocks, so each weight tile is read once per 64 rows. fp32 multiplies in full
    precision without tensor-core tiles, so its tiles are smaller. Warps and stages are those
    whose sm_90 build spills no registers (tests/kernels/gpu_compile.py).
    """
    per_expert = num_slots / num_experts
    if dtype == torch.float32:
        if per_expert <= 16:
            return MoeTiles(16, 32, 32, 4, 2)
        return MoeTiles(32, 32, 32, 4, 2)
    if per_expert <= 16:
        return MoeTiles(16, 64, 128, 4, 3)
    if per_expert <= 48:
        return MoeTiles(32, 64, 64, 4, 3)
    return MoeTiles(64, 64, 64, 4, 3)


# MoeActivation.name -> the kernel's ACTIVATION code.
ACTIVATIONS = {"silu": 0, "swigluoai": 1, "relu2": 2, "gelu_tanh": 3, "gelu": 4}


@triton.jit
def _e2m1(code):
    # An FP4 (E2M1) code's value: bit 3 the sign, bits 2-1 the exponent (bias 1), bit 0 the
    # mantissa; exponent 0 is subnormal (0 or 0.5).
    exp = (code >> 1) & 3
    man = (code & 1).to(tl.float32)
    mag = tl.where(exp == 0, 0.5 * man, (1.0 + 0.5 * man) * tl.exp2((exp - 1).to(tl.float32)))
    return tl.where(code >= 8, -mag, mag)


@triton.jit
def _mxfp4_tiles(q_ptrs, s_ptrs, mask, dtype: tl.constexpr):
    # A tile of packed bytes [BLOCK_K / 2, BLOCK_N] -> the weights at its even and at its odd K
    # positions (low and high nibbles), each times its group's power of two, in `dtype` (exact).
    q = tl.load(q_ptrs, mask=mask, other=0).to(tl.int32)
    scale = tl.exp2((tl.load(s_ptrs, mask=mask, other=127).to(tl.int32) - 127).to(tl.float32))
    return (_e2m1(q & 15) * scale).to(dtype), (_e2m1(q >> 4) * scale).to(dtype)


@triton.jit
def _int4_tiles(
    q_ptrs,
    s_ptrs,
    l_ptrs,
    mask,
    x_dtype: tl.constexpr,
    dtype: tl.constexpr,
    ROUND_BF16: tl.constexpr,
):
    # A tile of packed bytes [BLOCK_K / 2, BLOCK_N] -> the weights at its even and at its odd K
    # positions: code * scale + low of the byte's group in fp32, rounded to x's dtype (as the
    # GPU's cast does), in `dtype`. Masked bytes read code = scale = low = 0: weight 0, not NaN.
    q = tl.load(q_ptrs, mask=mask, other=0).to(tl.int32)
    scale = tl.load(s_ptrs, mask=mask, other=0.0).to(tl.float32)
    low = tl.load(l_ptrs, mask=mask, other=0.0).to(tl.float32)
    w0 = (q & 15).to(tl.float32) * scale + low
    w1 = (q >> 4).to(tl.float32) * scale + low
    if ROUND_BF16:  # interpreter only: its fp32 -> bf16 cast below truncates
        w0, w1 = round_bf16(w0), round_bf16(w1)
    return w0.to(x_dtype).to(dtype), w1.to(x_dtype).to(dtype)


@triton.jit
def _4bit_tiles(
    q_ptrs,
    s_ptrs,
    l_ptrs,
    mask,
    x_dtype: tl.constexpr,
    dtype: tl.constexpr,
    INT4: tl.constexpr,
    ROUND_BF16: tl.constexpr,
):
    # The even- and odd-K weights of a byte tile, MXFP4 or (INT4) int4; l_ptrs read with INT4.
    if INT4:
        w0, w1 = _int4_tiles(q_ptrs, s_ptrs, l_ptrs, mask, x_dtype, dtype, ROUND_BF16)
    else:
        w0, w1 = _mxfp4_tiles(q_ptrs, s_ptrs, mask, dtype)
    return w0, w1


@triton.jit
def _moe_gemm_kernel(
    a_ptr,  # [rows, K]: slot s reads row s // a_row_div (x's token rows, or act's slot rows)
    w_ptr,  # [E, N, K], or [E, 2N, K] with GATED (gate rows, then up rows); 4-bit: [.., K / 2]
    w_scales_ptr,  # MXFP4: [E, N or 2N, K / 32] uint8; int4: likewise, float; FP8: [E, N or 2N]
    w_lows_ptr,  # int4: [E, N or 2N, K / 32] float, read only with W_INT4
    bias_ptr,  # [E, N] or [E, 2N] like w's rows, read only with HAS_BIAS
    topk_weights_ptr,  # [S] float32, read only with MUL_ROUTED_WEIGHT
    sorted_slot_ids_ptr,  # [max_blocks * BLOCK_M] int32, num_slots = padding
    block_expert_ids_ptr,  # [max_blocks] int32
    num_used_blocks_ptr,  # [1] int32
    out_ptr,  # [S, N]
    num_slots,
    N,
    K,
    a_row_div,
    stride_am,
    stride_we,
    stride_wn,
    stride_om,
    stride_be,
    stride_se,
    stride_sn,
    stride_le,
    stride_ln,
    swiglu_alpha,
    swiglu_limit,
    FUSE_ACT: tl.constexpr,
    ACTIVATION: tl.constexpr,  # ACTIVATIONS' code, with FUSE_ACT
    GATED: tl.constexpr,  # FUSE_ACT with a gated ACTIVATION: a second (up) accumulator
    HAS_BIAS: tl.constexpr,
    MUL_ROUTED_WEIGHT: tl.constexpr,
    W_MXFP4: tl.constexpr,  # w is MXFP4 bytes + scales (BLOCK_K a multiple of 32, K of 32)
    W_FP8: tl.constexpr,  # w is float8_e4m3fn with a float32 scale per row
    W_INT4: tl.constexpr,  # w is int4 bytes + scales + lows (BLOCK_K a multiple of 32, K of 32)
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    DOT_UPCAST: tl.constexpr,  # interpreter only: its tl.dot multiplies raw bf16 bits
    ROUND_OUT_BITS: tl.constexpr,  # interpreter only, bf16 out: its fp32 -> bf16 cast truncates
    ROUND_W_BITS: tl.constexpr,  # interpreter only, int4 w and bf16 a: the same, for the weights
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    if pid_m >= tl.load(num_used_blocks_ptr):
        return
    expert = tl.load(block_expert_ids_ptr + pid_m).to(tl.int64)
    slots = tl.load(sorted_slot_ids_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    m_ok = slots < num_slots
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    n_ok = offs_n < N
    rows = (slots // a_row_div).to(tl.int64)
    a_tile = a_ptr + rows[:, None] * stride_am + offs_k[None, :]
    w_tile = w_ptr + expert * stride_we + offs_n[None, :].to(tl.int64) * stride_wn + offs_k[:, None]
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    acc_up = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)  # GATED only; folded away otherwise
    if W_MXFP4 or W_INT4:
        # Byte j of a tile holds K positions 2j (low nibble) and 2j + 1 (high), both in group
        # j // 16 (BLOCK_K and K multiples of 32: a K step spans whole groups, its tail past K
        # whole masked ones): two dots of BLOCK_K / 2, over the even and the odd columns of a.
        offs_j = tl.arange(0, BLOCK_K // 2)
        a_even = a_ptr + rows[:, None] * stride_am + 2 * offs_j[None, :]
        n_off = offs_n[None, :].to(tl.int64)
        group = (offs_j // 16)[:, None]
        q_tile = w_ptr + expert * stride_we + n_off * stride_wn + offs_j[:, None]
        s_tile = w_scales_ptr + expert * stride_se + n_off * stride_sn + group
        l_tile = w_lows_ptr + expert * stride_le + n_off * stride_ln + group  # W_INT4 only
        x_dtype = a_ptr.dtype.element_ty
        dtype = tl.float32 if DOT_UPCAST else x_dtype
        for k0 in range(0, K, BLOCK_K):
            j_ok = offs_j < (K - k0) // 2
            a_mask = m_ok[:, None] & j_ok[None, :]
            a0 = tl.load(a_even + k0, mask=a_mask, other=0.0)
            a1 = tl.load(a_even + k0 + 1, mask=a_mask, other=0.0)
            w_mask = j_ok[:, None] & n_ok[None, :]
            if DOT_UPCAST:
                a0, a1 = a0.to(tl.float32), a1.to(tl.float32)
            q, s, lo = q_tile + k0 // 2, s_tile + k0 // 32, l_tile + k0 // 32
            w0, w1 = _4bit_tiles(q, s, lo, w_mask, x_dtype, dtype, W_INT4, ROUND_W_BITS)
            acc = tl.dot(a0, w0, acc, input_precision=DOT_PRECISION)
            acc = tl.dot(a1, w1, acc, input_precision=DOT_PRECISION)
            if GATED:
                q, s, lo = q + N * stride_wn, s + N * stride_sn, lo + N * stride_ln
                w0, w1 = _4bit_tiles(q, s, lo, w_mask, x_dtype, dtype, W_INT4, ROUND_W_BITS)
                acc_up = tl.dot(a0, w0, acc_up, input_precision=DOT_PRECISION)
                acc_up = tl.dot(a1, w1, acc_up, input_precision=DOT_PRECISION)
    else:
        for k0 in range(0, K, BLOCK_K):
            k_ok = offs_k < K - k0
            a = tl.load(a_tile + k0, mask=m_ok[:, None] & k_ok[None, :], other=0.0)
            b = tl.load(w_tile + k0, mask=k_ok[:, None] & n_ok[None, :], other=0.0)  # W^T: [K, N]
            b = b.to(a_ptr.dtype.element_ty)  # fp8 -> a's dtype (exact); a no-op otherwise
            if DOT_UPCAST:
                a = a.to(tl.float32)
                b = b.to(tl.float32)
            acc = tl.dot(a, b, acc, input_precision=DOT_PRECISION)
            if GATED:
                b = tl.load(
                    w_tile + N * stride_wn + k0, mask=k_ok[:, None] & n_ok[None, :], other=0.0
                )
                b = b.to(a_ptr.dtype.element_ty)
                if DOT_UPCAST:
                    b = b.to(tl.float32)
                acc_up = tl.dot(a, b, acc_up, input_precision=DOT_PRECISION)
    if W_FP8:  # each output row's scale, constant along K
        row_scale = w_scales_ptr + expert * stride_se + offs_n * stride_sn
        acc = acc * tl.load(row_scale, mask=n_ok, other=0.0)[None, :]
        if GATED:
            acc_up = acc_up * tl.load(row_scale + N * stride_sn, mask=n_ok, other=0.0)[None, :]
    if HAS_BIAS:
        bias = bias_ptr + expert * stride_be + offs_n
        acc += tl.load(bias, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        if GATED:
            acc_up += tl.load(bias + N, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    if FUSE_ACT:
        if ACTIVATION == 0:  # silu
            acc = acc * tl.sigmoid(acc) * acc_up
        elif ACTIVATION == 1:  # swigluoai
            gate = tl.minimum(acc, swiglu_limit)
            up = tl.minimum(tl.maximum(acc_up, -swiglu_limit), swiglu_limit)
            acc = (up + 1.0) * gate * tl.sigmoid(gate * swiglu_alpha)
        elif ACTIVATION == 3:  # gelu_tanh
            inner = 0.7978845608028654 * (acc + 0.044715 * acc * acc * acc)
            acc = 0.5 * acc * (2.0 - 2.0 / (tl.exp2(inner * 2.8853900817779268) + 1.0)) * acc_up
        elif ACTIVATION == 4:  # gelu (erf): 0.5 g (1 + erf(g / sqrt(2))) * u
            acc = 0.5 * acc * (1.0 + tl.math.erf(acc * 0.7071067811865476)) * acc_up
        else:  # relu2 (not gated: acc is the up projection)
            acc = tl.maximum(acc, 0.0)
            acc = acc * acc
    if MUL_ROUTED_WEIGHT:
        acc = acc * tl.load(topk_weights_ptr + slots, mask=m_ok, other=0.0)[:, None]
    if ROUND_OUT_BITS:
        acc = round_bf16(acc)  # to nearest, as the GPU's cast rounds: the cast below is exact
    out = out_ptr + slots[:, None].to(tl.int64) * stride_om + offs_n[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


# A projection's weights: dense in x's dtype, or one of the quantized formats.
MoeWeight = torch.Tensor | Mxfp4Weight | Fp8Weight | Int4Weight


def _launch(
    a: torch.Tensor,
    w: MoeWeight,
    bias: torch.Tensor | None,
    topk_weights: torch.Tensor | None,
    blocks: MoeBlocks,
    out: torch.Tensor,
    a_row_div: int,
    act: MoeActivation | None,
    tiles: MoeTiles,
) -> None:
    """out[s] = a[s // a_row_div] @ w[e]^T (+ bias[e]) for every slot s of the blocks, through
    `act` when given (see the kernel)."""
    n, k = out.shape[1], a.shape[1]
    grid = (blocks.block_expert_ids.shape[0], triton.cdiv(n, tiles.block_n))
    upcast = is_interpreter() and a.dtype != torch.float32
    mxfp4, fp8, int4 = (isinstance(w, kind) for kind in (Mxfp4Weight, Fp8Weight, Int4Weight))
    scales = lows = None
    if mxfp4 or fp8:
        w, scales = w
    elif int4:
        w, scales, lows = w
    _moe_gemm_kernel[grid](
        a,
        w,
        scales if scales is not None else w,
        lows if lows is not None else w,
        bias if bias is not None else out,
        topk_weights if topk_weights is not None else out,
        blocks.sorted_slot_ids,
        blocks.block_expert_ids,
        blocks.num_used_blocks,
        out,
        out.shape[0],
        n,
        k,
        a_row_div,
        a.stride(0),
        w.stride(0),
        w.stride(1),
        out.stride(0),
        bias.stride(0) if bias is not None else 0,
        scales.stride(0) if scales is not None else 0,
        scales.stride(1) if scales is not None else 0,
        lows.stride(0) if lows is not None else 0,
        lows.stride(1) if lows is not None else 0,
        float(act.alpha) if act is not None else 0.0,
        float(act.limit) if act is not None else 0.0,
        FUSE_ACT=act is not None,
        ACTIVATION=ACTIVATIONS[act.name] if act is not None else 0,
        GATED=act is not None and act.gated,
        HAS_BIAS=bias is not None,
        MUL_ROUTED_WEIGHT=topk_weights is not None,
        W_MXFP4=mxfp4,
        W_FP8=fp8,
        W_INT4=int4,
        BLOCK_M=tiles.block_m,
        BLOCK_N=tiles.block_n,
        BLOCK_K=tiles.block_k,
        DOT_PRECISION="ieee" if a.dtype == torch.float32 or upcast else "tf32",
        DOT_UPCAST=upcast,
        ROUND_OUT_BITS=is_interpreter() and out.dtype == torch.bfloat16,
        ROUND_W_BITS=is_interpreter() and int4 and a.dtype == torch.bfloat16,
        num_warps=1 if is_interpreter() else tiles.num_warps,
        num_stages=tiles.num_stages,
    )


def _check_int4_weight(w: Int4Weight, name: str) -> None:
    """packed uint8 [E, N, K/2], scale and low float [E, N, K/32] (so K is a multiple of 32)."""
    packed, scale, low = w
    check(
        packed.dtype == torch.uint8 and scale.dtype in FLOAT_DTYPES and low.dtype in FLOAT_DTYPES,
        f"{name}: int4 packed must be uint8 and scale / low float, got {packed.dtype} / "
        f"{scale.dtype} / {low.dtype}",
    )
    check(
        packed.dim() == 3
        and scale.shape == low.shape == (*packed.shape[:-1], packed.shape[-1] // 16)
        and packed.shape[-1] % 16 == 0,
        f"{name}: int4 packed {tuple(packed.shape)} must be [E, N, K/2] and scale "
        f"{tuple(scale.shape)} / low {tuple(low.shape)} [E, N, K/32] (K a multiple of 32)",
    )


def fused_moe(
    x: torch.Tensor,  # [T, H]
    gate_up: MoeWeight,  # [E, 2I, H]: gate rows, then up; [E, I, H] when not gated
    down: MoeWeight,  # [E, H, I]
    topk_weights: torch.Tensor,  # [T, k] float
    topk_ids: torch.Tensor,  # [T, k] int, each in [0, E)
    *,
    gate_up_bias: torch.Tensor | None = None,  # [E, 2I], or [E, I] when not gated
    down_bias: torch.Tensor | None = None,  # [E, H]
    activation: MoeActivation = SILU,
    tiles: MoeTiles | None = None,  # None: choose_moe_tiles
) -> torch.Tensor:  # [T, H] in x's dtype
    """sum_j w_tj * (down_e(act(gate_e x_t, up_e x_t)) + b_e) over each token's k experts: two
    grouped GEMMs (biases and the activation fused into the first), fp32 accumulation, the
    activation rounded to x's dtype between them. A non-gated activation (`relu2`) computes
    down_e(act(up_e x_t)), gate_up then being the up projection alone [E, I, H]. No host sync:
    capturable in a CUDA graph. Ids are not range-checked (that would read them on the host).

    Weights in x's dtype; or both projections in MXFP4 (`Mxfp4Weight`: H and I multiples of
    32), in FP8 (`Fp8Weight`: float8_e4m3fn with a float32 scale per output row) or in int4
    (`Int4Weight`: codes * scale + low per 32 inputs; H and I multiples of 32), decoded tile by
    tile into x's dtype as the GEMMs load them (MXFP4 and FP8 exactly; int4 in fp32, then
    rounded), FP8's row scales multiplying the finished sums."""
    check(x.dim() == 2, f"x must be [T, H], got {tuple(x.shape)}")
    kinds = {type(gate_up), type(down)}
    check(len(kinds) == 1, "gate_up and down: both dense, or both MXFP4, FP8 or int4")
    mxfp4, fp8 = isinstance(gate_up, Mxfp4Weight), isinstance(gate_up, Fp8Weight)
    int4 = isinstance(gate_up, Int4Weight)
    if mxfp4 or int4:
        check_4bit = check_mxfp4 if mxfp4 else _check_int4_weight
        check_4bit(gate_up, "gate_up")
        check_4bit(down, "down")
        g_shape = (*gate_up[0].shape[:-1], 2 * gate_up[0].shape[-1])  # K = 2 * bytes
        d_shape = (*down[0].shape[:-1], 2 * down[0].shape[-1])
        weights: tuple[torch.Tensor, ...] = (*gate_up, *down)
    elif fp8:
        for name, w in (("gate_up", gate_up), ("down", down)):
            check(
                w.weight.dtype == torch.float8_e4m3fn and w.scale.dtype == torch.float32,
                f"{name}: FP8 weights must be float8_e4m3fn with float32 scales",
            )
            check(w.scale.shape == w.weight.shape[:-1], f"{name}: one scale per row [E, N]")
        g_shape, d_shape = tuple(gate_up.weight.shape), tuple(down.weight.shape)
        weights = (*gate_up, *down)
    else:
        g_shape, d_shape, weights = tuple(gate_up.shape), tuple(down.shape), (gate_up, down)
    check_moe_activation(activation)
    rows, g_name = (2, "2I") if activation.gated else (1, "I")  # gate_up's rows per I
    check(
        len(g_shape) == 3 and len(d_shape) == 3,
        f"gate_up must be [E, {g_name}, H] and down [E, H, I]",
    )
    t, h = x.shape
    e, i = g_shape[0], d_shape[2]
    check(
        g_shape == (e, rows * i, h),
        f"gate_up {g_shape} != [E, {g_name}, H] = [{e}, {rows * i}, {h}] for "
        f"{activation.name!r} (down {d_shape})",
    )
    check(d_shape == (e, h, i), f"down {d_shape} != [E, H, I] = [{e}, {h}, {i}]")
    check(x.dtype in FLOAT_DTYPES, f"unsupported dtype {x.dtype}")
    if not (mxfp4 or fp8 or int4):
        check(
            gate_up.dtype == down.dtype == x.dtype,
            f"gate_up / down dtype {gate_up.dtype} / {down.dtype} != x's dtype {x.dtype}",
        )
    for name, b, shape in (
        ("gate_up_bias", gate_up_bias, (e, rows * i)),
        ("down_bias", down_bias, (e, h)),
    ):
        if b is not None:
            check(tuple(b.shape) == shape, f"{name} {tuple(b.shape)} != {list(shape)}")
            check(b.dtype in FLOAT_DTYPES, f"{name}: unsupported dtype {b.dtype}")
            check_last_dim_contiguous(name, b)
    check(
        topk_ids.dim() == 2 and topk_ids.shape[0] == t,
        f"topk_ids must be [T={t}, k], got {tuple(topk_ids.shape)}",
    )
    check(not topk_ids.is_floating_point(), f"topk_ids must be integers, got {topk_ids.dtype}")
    check(
        topk_weights.shape == topk_ids.shape,
        f"topk_weights {tuple(topk_weights.shape)} != topk_ids {tuple(topk_ids.shape)}",
    )
    k = topk_ids.shape[1]
    check(1 <= k <= e, f"top-k {k} must be between 1 and the number of experts {e}")
    tensors = (x, *weights, topk_weights, topk_ids, gate_up_bias, down_bias)
    devices = {t.device for t in tensors if t is not None}
    check(len(devices) == 1, f"tensors on several devices: {sorted(map(str, devices))}")
    for w in weights:
        check_last_dim_contiguous("gate_up / down", w)
    if x.stride(-1) != 1:
        x = x.contiguous()
    s = t * k
    if s == 0 or h == 0 or i == 0:
        return torch.zeros_like(x)
    tiles = tiles or choose_moe_tiles(s, e, x.dtype)
    sizes = (tiles.block_m, tiles.block_n, tiles.block_k)
    check(
        all(b >= 16 and b & (b - 1) == 0 for b in sizes),
        f"tiles: block sizes {sizes} must be powers of two >= 16 (tl.dot's minimum)",
    )
    check(
        not (mxfp4 or int4) or tiles.block_k >= 32,
        f"tiles: MXFP4 / int4 need block_k >= 32, got {sizes}",
    )
    blocks = align_moe_blocks(topk_ids, e, tiles.block_m)
    act = torch.empty(s, i, dtype=x.dtype, device=x.device)
    _launch(x, gate_up, gate_up_bias, None, blocks, act, k, activation, tiles)
    ys = torch.empty(s, h, dtype=torch.float32, device=x.device)  # every row written
    weights = topk_weights.reshape(-1).to(torch.float32)
    _launch(act, down, down_bias, weights, blocks, ys, 1, None, tiles)
    return ys.view(t, k, h).sum(1).to(x.dtype)
