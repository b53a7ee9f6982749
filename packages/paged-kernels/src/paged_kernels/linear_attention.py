"""Linear attention over a varlen batch whose sequences each own a row of state pools: the short
causal conv and the gated delta rule of Gated DeltaNet (Qwen3-Next / Qwen3.5), whose decay is one
scalar per head and token, or Kimi Delta Attention's (KDA, Kimi Linear), one per key channel,
head and token. Mamba2's
selective scan, which shares the conv and this batch layout, is in ssd.py; Mamba's (v1) in
mamba1.py.

Batch layout of the ops: the tokens of S sequences flattened along dim 0; sequence i owns
tokens [cu_seqlens[i], cu_seqlens[i + 1]) and reads and updates row state_slots[i] of the state
pools (-1: padding, skipped); has_initial_state[i] False starts it from zeros (the row's old
contents are ignored, then overwritten). Slots are distinct within a batch. Nothing is read on
the host and the grids depend on shapes only, so a CUDA graph captures every launch.

causal_conv1d: a program per (BLOCK_T tokens of one sequence, BLOCK_C channels); each of the K
taps is one [BLOCK_T, BLOCK_C] load, from x or, for the first K - 1 positions, from the slot's
conv state. The sequence's first tile alone reads the state (BLOCK_T >= K - 1), so it alone
writes the new one, after a barrier.

gated_delta_rule: a fused recurrent kernel, a program per (sequence, value head, BLOCK_V value
columns) holding S[Dk, BLOCK_V] in fp32 registers and walking the sequence's tokens one by one:
fine for decode, sequential (slow) for long prefills; there is no chunked prefill kernel yet. A
per-key-channel decay (G_PER_K) scales S's rows by the token's [Dk] gate vector instead.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from paged_kernels._utils import FLOAT_DTYPES, check, check_last_dim_contiguous, next_pow2
from paged_kernels.attention import _find_seq

MAX_CONV_WIDTH = 8
CONV_BLOCK_T = 16  # > MAX_CONV_WIDTH - 1: only a sequence's first tile reads the conv state


@triton.jit(do_not_specialize=["num_seqs"])
def _causal_conv1d_kernel(
    x_ptr,  # [T, C]
    weight_ptr,  # [C, K]
    bias_ptr,  # [C], read only if HAS_BIAS
    state_ptr,  # [num_slots, C, K - 1], oldest input first
    cu_seqlens_ptr,  # [S + 1] int32
    slots_ptr,  # [S] int, -1 = padding
    has_init_ptr,  # [S] uint8 (bool)
    out_ptr,  # [T, C]
    num_seqs,
    stride_xt,
    stride_ot,
    stride_wc,
    stride_sn,
    stride_sc,
    C: tl.constexpr,
    K: tl.constexpr,
    BLOCK_W: tl.constexpr,  # next_pow2(K - 1): the state tile
    BLOCK_T: tl.constexpr,
    BLOCK_C: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    SILU: tl.constexpr,
):
    tile = tl.program_id(0)
    seq = _find_seq(cu_seqlens_ptr, num_seqs, tile, BLOCK_T)
    start = tl.load(cu_seqlens_ptr + seq)
    seq_len = tl.load(cu_seqlens_ptr + seq + 1) - start
    local = tile - (start // BLOCK_T + seq)
    slot = tl.load(slots_ptr + seq).to(tl.int64)
    if (local * BLOCK_T >= seq_len) | (slot < 0):
        return
    # A scalar condition masks a load through tl.where: `mask & scalar` fails in the interpreter.
    has_init = tl.load(has_init_ptr + seq) != 0

    # xin = [context (K - 1 entries), the sequence's inputs]; output t reads xin[t .. t + K - 1].
    offs_t = local * BLOCK_T + tl.arange(0, BLOCK_T)
    t_ok = offs_t < seq_len
    offs_c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    c_ok = offs_c < C
    state = state_ptr + slot * stride_sn + offs_c * stride_sc  # [BLOCK_C] row starts
    acc = tl.zeros([BLOCK_T, BLOCK_C], tl.float32)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_c, mask=c_ok, other=0.0).to(tl.float32)[None, :]
    for j in tl.static_range(K):
        pos = offs_t + j - (K - 1)  # the tap's position among the sequence's inputs; < 0: context
        rows = (start + pos).to(tl.int64)
        xv = tl.load(
            x_ptr + rows[:, None] * stride_xt + offs_c[None, :],
            mask=(t_ok & (pos >= 0))[:, None] & c_ok[None, :],
            other=0.0,
        )
        sv = tl.load(
            state[None, :] + (offs_t + j)[:, None],
            mask=tl.where(has_init, (t_ok & (pos < 0))[:, None] & c_ok[None, :], False),
            other=0.0,
        )
        w = tl.load(weight_ptr + offs_c * stride_wc + j, mask=c_ok, other=0.0).to(tl.float32)
        acc += (xv.to(tl.float32) + sv.to(tl.float32)) * w[None, :]
    if SILU:
        acc = acc / (1.0 + tl.exp(-acc))
    out = out_ptr + (start + offs_t).to(tl.int64)[:, None] * stride_ot + offs_c[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=t_ok[:, None] & c_ok[None, :])

    if local == 0:  # the new state: xin[seq_len .. seq_len + K - 2]
        offs_w = tl.arange(0, BLOCK_W)
        w_ok = offs_w < K - 1
        new_pos = seq_len + offs_w - (K - 1)
        new_rows = (start + new_pos).to(tl.int64)
        new_x = tl.load(
            x_ptr + new_rows[:, None] * stride_xt + offs_c[None, :],
            mask=(w_ok & (new_pos >= 0))[:, None] & c_ok[None, :],
            other=0.0,
        )
        kept = tl.load(
            state[None, :] + (seq_len + offs_w)[:, None],
            mask=tl.where(has_init, (w_ok & (new_pos < 0))[:, None] & c_ok[None, :], False),
            other=0.0,
        )
        new = new_x.to(state_ptr.dtype.element_ty) + kept.to(state_ptr.dtype.element_ty)
        tl.debug_barrier()  # every thread's reads of the old state precede the first write
        tl.store(state[None, :] + offs_w[:, None], new, mask=w_ok[:, None] & c_ok[None, :])


def _check_floats(named: dict[str, torch.Tensor]) -> None:
    """Float tensors on the first one's device, each with a contiguous last dim."""
    first, device = next(iter(named)), next(iter(named.values())).device
    for name, t in named.items():
        check(t.dtype in FLOAT_DTYPES, f"{name}: unsupported dtype {t.dtype}")
        check(t.device == device, f"{name} is on {t.device}, {first} on {device}")
        check_last_dim_contiguous(name, t)


