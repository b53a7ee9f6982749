"""DeepSeek Sparse Attention (DSA) over a paged latent cache: the lightning indexer's choice of
keys and multi-head latent attention over the chosen keys alone (DeepSeek-V3.2, GLM-5 and the
models built on them).

The cache holds one row a token, [c | k_pe | ...]: LATENT entries (kv_lora_rank), ROPE entries
(qk_rope_head_dim, possibly 0) and, on a layer with an indexer, the indexer key after them.
Rows are addressed by slot = block * block_size + offset.

`index_topk` picks each query row's keys for the whole batch at once: `_index_scores_kernel`
(a program a query row and BLOCK_N keys) scores key j for the row at position p as
sum_h w_h * relu(q_h . k_j) * index_dim^-0.5 (fp32, keys j <= p; -inf past p), and a stable
descending sort keeps the `topk` best, ties to the earlier key. The result is [T, K] slots,
-1 padding, K = min(topk, max_seqlen_k): no per-sequence loop and no read of lengths on the
host (rows are sorted in chunks of _MAX_SCORES entries to bound memory).

`sparse_mla_attention` (a program a query row and HEADS heads) walks that row's slots in tiles
of BLOCK_N, loads each [BLOCK_N, LATENT] latent and [BLOCK_N, ROPE] rope tile once for all its
heads, s = (q_c . c + q_pe . k_pe) * scale, and keeps an fp32 base-2 online softmax with
acc += p @ c; padding slots score -inf. An optional sink logit a head (Hy-V4) starts the
running max and sum (its probability multiplies no value). A row with no key and no sink
outputs 0. fp8 caches fold the key scale into the softmax scale and the normalisation as
mla.py's kernel does.

reference.py's `ref_index_topk` and `ref_sparse_mla_attention` define the semantics.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from paged_kernels._utils import (
    FLOAT_DTYPES,
    FP8_DTYPES,
    INTERPRETED,
    check,
    check_fp8_readable,
    check_kv_scales,
    check_last_dim_contiguous,
    next_pow2,
)

# Query heads a program holds: 16 rows is the smallest tile tl.dot takes on tensor cores.
MAX_HEADS_PER_PROGRAM = 16
# fp32 scores sorted at once by index_topk: rows x keys
_MAX_SCORES = 2**24


@triton.jit(do_not_specialize=["num_keys"])
def _sparse_mla_kernel(
    q_ptr,  # [num_q_tokens, num_heads, LATENT + ROPE]
    cache_ptr,  # [num_blocks, block_size, 1, >= LATENT + ROPE]
    indices_ptr,  # [num_q_tokens, num_keys] int32 slots, -1 = padding
    sinks_ptr,  # [num_heads] fp32, read if HAS_SINKS
    out_ptr,  # [num_q_tokens, num_heads, >= LATENT]
    num_keys,
    scale,  # softmax scale times the cache's key scale
    v_scale,
    stride_qt,
    stride_qh,
    stride_it,
    stride_ot,
    stride_oh,
    stride_cb,
    stride_cs,
    NUM_HEADS: tl.constexpr,
    HEADS: tl.constexpr,  # query heads a program holds (a power of two, >= 16)
    LATENT: tl.constexpr,
    LATENT_P2: tl.constexpr,
    ROPE: tl.constexpr,  # 0: no rope part (Mistral Large 4's NoPE layers)
    ROPE_P2: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HAS_SINKS: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    DOT_UPCAST: tl.constexpr,  # interpreter only: its tl.dot multiplies raw bf16 bits
):
    tok = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1) * HEADS + tl.arange(0, HEADS)
    h_ok = head < NUM_HEADS
    offs_c = tl.arange(0, LATENT_P2)
    c_ok = offs_c < LATENT
    offs_r = LATENT + tl.arange(0, ROPE_P2)
    r_ok = offs_r < LATENT + ROPE
    q_base = q_ptr + tok * stride_qt + head[:, None] * stride_qh
    q_c = tl.load(q_base + offs_c[None, :], mask=h_ok[:, None] & c_ok[None, :], other=0.0)
    q_r = tl.load(q_base + offs_r[None, :], mask=h_ok[:, None] & r_ok[None, :], other=0.0)
    if DOT_UPCAST:
        q_c, q_r = q_c.to(tl.float32), q_r.to(tl.float32)

    if HAS_SINKS:  # the sink is one more logit: it starts the running max, its e^0 the sum
        m_i = tl.load(sinks_ptr + head, mask=h_ok, other=0.0).to(tl.float32) * 1.4426950408889634
        l_i = tl.full([HEADS], 1.0, tl.float32)
    else:
        m_i = tl.full([HEADS], -1.0e30, tl.float32)
        l_i = tl.zeros([HEADS], tl.float32)
    acc = tl.zeros([HEADS, LATENT_P2], tl.float32)
    zero_s = tl.zeros([HEADS, BLOCK_N], tl.float32)
    zero_o = tl.zeros([HEADS, LATENT_P2], tl.float32)
    row_indices = indices_ptr + tok * stride_it
    for start in range(0, num_keys, BLOCK_N):
        offs_n = start + tl.arange(0, BLOCK_N)
        slot = tl.load(row_indices + offs_n, mask=offs_n < num_keys, other=-1)
        n_ok = slot >= 0
        slot = tl.where(n_ok, slot, 0).to(tl.int64)
        row = cache_ptr + (slot // BLOCK_SIZE) * stride_cb + (slot % BLOCK_SIZE) * stride_cs
        c = tl.load(row[:, None] + offs_c[None, :], mask=n_ok[:, None] & c_ok[None, :], other=0.0)
        c = c.to(q_ptr.dtype.element_ty)  # no-op unless the cache is fp8
        if DOT_UPCAST:
            c = c.to(tl.float32)
        s = tl.dot(q_c, tl.trans(c), zero_s, input_precision=DOT_PRECISION)
        if ROPE > 0:
            k_r = tl.load(
                row[:, None] + offs_r[None, :], mask=n_ok[:, None] & r_ok[None, :], other=0.0
            )
            k_r = k_r.to(q_ptr.dtype.element_ty)
            if DOT_UPCAST:
                k_r = k_r.to(tl.float32)
            s = tl.dot(q_r, tl.trans(k_r), s, input_precision=DOT_PRECISION)
        s = tl.where(n_ok[None, :], s * (scale * 1.4426950408889634), float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        p = p.to(q_ptr.dtype.element_ty)  # PV in the compute dtype, like mla.py
        if DOT_UPCAST:
            p = p.to(tl.float32)
        acc = acc * alpha[:, None] + tl.dot(p, c, zero_o, input_precision=DOT_PRECISION)
        m_i = m_new

    acc = acc * (v_scale / tl.where(l_i > 0, l_i, 1.0))[:, None]  # no key, no sink: 0
    out = out_ptr + tok * stride_ot + head[:, None] * stride_oh + offs_c[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=h_ok[:, None] & c_ok[None, :])


@triton.jit(do_not_specialize=["num_keys"])
def _index_scores_kernel(
    q_ptr,  # [num_q_tokens, >= HEADS * DIM + HEADS] fp32: queries, then head weights
    cache_ptr,  # [num_blocks, block_size, 1, >= KEY_OFFSET + DIM]
    block_tables_ptr,  # [num_seqs, max_blocks] int32
    token_seq_ptr,  # [num_q_tokens] int32: each row's sequence
    token_pos_ptr,  # [num_q_tokens] int32: each row's position (it sees keys <= it)
    scores_ptr,  # [num_q_tokens, num_keys] fp32, -inf past the row's position
    num_keys,
    key_scale,  # the cache's k_scale times index_dim^-0.5 (positive: relu commutes)
    stride_qt,
    stride_st,
    stride_cb,
    stride_cs,
    stride_bt,
    HEADS: tl.constexpr,
    HEADS_P2: tl.constexpr,
    DIM: tl.constexpr,
    DIM_P2: tl.constexpr,
    KEY_OFFSET: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    tok = tl.program_id(0).to(tl.int64)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    pos = tl.load(token_pos_ptr + tok)
    visible = (offs_n <= pos) & (offs_n < num_keys)
    out = scores_ptr + tok * stride_st + offs_n
    if tl.program_id(1) * BLOCK_N > pos:  # the whole tile is past the row
        tl.store(out, tl.full([BLOCK_N], float("-inf"), tl.float32), mask=offs_n < num_keys)
        return
    heads = tl.arange(0, HEADS_P2)
    h_ok = heads < HEADS
    offs_d = tl.arange(0, DIM_P2)
    d_ok = offs_d < DIM
    q_row = q_ptr + tok * stride_qt
    q = tl.load(
        q_row + heads[:, None] * DIM + offs_d[None, :], mask=h_ok[:, None] & d_ok[None, :],
        other=0.0,
    )  # fmt: skip
    w = tl.load(q_row + HEADS * DIM + heads, mask=h_ok, other=0.0)
    seq = tl.load(token_seq_ptr + tok).to(tl.int64)
    block = tl.load(
        block_tables_ptr + seq * stride_bt + offs_n // BLOCK_SIZE, mask=visible, other=0
    ).to(tl.int64)
    row = cache_ptr + block * stride_cb + (offs_n % BLOCK_SIZE) * stride_cs + KEY_OFFSET
    k = tl.load(row[:, None] + offs_d[None, :], mask=visible[:, None] & d_ok[None, :], other=0.0)
    s = tl.dot(q, tl.trans(k.to(tl.float32)), input_precision="ieee") * key_scale  # [Hp, N]
    score = tl.sum(w[:, None] * tl.maximum(s, 0.0), 0)
    tl.store(out, tl.where(visible, score, float("-inf")), mask=offs_n < num_keys)


def sparse_mla_attention(
    q: torch.Tensor,  # [num_q_tokens, num_heads, latent + rope]
    cache: torch.Tensor,  # [num_blocks, block_size, 1, >= latent + rope]
    indices: torch.Tensor,  # [num_q_tokens, K] int32 slots, -1 = padding
    scale: float,
    *,
    latent_dim: int,
    k_scale: float = 1.0,
    sinks: torch.Tensor | None = None,  # [num_heads] float logits
    out: torch.Tensor | None = None,  # [num_q_tokens, num_heads, >= latent_dim]
) -> torch.Tensor:
    """Each query row's absorbed MLA heads over the cache rows its `indices` name (the first
    latent + rope entries of a row are the key, its first `latent_dim` the value); returns
    `out` with its first `latent_dim` columns set (the rest untouched). The cache may be any
    strided view whose last dim is dense (a backend's `block_view`); columns past the key
    (the indexer key) are not read. `sinks`: a raw logit a head joining each softmax."""
    check(q.dim() == 3, f"q must be [num_q_tokens, num_heads, D], got {tuple(q.shape)}")
    check(cache.dim() == 4 and cache.shape[2] == 1, "cache must be [num_blocks, block_size, 1, W]")
    num_tokens, num_heads, width = q.shape
    block_size = cache.shape[1]
    check(cache.shape[3] >= width, f"cache width {cache.shape[3]} < q's {width}")
    check(0 < latent_dim <= width, f"latent_dim {latent_dim} must be in (0, {width}]")
    check(q.dtype in FLOAT_DTYPES, f"unsupported dtype {q.dtype}")
    check(cache.dtype == q.dtype or cache.dtype in FP8_DTYPES, "cache dtype must be q's or fp8")
    check_kv_scales(cache.dtype, k_scale, k_scale)
    check_fp8_readable(cache.dtype, q.device)
    check_last_dim_contiguous("q", q)
    check_last_dim_contiguous("cache", cache)
    check(
        indices.dim() == 2 and indices.shape[0] == num_tokens and indices.dtype == torch.int32,
        f"indices must be [num_q_tokens, K] int32, got {tuple(indices.shape)} {indices.dtype}",
    )
    check_last_dim_contiguous("indices", indices)
    if sinks is not None:
        check(sinks.shape == (num_heads,), f"sinks must be [{num_heads}]")
        sinks = sinks.float().contiguous()
    if out is None:
        out = torch.empty(num_tokens, num_heads, latent_dim, dtype=q.dtype, device=q.device)
    check(out.shape[:2] == q.shape[:2] and out.shape[2] >= latent_dim, "bad out shape")
    check(out.stride(2) == 1 and out.dtype == q.dtype, "out must match q's dtype, last dim dense")
    if num_tokens == 0:
        return out
    heads = max(16, min(MAX_HEADS_PER_PROGRAM, next_pow2(num_heads)))
    rope = width - latent_dim
    upcast = INTERPRETED and q.dtype == torch.bfloat16
    grid = (num_tokens, triton.cdiv(num_heads, heads))
    _sparse_mla_kernel[grid](
        q, cache, indices, sinks if sinks is not None else q, out,
        indices.shape[1], float(scale) * float(k_scale), float(k_scale),
        q.stride(0), q.stride(1), indices.stride(0), out.stride(0), out.stride(1),
        cache.stride(0), cache.stride(1),
        NUM_HEADS=num_heads, HEADS=heads,
        LATENT=latent_dim, LATENT_P2=max(16, next_pow2(latent_dim)),
        ROPE=rope, ROPE_P2=max(16, next_pow2(rope)),
        BLOCK_SIZE=block_size, BLOCK_N=32, HAS_SINKS=sinks is not None,
        DOT_PRECISION="ieee" if q.dtype == torch.float32 or upcast else "tf32",
        DOT_UPCAST=upcast,
        num_warps=1 if INTERPRETED else 8,
        num_stages=2,
    )  # fmt: skip
    return out


def token_rows(
    cu_seqlens_q: torch.Tensor,  # [num_seqs + 1] int32
    seq_lens: torch.Tensor,  # [num_seqs] int32
    num_tokens: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each query row's sequence and position ([T] int64 each), on the device: row t of
    sequence s sits at seq_lens[s] - (cu_seqlens_q[s + 1] - t)."""
    t = torch.arange(num_tokens, device=seq_lens.device)
    ends = cu_seqlens_q[1:].long()
    seq = torch.searchsorted(ends, t, right=True).clamp_(max=seq_lens.shape[0] - 1)
    return seq, seq_lens.long()[seq] - (ends[seq] - t)


def index_topk(
    index_q: torch.Tensor,  # [num_q_tokens, heads * dim + heads] fp32: queries, head weights
    cache: torch.Tensor,  # [num_blocks, block_size, 1, >= key_offset + dim]
    block_tables: torch.Tensor,  # [num_seqs, max_blocks] int32
    cu_seqlens_q: torch.Tensor,  # [num_seqs + 1] int32
    seq_lens: torch.Tensor,  # [num_seqs] int32
    *,
    key_offset: int,  # where a row's indexer key starts
    index_heads: int,
    index_dim: int,
    topk: int,
    max_seqlen_k: int,  # >= every seq_len (a static bound is fine: no host read)
    k_scale: float = 1.0,
) -> torch.Tensor:  # [num_q_tokens, min(topk, max_seqlen_k)] int32 slots, -1 = padding
    """The lightning indexer's choice for every query row of the batch: the slots of the
    `topk` visible keys scoring highest (module docstring), best first, ties to the earlier
    key; a row that sees fewer keys keeps them all and pads with -1."""
    check(cache.dim() == 4 and cache.shape[2] == 1, "cache must be [num_blocks, block_size, 1, W]")
    check(cache.shape[3] >= key_offset + index_dim, "cache rows hold no indexer key there")
    check(index_q.dtype == torch.float32 and index_q.dim() == 2, "index_q must be 2-D fp32")
    check(index_q.shape[1] >= index_heads * (index_dim + 1), "index_q is too narrow")
    check_last_dim_contiguous("index_q", index_q)
    check_last_dim_contiguous("cache", cache)
    check_kv_scales(cache.dtype, k_scale, k_scale)
    check_fp8_readable(cache.dtype, index_q.device)
    check(topk >= 1 and max_seqlen_k >= 1, "topk and max_seqlen_k must be positive")
    num_tokens, block_size = index_q.shape[0], cache.shape[1]
    keys = max_seqlen_k
    k = min(topk, keys)
    indices = torch.empty(num_tokens, k, dtype=torch.int32, device=index_q.device)
    if num_tokens == 0:
        return indices
    seq, pos = token_rows(cu_seqlens_q, seq_lens, num_tokens)
    block_n = 64
    step = max(1, _MAX_SCORES // keys)
    for r0 in range(0, num_tokens, step):  # row chunks bound the sort's memory
        r1 = min(r0 + step, num_tokens)
        scores = torch.empty(r1 - r0, keys, dtype=torch.float32, device=index_q.device)
        _index_scores_kernel[(r1 - r0, triton.cdiv(keys, block_n))](
            index_q[r0:r1], cache, block_tables, seq[r0:r1].to(torch.int32),
            pos[r0:r1].to(torch.int32), scores, keys,
            float(k_scale) * index_dim**-0.5,
            index_q.stride(0), scores.stride(0), cache.stride(0), cache.stride(1),
            block_tables.stride(0),
            HEADS=index_heads, HEADS_P2=max(16, next_pow2(index_heads)),
            DIM=index_dim, DIM_P2=max(16, next_pow2(index_dim)),
            KEY_OFFSET=key_offset, BLOCK_SIZE=block_size, BLOCK_N=block_n,
            num_warps=1 if INTERPRETED else 4,
        )  # fmt: skip
        indices[r0:r1] = _slots(scores, k, block_tables, seq[r0:r1], block_size)
    return indices


def _slots(
    scores: torch.Tensor,  # [R, L] fp32, -inf = not visible
    k: int,
    block_tables: torch.Tensor,  # [num_seqs, max_blocks]
    seq: torch.Tensor,  # [R] each row's sequence
    block_size: int,
) -> torch.Tensor:  # [R, k] int32 slots of each row's k best keys, -1 = padding
    """A stable sort keeps equal scores in key order, so ties go to the earlier key."""
    values, order = scores.sort(dim=-1, descending=True, stable=True)
    values, order = values[:, :k], order[:, :k]
    column = (order // block_size).clamp_(max=block_tables.shape[1] - 1)  # -inf keys: any
    slots = block_tables.long()[seq[:, None], column] * block_size + order % block_size
    return torch.where(values > float("-inf"), slots, -1).to(torch.int32)
