"""Mamba2's selective scan (SSD, recurrent form) over linear_attention.py's varlen batch layout:
per sequence i, tokens [cu_seqlens[i], cu_seqlens[i + 1]) and state row state_slots[i] (-1:
padding), from zeros when has_initial_state[i] is False. Per head h (group h // (H // G)):

    S = exp(dt A) S + dt x (x) B;   y = S . C          (S: [P, N]; the D skip is the caller's)

A program per (sequence, head, BLOCK_P rows of the head dim) holds S[BLOCK_P, N] in fp32
registers and walks the sequence's tokens: fine for decode, sequential for long prefills (there
is no chunked prefill kernel yet). Nothing is read on the host (CUDA-graph capturable).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from paged_kernels._utils import check, next_pow2
from paged_kernels.linear_attention import _check_batch, _check_floats, _state_tile


@triton.jit
def _ssd_scan_kernel(
    x_ptr,  # [T, H, P]
    dt_ptr,  # [T, H] fp32 step sizes
    a_ptr,  # [H] fp32, negative
    b_ptr,  # [T, G, N]
    c_ptr,  # [T, G, N]
    state_ptr,  # [num_slots, H, P, N]
    cu_seqlens_ptr,  # [S + 1] int32
    slots_ptr,  # [S] int, -1 = padding
    has_init_ptr,  # [S] uint8 (bool)
    out_ptr,  # [T, H, P] fp32
    stride_xt,
    stride_xh,
    stride_dt,
    stride_bt,
    stride_bg,
    stride_ct,
    stride_cg,
    stride_ot,
    stride_oh,
    stride_sn,
    stride_sh,
    stride_sp,
    GROUP: tl.constexpr,  # heads a B / C group serves
    P: tl.constexpr,
    N: tl.constexpr,
    BLOCK_P: tl.constexpr,
    BLOCK_N: tl.constexpr,  # next_pow2(N): the whole state row
):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    start = tl.load(cu_seqlens_ptr + seq).to(tl.int64)  # so the loop's token index is int64
    end = tl.load(cu_seqlens_ptr + seq + 1).to(tl.int64)
    slot = tl.load(slots_ptr + seq).to(tl.int64)
    if (end <= start) | (slot < 0):
        return
    has_init = tl.load(has_init_ptr + seq) != 0
    group = head // GROUP
    a = tl.load(a_ptr + head)

    offs_p = tl.program_id(2) * BLOCK_P + tl.arange(0, BLOCK_P)
    p_ok = offs_p < P
    offs_n = tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    state = state_ptr + slot * stride_sn + head * stride_sh
    state = state + offs_p[:, None] * stride_sp + offs_n[None, :]
    s_ok = p_ok[:, None] & n_ok[None, :]
    s = tl.load(state, mask=tl.where(has_init, s_ok, False), other=0.0).to(tl.float32)
    for tok in range(start, end):
        x = tl.load(x_ptr + tok * stride_xt + head * stride_xh + offs_p, mask=p_ok, other=0.0)
        b = tl.load(b_ptr + tok * stride_bt + group * stride_bg + offs_n, mask=n_ok, other=0.0)
        c = tl.load(c_ptr + tok * stride_ct + group * stride_cg + offs_n, mask=n_ok, other=0.0)
        dt = tl.load(dt_ptr + tok * stride_dt + head)
        u = dt * x.to(tl.float32)
        s = s * tl.exp(dt * a) + u[:, None] * b.to(tl.float32)[None, :]
        y = tl.sum(s * c.to(tl.float32)[None, :], 1)
        tl.store(out_ptr + tok * stride_ot + head * stride_oh + offs_p, y, mask=p_ok)
    tl.store(state, s.to(state_ptr.dtype.element_ty), mask=s_ok)


def ssd_scan(
    x: torch.Tensor,  # [T, H, P]
    dt: torch.Tensor,  # [T, H] float32 step sizes (softplus and bias applied)
    A: torch.Tensor,  # [H] float32, negative
    B: torch.Tensor,  # [T, G, N], H a multiple of G
    C: torch.Tensor,  # [T, G, N]
    ssm_state: torch.Tensor,  # [num_slots, H, P, N], updated in place
    cu_seqlens: torch.Tensor,  # [S + 1] int32
    state_slots: torch.Tensor,  # [S] int32 / int64, -1 = padding
    has_initial_state: torch.Tensor,  # [S] bool
) -> torch.Tensor:  # [T, H, P] float32
    """Mamba2's selective scan per sequence and head h (group h // (H // G)), in fp32: per
    token S = exp(dt A) S + dt x B^T; y = S C (the D skip is the caller's). S starts at the
    slot's state (or zeros) and is stored back in the pool's dtype. Rows of padding sequences
    and of tokens past cu_seqlens[S] are not written; an empty sequence leaves its slot
    untouched."""
    check(x.dim() == 3, f"x must be [T, H, P], got {tuple(x.shape)}")
    num_tokens, num_heads, head_dim = x.shape
    check(B.dim() == 3 and B.shape[0] == num_tokens, f"B must be [T, G, N], got {B.shape}")
    check(C.shape == B.shape, f"C must be B's shape {tuple(B.shape)}, got {tuple(C.shape)}")
    _, groups, d_state = B.shape
    check(num_heads % groups == 0, f"heads ({num_heads}) must be a multiple of groups ({groups})")
    check(head_dim <= 256 and d_state <= 256, f"P, N must be <= 256: P={head_dim}, N={d_state}")
    check(dt.shape == (num_tokens, num_heads) and dt.dtype == torch.float32, "dt: fp32 [T, H]")
    check(A.shape == (num_heads,) and A.dtype == torch.float32, "A: fp32 [H]")
    check(
        ssm_state.dim() == 4 and ssm_state.shape[1:] == (num_heads, head_dim, d_state),
        f"ssm_state must be [num_slots, {num_heads}, {head_dim}, {d_state}], got "
        f"{tuple(ssm_state.shape)}",
    )
    _check_floats({"x": x, "dt": dt, "A": A, "B": B, "C": C, "ssm_state": ssm_state})
    num_seqs = _check_batch(
        cu_seqlens, state_slots, has_initial_state, ssm_state.shape[0], x.device
    )
    out = torch.empty(num_tokens, num_heads, head_dim, dtype=torch.float32, device=x.device)
    if num_tokens == 0 or num_seqs == 0:
        return out
    block_p = _state_tile(head_dim, d_state)
    grid = (num_seqs, num_heads, triton.cdiv(head_dim, block_p))
    _ssd_scan_kernel[grid](
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
        x.stride(1),
        dt.stride(0),
        B.stride(0),
        B.stride(1),
        C.stride(0),
        C.stride(1),
        out.stride(0),
        out.stride(1),
        ssm_state.stride(0),
        ssm_state.stride(1),
        ssm_state.stride(2),
        GROUP=num_heads // groups,
        P=head_dim,
        N=d_state,
        BLOCK_P=block_p,
        BLOCK_N=next_pow2(d_state),
        num_warps=1,
    )
    return out
