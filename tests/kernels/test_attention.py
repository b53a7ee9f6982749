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


# (q_lens, ctx_lens): decode rows, a fresh prefill, chunked-prefill rows (70: two 64-row
# prefill tiles, the second partial), a lone long decode (19 blocks of 16, the last partial).
MIXED = ([1, 37, 1, 70, 3, 1], [90, 0, 300, 40, 1, 2])


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


# A 30-row chunk at positions 70..99 crosses the chunk boundary at 96; the 37-key window cuts
# its rows, both windows the long decode rows.
FEATURES_BATCH = ([1, 30, 1, 9], [300, 70, 5, 180])


@pytest.mark.parametrize("feature", list(FEATURES))
@pytest.mark.parametrize("num_splits", [1, 3])
def test_window_softcap_alibi(seed, device, feature, num_splits):
    b = make_batch(
        *FEATURES_BATCH,
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


# ---- key_ends: Gemma 3's images attend both ways at prefill ----------------------------------


def make_key_ends(
    q_lens: list[int], ctx_lens: list[int], device: torch.device, dtype=torch.int32
) -> torch.Tensor:
    """Key ends as the engine builds them: up to two random spans [s, e) of each sequence's new
    tokens (the first at least 2 tokens where there is room) get e, the other tokens p + 1, some
    of them a random value <= p + 1 instead (which must change nothing)."""
    ends = []
    for q_len, ctx in zip(q_lens, ctx_lens):
        pos = torch.arange(ctx, ctx + q_len)
        e = pos + 1
        noisy = torch.rand(q_len) < 0.3
        e[noisy] = (torch.rand(q_len)[noisy] * (pos[noisy] + 5)).long() - 3  # in [-3, p + 1]
        if q_len >= 3:
            a = int(torch.randint(0, q_len - 1, ()))
            z = int(torch.randint(a + 2, q_len + 1, ()))
            e[a:z] = ctx + z
            if z < q_len:  # a second span after the first
                a2 = int(torch.randint(z, q_len, ()))
                z2 = int(torch.randint(a2 + 1, q_len + 1, ()))
                e[a2:z2] = ctx + z2
        ends.append(e)
    return torch.cat(ends).to(device=device, dtype=dtype)


# Decode rows, a fresh prefill longer than a query tile (at most 32 rows in these tests),
# chunked prefills with context.
KEY_ENDS_BATCH = ([1, 40, 1, 40, 6], [50, 0, 30, 25, 3])

KEY_ENDS_FEATURES = {
    "plain": {},
    "window_small": {"sliding_window": 9},  # smaller than most spans
    "window_large": {"sliding_window": 45},
    "chunk": {"attention_chunk_size": 48},
    "sinks": {"sinks": "random"},
    "alibi_soft_cap": {"alibi_slopes": "alibi", "soft_cap": 5.0},
}


def compare_key_ends(
    b: Batch, key_ends: torch.Tensor, *, num_splits: int | None = 1, **kw
) -> torch.Tensor:
    """paged_attention == the reference with key_ends, which differs from plain causal (so a
    kernel ignoring key_ends would fail)."""
    want = run_and_compare(b, num_splits=num_splits, key_ends=key_ends, **kw)
    scale = b.q.shape[-1] ** -0.5
    args = (b.q, b.key_cache, b.value_cache, b.block_tables, b.cu_seqlens_q, b.seq_lens, scale)
    plain = ref_paged_attention(*args, **kw).float()
    tol = TOL[b.q.dtype]
    assert not torch.allclose(plain, want.float(), atol=tol, rtol=tol), "key_ends change nothing"
    return want


@pytest.mark.parametrize(
    ("dtype", "num_heads", "num_kv_heads", "block_size", "ends_dtype"),
    [
        (torch.float32, 2, 2, 16, torch.int32),
        (torch.float32, 8, 2, 8, torch.int64),
        (torch.bfloat16, 4, 1, 16, torch.int32),
        (torch.float16, 6, 2, 32, torch.int64),  # GROUP 3: padded head rows
    ],
)
def test_key_ends_mixed_batch(seed, device, dtype, num_heads, num_kv_heads, block_size, ends_dtype):
    b = make_batch(
        *KEY_ENDS_BATCH,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=32,
        block_size=block_size,
        dtype=dtype,
        device=device,
    )
    compare_key_ends(b, make_key_ends(*KEY_ENDS_BATCH, device, ends_dtype))


@pytest.mark.parametrize(
    ("feature", "num_splits"),
    [(f, 1) for f in KEY_ENDS_FEATURES]
    + [(f, 2) for f in ("plain", "window_small", "chunk", "sinks")],  # forced split-KV
)
def test_key_ends_window_chunk_sinks_splits(seed, device, feature, num_splits):
    # GQA 2 on one KV head: split-KV's merge runs one program per (token, head).
    b = make_batch(
        *KEY_ENDS_BATCH,
        num_heads=2,
        num_kv_heads=1,
        head_dim=32,
        block_size=16,
        dtype=torch.float32,
        device=device,
    )
    kw = dict(KEY_ENDS_FEATURES[feature])
    if kw.get("sinks") == "random":
        kw["sinks"] = torch.randn(2, device=device) + 2.0
    if kw.get("alibi_slopes") == "alibi":
        kw["alibi_slopes"] = alibi_slopes(2).to(device)
    compare_key_ends(b, make_key_ends(*KEY_ENDS_BATCH, device), num_splits=num_splits, **kw)


def test_key_ends_batch_invariant(seed, device):
    """batch_invariant=True with key_ends: a 40-token prompt with an image span [10, 30) gives
    the same bits prefilled whole, in two chunks split at the span's start, and among others."""
    num_heads, num_kv_heads, head_dim, block_size, length = 4, 2, 32, 16, 40
    other_q, other_ctx = [1, 9], [33, 0]
    b = make_batch(
        [length, *other_q],
        [0, *other_ctx],
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        block_size=block_size,
        dtype=torch.bfloat16,
        device=device,
    )
    ends = torch.arange(1, length + 1, dtype=torch.int32, device=device)
    ends[10:30] = 30
    others = make_key_ends(other_q, other_ctx, device)
    scale = head_dim**-0.5
    cache = (b.key_cache, b.value_cache)
    kw = {"batch_invariant": True}

    def attend(rows: slice, seqs: list[int], q_lens: list[int], key_ends: torch.Tensor):
        cu = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
        lens = torch.tensor(seqs, dtype=torch.int32, device=device)
        args = (*cache, b.block_tables[: len(seqs)], cu.to(device), lens, scale)
        q = b.q[rows]
        got = paged_attention(q, *args, key_ends=key_ends, **kw)
        want = ref_paged_attention(q, *args, key_ends=key_ends)
        torch.testing.assert_close(got.float(), want.float(), atol=3e-2, rtol=3e-2)
        return got

    alone = attend(slice(0, length), [length], [length], ends)
    first = attend(slice(0, 10), [10], [10], ends[:10])
    second = attend(slice(10, length), [length], [length - 10], ends[10:])
    assert torch.equal(torch.cat([first, second]), alone)
    # The batch's own tables: the 40-token prompt then the others, all prefilled together.
    mixed = attend(
        slice(None),
        [length, *[c + q for c, q in zip(other_ctx, other_q)]],
        [length, *other_q],
        torch.cat([ends, others]),
    )
    assert torch.equal(mixed[:length], alone)


def dense_key_ends_attention(
    q: torch.Tensor,  # [T, H, D]
    keys: list[torch.Tensor],  # per sequence [seq_len, Hkv, D]
    values: list[torch.Tensor],
    q_lens: list[int],
    key_ends: list[int],
    scale: float,
    *,
    sliding_window: int | None = None,
    attention_chunk_size: int | None = None,
    soft_cap: float | None = None,
    alibi_slopes: torch.Tensor | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Brute force in float64: one dense [q, k] mask per sequence from the rule
    k <= max(p, key_end - 1), p - k < W, k >= p - p % C."""
    out = torch.empty(q.shape, dtype=torch.float64)
    t = 0
    for k_seq, v_seq, q_len in zip(keys, values, q_lens):
        seq_len = k_seq.shape[0]
        group = q.shape[1] // k_seq.shape[1]
        k_all = k_seq.double().repeat_interleave(group, dim=1)  # [seq_len, H, D]
        v_all = v_seq.double().repeat_interleave(group, dim=1)
        for j in range(q_len):
            p = seq_len - q_len + j
            mask = torch.zeros(seq_len, dtype=torch.bool)
            for k in range(seq_len):
                ok = k <= max(p, key_ends[t] - 1)
                if sliding_window:
                    ok = ok and p - k < sliding_window
                if attention_chunk_size:
                    ok = ok and k >= p - p % attention_chunk_size
                mask[k] = ok
            s = torch.einsum("hd,khd->hk", q[t].double(), k_all) * scale  # [H, seq_len]
            if soft_cap:
                s = soft_cap * torch.tanh(s / soft_cap)
            if alibi_slopes is not None:
                s = s + alibi_slopes.double()[:, None] * (torch.arange(seq_len) - p).double()
            s = s.masked_fill(~mask, float("-inf"))
            if sinks is not None:
                s = torch.cat([s, sinks.double()[:, None]], dim=1)
            probs = s.softmax(-1)[:, :seq_len]
            out[t] = torch.einsum("hk,khd->hd", probs, v_all)
            t += 1
    return out


@pytest.mark.parametrize(
    "kw",
    [
        {},
        {"sliding_window": 4},
        {"attention_chunk_size": 6},
        {"soft_cap": 2.0, "alibi_slopes": "alibi"},
        {"sinks": "random", "sliding_window": 7},
    ],
    ids=["plain", "window", "chunk", "alibi_soft_cap", "sinks_window"],
)
def test_ref_key_ends_matches_dense_mask(seed, kw):
    """ref_paged_attention with key_ends against a dense brute force on contiguous K/V."""
    q_lens, ctx_lens = [1, 12, 9], [10, 0, 7]
    num_heads, num_kv_heads, head_dim, block_size = 4, 2, 8, 4
    b = make_batch(
        q_lens,
        ctx_lens,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        block_size=block_size,
        dtype=torch.float32,
        device=torch.device("cpu"),
    )
    kw = dict(kw)
    if kw.get("alibi_slopes") == "alibi":
        kw["alibi_slopes"] = alibi_slopes(num_heads)
    if kw.get("sinks") == "random":
        kw["sinks"] = torch.randn(num_heads) + 1.0
    key_ends = make_key_ends(q_lens, ctx_lens, torch.device("cpu"))
    keys, values = [], []
    for i, seq_len in enumerate(b.seq_lens.tolist()):
        pos = torch.arange(seq_len)
        slots = b.block_tables[i].long()[pos // block_size] * block_size + pos % block_size
        keys.append(b.key_cache.flatten(0, 1)[slots])
        values.append(b.value_cache.flatten(0, 1)[slots])
    scale = head_dim**-0.5
    want = dense_key_ends_attention(b.q, keys, values, q_lens, key_ends.tolist(), scale, **kw)
    args = (b.q, b.key_cache, b.value_cache, b.block_tables, b.cu_seqlens_q, b.seq_lens, scale)
    got = ref_paged_attention(*args, key_ends=key_ends, **kw)
    torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-5)
    # Without key_ends (all ends 0: nothing past p) both are plain causal attention.
    plain = dense_key_ends_attention(b.q, keys, values, q_lens, [0] * len(key_ends), scale, **kw)
    assert not torch.allclose(plain, want, atol=1e-3, rtol=1e-3), "key_ends change nothing"
    torch.testing.assert_close(
        ref_paged_attention(*args, **kw).double(), plain, atol=1e-5, rtol=1e-5
    )


def test_key_ends_none_is_the_default(seed, device):
    b = make_batch(
        [1, 20],
        [30, 5],
        num_heads=4,
        num_kv_heads=2,
        head_dim=32,
        block_size=16,
        dtype=torch.bfloat16,
        device=device,
    )
    scale = 32**-0.5
    args = (b.q, b.key_cache, b.value_cache, b.block_tables, b.cu_seqlens_q, b.seq_lens, scale)
    assert torch.equal(paged_attention(*args, key_ends=None), paged_attention(*args))
    assert torch.equal(ref_paged_attention(*args, key_ends=None), ref_paged_attention(*args))


def test_key_ends_rejects_bad_arguments(device):
    b = make_batch(
        [2, 3],
        [3, 0],
        num_heads=4,
        num_kv_heads=2,
        head_dim=32,
        block_size=16,
        dtype=torch.float32,
        device=device,
    )
    args = (b.q, b.key_cache, b.value_cache, b.block_tables, b.cu_seqlens_q, b.seq_lens, 1.0)
    good = torch.tensor([4, 5, 1, 2, 3], dtype=torch.int32, device=device)
    for fn in (paged_attention, ref_paged_attention):
        for key_ends in (good[:4], good[None], good.float()):  # shape, 2-D, dtype
            with pytest.raises(ValueError, match="key_ends"):
                fn(*args, key_ends=key_ends)
    with pytest.raises(ValueError, match="key_ends"):  # past seq_len: the reference checks
        ref_paged_attention(*args, key_ends=torch.tensor([4, 6, 1, 2, 3], device=device))


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
