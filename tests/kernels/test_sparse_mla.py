"""DeepSeek Sparse Attention kernels against their torch references on random paged caches:
sparse_mla_attention (each query row over an explicit list of cache slots, -1 padding, with and
without sink logits, rope part or none, fp8) and index_topk (the indexer's batched top-k)."""

from __future__ import annotations

import pytest
import torch

from paged_kernels import (
    index_topk,
    ref_index_topk,
    ref_sparse_mla_attention,
    sparse_mla_attention,
)

TOL = {torch.float32: 2e-3, torch.bfloat16: 3e-2}
# |o| >= 4 (a few keys of randn values) puts one bf16 ulp (2^-5) past 3e-2: a relative part
# of 1e-2 (> 2^-7, an ulp's relative size) covers one rounding step.
RTOL = {torch.bfloat16: 1e-2}


def _cache(num_blocks: int, block_size: int, width: int, dtype, device) -> torch.Tensor:
    return torch.randn(num_blocks, block_size, 1, width, device=device).to(dtype)


def _indices(tokens: int, k: int, num_slots: int, pad: float, device) -> torch.Tensor:
    """Distinct random slots a row (spanning blocks), a `pad` share of them -1."""
    rows = torch.stack([torch.randperm(num_slots)[:k] for _ in range(tokens)])
    rows[torch.rand(tokens, k) < pad] = -1
    return rows.to(torch.int32).to(device)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    ("heads", "latent", "rope", "block_size", "k", "pad"),
    [
        (4, 32, 8, 16, 5, 0.0),  # fewer keys than a tile
        (20, 48, 16, 4, 70, 0.3),  # a second, partly masked head group; three key tiles
        (1, 32, 0, 8, 33, 0.5),  # no rope part (a NoPE layer)
    ],
)
def test_sparse_attention_matches_reference(seed, device, dtype, heads, latent, rope,
                                            block_size, k, pad):  # fmt: skip
    cache = _cache(24, block_size, latent + rope + 16, dtype, device)  # + an indexer key
    q = torch.randn(6, heads, latent + rope, device=device).to(dtype)
    indices = _indices(6, k, 24 * block_size, pad, device)
    indices[0, 1:] = -1  # one key
    scale = (latent + rope) ** -0.5
    out = torch.full_like(q, float("nan"))  # the layer's view: columns past latent unwritten
    got = sparse_mla_attention(q, cache, indices, scale, latent_dim=latent, out=out)
    want = ref_sparse_mla_attention(q, cache, indices, scale, latent_dim=latent)
    assert got is out
    if rope:
        assert got[..., latent:].isnan().all()
    torch.testing.assert_close(
        got[..., :latent].float(), want.float(), atol=TOL[dtype], rtol=RTOL.get(dtype, 0.0)
    )


def test_sinks_and_rows_without_keys(seed, device):
    """A sink joins each head's softmax; a row of padding alone outputs 0 without sinks and
    0 with them (the sink's probability multiplies no value)."""
    cache = _cache(10, 16, 40, torch.float32, device)
    q = torch.randn(4, 5, 40, device=device)
    indices = _indices(4, 40, 160, 0.2, device)
    indices[3] = -1
    sinks = torch.randn(5, device=device) * 3
    for s in (None, sinks):
        got = sparse_mla_attention(q, cache, indices, 0.15, latent_dim=32, sinks=s)
        want = ref_sparse_mla_attention(q, cache, indices, 0.15, latent_dim=32, sinks=s)
        torch.testing.assert_close(got, want, atol=2e-3, rtol=0)
        assert not got[3].any()


def test_deepseek_v32_widths_fp8(seed, device):
    """512 latent + 64 rope (+ a 128-wide indexer key), 16 heads, over an fp8 cache whose key
    scale applies to the values too."""
    cache = (_cache(8, 16, 512 + 64 + 128, torch.float32, device) * 2).to(torch.float8_e5m2)
    q = torch.randn(2, 16, 576, device=device).to(torch.bfloat16)
    indices = _indices(2, 40, 128, 0.1, device)
    kw = {"latent_dim": 512, "k_scale": 0.5}
    got = sparse_mla_attention(q, cache, indices, 576**-0.5, **kw)
    want = ref_sparse_mla_attention(q, cache, indices, 576**-0.5, **kw)
    torch.testing.assert_close(got.float(), want.float(), atol=3e-2, rtol=RTOL[torch.bfloat16])


@pytest.mark.parametrize(
    ("index_heads", "index_dim", "topk", "block_size", "fp8"),
    [(8, 16, 6, 4, False), (8, 16, 6, 16, True), (3, 24, 50, 4, False), (3, 24, 50, 16, False)],
)
def test_index_topk_matches_reference(seed, device, index_heads, index_dim, topk, block_size,
                                      fp8):  # fmt: skip
    """Decode rows, a prefill and a chunked prefill over a cached prefix, some shorter than
    topk (padded with -1); zero keys score exactly 0 and tie, the earlier key winning; an fp8
    cache's keys scaled by k_scale."""
    q_lens, ctx_lens = [1, 9, 1, 5], [30, 0, 2, 60]
    seq_lens = [c + n for c, n in zip(ctx_lens, q_lens, strict=True)]
    blocks = [-(-n // block_size) for n in seq_lens]
    num_blocks = sum(blocks) + 3
    perm = torch.randperm(num_blocks).tolist()
    tables = torch.zeros(len(seq_lens), max(blocks) + 1, dtype=torch.int32)
    for s, n in enumerate(blocks):
        tables[s, :n] = torch.tensor(perm[:n])
        del perm[:n]
    offset = 40  # the key follows [c | k_pe]
    cache = _cache(num_blocks, block_size, offset + index_dim, torch.float32, device)
    cache.view(-1, offset + index_dim)[::3, offset:] = 0  # ties at score 0
    if fp8:
        cache = (cache * 4).to(torch.float8_e5m2)
    t = sum(q_lens)
    index_q = torch.randn(t, index_heads * (index_dim + 1), device=device)
    cu = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    args = (index_q, cache, tables.to(device), cu.to(device),
            torch.tensor(seq_lens, dtype=torch.int32, device=device))  # fmt: skip
    kw = {"key_offset": offset, "index_heads": index_heads, "index_dim": index_dim,
          "topk": topk, "max_seqlen_k": max(seq_lens) + 7,
          "k_scale": 0.25 if fp8 else 1.0}  # fmt: skip
    got = index_topk(*args, **kw)
    want = ref_index_topk(*args, **kw)
    assert got.shape == (t, min(topk, max(seq_lens) + 7))
    assert (got == -1).any() and (got[:, :1] >= 0).all()
    # the same keys; their order (best first) may differ where scores differ in the last bit
    assert torch.equal(got.sort(dim=-1).values, want.sort(dim=-1).values)


def test_bad_arguments(device):
    cache = _cache(4, 16, 40, torch.float32, device)
    q = torch.randn(2, 4, 40, device=device)
    with pytest.raises(ValueError, match="indices must be"):
        sparse_mla_attention(q, cache, torch.zeros(2, 3, dtype=torch.int64), 1.0, latent_dim=32)
    with pytest.raises(ValueError, match="cache width"):
        sparse_mla_attention(q, cache[..., :30], torch.zeros(2, 3, dtype=torch.int32), 1.0,
                             latent_dim=32)  # fmt: skip
