"""Mamba1's selective scan (Mamba, Falcon Mamba, Jamba's mamba layers) over linear_attention.py's
varlen batch layout: per sequence i, tokens [cu_seqlens[i], cu_seqlens[i + 1]) and state row
state_slots[i] (-1: padding), from zeros when has_initial_state[i] is False. Per channel d and
state index n:

    h[d, n] = exp(dt[d] A[d, n]) h[d, n] + dt[d] x[d] B[n];   y[d] = sum_n h[d, n] C[n]

(the D skip and the gate are the caller's). Unlike Mamba2's scan (ssd.py), whose decay is one
scalar per head and token, every state entry decays at its own rate, so each step costs an exp
per entry of h.

A program per (sequence, BLOCK_D channels) holds h[BLOCK_D, N] and A's matching rows in fp32
registers and walks the sequence's tokens: fine for decode, sequential for long prefills (there
is no chunked prefill kernel). Nothing is read on the host (CUDA-graph capturable). (The module
is not named selective_scan: `import paged_kernels.X` would shadow a kernel named X.)
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from paged_kernels._utils import check, next_pow2
from paged_kernels.linear_attention import _check_batch, _check_floats

MAX_D_STATE = 256
# Entries of a program's state tile [BLOCK_D, next_pow2(N)]: with A's tile beside it, 2 * 2048
# fp32 values over SCAN_WARPS warps, 64 registers a thread.
STATE_TILE = 2048
SCAN_WARPS = 2


@triton.jit
def _selective_scan_kernel(
    x_ptr,  # [T, D]
    dt_ptr,  # [T, D] fp32 step sizes
    a_ptr,  # [D, N] fp32, negative
    b_ptr,  # [T, N]
    c_ptr,  # [T, N]
    state_ptr,  # [num_slots, D, N]
    cu_seqlens_ptr,  # [S + 1] int32
    slots_ptr,  # [S] int, -1 = padding
    has_init_ptr,  # [S] uint8 (bool)
    out_ptr,  # [T, D] fp32
    stride_xt,
    stride_dt,
    stride_ad,
    stride_bt,
    stride_ct,
    stride_ot,
    stride_sn,
    stride_sd,
    D: tl.constexpr,
    N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,  # next_pow2(N): the whole state row
):
    seq = tl.program_id(0)
    start = tl.load(cu_seqlens_ptr + seq).to(tl.int64)  # so the loop's token index is int64
    end = tl.load(cu_seqlens_ptr + seq + 1).to(tl.int64)
    slot = tl.load(slots_ptr + seq).to(tl.int64)
    if (end <= start) | (slot < 0):
        return
    has_init = tl.load(has_init_ptr + seq) != 0

    # Per-channel values are [BLOCK_D, 1] columns, in h's layout: no layout change per token.
    offs_d = (tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D))[:, None]
    d_ok = offs_d < D
    offs_n = tl.arange(0, BLOCK_N)[None, :]
    n_ok = offs_n < N
    h_ok = d_ok & n_ok
    # Masked entries: A = 0 (decay 1) and B = x = 0 keep h there at 0.
    a = tl.load(a_ptr + offs_d * stride_ad + offs_n, mask=h_ok, other=0.0)
    a = a * 1.4426950408889634  # log2(e): exp(dt A) = exp2(dt A log2(e))
    state = state_ptr + slot * stride_sn + offs_d * stride_sd + offs_n
    # A scalar condition masks a load through tl.where: `mask & scalar` fails in the interpreter.
    h = tl.load(state, mask=tl.where(has_init, h_ok, False), other=0.0).to(tl.float32)
    for tok in range(start, end):
        x = tl.load(x_ptr + tok * stride_xt + offs_d, mask=d_ok, other=0.0).to(tl.float32)
        dt = tl.load(dt_ptr + tok * stride_dt + offs_d, mask=d_ok, other=0.0)
        b = tl.load(b_ptr + tok * stride_bt + offs_n, mask=n_ok, other=0.0).to(tl.float32)
        c = tl.load(c_ptr + tok * stride_ct + offs_n, mask=n_ok, other=0.0).to(tl.float32)
        h = h * tl.exp2(dt * a) + (dt * x) * b
        y = tl.sum(h * c, 1, keep_dims=True)
        tl.store(out_ptr + tok * stride_ot + offs_d, y, mask=d_ok)
    tl.store(state, h.to(state_ptr.dtype.element_ty), mask=h_ok)


def _channel_tile(channels: int, d_state: int) -> int:
    """BLOCK_D: the channels a program holds, so that its state tile [BLOCK_D, next_pow2(N)] has
    at most STATE_TILE entries (128 channels at N = 16, 8 at N = 256)."""
    return max(1, min(next_pow2(channels), STATE_TILE // next_pow2(d_state)))


def selective_scan(
    x: torch.Tensor,  # [T, D]
    dt: torch.Tensor,  # [T, D] float32 step sizes (softplus and bias applied)
    A: torch.Tensor,  # [D, N] float32, negative
    B: torch.Tensor,  # [T, N]
    C: torch.Tensor,  # [T, N]
    ssm_state: torch.Tensor,  # [num_slots, D, N], updated in place
    cu_seqlens: torch.Tensor,  # [S + 1] int32
    state_slots: torch.Tensor,  # [S] int32 / int64, -1 = padding
    has_initial_state: torch.Tensor,  # [S] bool
) -> torch.Tensor:  # [T, D] float32
    """Mamba1's selective scan per sequence, in fp32: per token h = exp(dt A) * h + (dt x) B^T
    (h: [D, N], dt and x per channel, B per state index); y = h C (the D skip and the gate are
    the caller's). h starts at the slot's state (or zeros) and is stored back in the pool's
    dtype. Rows of padding sequences and of tokens past cu_seqlens[S] are not written; an empty
    sequence leaves its slot untouched. x, B and C may be strided views whose last dim is
    contiguous (slices of a projection's output)."""
    check(x.dim() == 2, f"x must be [T, D], got {tuple(x.shape)}")
    num_tokens, channels = x.shape
    check(
        B.dim() == 2 and B.shape[0] == num_tokens,
        f"B must be [T, N] = [{num_tokens}, N], got {tuple(B.shape)}",
    )
    check(C.shape == B.shape, f"C must be B's shape {tuple(B.shape)}, got {tuple(C.shape)}")
    d_state = B.shape[1]
    check(0 < d_state <= MAX_D_STATE, f"N must be in [1, {MAX_D_STATE}], got {d_state}")
    check(
        dt.shape == (num_tokens, channels) and dt.dtype == torch.float32,
        f"dt must be float32 [T, D] = [{num_tokens}, {channels}], got {dt.dtype} {tuple(dt.shape)}",
    )
    check(
        A.shape == (channels, d_state) and A.dtype == torch.float32,
        f"A must be float32 [D, N] = [{channels}, {d_state}], got {A.dtype} {tuple(A.shape)}",
    )
    check(
        ssm_state.dim() == 3 and ssm_state.shape[1:] == (channels, d_state),
        f"ssm_state must be [num_slots, {channels}, {d_state}], got {tuple(ssm_state.shape)}",
    )
    _check_floats({"x": x, "dt": dt, "A": A, "B": B, "C": C, "ssm_state": ssm_state})
    num_seqs = _check_batch(
        cu_seqlens, state_slots, has_initial_state, ssm_state.shape[0], x.device
    )
    out = torch.empty(num_tokens, channels, dtype=torch.float32, device=x.device)
    if num_tokens == 0 or num_seqs == 0 or channels == 0:
        return out
    block_d = _channel_tile(channels, d_state)
    grid = (num_seqs, triton.cdiv(channels, block_d))
    _selective_scan_kernel[grid](
        x,
        dt,
        A,
        B,
        C,
        ssm_state,
        cu_seqlens,
        state_slots,
        has_initial_state.view(torch.uint8),
        out,
        x.stride(0),
        dt.stride(0),
        A.stride(0),
        B.stride(0),
        C.stride(0),
        out.stride(0),
        ssm_state.stride(0),
        ssm_state.stride(1),
        D=channels,
        N=d_state,
        BLOCK_D=block_d,
        BLOCK_N=next_pow2(d_state),
        num_warps=SCAN_WARPS,
    )
    return out