def _check_batch(cu_seqlens, state_slots, has_initial_state, num_slots: int, device) -> int:
    num_seqs = state_slots.shape[0]
    check(state_slots.dim() == 1, f"state_slots must be [S], got {tuple(state_slots.shape)}")
    check(
        state_slots.dtype in (torch.int32, torch.int64),
        f"state_slots must be int32 / int64, got {state_slots.dtype}",
    )
    check(
        cu_seqlens.shape == (num_seqs + 1,) and cu_seqlens.dtype == torch.int32,
        f"cu_seqlens must be int32 [S + 1] = [{num_seqs + 1}], got {cu_seqlens.dtype} "
        f"{tuple(cu_seqlens.shape)}",
    )
    check(
        has_initial_state.shape == (num_seqs,) and has_initial_state.dtype == torch.bool,
        f"has_initial_state must be bool [S], got {has_initial_state.dtype} "
        f"{tuple(has_initial_state.shape)}",
    )
    for name, t in (
        ("cu_seqlens", cu_seqlens),
        ("state_slots", state_slots),
        ("has_initial_state", has_initial_state),
    ):
        check(t.device == device, f"{name} is on {t.device}, the inputs on {device}")
        check(t.is_contiguous(), f"{name} must be contiguous")
    check(num_slots > 0 or num_seqs == 0, "the state pool has no rows")
    return num_seqs


