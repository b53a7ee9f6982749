"""fp8 KV caches: the write kernel's quantization is bit-exact with the reference (torch's
saturating round-to-nearest-even cast), attention dequantizes on load like the reference, and
block copies / swaps move fp8 blocks unchanged."""

from __future__ import annotations

import pytest
import torch
from test_attention import make_batch  # tests/kernels is on sys.path

from paged_kernels import (
    copy_blocks,
    paged_attention,
    ref_copy_blocks,
    ref_paged_attention,
    ref_swap_blocks,
    ref_write_kv_cache,
    swap_blocks,
    write_kv_cache,
)
from paged_kernels.reference import ref_dequantize, ref_quantize

FP8 = [torch.float8_e4m3fn, torch.float8_e5m2]
FMAX = {torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0}
# (q_lens, ctx_lens), MIXED's kinds of rows in fewer tokens (the interpreter walks every tile):
# a decode row over 6 blocks (key tiles of 16 and 64, the last partial), a fresh prefill over
# 2 (16-bit) or 3 (fp32) query tiles, the last partial, a chunked prefill after a cached context
FP8_MIXED = ([1, 19, 3], [90, 0, 21])
# decode rows for split-KV (3 splits): 261 keys in splits of 2, 2 and 1 partial 64-key tiles (6,
# 6 and 5 of 16 keys in fp32); 41 keys: one partial tile, two empty splits
FP8_SPLIT = ([1, 1, 1], [200, 40, 260])


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8)


@pytest.mark.parametrize("cache_dtype", FP8)
def test_quantize_every_fp16_value(device, cache_dtype):
    """Nearly all finite fp16 values (subnormals, both zeros, far past the fp8 range) through
    the kernel: the same bits as the reference."""
    values = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16).view(torch.float16)
    values = values[values.isfinite()].to(device)
    n = values.numel() // 2048 * 2048
    key = values[:n].view(-1, 16, 128)  # few tokens: one interpreted program each
    slots = torch.arange(key.shape[0], device=device)
    cache = torch.zeros(key.shape[0], 1, 16, 128, dtype=cache_dtype, device=device)
    ref = cache.clone()
    write_kv_cache(key, key, cache, cache.clone(), slots)
    ref_write_kv_cache(key, key, ref, ref.clone(), slots)
    assert torch.equal(_bits(cache), _bits(ref))
    # The reference itself: a saturating cast (vLLM's clamp-then-convert).
    big = torch.tensor([1e9, -1e9], device=device)
    fmax = FMAX[cache_dtype]
    assert ref_quantize(big, cache_dtype).float().tolist() == [fmax, -fmax]


@pytest.mark.parametrize("cache_dtype", FP8)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("scales", [(1.0, 1.0), (0.02, 0.5), (3.0, 7.0)])
def test_write_kv_cache_fp8(seed, device, cache_dtype, dtype, scales):
    k_scale, v_scale = scales
    # a program per token (interpreted): 24 tokens in random slots of the 12 blocks, every
    # fourth padding (-1); head_dim 80: a partial 128-wide tile
    num_blocks, block_size, heads, head_dim, num_tokens = 12, 16, 3, 80, 24
    kv = (torch.randn(num_tokens, 2, heads, head_dim, device=device) * 4).to(dtype)
    key, value = kv[:, 0], kv[:, 1]  # strided, as views of a fused projection
    slots = torch.randperm(num_blocks * block_size, device=device)[:num_tokens]
    slots[1::4] = -1
    caches = [
        torch.randn(num_blocks, block_size, heads, head_dim, device=device).to(cache_dtype)
        for _ in range(2)
    ]
    refs = [c.clone() for c in caches]
    write_kv_cache(key, value, *caches, slots, k_scale=k_scale, v_scale=v_scale)
    ref_write_kv_cache(key, value, *refs, slots, k_scale=k_scale, v_scale=v_scale)
    for got, want in zip(caches, refs):
        assert torch.equal(_bits(got), _bits(want))
    # A stored value is within half an fp8 step of the input (3 / 2 mantissa bits), or the
    # format's max when the input lies beyond it (saturation).
    rel = {torch.float8_e4m3fn: 2**-4, torch.float8_e5m2: 2**-3}[cache_dtype]
    flat = caches[0].view(-1, heads, head_dim)
    valid = slots >= 0
    stored = ref_dequantize(flat[slots[valid].long()], k_scale)
    exact = key[valid].float()
    small = 2.0 ** (-9 if cache_dtype == torch.float8_e4m3fn else -16) * k_scale
    limit = FMAX[cache_dtype] * k_scale
    want = exact.clamp(-limit, limit)
    assert ((stored - want).abs() <= rel * want.abs() + small).all()
    assert (stored.abs() <= limit).all()


