"""paged_attention against ref_paged_attention on random mixed decode / prefill batches.

Every test fills `out` with NaN first, scatters the sequences' blocks over a random permutation
of a larger pool (unused blocks hold random data too) and draws fresh random inputs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import pytest
import torch

from paged_kernels import (
    alibi_slopes,
    choose_num_splits,
    paged_attention,
    ref_paged_attention,
    write_kv_cache,
)

TOL = {torch.float32: 2e-3, torch.float16: 1e-2, torch.bfloat16: 3e-2}


@dataclass(slots=True)
class Batch:
    q: torch.Tensor  # [num_q_tokens, num_heads, head_dim]
    key_cache: torch.Tensor  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor
    block_tables: torch.Tensor  # [num_seqs, max_blocks] int32
    cu_seqlens_q: torch.Tensor  # [num_seqs + 1] int32
    seq_lens: torch.Tensor  # [num_seqs] int32
    max_seqlen_q: int
    max_seqlen_k: int


def make_batch(
    q_lens: list[int],
    ctx_lens: list[int],  # cached prefix before this step's tokens
    *,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype,
    device: torch.device,
    spare_blocks: int = 16,
) -> Batch:
    seq_lens = [c + q for c, q in zip(ctx_lens, q_lens)]
    needed = [math.ceil(s / block_size) for s in seq_lens]
    max_blocks = max(needed) + 2
    num_blocks = sum(needed) + spare_blocks
    perm = torch.randperm(num_blocks)
    # Table entries past a sequence's blocks point at random blocks: reading them is an error
    # the comparison catches.
    tables = torch.randint(0, num_blocks, (len(q_lens), max_blocks), dtype=torch.int32)
    start = 0
    for i, n in enumerate(needed):
        tables[i, :n] = perm[start : start + n]
        start += n
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    cu = [0]
    for n in q_lens:
        cu.append(cu[-1] + n)
    return Batch(
        q=torch.randn(cu[-1], num_heads, head_dim, device=device).to(dtype),
        key_cache=torch.randn(shape, device=device).to(dtype),
        value_cache=torch.randn(shape, device=device).to(dtype),
        block_tables=tables.to(device),
        cu_seqlens_q=torch.tensor(cu, dtype=torch.int32, device=device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        max_seqlen_q=max(q_lens),
        max_seqlen_k=max(seq_lens),
    )


def run_and_compare(b: Batch, *, num_splits: int | None = None, **kw) -> torch.Tensor:
    head_dim = b.q.shape[-1]
    scale = head_dim**-0.5
    args = (b.q, b.key_cache, b.value_cache, b.block_tables, b.cu_seqlens_q, b.seq_lens, scale)
    out = torch.full_like(b.q, float("nan"))  # poisoned: every element must be written
    got = paged_attention(
        *args,
        max_seqlen_q=b.max_seqlen_q,
        max_seqlen_k=b.max_seqlen_k,
        out=out,
        num_splits=num_splits,
        **kw,
    )
    assert got.data_ptr() == out.data_ptr()
    want = ref_paged_attention(*args, **kw)
    assert not out.isnan().any(), "output rows left unwritten"
    tol = TOL[b.q.dtype]
    torch.testing.assert_close(out.float(), want.float(), atol=tol, rtol=tol)
    return out


# (q_lens, ctx_lens): decode rows, a fresh prefill, chunked-prefill rows, a lone long decode.
MIXED = ([1, 37, 1, 130, 3, 1], [90, 0, 700, 40, 1, 2])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize(("num_heads", "num_kv_heads"), [(2, 2), (8, 2), (16, 2)])
def test_mixed_batch_dtypes_and_gqa(seed, device, dtype, num_heads, num_kv_heads):
    b = make_batch(
        *MIXED,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=64,
        block_size=16,
        dtype=dtype,
        device=device,
    )
    run_and_compare(b, num_splits=1)


@pytest.mark.parametrize(
    ("head_dim", "block_size"),
    [(64, 32), (80, 16), (96, 8), (128, 64), (256, 16), (288, 32), (512, 16)],
)
def test_head_dims_and_block_sizes(seed, device, head_dim, block_size):
    b = make_batch(
        [1, 20, 1],
        [50, 13, 200],
        num_heads=4,
        num_kv_heads=2,
        head_dim=head_dim,
        block_size=block_size,
        dtype=torch.float16,
        device=device,
    )
    run_and_compare(b, num_splits=1)


def test_long_prefill_rows(seed, device):
    """Query lengths up to 300 and a context of a few thousand tokens."""
    b = make_batch(
        [300, 1, 77],
        [0, 2500, 1200],
        num_heads=4,
        num_kv_heads=1,
        head_dim=64,
        block_size=16,
        dtype=torch.bfloat16,
        device=device,
    )
    run_and_compare(b)


FEATURES = {
    "window": {"sliding_window": 37},
    "chunk": {"attention_chunk_size": 48},  # not a multiple of the block size or a tile
    "soft_cap": {"soft_cap": 3.0},
    "alibi": {"alibi_slopes": alibi_slopes(4)},
    "all": {"sliding_window": 100, "soft_cap": 5.0, "alibi_slopes": alibi_slopes(4)},
}


@pytest.mark.parametrize("feature", list(FEATURES))
@pytest.mark.parametrize("num_splits", [1, 3])
def test_window_softcap_alibi(seed, device, feature, num_splits):
    b = make_batch(
        [1, 45, 1, 9],
        [300, 70, 5, 180],
        num_heads=4,
        num_kv_heads=2,
        head_dim=64,
        block_size=16,
        dtype=torch.float32,
        device=device,
    )
    kw = dict(FEATURES[feature])
    if "alibi_slopes" in kw:
        kw["alibi_slopes"] = kw["alibi_slopes"].to(device)
    run_and_compare(b, num_splits=num_splits, **kw)


@pytest.mark.parametrize("num_splits", [None, 1, 2, 7])
def test_split_kv_decode(seed, device, num_splits):
    """Few sequences, long contexts: the flash-decoding path, forced on and off."""
    b = make_batch(
        [1, 1],
        [3000, 1100],
        num_heads=8,
        num_kv_heads=1,
        head_dim=64,
        block_size=32,
        dtype=torch.bfloat16,
        device=device,
    )
    run_and_compare(b, num_splits=num_splits)


def test_int64_metadata_empty_seq_strided_q(seed, device):
    """int64 tables/offsets, a sequence with no query rows, q a view into a fused QKV tensor."""
    b = make_batch(
        [3, 0, 1],
        [20, 9, 60],
        num_heads=4,
        num_kv_heads=2,
        head_dim=64,
        block_size=16,
        dtype=torch.float16,
        device=device,
    )
    qkv = torch.randn(b.q.shape[0], 4 + 2 * 2, 64, device=device).to(torch.float16)
    b.q = qkv[:, :4]
    b.block_tables = b.block_tables.long()
    b.cu_seqlens_q = b.cu_seqlens_q.long()
    b.seq_lens = b.seq_lens.long()
    run_and_compare(b)


def test_split_kv_heuristic():
    assert choose_num_splits(2, 8, 1, 32768, 132) == 17  # decode, 16 pairs: ~2 programs per SM
    assert choose_num_splits(2, 8, 1, 1024, 132) == 2  # capped by >= 512 keys per split
    assert choose_num_splits(2, 8, 7, 32768, 132) == 1  # prefill rows present
    assert choose_num_splits(64, 8, 1, 32768, 132) == 2  # up to 4x the SMs, long: two splits
    assert choose_num_splits(64, 8, 1, 2047, 132) == 1  # ... not under 2048 keys
    assert choose_num_splits(67, 8, 1, 32768, 132) == 1  # more than 4x the SMs: no split
    assert choose_num_splits(128, 8, 1, 32768, 132) == 1
    assert choose_num_splits(1, 1, 1, 100, 132) == 1  # too short to split


def test_write_then_attend_chunked_prefill(seed, device):
    """Prefill a prompt in chunks (write K/V, then attend) == one-shot causal attention."""
    num_heads, num_kv_heads, head_dim, block_size, total = 4, 2, 64, 16, 150
    num_blocks = 40
    table = torch.randperm(num_blocks)[: math.ceil(total / block_size)].to(torch.int32)
    tables = table[None].to(device)
    key_cache = torch.zeros(num_blocks, block_size, num_kv_heads, head_dim, device=device)
    value_cache = torch.zeros_like(key_cache)
    q = torch.randn(total, num_heads, head_dim, device=device)
    k = torch.randn(total, num_kv_heads, head_dim, device=device)
    v = torch.randn(total, num_kv_heads, head_dim, device=device)
    pos = torch.arange(total, device=device)
    slots = table.to(device).long()[pos // block_size] * block_size + pos % block_size
    out = torch.full_like(q, float("nan"))
    for lo, hi in [(0, 64), (64, 65), (65, 140), (140, 150)]:
        write_kv_cache(k[lo:hi], v[lo:hi], key_cache, value_cache, slots[lo:hi])
        cu = torch.tensor([0, hi - lo], dtype=torch.int32, device=device)
        lens = torch.tensor([hi], dtype=torch.int32, device=device)
        paged_attention(q[lo:hi], key_cache, value_cache, tables, cu, lens, 0.125, out=out[lo:hi])
    scores = torch.einsum("qhd,khd->hqk", q, k.repeat_interleave(2, dim=1)) * 0.125
    causal = torch.ones(total, total, dtype=torch.bool, device=device).tril()
    probs = scores.masked_fill(~causal, float("-inf")).softmax(-1)
    want = torch.einsum("hqk,khd->qhd", probs, v.repeat_interleave(2, dim=1))
    torch.testing.assert_close(out, want, atol=2e-3, rtol=2e-3)


def test_rejects_bad_arguments(device):
    b = make_batch(
        [2],
        [3],
        num_heads=4,
        num_kv_heads=2,
        head_dim=64,
        block_size=16,
        dtype=torch.float32,
        device=device,
    )
    args = (b.key_cache, b.value_cache, b.block_tables, b.cu_seqlens_q, b.seq_lens, 1.0)
    with pytest.raises(ValueError, match="multiple"):
        paged_attention(b.q[:, :3], *args)
    with pytest.raises(ValueError, match="dtype"):
        paged_attention(b.q.half(), *args)
    with pytest.raises(ValueError, match="cu_seqlens_q"):
        paged_attention(b.q, *args[:3], b.cu_seqlens_q[:1], *args[4:])
    with pytest.raises(ValueError, match="last dim"):
        paged_attention(b.q.transpose(1, 2).contiguous().transpose(1, 2), *args)


# ---- GPU only: realistic and large shapes ----------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("head_dim", [64, 80, 96, 128, 256])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_gpu_realistic_mixed(seed, head_dim, dtype):
    q_lens = [1] * 48 + [300, 17, 128, 1000]
    ctx_lens = torch.randint(1, 4000, (len(q_lens),)).tolist()
    b = make_batch(
        q_lens,
        ctx_lens,
        num_heads=32,
        num_kv_heads=8,
        head_dim=head_dim,
        block_size=16,
        dtype=dtype,
        device=torch.device("cuda"),
        spare_blocks=2000,
    )
    run_and_compare(b)
    run_and_compare(b, sliding_window=1024, soft_cap=30.0)


@pytest.mark.gpu
@pytest.mark.parametrize("num_splits", [None, 1])
def test_gpu_32k_context(seed, num_splits):
    b = make_batch(
        [1, 1, 64],
        [32768, 40000, 32768],
        num_heads=32,
        num_kv_heads=8,
        head_dim=128,
        block_size=32,
        dtype=torch.bfloat16,
        device=torch.device("cuda"),
    )
    run_and_compare(b, num_splits=num_splits)


@pytest.mark.gpu
def test_gpu_pool_over_2gib(seed):
    """Blocks past 2^31 bytes of a pool: cache offsets must be computed in int64."""
    num_kv_heads, head_dim, block_size = 8, 128, 16
    block_bytes = block_size * num_kv_heads * head_dim * 2
    num_blocks = (2**31 // block_bytes) * 2 + 64  # > 4 GiB per cache
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    key_cache = torch.empty(shape, dtype=torch.bfloat16, device="cuda")
    value_cache = torch.empty_like(key_cache)
    seq_len = 40 * block_size
    high = torch.arange(num_blocks - 40, num_blocks, dtype=torch.int32, device="cuda")
    pos = torch.arange(seq_len, device="cuda")
    slots = high.long()[pos // block_size] * block_size + pos % block_size
    k = torch.randn(seq_len, num_kv_heads, head_dim, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    write_kv_cache(k, v, key_cache, value_cache, slots)
    q = torch.randn(seq_len, 32, head_dim, device="cuda", dtype=torch.bfloat16)
    b = Batch(
        q=q,
        key_cache=key_cache,
        value_cache=value_cache,
        block_tables=high[None],
        cu_seqlens_q=torch.tensor([0, seq_len], dtype=torch.int32, device="cuda"),
        seq_lens=torch.tensor([seq_len], dtype=torch.int32, device="cuda"),
        max_seqlen_q=seq_len,
        max_seqlen_k=seq_len,
    )
    run_and_compare(b)
