"""Attention sinks (gpt-oss): one raw logit per query head in every row's softmax denominator.

The reference against HF's eager formula written densely (concatenate the sink logit, softmax,
drop its column), then paged_attention against the reference across the kernel's paths: dtypes,
GQA, block sizes, mixed rows, window / soft cap / ALiBi, forced split-KV (with a split 0 that
sees no key), fp8 caches and batch_invariant=True. Every case also checks that its sinks move
the output well past the tolerance, so a kernel that ignored them would fail.
"""

from __future__ import annotations

import math

import pytest
import torch
from test_attention import (  # tests/kernels is on sys.path
    FEATURES,
    FEATURES_BATCH,
    MIXED,
    TOL,
    Batch,
    make_batch,
)
from test_batch_invariant_kernels import Pool, attend

from paged_kernels import paged_attention, ref_paged_attention
from paged_kernels.reference import ref_quantize


def random_sinks(num_heads: int, device: torch.device, keys: int = 50) -> torch.Tensor:
    """Around log(keys): with about that many visible keys (scores ~ N(0, 1)) a sink takes a
    large share of a row's mass, from most to little as the heads' sinks spread."""
    return torch.randn(num_heads, device=device) * 1.5 + math.log(keys)


def args_of(b: Batch) -> tuple:
    scale = b.q.shape[-1] ** -0.5
    return (b.q, b.key_cache, b.value_cache, b.block_tables, b.cu_seqlens_q, b.seq_lens, scale)


def check_sinks(b: Batch, sinks: torch.Tensor, *, num_splits: int | None = 1, **kw) -> None:
    """paged_attention with sinks == the reference with sinks, which the same comparison
    would reject without sinks (so the test fails if the kernel drops them). Values get a mean
    of 1 (unless fp8): an output is then about the share of its row's mass the keys keep, so a
    wrong denominator shows at O(1), not at the ~1/sqrt(keys) of zero-mean values."""
    if b.value_cache.dtype == b.q.dtype:
        b.value_cache = b.value_cache + 1.0
    args = args_of(b)
    out = torch.full_like(b.q, float("nan"))  # poisoned: every element must be written
    paged_attention(
        *args,
        max_seqlen_q=b.max_seqlen_q,
        max_seqlen_k=b.max_seqlen_k,
        out=out,
        num_splits=num_splits,
        sinks=sinks,
        **kw,
    )
    want = ref_paged_attention(*args, sinks=sinks, **kw).float()
    assert not out.isnan().any(), "output rows left unwritten"
    tol = TOL[b.q.dtype]
    torch.testing.assert_close(out.float(), want, atol=tol, rtol=tol)
    plain = ref_paged_attention(*args, **kw).float()
    assert not torch.allclose(plain, want, atol=tol, rtol=tol), "the sinks change nothing here"


def dense_hf(
    q: torch.Tensor,  # [q_len, H, D], the last q_len positions of the sequence
    k: torch.Tensor,  # [seq_len, Hkv, D]
    v: torch.Tensor,
    sinks: torch.Tensor,  # [H]
    scale: float,
    window: int | None,
) -> torch.Tensor:  # [q_len, H, D] fp32
    """HF's eager_attention_forward for gpt-oss: scores, mask, the sink as a last column,
    softmax, the column dropped."""
    group = q.shape[1] // k.shape[1]
    k = k.float().repeat_interleave(group, dim=1)
    v = v.float().repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.float(), k) * scale
    q_pos = torch.arange(k.shape[0] - q.shape[0], k.shape[0])[:, None]
    k_pos = torch.arange(k.shape[0])[None, :]
    visible = k_pos <= q_pos
    if window:
        visible &= q_pos - k_pos < window
    scores = scores.masked_fill(~visible, float("-inf"))
    column = sinks.float()[:, None, None].expand(-1, q.shape[0], 1)
    probs = torch.cat([scores, column], dim=-1).softmax(-1)[..., :-1]
    return torch.einsum("hqk,khd->qhd", probs, v)


