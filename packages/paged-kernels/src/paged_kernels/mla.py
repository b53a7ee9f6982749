"""Paged attention over a latent KV cache (multi-head latent attention, DeepSeek-V2 / V3).

The cache holds one vector a token, [c, k_pe]: LATENT entries (kv_lora_rank, 512) and ROPE
entries (qk_rope_head_dim, 64). It is every query head's key, and its first LATENT entries are
the value. Queries come absorbed into the same space ([T, H, LATENT + ROPE]); the output is
[T, H, LATENT] (written into the first LATENT columns of `out`).

A program owns BLOCK_Q query tokens of one sequence and a group of HEADS query heads (rows
m = token m // HEADS, head m % HEADS). Each key tile is loaded once as [BLOCK_N, LATENT] and
[BLOCK_N, ROPE] and serves both products: s = q_c . c + q_pe . k_pe and acc += p @ c. Heads
wider than the Triton paged_attention kernel's MAX_HEAD_DIM fit because the latent part is one
power-of-two tile and the rope part a second one, instead of one padded 1024-wide tile. Causal
masking, the fp32 base-2 online softmax and fp8 caches (the key scale folded into the softmax
scale, the value scale, equal to it, into the normalisation) follow paged_attention. No
windows, soft-caps, ALiBi or sinks: MLA models use none of them.

Decode can split each sequence's keys over programs (split-KV, as paged_attention; the partial
results merged by its merge kernel): with 16 heads a sequence is one program, so a batch of 32
fills a quarter of an H200's SMs (9% of its copy bandwidth at 2k keys, unsplit).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from paged_kernels._dot import tile_dot
from paged_kernels._utils import (
    FLOAT_DTYPES,
    FP8_DTYPES,
    INTERPRETED,
    check,
    check_fp8_readable,
    check_kv_scales,
    check_last_dim_contiguous,
    device_sms,
    next_pow2,
)
from paged_kernels.attention import (
    _find_seq,
    _invariant_splits,
    _merge_splits,
    _split_parts,
    _store_rows,
    choose_num_splits,
)

# Query heads a program holds: 16 rows is the smallest tile tl.dot takes on tensor cores.
MAX_HEADS_PER_PROGRAM = 16


@triton.jit(do_not_specialize=["num_seqs", "num_q_tokens", "stride_bt"])
def _mla_attention_kernel(
    q_ptr,  # [num_q_tokens, num_heads, LATENT + ROPE]
    cache_ptr,  # [num_blocks, block_size, 1, LATENT + ROPE]
    block_tables_ptr,  # [num_seqs, max_blocks] int32
    cu_seqlens_q_ptr,  # [num_seqs + 1] int32
    seq_lens_ptr,  # [num_seqs] int32, context incl. this step's query tokens
    out_ptr,  # [num_q_tokens, num_heads, >= LATENT], written unless SPLIT
    part_out_ptr,  # [num_splits, num_q_tokens, num_heads, LATENT] fp32, written if SPLIT
    part_lse_ptr,  # [num_splits, num_q_tokens, num_heads] fp32 (log2 domain), written if SPLIT
    num_seqs,
    num_q_tokens,
    scale,  # softmax scale times the cache's key scale
    v_scale,
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_cb,
    stride_cs,
    stride_bt,
    NUM_HEADS: tl.constexpr,
    HEADS: tl.constexpr,  # query heads a program holds (a power of two)
    LATENT: tl.constexpr,
    LATENT_P2: tl.constexpr,
    ROPE: tl.constexpr,
    ROPE_P2: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_M: tl.constexpr,  # BLOCK_Q * HEADS
    BLOCK_N: tl.constexpr,
    SPLIT: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    DOT_UPCAST: tl.constexpr,  # interpreter only: its tl.dot multiplies raw bf16 bits
    EXPLICIT_DOT: tl.constexpr,  # interpreter and batch_invariant only (_dot.py)
):
    tile = tl.program_id(0)
    head_group = tl.program_id(1)
    split = tl.program_id(2)
    seq = _find_seq(cu_seqlens_q_ptr, num_seqs, tile, BLOCK_Q)
    q_start = tl.load(cu_seqlens_q_ptr + seq)
    q_len = tl.load(cu_seqlens_q_ptr + seq + 1) - q_start
    local = tile - (q_start // BLOCK_Q + seq)
    if local * BLOCK_Q >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    ctx = seq_len - q_len

    offs_m = tl.arange(0, BLOCK_M)
    q_row = local * BLOCK_Q + offs_m // HEADS
    head = head_group * HEADS + offs_m % HEADS
    row_ok = (q_row < q_len) & (head < NUM_HEADS)
    q_pos = ctx + q_row
    tok = (q_start + q_row).to(tl.int64)
    offs_c = tl.arange(0, LATENT_P2)
    c_ok = offs_c < LATENT
    offs_r = LATENT + tl.arange(0, ROPE_P2)
    r_ok = offs_r < LATENT + ROPE
    q_base = q_ptr + tok[:, None] * stride_qt + head[:, None] * stride_qh
    q_c = tl.load(q_base + offs_c[None, :], mask=row_ok[:, None] & c_ok[None, :], other=0.0)
    q_r = tl.load(q_base + offs_r[None, :], mask=row_ok[:, None] & r_ok[None, :], other=0.0)
    if DOT_UPCAST:
        q_c, q_r = q_c.to(tl.float32), q_r.to(tl.float32)

    hi = ctx + tl.minimum(q_len, (local + 1) * BLOCK_Q)  # keys any row of the tile can see
    lo = 0
    if SPLIT:
        split_len = tl.cdiv(tl.cdiv(seq_len, tl.num_programs(2)), BLOCK_N) * BLOCK_N
        lo = split * split_len
        hi = tl.minimum(hi, (split + 1) * split_len)
    m_i = tl.full([BLOCK_M], -1.0e30, tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, LATENT_P2], tl.float32)
    zero_s = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    zero_o = tl.zeros([BLOCK_M, LATENT_P2], tl.float32)
    table = block_tables_ptr + seq.to(tl.int64) * stride_bt
    for start in range(lo, hi, BLOCK_N):
        offs_n = start + tl.arange(0, BLOCK_N)
        n_ok = offs_n < hi
        block = tl.load(table + offs_n // BLOCK_SIZE, mask=n_ok, other=0).to(tl.int64)
        row_base = cache_ptr + block * stride_cb + (offs_n % BLOCK_SIZE) * stride_cs
        c = tl.load(
            row_base[:, None] + offs_c[None, :], mask=n_ok[:, None] & c_ok[None, :], other=0.0
        )  # [BLOCK_N, LATENT_P2]
        k_r = tl.load(
            row_base[:, None] + offs_r[None, :], mask=n_ok[:, None] & r_ok[None, :], other=0.0
        )
        c = c.to(q_ptr.dtype.element_ty)  # no-op unless the cache is fp8
        k_r = k_r.to(q_ptr.dtype.element_ty)
        if DOT_UPCAST:
            c, k_r = c.to(tl.float32), k_r.to(tl.float32)
        s = tile_dot(q_c, tl.trans(c), zero_s, DOT_PRECISION, EXPLICIT_DOT)
        s = tile_dot(q_r, tl.trans(k_r), s, DOT_PRECISION, EXPLICIT_DOT) * scale
        visible = (offs_n[None, :] <= q_pos[:, None]) & n_ok[None, :]
        s = tl.where(visible, s * 1.4426950408889634, float("-inf"))  # log2(e): base-2 softmax
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        p = p.to(q_ptr.dtype.element_ty)  # PV in the compute dtype, like the GPU
        if DOT_UPCAST:
            p = p.to(tl.float32)
        acc = acc * alpha[:, None] + tile_dot(p, c, zero_o, DOT_PRECISION, EXPLICIT_DOT)
        m_i = m_new

    _store_rows(
        acc, m_i, l_i, v_scale, out_ptr, part_out_ptr, part_lse_ptr, tok, head, split,
        num_q_tokens, stride_ot, stride_oh, offs_c, row_ok, c_ok, NUM_HEADS, LATENT, SPLIT,
    )  # fmt: skip


def _tiles(num_heads: int, decode: bool) -> tuple[int, int, int, int]:
    """(HEADS, BLOCK_Q, BLOCK_N, num_warps): at least 16 rows a tile (tl.dot's minimum), 32 in
    prefill tiles; 32-key tiles keep the [BLOCK_N, 512] latent tile and the [M, 512] fp32
    accumulator in registers."""
    heads = min(MAX_HEADS_PER_PROGRAM, next_pow2(num_heads))
    rows = 16 if decode else 32
    return heads, max(1, rows // heads), 32, 8


def mla_attention(
    q: torch.Tensor,  # [num_q_tokens, num_heads, latent + rope]
    cache: torch.Tensor,  # [num_blocks, block_size, 1, latent + rope]
    block_tables: torch.Tensor,  # [num_seqs, max_blocks] int32
    cu_seqlens_q: torch.Tensor,  # [num_seqs + 1] int32
    seq_lens: torch.Tensor,  # [num_seqs] int32
    scale: float,
    *,
    latent_dim: int,
    max_seqlen_q: int | None = None,
    max_seqlen_k: int | None = None,
    k_scale: float = 1.0,
    out: torch.Tensor | None = None,  # [num_q_tokens, num_heads, >= latent_dim]
    batch_invariant: bool = False,
    num_splits: int | None = None,  # None: heuristic (decode with max_seqlen_k); 1: never split
) -> torch.Tensor:
    """Causal attention of absorbed MLA queries over a latent paged cache; returns `out`, whose
    first `latent_dim` columns hold softmax(q K^T * scale) @ cache[..., :latent_dim] per head
    (the rest untouched). `max_seqlen_q` (1: every row decodes) picks the tiles without reading
    lengths on the host; an fp8 cache's `k_scale` also scales its values (they are the keys).
    Decode steps given `max_seqlen_k` split each sequence's keys over several programs when
    too few (sequence, head group) pairs would fill the device (`choose_num_splits`, as
    paged_attention); `num_splits` forces a count. `batch_invariant`: one tile shape for every
    batch and never split, so a row's result never depends on what else is in the batch."""
    check(q.dim() == 3, f"q must be [num_q_tokens, num_heads, D], got {tuple(q.shape)}")
    check(cache.dim() == 4 and cache.shape[2] == 1, "cache must be [num_blocks, block_size, 1, D]")
    num_tokens, num_heads, width = q.shape
    _, block_size, _, cache_width = cache.shape
    check(cache_width == width, f"cache width {cache_width} != q's {width}")
    check(0 < latent_dim < width, f"latent_dim {latent_dim} must be in (0, {width})")
    check(q.dtype in FLOAT_DTYPES, f"unsupported dtype {q.dtype}")
    check(cache.dtype == q.dtype or cache.dtype in FP8_DTYPES, "cache dtype must be q's or fp8")
    check_kv_scales(cache.dtype, k_scale, k_scale)
    check_fp8_readable(cache.dtype, q.device)
    check(cache.is_contiguous(), "cache must be contiguous")
    check_last_dim_contiguous("q", q)
    if out is None:
        out = torch.empty(num_tokens, num_heads, latent_dim, dtype=q.dtype, device=q.device)
    check(out.shape[:2] == q.shape[:2] and out.shape[2] >= latent_dim, "bad out shape")
    check(out.stride(2) == 1 and out.dtype == q.dtype, "out must match q's dtype, last dim dense")
    num_seqs = seq_lens.shape[0]
    if num_tokens == 0 or num_seqs == 0:
        return out
    if max_seqlen_q is None and not batch_invariant:
        max_seqlen_q = int((cu_seqlens_q[1:] - cu_seqlens_q[:-1]).max())
    decode = not batch_invariant and max_seqlen_q == 1
    heads, block_q, block_n, num_warps = _tiles(num_heads, decode)
    groups = triton.cdiv(num_heads, heads)
    num_splits = _invariant_splits(num_splits, batch_invariant)
    if num_splits is None:  # without max_seqlen_k: no split (its heuristic would read lengths)
        num_splits = 1
        if decode and max_seqlen_k is not None:
            num_splits = choose_num_splits(
                num_seqs, groups, max_seqlen_q, max_seqlen_k, device_sms(q.device)
            )
    check(num_splits >= 1, "num_splits must be >= 1")
    split = num_splits > 1
    part_out, part_lse = _split_parts(num_splits, num_tokens, num_heads, latent_dim, out)
    rope = width - latent_dim
    upcast = INTERPRETED and q.dtype == torch.bfloat16
    grid = (num_tokens // block_q + num_seqs, groups, num_splits)
    _mla_attention_kernel[grid](
        q,
        cache,
        block_tables,
        cu_seqlens_q,
        seq_lens,
        out,
        part_out,
        part_lse,
        num_seqs,
        num_tokens,
        float(scale) * float(k_scale),
        float(k_scale),
        q.stride(0),
        q.stride(1),
        out.stride(0),
        out.stride(1),
        cache.stride(0),
        cache.stride(1),
        block_tables.stride(0),
        NUM_HEADS=num_heads,
        HEADS=heads,
        LATENT=latent_dim,
        LATENT_P2=max(16, next_pow2(latent_dim)),
        ROPE=rope,
        ROPE_P2=max(16, next_pow2(rope)),
        BLOCK_SIZE=block_size,
        BLOCK_Q=block_q,
        BLOCK_M=block_q * heads,
        BLOCK_N=block_n,
        SPLIT=split,
        DOT_PRECISION="ieee" if q.dtype == torch.float32 or upcast else "tf32",
        DOT_UPCAST=upcast,
        EXPLICIT_DOT=INTERPRETED and batch_invariant,
        num_warps=1 if INTERPRETED else num_warps,
        num_stages=2,
    )
    if split:
        _merge_splits(part_out, part_lse, out)
    return out