@pytest.mark.parametrize("cache_dtype", FP8)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("num_splits", [1, 3])
def test_paged_attention_fp8_cache(seed, device, cache_dtype, dtype, num_splits):
    """num_splits=1: a mixed prefill + decode batch; 3: a decode batch cut into splits (splits
    cut only pure decode batches)."""
    k_scale, v_scale = 0.25, 0.5
    scale = 64**-0.5
    tol = {torch.float32: 2e-3, torch.float16: 1e-2, torch.bfloat16: 3e-2}[dtype]
    shape = {"num_heads": 8, "num_kv_heads": 2, "head_dim": 64, "block_size": 16}
    b = make_batch(
        *(FP8_MIXED if num_splits == 1 else FP8_SPLIT), **shape, dtype=dtype, device=device
    )
    key_cache = ref_quantize(b.key_cache, cache_dtype, k_scale)
    value_cache = ref_quantize(b.value_cache, cache_dtype, v_scale)
    args = (b.q, key_cache, value_cache, b.block_tables, b.cu_seqlens_q, b.seq_lens, scale)
    out = torch.full_like(b.q, float("nan"))
    got = paged_attention(
        *args,
        max_seqlen_q=b.max_seqlen_q,
        max_seqlen_k=b.max_seqlen_k,
        out=out,
        num_splits=num_splits,
        k_scale=k_scale,
        v_scale=v_scale,
    )
    want = ref_paged_attention(*args, k_scale=k_scale, v_scale=v_scale)
    assert not got.isnan().any()
    torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)


def test_fp8_attention_close_to_unquantized(seed, device):
    """What fp8 costs: attention over an e4m3 cache stays within a few percent of the fp32
    cache it was quantized from (the engine tests bound the effect on tokens)."""
    b = make_batch(
        *FP8_MIXED, num_heads=4, num_kv_heads=2, head_dim=64, block_size=16,
        dtype=torch.float32, device=device,
    )  # fmt: skip
    scale = 64**-0.5
    meta = (b.block_tables, b.cu_seqlens_q, b.seq_lens, scale)
    exact = ref_paged_attention(b.q, b.key_cache, b.value_cache, *meta)
    kc = ref_quantize(b.key_cache, torch.float8_e4m3fn)
    vc = ref_quantize(b.value_cache, torch.float8_e4m3fn)
    got = paged_attention(b.q, kc, vc, *meta, max_seqlen_q=b.max_seqlen_q)
    err = (got - exact).abs()
    # Inputs are N(0, 1): e4m3 keeps ~2^-4 relative precision per element.
    assert 0 < err.mean().item() < 0.03 and err.max().item() < 0.3, (err.mean(), err.max())


def test_scales_refused_without_fp8(device):
    cache = torch.zeros(4, 16, 2, 64, device=device)
    key = torch.zeros(3, 2, 64, device=device)
    slots = torch.zeros(3, dtype=torch.int64, device=device)
    with pytest.raises(ValueError, match="k_scale"):
        write_kv_cache(key, key, cache, cache, slots, k_scale=2.0)
    fp8 = cache.to(torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="k_scale"):
        write_kv_cache(key, key, fp8, fp8.clone(), slots, k_scale=0.0)
    with pytest.raises(ValueError, match="dtypes differ"):
        write_kv_cache(key, key, fp8, cache, slots)


@pytest.mark.parametrize("cache_dtype", FP8)
def test_copy_and_swap_fp8_blocks(seed, device, cache_dtype):
    keys = [torch.randn(10, 16, 2, 32, device=device).to(cache_dtype) for _ in range(3)]
    values = [torch.randn(10, 16, 2, 32, device=device).to(cache_dtype) for _ in range(3)]
    mapping = torch.tensor([[1, 7], [2, 8], [5, 9]])
    ref_k, ref_v = [k.clone() for k in keys], [v.clone() for v in values]
    copy_blocks(keys, values, mapping)
    ref_copy_blocks(ref_k, ref_v, mapping)
    for got, want in zip(keys + values, ref_k + ref_v):
        assert torch.equal(_bits(got), _bits(want))
    cpu = torch.zeros(6, 16, 2, 32, dtype=cache_dtype)
    ref_cpu = cpu.clone()
    pairs = torch.tensor([[7, 0], [3, 5]])
    swap_blocks(keys[0], cpu, pairs)
    ref_swap_blocks(ref_k[0], ref_cpu, pairs)
    assert torch.equal(_bits(cpu), _bits(ref_cpu))
    assert torch.equal(_bits(cpu[0]), _bits(keys[0][7].cpu()))


def test_e4m3_cache_on_a_gpu_before_ada_is_refused(monkeypatch):
    """Triton's fp8e4nv type does not exist before compute capability 8.9: the attention kernel
    would fail to compile there (tests/kernels/gpu_compile.py --arch 80 shows the error)."""
    import paged_kernels._utils as utils

    gpu = torch.device("cuda", 0)
    monkeypatch.setattr(utils, "capability", lambda index: (8, 0))
    with pytest.raises(ValueError, match="fp8_e5m2"):
        utils.check_fp8_readable(torch.float8_e4m3fn, gpu)
    utils.check_fp8_readable(torch.float8_e5m2, gpu)
    monkeypatch.setattr(utils, "capability", lambda index: (8, 9))
    utils.check_fp8_readable(torch.float8_e4m3fn, gpu)
