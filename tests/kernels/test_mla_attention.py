"""mla_attention (a latent cache: one KV head that is also the value) against ref_mla_attention
on random mixed decode / prefill batches, DeepSeek-V3's widths included (512 + 64: above
paged_attention's MAX_HEAD_DIM)."""

from __future__ import annotations

import pytest
import torch
from test_attention import make_batch

from paged_kernels import mla_attention, ref_mla_attention

TOL = {torch.float32: 2e-3, torch.float16: 1e-2, torch.bfloat16: 3e-2}
# Outputs (averages of randn values) reach |o| >= 4 on some seeds, where one bf16 ulp (2^-5)
# exceeds 3e-2: a relative part of 1e-2 (> 2^-7, an ulp's relative size) covers one rounding
# step (the interpreter truncates). A wrong scale or key moves outputs by O(0.1-1).
RTOL = {torch.bfloat16: 1e-2}


def _check(q_lens, ctx_lens, *, heads, latent, rope, block_size, dtype, device, **kw):
    b = make_batch(
        q_lens,
        ctx_lens,
        num_heads=heads,
        num_kv_heads=1,
        head_dim=latent + rope,
        block_size=block_size,
        dtype=dtype,
        device=device,
    )
    scale = (latent + rope) ** -0.5
    args = (b.q, b.key_cache, b.block_tables, b.cu_seqlens_q, b.seq_lens, scale)
    # The output is as wide as the queries (the layer's view); columns past latent stay NaN.
    out = torch.full_like(b.q, float("nan"))
    got = mla_attention(*args, latent_dim=latent, max_seqlen_q=b.max_seqlen_q, out=out, **kw)
    want = ref_mla_attention(*args, latent_dim=latent, **kw)
    assert got is out
    assert not got[..., :latent].isnan().any()
    assert got[..., latent:].isnan().all()  # never written
    torch.testing.assert_close(
        got[..., :latent].float(), want.float(), atol=TOL[dtype], rtol=RTOL.get(dtype, 0.0)
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize(
    ("heads", "latent", "rope", "block_size"),
    [(4, 32, 8, 16), (16, 64, 16, 32), (20, 48, 16, 16), (1, 32, 8, 8)],
)
def test_mixed_batch_matches_reference(seed, device, dtype, heads, latent, rope, block_size):
    """Decode rows, a prefill, a chunked prefill over a cached prefix; head counts below, at and
    above one program's 16 (20: a second, partly masked head group), widths not powers of two."""
    _check(
        [1, 23, 1, 9],
        [37, 0, 5, 40],
        heads=heads,
        latent=latent,
        rope=rope,
        block_size=block_size,
        dtype=dtype,
        device=device,
    )


def test_deepseek_v3_widths(seed, device):
    """512 latent + 64 rope entries, 16 heads (one TP rank's share of 128), decode and prefill."""
    _check(
        [1, 1, 6],
        [70, 3, 30],
        heads=16,
        latent=512,
        rope=64,
        block_size=16,
        dtype=torch.bfloat16,
        device=device,
    )


@pytest.mark.parametrize("cache_dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_fp8_latent_cache(seed, device, cache_dtype):
    """An fp8 cache's key scale applies to the values too (they are the keys)."""
    b = make_batch(
        [1, 12],
        [20, 4],
        num_heads=4,
        num_kv_heads=1,
        head_dim=40,
        block_size=16,
        dtype=torch.bfloat16,
        device=device,
    )
    cache = (b.key_cache.float() * 2).to(cache_dtype)
    args = (b.q, cache, b.block_tables, b.cu_seqlens_q, b.seq_lens, 40**-0.5)
    got = mla_attention(*args, latent_dim=32, max_seqlen_q=b.max_seqlen_q, k_scale=0.5)
    want = ref_mla_attention(*args, latent_dim=32, k_scale=0.5)
    torch.testing.assert_close(got.float(), want.float(), atol=3e-2, rtol=RTOL[torch.bfloat16])


@pytest.mark.parametrize("num_splits", [2, 3, 7])
def test_split_kv_decode_matches_reference(seed, device, num_splits):
    """Decode rows whose keys are split over programs and merged: the reference's output; a
    split may hold no key (4 keys over 7 splits of 32-key tiles) and must not count."""
    b = make_batch(
        [1, 1, 1], [90, 3, 200], num_heads=20, num_kv_heads=1, head_dim=48 + 16,
        block_size=16, dtype=torch.float32, device=device,
    )  # fmt: skip
    args = (b.q, b.key_cache, b.block_tables, b.cu_seqlens_q, b.seq_lens, 64**-0.5)
    out = torch.full_like(b.q, float("nan"))
    got = mla_attention(
        *args, latent_dim=48, max_seqlen_q=1, max_seqlen_k=201, num_splits=num_splits, out=out
    )
    want = ref_mla_attention(*args, latent_dim=48)
    assert got[..., 48:].isnan().all()  # the merge writes the latent columns alone
    torch.testing.assert_close(got[..., :48], want, atol=2e-3, rtol=0)
    with pytest.raises(ValueError, match="never splits"):
        mla_attention(*args, latent_dim=48, batch_invariant=True, num_splits=num_splits)


def test_bad_arguments(device):
    b = make_batch(
        [1], [4], num_heads=2, num_kv_heads=2, head_dim=40, block_size=16,
        dtype=torch.float32, device=device,
    )  # fmt: skip
    with pytest.raises(ValueError, match="cache must be"):
        mla_attention(
            b.q, b.key_cache, b.block_tables, b.cu_seqlens_q, b.seq_lens, 1.0, latent_dim=32
        )
    one = b.key_cache[:, :, :1].contiguous()
    with pytest.raises(ValueError, match="latent_dim"):
        mla_attention(b.q, one, b.block_tables, b.cu_seqlens_q, b.seq_lens, 1.0, latent_dim=40)


def test_batch_invariant_rows_do_not_depend_on_the_batch(seed, device):
    """A decode row alone and inside a batch with a prefill: bit-identical outputs."""
    b = make_batch(
        [1, 17], [30, 6], num_heads=4, num_kv_heads=1, head_dim=40, block_size=16,
        dtype=torch.bfloat16, device=device,
    )  # fmt: skip
    args = (b.q, b.key_cache, b.block_tables, b.cu_seqlens_q, b.seq_lens, 0.2)
    both = mla_attention(*args, latent_dim=32, batch_invariant=True)
    alone = mla_attention(
        b.q[:1],
        b.key_cache,
        b.block_tables[:1],
        b.cu_seqlens_q[:2],
        b.seq_lens[:1],
        0.2,
        latent_dim=32,
        batch_invariant=True,
    )
    assert torch.equal(both[:1], alone)


# ---- GPU only: DeepSeek's sizes ----------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("heads", [16, 128])  # V2-Lite / Moonlight; V3 / R1 on one GPU
def test_gpu_deepseek_sizes(seed, heads):
    _check(
        [1] * 32 + [300, 17, 1000],
        torch.randint(1, 4000, (35,)).tolist(),
        heads=heads,
        latent=512,
        rope=64,
        block_size=16,
        dtype=torch.bfloat16,
        device=torch.device("cuda"),
    )
