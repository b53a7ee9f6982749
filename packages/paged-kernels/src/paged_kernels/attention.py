"""Paged attention for a varlen batch mixing decode, prefill and chunked-prefill rows.

One kernel serves every row kind. A program owns one tile of BLOCK_Q consecutive query tokens
of one sequence and one KV head; the GROUP query heads sharing that KV head are packed into the
M dimension (row m = query token m // GROUP_P2, head m % GROUP_P2), so each K/V tile is read
once per GROUP heads. K/V are gathered through the block table a BLOCK_N-key tile at a time,
with an fp32 online softmax (base 2) and tl.dot for QK^T and PV. Key tiles outside the causal /
sliding-window / attention-chunk range of the query tile are never visited.

Chunked local attention (Llama 4's rope layers, `attention_chunk_size` C): a query at position p
sees the keys of its own chunk, positions floor(p / C) * C .. p.

Key ends (Gemma 3's images attend both ways at prefill): query token t may also see keys up to
key_ends[t] - 1; a tile's key range then ends at the largest key end of its rows.

Split-KV (flash decoding): with few (sequence, KV head) pairs and long contexts, the key range of
each sequence is cut into NUM_SPLITS chunks handled by separate programs (splits wholly before a
window or attention chunk find no keys); each writes a normalised partial output and its
log-sum-exp, and a small second kernel merges them.

An fp8 cache is dequantized on load: each K/V tile is cast to q's dtype (exact: every fp8 value
is representable there) and the per-tensor scales are folded into the math, k_scale into the
softmax scale and v_scale into the final normalisation.

Attention sinks (gpt-oss: one raw logit per query head) act as one extra key of value 0 seen by
every row: the online softmax starts from it (m = sink, l = 1, acc = 0) instead of from nothing.
Under split-KV only split 0 carries it, so the merge counts it once, through split 0's
log-sum-exp (a split 0 without visible keys then holds just the sink: o = 0, lse = sink).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from paged_kernels._dot import tile_dot
from paged_kernels._utils import (
    FLOAT_DTYPES,
    FP8_DTYPES,
    INTERPRETED,
    MAX_HEAD_DIM,
    check,
    check_fp8_readable,
    check_kv_scales,
    check_last_dim_contiguous,
    device_sms,
    next_pow2,
)

MAX_SPLITS = 64
MIN_KEYS_PER_SPLIT = 512


@triton.jit
def _tanh(x):
    # tanh from exp2: saturates cleanly to +-1 in fp32 (exp2 overflow -> inf -> 1 - 0).
    return 1.0 - 2.0 / (tl.exp2(x * 2.8853900817779268) + 1.0)


@triton.jit
def _find_seq(cu_seqlens_q_ptr, num_seqs, tile, BLOCK_Q: tl.constexpr):
    # Sequence i owns the tiles starting at cu_q[i] // BLOCK_Q + i: a monotone bound on the tiles
    # of all earlier sequences, so no host-side tile map is needed. Largest i with start <= tile.
    left = tile * 0
    right = left + num_seqs
    while left < right:
        mid = (left + right) // 2
        start = tl.load(cu_seqlens_q_ptr + mid) // BLOCK_Q + mid
        if start <= tile:
            left = mid + 1
        else:
            right = mid
    return left - 1


# Batch-shape scalars change every step: no specialisation on them (one compile per config).
@triton.jit(do_not_specialize=["num_seqs", "num_q_tokens", "window", "chunk", "stride_bt"])
def _paged_attention_kernel(
    q_ptr,  # [num_q_tokens, num_heads, head_dim]
    k_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_tables_ptr,  # [num_seqs, max_blocks] int32
    cu_seqlens_q_ptr,  # [num_seqs + 1] int32
    seq_lens_ptr,  # [num_seqs] int32, context incl. this step's query tokens
    alibi_ptr,  # [num_heads] fp32, read only if USE_ALIBI
    sinks_ptr,  # [num_heads] fp32 raw logits, read only if USE_SINKS
    key_ends_ptr,  # [num_q_tokens] int32/int64 exclusive key ends, read only if USE_KEY_ENDS
    out_ptr,  # [num_q_tokens, num_heads, head_dim], written unless SPLIT
    part_out_ptr,  # [num_splits, num_q_tokens, num_heads, head_dim] fp32, written if SPLIT
    part_lse_ptr,  # [num_splits, num_q_tokens, num_heads] fp32 (log2 domain), written if SPLIT
    num_seqs,
    num_q_tokens,
    scale,  # softmax scale times k_scale (an fp8 cache's key scale; 1 otherwise)
    v_scale,  # an fp8 cache's value scale; 1 otherwise
    soft_cap,
    window,
    chunk,  # attention_chunk_size, read only if USE_CHUNK
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_kb,
    stride_ks,
    stride_kh,
    stride_vb,
    stride_vs,
    stride_vh,
    stride_bt,
    NUM_HEADS: tl.constexpr,
    GROUP: tl.constexpr,
    GROUP_P2: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_P2: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_M: tl.constexpr,  # BLOCK_Q * GROUP_P2
    BLOCK_N: tl.constexpr,
    USE_WINDOW: tl.constexpr,
    USE_CHUNK: tl.constexpr,
    USE_SOFT_CAP: tl.constexpr,
    USE_ALIBI: tl.constexpr,
    USE_SINKS: tl.constexpr,
    USE_KEY_ENDS: tl.constexpr,
    SPLIT: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    DOT_UPCAST: tl.constexpr,  # interpreter only: its tl.dot multiplies raw bf16 bits
    EXPLICIT_DOT: tl.constexpr,  # interpreter and batch_invariant only (_dot.py)
):
    tile = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq = _find_seq(cu_seqlens_q_ptr, num_seqs, tile, BLOCK_Q)
    q_start = tl.load(cu_seqlens_q_ptr + seq)
    q_len = tl.load(cu_seqlens_q_ptr + seq + 1) - q_start
    local = tile - (q_start // BLOCK_Q + seq)  # tile index within the sequence
    if local * BLOCK_Q >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    ctx = seq_len - q_len  # position of the sequence's first query token

    offs_m = tl.arange(0, BLOCK_M)
    q_row = local * BLOCK_Q + offs_m // GROUP_P2
    head = kv_head * GROUP + offs_m % GROUP_P2
    row_ok = (q_row < q_len) & (offs_m % GROUP_P2 < GROUP)
    q_pos = ctx + q_row
    tok = (q_start + q_row).to(tl.int64)
    offs_d = tl.arange(0, HEAD_DIM_P2)
    d_ok = offs_d < HEAD_DIM
    q = tl.load(
        q_ptr + tok[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :],
        mask=row_ok[:, None] & d_ok[None, :],
        other=0.0,
    )
    if DOT_UPCAST:
        q = q.to(tl.float32)

    # Keys any row of this tile can see: [lo, hi). Row m's last key is `last`.
    hi = ctx + tl.minimum(q_len, (local + 1) * BLOCK_Q)
    lo = hi * 0
    last = q_pos
    if USE_KEY_ENDS:
        # The lower bounds below still come from q_pos. hi: clamped to seq_len, so a bad key
        # end never reads past the sequence's blocks (padded rows load 0, which changes nothing).
        key_end = tl.load(key_ends_ptr + tok, mask=row_ok, other=0).to(tl.int32)
        last = tl.maximum(last, key_end - 1)
        hi = tl.minimum(tl.maximum(hi, tl.max(key_end, 0)), seq_len)
    if USE_WINDOW:
        # Aligned down to a key tile: every row then meets the same tiles at the same offsets
        # however its query rows were tiled (leading fully masked tiles are exact no-ops).
        lo = tl.maximum(lo, ctx + local * BLOCK_Q - window + 1)
        lo -= lo % BLOCK_N
    if USE_CHUNK:  # the first row's chunk starts first (aligned down likewise)
        first = ctx + local * BLOCK_Q
        lo = tl.maximum(lo, first - first % chunk)
        lo -= lo % BLOCK_N
    if SPLIT:
        split_len = tl.cdiv(tl.cdiv(seq_len, tl.num_programs(2)), BLOCK_N) * BLOCK_N
        lo = tl.maximum(lo, split * split_len)
        hi = tl.minimum(hi, (split + 1) * split_len)
    if USE_ALIBI:
        slope = tl.load(alibi_ptr + head, mask=row_ok, other=0.0)

    m_i = tl.full([BLOCK_M], -1.0e30, tl.float32)  # finite: fully masked tiles give p = 0
    l_i = tl.zeros([BLOCK_M], tl.float32)
    if USE_SINKS:
        # The sink as a key already visited: its logit is the running max, its weight
        # 2^(sink - m) = 1 the running sum, its value 0 (acc stays 0). Clamped to m_i's floor
        # so a -inf sink (no sink) keeps alpha finite. Only split 0 holds it.
        sink = tl.load(sinks_ptr + head, mask=row_ok, other=0.0) * 1.4426950408889634
        carry = row_ok
        if SPLIT:
            carry = carry & (split == 0)
        m_i = tl.where(carry, tl.maximum(sink, -1.0e30), m_i)
        l_i = tl.where(carry, 1.0, l_i)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_P2], tl.float32)
    zero_s = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    zero_o = tl.zeros([BLOCK_M, HEAD_DIM_P2], tl.float32)
    table = block_tables_ptr + seq.to(tl.int64) * stride_bt
    for start in range(lo, hi, BLOCK_N):
        offs_n = start + tl.arange(0, BLOCK_N)
        n_ok = offs_n < hi
        # int64 before scaling by the block stride: pools may exceed 2^31 elements.
        block = tl.load(table + offs_n // BLOCK_SIZE, mask=n_ok, other=0).to(tl.int64)
        in_block = offs_n % BLOCK_SIZE
        k_off = block * stride_kb + in_block * stride_ks + kv_head * stride_kh
        v_off = block * stride_vb + in_block * stride_vs + kv_head * stride_vh
        k_mask = d_ok[:, None] & n_ok[None, :]
        k = tl.load(k_cache_ptr + k_off[None, :] + offs_d[:, None], mask=k_mask, other=0.0)
        k = k.to(q_ptr.dtype.element_ty)  # no-op unless the cache is fp8
        if DOT_UPCAST:
            k = k.to(tl.float32)
        s = tile_dot(q, k, zero_s, DOT_PRECISION, EXPLICIT_DOT) * scale  # [BLOCK_M, BLOCK_N]
        if USE_SOFT_CAP:
            s = soft_cap * _tanh(s / soft_cap)
        if USE_ALIBI:
            s += slope[:, None] * (offs_n[None, :] - q_pos[:, None]).to(tl.float32)
        visible = (offs_n[None, :] <= last[:, None]) & n_ok[None, :]
        if USE_WINDOW:
            visible = visible & (q_pos[:, None] - offs_n[None, :] < window)
        if USE_CHUNK:
            visible = visible & (offs_n[None, :] >= (q_pos - q_pos % chunk)[:, None])
        s = tl.where(visible, s * 1.4426950408889634, float("-inf"))  # log2(e): base-2 softmax
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v_mask = n_ok[:, None] & d_ok[None, :]
        v = tl.load(v_cache_ptr + v_off[:, None] + offs_d[None, :], mask=v_mask, other=0.0)
        v = v.to(q_ptr.dtype.element_ty)
        p = p.to(q_ptr.dtype.element_ty)  # PV runs in the compute dtype, like the GPU
        if DOT_UPCAST:
            p, v = p.to(tl.float32), v.to(tl.float32)
        acc = acc * alpha[:, None] + tile_dot(p, v, zero_o, DOT_PRECISION, EXPLICIT_DOT)
        m_i = m_new

    # with sinks only split 0 holds one: another split may end without a key (lse -inf)
    _store_rows(
        acc, m_i, l_i, v_scale, out_ptr, part_out_ptr, part_lse_ptr, tok, head, split,
        num_q_tokens, stride_ot, stride_oh, offs_d, row_ok, d_ok, NUM_HEADS, HEAD_DIM, SPLIT,
    )  # fmt: skip


@triton.jit
def _store_rows(
    acc, m_i, l_i, v_scale, out_ptr, part_out_ptr, part_lse_ptr, tok, head, split,
    num_q_tokens, stride_ot, stride_oh, offs_d, row_ok, d_ok,
    NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, SPLIT: tl.constexpr,
):  # fmt: skip
    """A tile's rows after its last key: normalised into `out`, or under split-KV this split's
    fp32 part and its base-2 log-sum-exp (-inf where the split held no key) for the merge."""
    has_keys = l_i > 0.0  # false only for padded rows or an empty split
    o = acc * (v_scale / tl.where(has_keys, l_i, 1.0))[:, None]
    mask = row_ok[:, None] & d_ok[None, :]
    if SPLIT:
        idx = (split * num_q_tokens + tok) * NUM_HEADS + head  # int64 via tok
        tl.store(part_out_ptr + idx[:, None] * HEAD_DIM + offs_d[None, :], o, mask=mask)
        lse = tl.where(has_keys, m_i + tl.log2(tl.where(has_keys, l_i, 1.0)), float("-inf"))
        tl.store(part_lse_ptr + idx, lse, mask=row_ok)
    else:
        out = out_ptr + tok[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :]
        tl.store(out, o.to(out_ptr.dtype.element_ty), mask=mask)


def choose_num_splits(
    num_seqs: int, num_kv_heads: int, max_seqlen_q: int, max_seqlen_k: int, num_sms: int
) -> int:
    """Split-KV heuristic, for pure decode only.

    Fewer (seq, kv head) pairs than SMs: about two programs per SM, every split at least
    MIN_KEYS_PER_SPLIT keys. Up to 4x as many pairs as SMs over long contexts (>= 4 splits'
    worth of keys): two splits, which keep more loads in flight. Measured on an H100 (132 SMs;
    32 query / 8 KV heads of 128, bf16; kernel_bench --split-sweep): batch 64 at 2k keys
    0.236 -> 0.217 ms, at 8k 0.893 -> 0.785 ms; batch 32 at 2k even; batch 128 (1024 pairs)
    slower split (0.388 -> 0.417 ms), so more pairs never split.
    """
    pairs = num_seqs * num_kv_heads
    if max_seqlen_q != 1:
        return 1
    if pairs >= num_sms:
        return 2 if pairs <= 4 * num_sms and max_seqlen_k >= 4 * MIN_KEYS_PER_SPLIT else 1
    splits = min(triton.cdiv(2 * num_sms, pairs), max_seqlen_k // MIN_KEYS_PER_SPLIT, MAX_SPLITS)
    return max(splits, 1)


class TileConfig(NamedTuple):
    block_q: int  # query tokens a program (x GROUP_P2 heads = BLOCK_M rows)
    block_n: int  # keys a tile
    num_warps: int
    num_stages: int


def _tile_config(group_p2: int, head_dim_p2: int, decode: bool, fp32: bool = False) -> TileConfig:
    """M >= 16 rows keeps tl.dot legal on tensor cores. Sized so
    the sm_90 build spills no registers (ptxas -v over tests/kernels/gpu_compile.py's launches):
    with 4 warps every 16-bit 64-key tile at head size 128 spilled 344-924 bytes a thread,
    decode included (the 128-key decode tile below does not); a 64-row tile at head size 256
    spilled with 8 warps too; fp32 (full precision dots, no tensor cores) spilled kilobytes at
    any BLOCK_N above 16 but 16.
    `decode`: every row is a decode row (16-row tiles); otherwise the prefill tiles.

    Decode at head size 128 (16-bit) takes the tile the H100 sweep timed fastest
    (`kernel_bench --tile-sweep`, docs/benchmarks/h100): BLOCK_N 128 with 4 warps, 4.6-6.2%
    faster than (64, 8 warps) at batch 32-256 over 2k-8k keys, within 1% of the best of 18 in
    every case. The other head sizes keep the spill-free tiles, untimed (512 included: 16 rows
    of 16 keys, which spill nothing on sm_80 or sm_90)."""
    if head_dim_p2 > 256:  # 512 (Gemma 4's full layers): 16 rows of 16 keys, any dtype
        block_m, block_n, num_warps = 16, 16, 8
    elif fp32:
        block_m, block_n = (16 if decode else 32), 16
        num_warps = 8 if head_dim_p2 > 128 else 4
    elif decode and head_dim_p2 == 128:
        block_m, block_n, num_warps = 16, 128, 4
    else:
        block_m = 16 if decode else (32 if head_dim_p2 > 128 else 64)
        block_n = 32 if head_dim_p2 > 128 else 64
        num_warps = 8 if head_dim_p2 >= 128 else 4
    return TileConfig(max(1, block_m // group_p2), block_n, num_warps, 2)


def paged_attention(
    q: torch.Tensor,  # [num_q_tokens, num_heads, head_dim]
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_tables: torch.Tensor,  # [num_seqs, max_blocks] int32
    cu_seqlens_q: torch.Tensor,  # [num_seqs + 1] int32
    seq_lens: torch.Tensor,  # [num_seqs] int32, context incl. this step's query tokens
    scale: float,
    *,
    max_seqlen_q: int | None = None,
    max_seqlen_k: int | None = None,
    sliding_window: int | None = None,
    attention_chunk_size: int | None = None,
    soft_cap: float | None = None,
    alibi_slopes: torch.Tensor | None = None,  # [num_heads] fp32
    out: torch.Tensor | None = None,  # [num_q_tokens, num_heads, head_dim]
    num_splits: int | None = None,  # None: heuristic; 1: never split; >1: force split-KV
    k_scale: float = 1.0,  # fp8 caches: key = stored * k_scale
    v_scale: float = 1.0,
    batch_invariant: bool = False,
    sinks: torch.Tensor | None = None,  # [num_heads] raw logits (gpt-oss), any float dtype
    key_ends: torch.Tensor | None = None,  # [num_q_tokens] int32/int64 exclusive key ends
) -> torch.Tensor:
    """Causal attention of each sequence's new query rows over its paged K/V.

    Same semantics as `ref_paged_attention` (an fp8 cache is dequantized on load; `sinks` add
    one raw logit per head to each row's softmax denominator and nothing to its values;
    `key_ends` (Gemma 3's two-way image spans): query token t at position p sees keys
    k <= max(p, key_ends[t] - 1), lower bounds (window, chunk) still from p; the caller keeps
    key_ends[t] <= its sequence's seq_len (unchecked here: no host sync; the kernel clamps). Pass
    max_seqlen_q / max_seqlen_k to avoid a host sync (they only steer tile sizes and the split
    heuristic). Output rows past cu_seqlens_q[-1] are not written.

    `batch_invariant=True`: a row's output has the same bits whatever else is in the batch and
    however its sequence's query rows are chunked. Every call then uses one tile config (the
    prefill one, whatever max_seqlen_q) and never splits the keys (num_splits must be None or
    1): each row walks its keys in BLOCK_N tiles from key 0, the same tiles in the same order.
    """
    if q.dim() != 3:
        raise ValueError(f"q must be [num_q_tokens, num_heads, head_dim], got {tuple(q.shape)}")
    check(key_cache.dim() == 4, "key_cache must be [num_blocks, block_size, num_kv_heads, D]")
    check(key_cache.shape == value_cache.shape, "key_cache and value_cache shapes differ")
    num_tokens, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, cache_head_dim = key_cache.shape
    if cache_head_dim != head_dim:
        raise ValueError(f"cache head_dim {cache_head_dim} != q's {head_dim}")
    if head_dim > MAX_HEAD_DIM:
        raise ValueError(f"head_dim {head_dim} > {MAX_HEAD_DIM} is not supported")
    if num_heads % num_kv_heads != 0:
        raise ValueError(f"{num_heads} heads not a multiple of {num_kv_heads}")
    if q.dtype not in FLOAT_DTYPES:
        raise ValueError(f"unsupported dtype {q.dtype}")
    check(key_cache.dtype == value_cache.dtype, "key_cache and value_cache dtypes differ")
    if not (key_cache.dtype == q.dtype or key_cache.dtype in FP8_DTYPES):
        raise ValueError(
            f"the caches ({key_cache.dtype}) must have q's dtype ({q.dtype}) or be fp8"
        )
    check_kv_scales(key_cache.dtype, k_scale, v_scale)
    check_fp8_readable(key_cache.dtype, q.device)
    num_seqs = seq_lens.shape[0]
    check(seq_lens.dim() == 1, "seq_lens must be [num_seqs]")
    check(cu_seqlens_q.shape == (num_seqs + 1,), "cu_seqlens_q must be [num_seqs + 1]")
    check(block_tables.dim() == 2 and block_tables.shape[0] == num_seqs, "block_tables: [S, B]")
    for name, t in (("block_tables", block_tables), ("cu_seqlens_q", cu_seqlens_q)):
        if t.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"{name} must be int32/int64")
    check(seq_lens.dtype in (torch.int32, torch.int64), "seq_lens must be int32/int64")
    check(cu_seqlens_q.is_contiguous() and seq_lens.is_contiguous(), "metadata must be contiguous")
    check(block_tables.stride(1) == 1, "block_tables must be contiguous in its last dim")
    for name, t in (("q", q), ("key_cache", key_cache), ("value_cache", value_cache)):
        check_last_dim_contiguous(name, t)
    if out is None:
        out = torch.empty_like(q)
    check(out.shape == q.shape and out.dtype == q.dtype, "out must match q's shape and dtype")
    check_last_dim_contiguous("out", out)
    if alibi_slopes is not None:
        check(alibi_slopes.shape == (num_heads,), "alibi_slopes must be [num_heads]")
        alibi_slopes = alibi_slopes.to(device=q.device, dtype=torch.float32).contiguous()
    if sinks is not None:
        if sinks.shape != (num_heads,):
            raise ValueError(f"sinks must be [num_heads={num_heads}]")
        if not sinks.is_floating_point():
            raise ValueError(f"sinks must be floating point, got {sinks.dtype}")
        sinks = sinks.to(device=q.device, dtype=torch.float32).contiguous()
    tensors = (q, key_cache, value_cache, block_tables, cu_seqlens_q, seq_lens, out)
    if key_ends is not None:
        if key_ends.shape != (num_tokens,):
            raise ValueError(
                f"key_ends must be [num_q_tokens={num_tokens}], got {tuple(key_ends.shape)}"
            )
        if key_ends.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"key_ends must be int32/int64, got {key_ends.dtype}")
        check(key_ends.is_contiguous(), "key_ends must be contiguous")
        tensors += (key_ends,)
    devices = {t.device for t in tensors}
    if len(devices) != 1:
        raise ValueError(f"all tensors must be on one device, got {devices}")
    if num_tokens == 0 or num_seqs == 0:
        return out

    num_splits = _invariant_splits(num_splits, batch_invariant)
    if max_seqlen_q is None and not batch_invariant:  # (batch_invariant: prefill tiles always)
        max_seqlen_q = int((cu_seqlens_q[1:] - cu_seqlens_q[:-1]).max())
    group = num_heads // num_kv_heads
    group_p2, head_dim_p2 = next_pow2(group), max(16, next_pow2(head_dim))
    decode = not batch_invariant and max_seqlen_q == 1
    fp32 = q.dtype == torch.float32
    block_q, block_n, num_warps, num_stages = _tile_config(group_p2, head_dim_p2, decode, fp32)
    if num_splits is None:
        if max_seqlen_q == 1 and max_seqlen_k is None:
            max_seqlen_k = int(seq_lens.max())
        num_splits = choose_num_splits(
            num_seqs, num_kv_heads, max_seqlen_q, max_seqlen_k or 0, device_sms(q.device)
        )
    check(num_splits >= 1, "num_splits must be >= 1")
    split = num_splits > 1
    part_out, part_lse = _split_parts(num_splits, num_tokens, num_heads, head_dim, out)

    grid = (num_tokens // block_q + num_seqs, num_kv_heads, num_splits)
    upcast = INTERPRETED and q.dtype == torch.bfloat16
    _paged_attention_kernel[grid](
        q,
        key_cache,
        value_cache,
        block_tables,
        cu_seqlens_q,
        seq_lens,
        alibi_slopes if alibi_slopes is not None else q,
        sinks if sinks is not None else q,
        key_ends if key_ends is not None else cu_seqlens_q,
        out,
        part_out,
        part_lse,
        num_seqs,
        num_tokens,
        float(scale) * float(k_scale),
        float(v_scale),
        float(soft_cap or 0.0),
        int(sliding_window or 0),
        int(attention_chunk_size or 1),
        q.stride(0),
        q.stride(1),
        out.stride(0),
        out.stride(1),
        key_cache.stride(0),
        key_cache.stride(1),
        key_cache.stride(2),
        value_cache.stride(0),
        value_cache.stride(1),
        value_cache.stride(2),
        block_tables.stride(0),
        NUM_HEADS=num_heads,
        GROUP=group,
        GROUP_P2=group_p2,
        HEAD_DIM=head_dim,
        HEAD_DIM_P2=head_dim_p2,
        BLOCK_SIZE=block_size,
        BLOCK_Q=block_q,
        BLOCK_M=block_q * group_p2,
        BLOCK_N=block_n,
        USE_WINDOW=bool(sliding_window and sliding_window > 0),
        USE_CHUNK=bool(attention_chunk_size and attention_chunk_size > 0),
        USE_SOFT_CAP=bool(soft_cap and soft_cap > 0),
        USE_ALIBI=alibi_slopes is not None,
        USE_SINKS=sinks is not None,
        USE_KEY_ENDS=key_ends is not None,
        SPLIT=split,
        DOT_PRECISION="ieee" if q.dtype == torch.float32 or upcast else "tf32",
        DOT_UPCAST=upcast,
        EXPLICIT_DOT=INTERPRETED and batch_invariant,
        num_warps=1 if INTERPRETED else num_warps,
        num_stages=num_stages,
    )
    if split:
        _merge_splits(part_out, part_lse, out)
    return out


def _invariant_splits(num_splits: int | None, batch_invariant: bool) -> int | None:
    """`num_splits` as asked; 1 under batch_invariant, which never splits (a count > 1 there is
    an error)."""
    if not batch_invariant:
        return num_splits
    if num_splits not in (None, 1):
        raise ValueError(f"batch_invariant=True never splits (num_splits={num_splits})")
    return 1


def _split_parts(
    num_splits: int, num_tokens: int, num_heads: int, head_dim: int, out: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Split-KV's partial outputs [S, T, H, D] and base-2 log-sum-exps [S, T, H], fp32, for
    `_merge_splits`; unsplit, `out` twice (placeholders the kernel never reads)."""
    if num_splits == 1:
        return out, out
    part_out = torch.empty(
        (num_splits, num_tokens, num_heads, head_dim), dtype=torch.float32, device=out.device
    )
    part_lse = torch.empty(
        (num_splits, num_tokens, num_heads), dtype=torch.float32, device=out.device
    )
    return part_out, part_lse


@triton.jit(do_not_specialize=["num_splits", "num_q_tokens"])
def _merge_splits_kernel(
    part_out_ptr,  # [num_splits, num_q_tokens, num_heads, head_dim] fp32
    part_lse_ptr,  # [num_splits, num_q_tokens, num_heads] fp32, log2 domain
    out_ptr,  # [num_q_tokens, num_heads, head_dim]
    num_splits,
    num_q_tokens,
    stride_ot,
    stride_oh,
    NUM_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_P2: tl.constexpr,
    SPLITS_P2: tl.constexpr,
):
    # One program per (query token, head): out = sum_s w_s o_s / sum_s w_s, w_s = 2^(lse_s - max).
    tok = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    offs_s = tl.arange(0, SPLITS_P2)
    offs_d = tl.arange(0, HEAD_DIM_P2)
    row = (offs_s * num_q_tokens + tok) * NUM_HEADS + head  # [SPLITS_P2] int64
    s_ok = offs_s < num_splits
    lse = tl.load(part_lse_ptr + row, mask=s_ok, other=float("-inf"))
    # Every real row has its diagonal key in some split, so the max is finite. Sinks need
    # nothing here: split 0's lse and (already normalised) output include its sink.
    w = tl.exp2(lse - tl.max(lse, 0))
    mask = s_ok[:, None] & (offs_d[None, :] < HEAD_DIM)
    o = tl.load(part_out_ptr + row[:, None] * HEAD_DIM + offs_d[None, :], mask=mask, other=0.0)
    merged = tl.sum(w[:, None] * o, 0) / tl.sum(w, 0)
    dst = out_ptr + tok * stride_ot + head * stride_oh + offs_d
    tl.store(dst, merged.to(out_ptr.dtype.element_ty), mask=offs_d < HEAD_DIM)


def _merge_splits(
    part_out: torch.Tensor,  # [num_splits, num_q_tokens, num_heads, head_dim] fp32
    part_lse: torch.Tensor,  # [num_splits, num_q_tokens, num_heads] fp32, log2 domain
    out: torch.Tensor,  # [num_q_tokens, num_heads, head_dim]
) -> None:
    num_splits, num_tokens, num_heads, head_dim = part_out.shape
    _merge_splits_kernel[(num_tokens, num_heads)](
        part_out,
        part_lse,
        out,
        num_splits,
        num_tokens,
        out.stride(0),
        out.stride(1),
        NUM_HEADS=num_heads,
        HEAD_DIM=head_dim,
        HEAD_DIM_P2=next_pow2(head_dim),
        SPLITS_P2=max(2, next_pow2(num_splits)),
        num_warps=1 if INTERPRETED else 4,
    )
