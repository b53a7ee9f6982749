"""rope_qk_: the q and k heads of a qkv row (normalised, then) rotated in place, against the
torch reference, on random shapes, dtypes, GQA ratios, partial rotary and both pair styles; its
fused KV write against rope_qk_ then write_kv_cache, bit for bit.

Triton's interpreter casts float32 to bfloat16 by truncation (a GPU rounds to nearest even), so
under the interpreter bfloat16 results may sit one unit in the last place from torch's; float32
and float16 must match bit for bit where no norm runs (the products are rounded one by one).
"""

from __future__ import annotations

import pytest
import torch

from paged_kernels import ref_rope_qk, rope_qk_, write_kv_cache

# (q heads, kv heads, head_dim, rotary dims): MHA, GQA 4:1 and 8:1, odd sizes, partial rotary
SHAPES = [(4, 4, 64, 64), (8, 2, 128, 128), (16, 2, 64, 64), (3, 1, 80, 32), (2, 1, 96, 48)]
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
EXTRA = 5  # columns past q, k and v that the kernel must leave alone
# The interpreter runs one program a token (all its heads; a GPU splits them, never the
# tokens): a few tokens at random positions cover every path, each costs a program
TOKENS = 4


def _inputs(dtype, device, hq, hk, d, r, tokens=TOKENS, max_pos=300):
    qkv = (torch.randn(tokens, (hq + 2 * hk) * d + EXTRA, device=device) * 2).to(dtype)
    positions = torch.randint(0, max_pos, (tokens,), device=device)
    angles = torch.outer(
        torch.arange(max_pos, device=device).float(), torch.rand(r // 2, device=device) * 0.5
    )
    return qkv, positions, angles.cos(), angles.sin()


def _check(out, ref, dtype, norm):
    if dtype == torch.bfloat16 or norm:  # truncating casts (interpreter) or reduction order
        # a unit or two in the last place of inputs up to ~4; a - b may cancel: absolute too
        rtol, atol = {torch.float32: (1e-5, 1e-5), torch.float16: (2e-3, 8e-3)}.get(
            dtype, (1.6e-2, 6e-2)
        )
        torch.testing.assert_close(out.float(), ref.float(), rtol=rtol, atol=atol)
    else:
        assert torch.equal(out, ref)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("neox", [True, False])
@pytest.mark.parametrize("norm", [None, "rms", "gemma"])
def test_rope_qk_matches_reference(seed, device, dtype, shape, neox, norm):
    """norm: none, Qwen3's q/k RMSNorms (rounded before the weight), or Gemma 3's (1 + w, the
    fp32 product rounded once)."""
    hq, hk, d, r = shape
    qkv, positions, cos, sin = _inputs(dtype, device, hq, hk, d, r)
    kw: dict = {}
    if norm:
        gemma = norm == "gemma"
        kw = dict(
            q_weight=(torch.randn(d, device=device) * 0.2 + (0 if gemma else 1)).to(dtype),
            k_weight=(torch.randn(d, device=device) * 0.2 + (0 if gemma else 1)).to(dtype),
            eps=1e-6,
            weight_offset=1.0 if gemma else 0.0,
            round_before_weight=False if gemma else None,
        )
    ref = ref_rope_qk(qkv, positions, cos, sin, hq, hk, d, is_neox_style=neox, **kw)
    before = qkv.clone()
    out = rope_qk_(qkv, positions, cos, sin, hq, hk, d, is_neox_style=neox, **kw)
    assert out is qkv  # in place
    _check(out, ref, dtype, norm)
    untouched = slice((hq + hk) * d, None)  # v heads and the extra columns
    assert torch.equal(out[:, untouched], before[:, untouched])


def test_rope_qk_strided_rows_and_empty(seed, device):
    """Rows of a wider buffer (a view with a larger row stride) and zero tokens."""
    hq, hk, d = 4, 2, 64
    wide = torch.randn(6, 2 * (hq + 2 * hk) * d, device=device)
    qkv = wide[:, : (hq + 2 * hk) * d]
    _, positions, cos, sin = _inputs(torch.float32, device, hq, hk, d, d, tokens=6)
    ref = ref_rope_qk(qkv, positions, cos, sin, hq, hk, d)
    rest = wide[:, qkv.shape[1] :].clone()
    rope_qk_(qkv, positions, cos, sin, hq, hk, d)
    assert torch.equal(qkv, ref)
    assert torch.equal(wide[:, qkv.shape[1] :], rest)
    empty = torch.empty(0, qkv.shape[1], device=device)
    assert rope_qk_(empty, positions[:0], cos, sin, hq, hk, d).shape == empty.shape


def test_rope_qk_rejects_bad_arguments(device):
    hq, hk, d = 2, 1, 64
    qkv, positions, cos, sin = _inputs(torch.float32, device, hq, hk, d, d, tokens=3)
    w = torch.ones(d, device=device)
    with pytest.raises(ValueError, match="qkv rows"):
        rope_qk_(qkv[:, : 3 * d], positions, cos, sin, hq, hk, d)
    with pytest.raises(ValueError, match="positions"):
        rope_qk_(qkv, positions[:2], cos, sin, hq, hk, d)
    with pytest.raises(ValueError, match="positions"):
        rope_qk_(qkv, positions.float(), cos, sin, hq, hk, d)
    with pytest.raises(ValueError, match="fp32"):
        rope_qk_(qkv, positions, cos.half(), sin.half(), hq, hk, d)
    with pytest.raises(ValueError, match="rotary dims"):
        rope_qk_(qkv, positions, torch.cat((cos, cos), 1), torch.cat((sin, sin), 1), hq, hk, d)
    with pytest.raises(ValueError, match="k_weight"):
        rope_qk_(qkv, positions, cos, sin, hq, hk, d, q_weight=w)
    with pytest.raises(ValueError, match="q_weight"):
        rope_qk_(qkv, positions, cos, sin, hq, hk, d, q_weight=w[:8], k_weight=w)
    with pytest.raises(ValueError, match="dtype"):
        rope_qk_(qkv.int(), positions, cos, sin, hq, hk, d)


def _caches(hk, d, cache_dtype, device, blocks=7, block_size=5):
    """A pair of caches filled with a pattern (what the write leaves must stay)."""
    base = torch.randn(blocks, block_size, hk, d, device=device)
    if cache_dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        base = base.clamp(-50, 50)
    return base.to(cache_dtype), (base * 2).to(cache_dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("shape", "block_size"), zip(SHAPES, [16, 1, 5, 16, 5]))
@pytest.mark.parametrize("cache", ["auto", torch.float8_e4m3fn, torch.float8_e5m2])
def test_rope_qk_fused_kv_write(seed, device, dtype, shape, cache, block_size):
    """The rotation and, in the same launch, every token's rotated k heads and its v heads in
    its slot (-1: none): the bits of rope_qk_ then write_kv_cache; the rest of the caches and
    of qkv untouched."""
    hq, hk, d, r = shape
    tokens = TOKENS
    qkv, positions, cos, sin = _inputs(dtype, device, hq, hk, d, r, tokens=tokens)
    cache_dtype = dtype if cache == "auto" else cache
    blocks = -(-(tokens + 4) // block_size)
    kc, vc = _caches(hk, d, cache_dtype, device, blocks, block_size)
    slots = torch.randperm(blocks * block_size, device=device)[:tokens]
    slots[[1, 3]] = -1  # padding
    fp8 = cache != "auto"
    scales = {"k_scale": 0.5, "v_scale": 3.0} if fp8 else {}
    norms = dict(q_weight=torch.rand(d, device=device).to(dtype), k_weight=torch.rand(d).to(dtype))
    norms = norms if shape[0] % 2 == 0 else {}  # normalised heads on some shapes
    want_qkv, want_k, want_v = qkv.clone(), kc.clone(), vc.clone()
    rope_qk_(want_qkv, positions, cos, sin, hq, hk, d, is_neox_style=r == d, **norms)
    k = want_qkv[:, hq * d : (hq + hk) * d].view(tokens, hk, d)
    v = want_qkv[:, (hq + hk) * d : (hq + 2 * hk) * d].view(tokens, hk, d)
    write_kv_cache(k, v, want_k, want_v, slots.to(torch.int32), **scales)
    got = rope_qk_(
        qkv, positions, cos, sin, hq, hk, d, is_neox_style=r == d, **norms,
        key_cache=kc, value_cache=vc, slot_mapping=slots, **scales,
    )  # fmt: skip
    assert got is qkv and torch.equal(qkv, want_qkv)
    bits = (lambda t: t.view(torch.uint8)) if fp8 else (lambda t: t)
    assert torch.equal(bits(kc), bits(want_k)) and torch.equal(bits(vc), bits(want_v))


def test_rope_qk_fused_kv_write_checks(device):
    hq, hk, d = 2, 1, 64
    qkv, positions, cos, sin = _inputs(torch.float32, device, hq, hk, d, d, tokens=3)
    kc, vc = _caches(hk, d, torch.float32, device)
    slots = torch.arange(3, device=device)
    with pytest.raises(ValueError, match="key_cache, value_cache and slot_mapping"):
        rope_qk_(qkv, positions, cos, sin, hq, hk, d, key_cache=kc, value_cache=vc)
    with pytest.raises(ValueError, match="slot_mapping must be"):
        rope_qk_(qkv, positions, cos, sin, hq, hk, d, key_cache=kc, value_cache=vc,
                 slot_mapping=slots[:2])  # fmt: skip
    wide_k, wide_v = _caches(2, d, torch.float32, device)  # two kv heads a slot, not one
    with pytest.raises(ValueError, match="cache heads"):
        rope_qk_(qkv, positions, cos, sin, hq, hk, d, key_cache=wide_k, value_cache=wide_v,
                 slot_mapping=slots)  # fmt: skip
    with pytest.raises(ValueError, match="fp8 caches only"):
        rope_qk_(qkv, positions, cos, sin, hq, hk, d, key_cache=kc, value_cache=vc,
                 slot_mapping=slots, k_scale=2.0)  # fmt: skip
    before = kc.clone()
    empty = torch.empty(0, qkv.shape[1], device=device)
    rope_qk_(empty, positions[:0], cos, sin, hq, hk, d, key_cache=kc, value_cache=vc,
             slot_mapping=slots[:0])  # fmt: skip
    assert torch.equal(kc, before)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("neox", [True, False])
def test_rope_qk_bits_on_gpu(dtype, neox):
    """On a GPU casts round to nearest even and the kernel fuses no multiply-add: the rotation
    is torch's, bit for bit, at a realistic size (Qwen3-0.6B's heads, 256 tokens)."""
    qkv, positions, cos, sin = _inputs(dtype, torch.device("cuda"), 16, 8, 128, 128, 256, 4096)
    ref = ref_rope_qk(qkv, positions, cos, sin, 16, 8, 128, is_neox_style=neox)
    assert torch.equal(rope_qk_(qkv, positions, cos, sin, 16, 8, 128, is_neox_style=neox), ref)