def causal_conv1d(
    x: torch.Tensor,  # [T, C]
    weight: torch.Tensor,  # [C, K]
    bias: torch.Tensor | None,  # [C]
    conv_state: torch.Tensor,  # [num_slots, C, K - 1], updated in place
    cu_seqlens: torch.Tensor,  # [S + 1] int32
    state_slots: torch.Tensor,  # [S] int32 / int64, -1 = padding
    has_initial_state: torch.Tensor,  # [S] bool
    activation: str | None = "silu",
) -> torch.Tensor:  # [T, C] in x's dtype
    """Causal depthwise conv of each sequence with its slot's last K - 1 inputs as left context
    (zeros without an initial state), fp32 accumulation, optional SiLU; the slot then holds the
    last K - 1 entries of [context, inputs]. Rows of padding sequences (slot < 0) and of tokens
    past cu_seqlens[S] are not written; an empty sequence leaves its slot untouched."""
    check(x.dim() == 2, f"x must be [T, C], got {tuple(x.shape)}")
    num_tokens, channels = x.shape
    check(weight.dim() == 2 and weight.shape[0] == channels, f"weight must be [C={channels}, K]")
    width = weight.shape[1]
    check(2 <= width <= MAX_CONV_WIDTH, f"kernel size must be in [2, {MAX_CONV_WIDTH}]: {width}")
    check(
        conv_state.dim() == 3 and conv_state.shape[1:] == (channels, width - 1),
        f"conv_state must be [num_slots, {channels}, {width - 1}], got {tuple(conv_state.shape)}",
    )
    check(activation in (None, "silu"), f"activation must be 'silu' or None: {activation!r}")
    for name, t in (("x", x), ("weight", weight), ("conv_state", conv_state)):
        check(t.dtype in FLOAT_DTYPES, f"{name}: unsupported dtype {t.dtype}")
        check(t.device == x.device, f"{name} is on {t.device}, x on {x.device}")
        check_last_dim_contiguous(name, t)
    if bias is not None:
        check(bias.shape == (channels,) and bias.is_contiguous(), f"bias must be [C={channels}]")
        check(bias.device == x.device, f"bias is on {bias.device}, x on {x.device}")
    num_seqs = _check_batch(
        cu_seqlens, state_slots, has_initial_state, conv_state.shape[0], x.device
    )
    out = torch.empty(num_tokens, channels, dtype=x.dtype, device=x.device)
    if num_tokens == 0 or num_seqs == 0:
        return out
    block_c = min(64, next_pow2(channels))
    grid = (num_tokens // CONV_BLOCK_T + num_seqs, triton.cdiv(channels, block_c))
    _causal_conv1d_kernel[grid](
        x,
        weight,
        x if bias is None else bias,
        conv_state,
        cu_seqlens,
        state_slots,
        has_initial_state.view(torch.uint8),
        out,
        num_seqs,
        x.stride(0),
        out.stride(0),
        weight.stride(0),
        conv_state.stride(0),
        conv_state.stride(1),
        C=channels,
        K=width,
        BLOCK_W=max(2, next_pow2(width - 1)),
        BLOCK_T=CONV_BLOCK_T,
        BLOCK_C=block_c,
        HAS_BIAS=bias is not None,
        SILU=activation == "silu",
        num_warps=4,
    )
    return out


@triton.jit
def _gated_delta_rule_kernel(
    q_ptr,  # [T, Hk, DK]
    k_ptr,  # [T, Hk, DK]
    v_ptr,  # [T, Hv, DV]
    g_ptr,  # [T, Hv] log decay (<= 0), or [T, Hv, DK] if G_PER_K
    beta_ptr,  # [T, Hv]
    state_ptr,  # [num_slots, Hv, DK, DV]
    cu_seqlens_ptr,  # [S + 1] int32
    slots_ptr,  # [S] int, -1 = padding
    has_init_ptr,  # [S] uint8 (bool)
    out_ptr,  # [T, Hv, DV]
    scale,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_gt,
    stride_gh,
    stride_bt,
    stride_ot,
    stride_oh,
    stride_sn,
    stride_sh,
    stride_sk,
    GROUP: tl.constexpr,  # value heads a key head serves
    DK: tl.constexpr,
    DV: tl.constexpr,
    BLOCK_K: tl.constexpr,  # next_pow2(DK): a whole key head
    BLOCK_V: tl.constexpr,
    L2NORM: tl.constexpr,
    G_PER_K: tl.constexpr,  # g holds one log decay per key channel (KDA)
):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    start = tl.load(cu_seqlens_ptr + seq).to(tl.int64)  # so the loop's token index is int64
    end = tl.load(cu_seqlens_ptr + seq + 1).to(tl.int64)
    slot = tl.load(slots_ptr + seq).to(tl.int64)
    if (end <= start) | (slot < 0):
        return
    has_init = tl.load(has_init_ptr + seq) != 0
    k_head = head // GROUP

    offs_k = tl.arange(0, BLOCK_K)
    k_ok = offs_k < DK
    offs_v = tl.program_id(2) * BLOCK_V + tl.arange(0, BLOCK_V)
    v_ok = offs_v < DV
    state = state_ptr + slot * stride_sn + head * stride_sh
    state = state + offs_k[:, None] * stride_sk + offs_v[None, :]
    s_ok = k_ok[:, None] & v_ok[None, :]
    s = tl.load(state, mask=tl.where(has_init, s_ok, False), other=0.0).to(tl.float32)
    for tok in range(start, end):
        q = tl.load(q_ptr + tok * stride_qt + k_head * stride_qh + offs_k, mask=k_ok, other=0.0)
        k = tl.load(k_ptr + tok * stride_kt + k_head * stride_kh + offs_k, mask=k_ok, other=0.0)
        v = tl.load(v_ptr + tok * stride_vt + head * stride_vh + offs_v, mask=v_ok, other=0.0)
        g_row = g_ptr + tok * stride_gt + head * stride_gh
        beta = tl.load(beta_ptr + tok * stride_bt + head).to(tl.float32)
        q, k = q.to(tl.float32), k.to(tl.float32)
        if L2NORM:
            q = q * tl.rsqrt(tl.sum(q * q, 0) + 1e-6)
            k = k * tl.rsqrt(tl.sum(k * k, 0) + 1e-6)
        if G_PER_K:
            g = tl.load(g_row + offs_k, mask=k_ok, other=0.0).to(tl.float32)
            s = s * tl.exp(g)[:, None]
        else:
            s = s * tl.exp(tl.load(g_row).to(tl.float32))
        delta = (v.to(tl.float32) - tl.sum(s * k[:, None], 0)) * beta  # what S fails to recall
        s = s + k[:, None] * delta[None, :]
        o = tl.sum(s * (q * scale)[:, None], 0)
        out = out_ptr + tok * stride_ot + head * stride_oh + offs_v
        tl.store(out, o.to(out_ptr.dtype.element_ty), mask=v_ok)
    tl.store(state, s.to(state_ptr.dtype.element_ty), mask=s_ok)


def _state_tile(split: int, whole: int) -> int:
    """Of a one-warp program's fp32 state tile [next_pow2(whole), BLOCK], the BLOCK entries of
    the `split` dim it holds: 2048 entries are 64 registers a thread (16 at a whole dim of 128,
    8 at 256; about 170 registers in all for the delta rule, no spills on sm_90), and 8-16
    programs a head at decode. gated_delta_rule splits Dv (whole: Dk), ssd_scan P (whole: N)."""
    return max(1, min(next_pow2(split), 2048 // next_pow2(whole)))


def gated_delta_rule(
    q: torch.Tensor,  # [T, Hk, Dk]
    k: torch.Tensor,  # [T, Hk, Dk]
    v: torch.Tensor,  # [T, Hv, Dv], Hv a multiple of Hk
    g: torch.Tensor,  # [T, Hv] or [T, Hv, Dk] (KDA) float32 log decay (<= 0)
    beta: torch.Tensor,  # [T, Hv], already through the sigmoid
    ssm_state: torch.Tensor,  # [num_slots, Hv, Dk, Dv], updated in place
    cu_seqlens: torch.Tensor,  # [S + 1] int32
    state_slots: torch.Tensor,  # [S] int32 / int64, -1 = padding
    has_initial_state: torch.Tensor,  # [S] bool
    scale: float | None = None,
    use_qk_l2norm: bool = True,
) -> torch.Tensor:  # [T, Hv, Dv] in v's dtype
    """The gated delta rule per sequence and value head h (key head h // (Hv // Hk)), in fp32:
    per token, q and k L2-normalised (x * rsqrt(|x|^2 + 1e-6)) if use_qk_l2norm, q scaled
    (default Dk ** -0.5), then S *= exp(g); S += k (beta (v - k^T S))^T; o = q^T S. A g of
    [T, Hv, Dk] decays each key channel (row of S) by its own exp(g) (Kimi Delta Attention). S
    starts at the slot's state (or zeros) and is stored back in the pool's dtype. Rows of padding
    sequences and of tokens past cu_seqlens[S] are not written; an empty sequence leaves its
    slot untouched."""
    check(q.dim() == 3 and k.shape == q.shape, f"q, k must be [T, Hk, Dk]: {q.shape}, {k.shape}")
    num_tokens, num_k_heads, dk = q.shape
    check(v.dim() == 3 and v.shape[0] == num_tokens, f"v must be [T, Hv, Dv], got {v.shape}")
    _, num_v_heads, dv = v.shape
    check(num_v_heads % num_k_heads == 0, f"Hv={num_v_heads} not a multiple of Hk={num_k_heads}")
    check(dk <= 256 and dv <= 256, f"head sizes must be <= 256, got Dk={dk}, Dv={dv}")
    per_k = g.dim() == 3
    check(
        g.shape in ((num_tokens, num_v_heads), (num_tokens, num_v_heads, dk))
        and g.dtype == torch.float32,
        f"g must be fp32 [T, Hv] or [T, Hv, Dk], got {g.dtype} {tuple(g.shape)}",
    )
    check(beta.shape == (num_tokens, num_v_heads), f"beta must be [T, Hv], got {beta.shape}")
    check(
        ssm_state.dim() == 4 and ssm_state.shape[1:] == (num_v_heads, dk, dv),
        f"ssm_state must be [num_slots, {num_v_heads}, {dk}, {dv}], got {tuple(ssm_state.shape)}",
    )
    _check_floats({"v": v, "q": q, "k": k, "g": g, "beta": beta, "ssm_state": ssm_state})
    check(ssm_state.stride(2) == dv, "ssm_state must be contiguous in its last two dims")
    num_seqs = _check_batch(
        cu_seqlens, state_slots, has_initial_state, ssm_state.shape[0], v.device
    )
    out = torch.empty(num_tokens, num_v_heads, dv, dtype=v.dtype, device=v.device)
    if num_tokens == 0 or num_seqs == 0:
        return out
    block_v = _state_tile(dv, dk)
    grid = (num_seqs, num_v_heads, triton.cdiv(dv, block_v))
    _gated_delta_rule_kernel[grid](
        q,
        k,
        v,
        g,
        beta,
        ssm_state,
        cu_seqlens,
        state_slots,
        has_initial_state.view(torch.uint8),
        out,
        float(dk**-0.5 if scale is None else scale),
        q.stride(0),
        q.stride(1),
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        g.stride(0),
        g.stride(1),
        beta.stride(0),
        out.stride(0),
        out.stride(1),
        ssm_state.stride(0),
        ssm_state.stride(1),
        ssm_state.stride(2),
        GROUP=num_v_heads // num_k_heads,
        DK=dk,
        DV=dv,
        BLOCK_K=next_pow2(dk),
        BLOCK_V=block_v,
        L2NORM=use_qk_l2norm,
        G_PER_K=per_k,
        num_warps=1,
    )
    return out