@pytest.mark.parametrize("window", [None, 5])
def test_reference_is_hfs_formula(seed, window):
    """A chunk after a cached context and a decode row, GQA 3:1, against the dense formula."""
    b = make_batch(
        [7, 1], [20, 30], num_heads=6, num_kv_heads=2, head_dim=16, block_size=4,
        dtype=torch.float32, device=torch.device("cpu"),
    )  # fmt: skip
    sinks = random_sinks(6, torch.device("cpu"))
    got = ref_paged_attention(*args_of(b), sinks=sinks, sliding_window=window)
    for i, (lo, hi) in enumerate([(0, 7), (7, 8)]):
        seq_len = int(b.seq_lens[i])
        blocks = b.block_tables[i, : -(-seq_len // 4)].long()
        k = b.key_cache[blocks].flatten(0, 1)[:seq_len]
        v = b.value_cache[blocks].flatten(0, 1)[:seq_len]
        want = dense_hf(b.q[lo:hi], k, v, sinks, 16**-0.5, window)
        torch.testing.assert_close(got[lo:hi], want, atol=1e-6, rtol=1e-5)
    # The sink only shrinks each row (a share of the mass goes nowhere): a very low sink is no
    # sink, a very high one leaves almost nothing.
    plain = ref_paged_attention(*args_of(b), sliding_window=window)
    low = ref_paged_attention(*args_of(b), sliding_window=window, sinks=torch.full((6,), -1e4))
    high = ref_paged_attention(*args_of(b), sliding_window=window, sinks=torch.full((6,), 60.0))
    assert torch.equal(low, plain) and high.abs().max() < 1e-20


@pytest.mark.parametrize(
    ("dtype", "num_heads", "num_kv_heads", "block_size"),
    [
        (torch.float32, 2, 2, 16),
        (torch.float16, 8, 2, 8),
        (torch.bfloat16, 16, 2, 32),
    ],
)
def test_mixed_batch(seed, device, dtype, num_heads, num_kv_heads, block_size):
    """Decode rows, a fresh prefill and chunked prefills in one batch; GQA 1, 4 and 8."""
    b = make_batch(
        *MIXED,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=64,
        block_size=block_size,
        dtype=dtype,
        device=device,
    )
    check_sinks(b, random_sinks(num_heads, device).to(dtype))  # cast to fp32 by the wrapper


@pytest.mark.parametrize("feature", ["window", "soft_cap", "all"])
@pytest.mark.parametrize("num_splits", [1, 3])
def test_with_window_softcap_alibi(seed, device, feature, num_splits):
    """The sink is not scaled, capped, biased or windowed (the reference's semantics)."""
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
    check_sinks(b, random_sinks(4, device), num_splits=num_splits, **kw)


@pytest.mark.parametrize(("num_splits", "window"), [(2, None), (7, None), (4, 200)])
def test_split_kv(seed, device, num_splits, window):
    """Flash decoding: split 0 alone carries the sink. With a 200-key window over contexts of
    3000 and 1100 keys, split 0 (and others) see no key: split 0 then holds the sink alone."""
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
    sinks = random_sinks(8, device, keys=window or 2000)
    check_sinks(b, sinks, num_splits=num_splits, sliding_window=window)


@pytest.mark.parametrize("num_splits", [1, 3])
def test_fp8_cache(seed, device, num_splits):
    """v_scale scales the values only, never the sink's share of the denominator."""
    b = make_batch(
        [1, 1, 1] if num_splits > 1 else MIXED[0],
        [300, 40, 500] if num_splits > 1 else MIXED[1],
        num_heads=8,
        num_kv_heads=2,
        head_dim=64,
        block_size=16,
        dtype=torch.float16,
        device=device,
    )
    k_scale, v_scale = 0.25, 0.5
    b.key_cache = ref_quantize(b.key_cache, torch.float8_e4m3fn, k_scale)
    b.value_cache = ref_quantize(b.value_cache, torch.float8_e4m3fn, v_scale)
    check_sinks(b, random_sinks(8, device), num_splits=num_splits, k_scale=k_scale, v_scale=v_scale)


def test_batch_invariant_rows(seed, device):
    """batch_invariant=True with sinks and a window: a sequence's rows have the same bits
    prefilled whole, chunked, decoded alone or beside other rows."""
    pool = Pool(1, 32, 16, torch.float32, device)  # GQA 4
    sinks = random_sinks(4, device)
    kw = {"batch_invariant": True, "sliding_window": 37, "sinks": sinks, "device": device}
    q = torch.randn(90, 4, 32, device=device)
    table = pool.table(90)
    (alone,) = attend(pool, [(q, table, 90)], **kw)
    first, second = attend(pool, [(q[:35], table, 35), (q[35:], table, 90)], **kw)
    assert torch.equal(torch.cat([first, second]), alone)
    other = (torch.randn(1, 4, 32, device=device), pool.table(120), 120)
    _, last = attend(pool, [other, (q[-1:], table, 90)], **kw)
    assert torch.equal(last, alone[-1:])
    plain = ref_paged_attention(
        q, pool.k, pool.v, table[None].to(device),
        torch.tensor([0, 90], dtype=torch.int32, device=device),
        torch.tensor([90], dtype=torch.int32, device=device), 0.125, sliding_window=37,
    )  # fmt: skip
    assert (alone - plain).abs().max() > 0.1


def test_minus_inf_sinks_are_no_sinks(seed, device):
    """A -inf sink adds e^-inf = 0: the same bits as no sinks, split or not (the kernel starts
    from its usual finite floor instead)."""
    b = make_batch(
        [1, 9, 1], [100, 70, 5], num_heads=4, num_kv_heads=2, head_dim=64, block_size=16,
        dtype=torch.float32, device=device,
    )  # fmt: skip
    minus_inf = torch.full((4,), float("-inf"), device=device)
    for kw in ({"num_splits": 1}, {"num_splits": 3, "sliding_window": 20}):
        plain = paged_attention(*args_of(b), **kw)
        assert torch.equal(paged_attention(*args_of(b), sinks=minus_inf, **kw), plain)


def test_rejects_bad_sinks(device):
    b = make_batch(
        [2], [3], num_heads=4, num_kv_heads=2, head_dim=64, block_size=16,
        dtype=torch.float32, device=device,
    )  # fmt: skip
    with pytest.raises(ValueError, match="sinks must be"):
        paged_attention(*args_of(b), sinks=torch.zeros(2, device=device))
    with pytest.raises(ValueError, match="sinks must be"):
        paged_attention(*args_of(b), sinks=torch.zeros(1, 4, device=device))
    with pytest.raises(ValueError, match="floating point"):
        paged_attention(*args_of(b), sinks=torch.zeros(4, dtype=torch.int32, device=device))
