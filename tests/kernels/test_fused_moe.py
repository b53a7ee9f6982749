"""fused_moe (paged_kernels/moe.py): the slot alignment's invariants, the grouped-GEMM kernels
against ref_fused_moe on random inputs (dtypes, token counts, experts, top-k, dims that are not
multiples of the tile, experts that get no token), no host reads, and argument checks. GPU-marked
tests run Qwen3-30B-A3B's shapes and a CUDA graph capture. The engine running its MoE layers
through these kernels is tested in tests/engine/test_models_moe.py.
"""

from __future__ import annotations

import pytest
import torch
from host_reads import spy_host_reads

import paged_kernels.moe as moe
from paged_kernels import (
    Fp8Weight,
    Int4Weight,
    MoeActivation,
    Mxfp4Weight,
    align_moe_blocks,
    dequantize_mxfp4,
    fused_moe,
    quantize_fp8_per_channel,
    ref_fused_moe,
)
from paged_kernels.moe import MoeTiles, max_moe_blocks
from paged_kernels.reference import SILU, moe_activation

TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
HID, INTER = 40, 24  # not multiples of any tile: the N and K edges are masked


def _route(tokens: int, experts: int, top_k: int, device, unused: int = 1):
    """Softmax top-k routing in which the last `unused` experts never win."""
    logits = torch.randn(tokens, experts, device=device) * 2
    logits[:, experts - unused :] = float("-inf")
    weights, ids = torch.softmax(logits, -1).topk(top_k, -1)
    return weights, ids


def _weights(experts: int, dtype, device, hid: int = HID, inter: int = INTER, gated: bool = True):
    """gate_up [E, 2I, H] (gated) or up [E, I, H], and down [E, H, I]."""
    rows = 2 * inter if gated else inter
    gate_up = torch.randn(experts, rows, hid, device=device) * hid**-0.5
    down = torch.randn(experts, hid, inter, device=device) * inter**-0.5
    return gate_up.to(dtype), down.to(dtype)


def _close(got: torch.Tensor, want: torch.Tensor, dtype) -> None:
    assert got.dtype == want.dtype == dtype
    torch.testing.assert_close(got.float(), want.float(), rtol=TOL[dtype], atol=TOL[dtype])


@pytest.mark.parametrize(
    ("tokens", "top_k", "experts", "block_m"),
    [(1, 1, 4, 16), (3, 2, 8, 16), (33, 2, 8, 16), (40, 3, 5, 32), (7, 4, 64, 64), (0, 2, 4, 16)],
)
def test_alignment_invariants(seed, device, tokens, top_k, experts, block_m):
    """Every slot exactly once, padding = S, each block one expert's slots in ascending order,
    groups in expert order, the used-block count and buffer sizes as promised; no host read."""
    ids = torch.rand(tokens, experts, device=device).argsort(-1)[:, :top_k]  # distinct per row
    ids = ids.to(torch.int32) if tokens % 2 else ids  # int64 from torch.topk, int32 accepted
    reads: list[str] = []
    with spy_host_reads(reads.append):
        blocks = align_moe_blocks(ids, experts, block_m)
    assert reads == []
    s = tokens * top_k
    max_blocks = max_moe_blocks(s, experts, block_m)
    assert blocks.sorted_slot_ids.shape == (max_blocks * block_m,)
    assert blocks.block_expert_ids.shape == (max_blocks,) and blocks.num_used_blocks.shape == (1,)
    for t in blocks:
        assert t.dtype == torch.int32 and t.device == ids.device
    counts = torch.bincount(ids.flatten().cpu(), minlength=experts)
    used = int(sum(-(-c // block_m) for c in counts.tolist()))
    assert int(blocks.num_used_blocks) == used <= max_blocks
    slots = blocks.sorted_slot_ids.cpu().view(max_blocks, block_m)
    experts_of = blocks.block_expert_ids.cpu()
    assert (experts_of[used:] == -1).all() and (slots[used:] == s).all()
    real = slots[slots < s]
    assert torch.equal(real.sort().values, torch.arange(s, dtype=torch.int32))
    assert (slots >= 0).all() and (slots <= s).all()
    flat_ids = ids.flatten().cpu()
    previous = -1
    for b in range(used):
        e = int(experts_of[b])
        assert e >= previous  # groups in ascending expert order
        mine = slots[b][slots[b] < s]
        assert len(mine) > 0 and (flat_ids[mine.long()] == e).all()
        # Within a block the real slots come first, ascending (a stable sort), padding last.
        assert torch.equal(slots[b][: len(mine)], mine) and bool((mine.diff() > 0).all())
        previous = e


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens", [1, 3, 33])
@pytest.mark.parametrize(("experts", "top_k"), [(4, 1), (8, 2)])
def test_fused_moe_matches_reference(seed, device, dtype, tokens, experts, top_k):
    x = torch.randn(tokens, HID, device=device).to(dtype)
    gate_up, down = _weights(experts, dtype, device)
    weights, ids = _route(tokens, experts, top_k, device)  # the last expert gets no token
    got = fused_moe(x, gate_up, down, weights, ids)
    _close(got, ref_fused_moe(x, gate_up, down, weights, ids), dtype)


def _gpt_oss_experts(x, gate_up_t, gate_up_bias, down_t, down_bias, weights, ids, act):
    """gpt-oss's experts as HF computes them, token by token: gate_up_t [E, H, 2I] with gate
    and up interleaved in its columns, down_t [E, I, H] (x @ W layouts), clamped SwiGLU."""
    out = torch.zeros(x.shape, dtype=torch.float32)
    for t in range(x.shape[0]):
        for w, e in zip(weights[t].tolist(), ids[t].tolist()):
            h = x[t].float() @ gate_up_t[e].float() + gate_up_bias[e].float()
            gate, up = h[::2].clamp(max=act.limit), h[1::2].clamp(-act.limit, act.limit)
            glu = (up + 1) * gate * torch.sigmoid(gate * act.alpha)
            out[t] += w * (glu @ down_t[e].float() + down_bias[e].float())
    return out


def test_reference_swigluoai_with_biases_is_gpt_oss_experts(seed):
    """ref_fused_moe with biases and swigluoai computes HF's gpt-oss experts once their
    interleaved gate / up columns are split into gate rows, then up rows."""
    experts, top_k, tokens = 5, 2, 9
    act = MoeActivation("swigluoai", alpha=1.702, limit=0.3)  # a limit the values reach
    x = torch.randn(tokens, HID)
    gate_up_t = torch.randn(experts, HID, 2 * INTER) * HID**-0.5
    gate_up_bias = torch.randn(experts, 2 * INTER) * 0.1
    down_t, down_bias = torch.randn(experts, INTER, HID), torch.randn(experts, HID)
    weights, ids = _route(tokens, experts, top_k, "cpu")
    gate_up = torch.cat([gate_up_t[..., ::2], gate_up_t[..., 1::2]], dim=-1).transpose(1, 2)
    bias = torch.cat([gate_up_bias[:, ::2], gate_up_bias[:, 1::2]], dim=-1)
    got = ref_fused_moe(
        x,
        gate_up.contiguous(),
        down_t.transpose(1, 2).contiguous(),
        weights,
        ids,
        gate_up_bias=bias,
        down_bias=down_bias,
        activation=act,
    )
    want = _gpt_oss_experts(x, gate_up_t, gate_up_bias, down_t, down_bias, weights, ids, act)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    clamped = ref_fused_moe(x, gate_up, down_t.transpose(1, 2), weights, ids, activation=act)
    unclamped = act._replace(limit=1e9)
    assert not torch.allclose(
        clamped,
        ref_fused_moe(x, gate_up, down_t.transpose(1, 2), weights, ids, activation=unclamped),
    )


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("tokens", "biases"), [(1, "both"), (3, "gate_up"), (33, "down")])
def test_biases_and_swigluoai_match_reference(seed, device, dtype, tokens, biases):
    """gpt-oss's experts: per-expert biases on either projection, the clamped SwiGLU (a limit
    small enough that the clamps bite), against ref_fused_moe."""
    experts, top_k = 8, 2
    act = MoeActivation("swigluoai", alpha=1.702, limit=0.5)
    x = torch.randn(tokens, HID, device=device).to(dtype)
    gate_up, down = _weights(experts, dtype, device)
    gb = torch.randn(experts, 2 * INTER, device=device).to(dtype) if biases != "down" else None
    db = torch.randn(experts, HID, device=device).to(dtype) if biases != "gate_up" else None
    weights, ids = _route(tokens, experts, top_k, device)
    kwargs = dict(gate_up_bias=gb, down_bias=db, activation=act)
    got = fused_moe(x, gate_up, down, weights, ids, **kwargs)
    _close(got, ref_fused_moe(x, gate_up, down, weights, ids, **kwargs), dtype)
    tiles = MoeTiles(16, 16, 16, 4, 2)  # several N tiles: each reads its slice of the bias
    _close(fused_moe(x, gate_up, down, weights, ids, tiles=tiles, **kwargs), got, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens", [1, 33])
def test_gelu_tanh_matches_reference(seed, device, dtype, tokens):
    """Gemma 4's experts: gelu(gate) * up with GELU's tanh approximation, against ref_fused_moe
    (itself torch's gelu(approximate="tanh")), over small tiles too."""
    experts, top_k = 8, 2
    act = MoeActivation("gelu_tanh")
    assert act.gated
    x = (torch.randn(tokens, HID, device=device) * 2).to(dtype)  # gates reach GELU's bend
    gate_up, down = _weights(experts, dtype, device)
    weights, ids = _route(tokens, experts, top_k, device)
    got = fused_moe(x, gate_up, down, weights, ids, activation=act)
    _close(got, ref_fused_moe(x, gate_up, down, weights, ids, activation=act), dtype)
    tiles = MoeTiles(16, 16, 16, 4, 2)
    _close(fused_moe(x, gate_up, down, weights, ids, tiles=tiles, activation=act), got, dtype)
    g, u = torch.randn(5, 7), torch.randn(5, 7)
    want = 0.5 * g * (1 + torch.tanh(0.7978845608028654 * (g + 0.044715 * g**3))) * u
    torch.testing.assert_close(moe_activation(g, u, act), want, rtol=1e-6, atol=1e-6)


def _mxfp4_weights(experts: int, hid: int, inter: int, device, seed: int = 0, gated: bool = True):
    """Random MXFP4 gate_up [E, 2I, H] (up [E, I, H] if not gated) and down [E, H, I]: every
    code, scales 2^-10 to 2^-5."""
    gen = torch.Generator().manual_seed(seed)

    def weight(n: int, k: int) -> Mxfp4Weight:
        blocks = torch.randint(0, 256, (experts, n, k // 2), generator=gen, dtype=torch.uint8)
        scales = torch.randint(117, 123, (experts, n, k // 32), generator=gen, dtype=torch.uint8)
        return Mxfp4Weight(blocks.to(device), scales.to(device))

    return weight(2 * inter if gated else inter, hid), weight(hid, inter)


def test_dequantize_mxfp4_reads_codes_low_nibble_first():
    codes = torch.arange(32) % 16  # every code twice
    blocks = (codes[0::2] | (codes[1::2] << 4)).to(torch.uint8).view(1, 16)
    e2m1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]
    signed = torch.tensor(e2m1 + [-v for v in e2m1])
    for biased, dtype in ((127, torch.float32), (130, torch.bfloat16), (120, torch.float16)):
        scales = torch.full((1, 1), biased, dtype=torch.uint8)
        got = dequantize_mxfp4(Mxfp4Weight(blocks, scales), dtype)
        want = (signed[codes] * 2.0 ** (biased - 127)).view(1, 32).to(dtype)
        assert got.dtype == dtype and torch.equal(got, want)
    assert torch.signbit(dequantize_mxfp4(Mxfp4Weight(blocks, scales))[0, 8])  # code 8: -0
    with pytest.raises(ValueError, match="uint8"):
        dequantize_mxfp4(Mxfp4Weight(blocks.int(), scales))
    with pytest.raises(ValueError, match="K/32"):
        dequantize_mxfp4(Mxfp4Weight(blocks[:, :8], scales))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("tokens", "experts", "top_k"), [(1, 4, 2), (5, 8, 2), (19, 4, 3)])
def test_mxfp4_experts_match_reference(seed, device, dtype, tokens, experts, top_k):
    """MXFP4 weights decoded in the GEMMs give the reference on their exact values: with and
    without gpt-oss's biases and clamped SwiGLU; H = 96, I = 64 (K not a multiple of the
    tile); in bf16 (19 tokens) also 32-wide K tiles and wide ones, and the dense kernel on
    the values."""
    hid, inter = 96, 64
    gate_up, down = _mxfp4_weights(experts, hid, inter, device, seed=tokens)
    x = torch.randn(tokens, hid, device=device).to(dtype)
    weights, ids = _route(tokens, experts, top_k, device)
    kwargs: dict = {}
    if tokens > 1:
        act = MoeActivation("swigluoai", alpha=1.702, limit=0.5)
        gb = torch.randn(experts, 2 * inter, device=device).to(dtype)
        kwargs = dict(
            gate_up_bias=gb, down_bias=torch.randn(experts, hid, device=device), activation=act
        )
    want = ref_fused_moe(x, gate_up, down, weights, ids, **kwargs)
    _close(fused_moe(x, gate_up, down, weights, ids, **kwargs), want, dtype)
    # The tile walks below once, on the shape with the most rows per expert (the interpreter is
    # slow; H and I, so the K and N walks, are the same at every shape).
    if dtype != torch.bfloat16 or tokens != 19:
        return
    for tiles in (MoeTiles(16, 16, 32, 4, 2), MoeTiles(16, 32, 128, 4, 2)):
        _close(fused_moe(x, gate_up, down, weights, ids, tiles=tiles, **kwargs), want, dtype)
    dense = [dequantize_mxfp4(w, dtype) for w in (gate_up, down)]
    _close(fused_moe(x, *dense, weights, ids, **kwargs), want, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("tokens", "biases"), [(1, False), (17, True)])
def test_fp8_experts_match_reference(seed, device, dtype, tokens, biases):
    """FP8 experts (a scale per output row; `quantization="fp8"`) cast in the GEMMs, their row
    scales on the sums: the reference on their exact values, with and without gpt-oss's biases
    and clamped SwiGLU, over small tiles too (several N tiles each reading their scales)."""
    experts, top_k = 6, 2
    gate_up, down = (
        Fp8Weight(*quantize_fp8_per_channel(w)) for w in _weights(experts, dtype, device)
    )
    x = torch.randn(tokens, HID, device=device).to(dtype)
    weights, ids = _route(tokens, experts, top_k, device)
    kwargs: dict = {}
    if biases:
        kwargs = dict(
            gate_up_bias=torch.randn(experts, 2 * INTER, device=device).to(dtype),
            down_bias=torch.randn(experts, HID, device=device).to(dtype),
            activation=MoeActivation("swigluoai", alpha=1.702, limit=0.5),
        )
    want = ref_fused_moe(x, gate_up, down, weights, ids, **kwargs)
    _close(fused_moe(x, gate_up, down, weights, ids, **kwargs), want, dtype)
    tiles = MoeTiles(16, 16, 16, 4, 2)
    _close(fused_moe(x, gate_up, down, weights, ids, tiles=tiles, **kwargs), want, dtype)
    with pytest.raises(ValueError, match="both dense, or both MXFP4, FP8 or int4"):
        fused_moe(x, gate_up, down.dequantize(dtype), weights, ids)


def _nemotron_experts(x, up, up_bias, down, weights, ids):
    """Nemotron-H's experts as HF's NemotronHExperts computes them, token by token: not gated,
    up [E, I, H], down [E, H, I], relu2(h) = relu(h)^2 (with a bias on up here)."""
    out = torch.zeros(x.shape, dtype=torch.float32)
    for t in range(x.shape[0]):
        for w, e in zip(weights[t].tolist(), ids[t].tolist()):
            h = up[e].float() @ x[t].float() + up_bias[e].float()
            out[t] += w * (down[e].float() @ torch.relu(h) ** 2)
    return out


def test_reference_relu2_is_nemotron_experts(seed):
    """ref_fused_moe with the non-gated relu2 (gate_up the up weight [E, I, H], its bias
    [E, I]) computes Nemotron-H's experts; moe_activation takes up=None for it."""
    experts, top_k, tokens = 5, 2, 9
    relu2 = MoeActivation("relu2")
    assert not relu2.gated and SILU.gated and MoeActivation("swigluoai").gated
    x = torch.randn(tokens, HID)
    up, down = _weights(experts, torch.float32, "cpu", gated=False)
    up_bias = torch.randn(experts, INTER) * 0.1
    weights, ids = _route(tokens, experts, top_k, "cpu")
    got = ref_fused_moe(x, up, down, weights, ids, gate_up_bias=up_bias, activation=relu2)
    want = _nemotron_experts(x, up, up_bias, down, weights, ids)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    h = torch.randn(3, 7)
    assert torch.equal(moe_activation(h, None, relu2), torch.relu(h).square())
    with pytest.raises(ValueError, match="up must be given iff gated"):
        moe_activation(h, h, relu2)
    with pytest.raises(ValueError, match="up must be given iff gated"):
        moe_activation(h, None, SILU)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("tokens", "biases"), [(1, False), (33, True)])
def test_relu2_matches_reference(seed, device, dtype, tokens, biases):
    """Nemotron-H's non-gated experts: the first GEMM over the up weight alone (here a strided
    view [E, I, H]), relu2 on its fp32 sums, with and without biases on both projections,
    against ref_fused_moe; over small tiles too (several K steps and N tiles)."""
    experts, top_k = 8, 2
    x = torch.randn(tokens, HID, device=device).to(dtype)
    gate_up, down = _weights(experts, dtype, device)
    up = gate_up[:, INTER:]  # [E, I, H] with the gated layout's expert stride
    weights, ids = _route(tokens, experts, top_k, device)
    kwargs: dict = dict(activation=MoeActivation("relu2"))
    if biases:
        kwargs["gate_up_bias"] = (torch.randn(experts, INTER, device=device) * 0.1).to(dtype)
        kwargs["down_bias"] = torch.randn(experts, HID, device=device).to(dtype)
    want = ref_fused_moe(x, up, down, weights, ids, **kwargs)
    _close(fused_moe(x, up, down, weights, ids, **kwargs), want, dtype)
    tiles = MoeTiles(16, 16, 16, 4, 2)
    _close(fused_moe(x, up, down, weights, ids, tiles=tiles, **kwargs), want, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_relu2_fp8_and_mxfp4_experts_match_reference(seed, device, dtype):
    """Non-gated experts quantized: FP8 (`quantization="fp8"`: up's row scales [E, I]) with an
    up bias, and MXFP4, decoded in the GEMMs: the reference on their exact values."""
    experts, top_k, tokens = 6, 2, 17
    relu2 = MoeActivation("relu2")
    up, down = (
        Fp8Weight(*quantize_fp8_per_channel(w))
        for w in _weights(experts, dtype, device, gated=False)
    )
    assert up.scale.shape == (experts, INTER)
    x = torch.randn(tokens, HID, device=device).to(dtype)
    weights, ids = _route(tokens, experts, top_k, device)
    bias = (torch.randn(experts, INTER, device=device) * 0.1).to(dtype)
    kwargs = dict(gate_up_bias=bias, activation=relu2)
    want = ref_fused_moe(x, up, down, weights, ids, **kwargs)
    _close(fused_moe(x, up, down, weights, ids, **kwargs), want, dtype)
    tiles = MoeTiles(16, 16, 16, 4, 2)
    _close(fused_moe(x, up, down, weights, ids, tiles=tiles, **kwargs), want, dtype)
    hid, inter = 64, 32
    up, down = _mxfp4_weights(experts, hid, inter, device, seed=1, gated=False)
    x = (torch.randn(tokens, hid, device=device) * 3).to(dtype)  # up x near N(0, 1)
    want = ref_fused_moe(x, up, down, weights, ids, activation=relu2)
    assert want.abs().max() > 0.1
    _close(fused_moe(x, up, down, weights, ids, activation=relu2), want, dtype)


def test_mxfp4_rejects_bad_arguments(device):
    gate_up, down = _mxfp4_weights(4, 64, 32, device)
    x = torch.randn(3, 64, device=device)
    weights, ids = _route(3, 4, 2, device)
    with pytest.raises(ValueError, match="both dense, or both MXFP4, FP8 or int4"):
        fused_moe(x, gate_up, dequantize_mxfp4(down), weights, ids)
    with pytest.raises(ValueError, match="block_k >= 32"):
        fused_moe(x, gate_up, down, weights, ids, tiles=MoeTiles(16, 16, 16, 4, 2))
    with pytest.raises(ValueError, match="gate_up"):
        fused_moe(x, gate_up._replace(scales=gate_up.scales[..., :1]), down, weights, ids)
    with pytest.raises(ValueError, match="down"):
        fused_moe(x[:, :32], gate_up, down, weights, ids)


def _int4_weights(
    experts: int, hid: int, inter: int, device, seed: int = 0, gated: bool = True, dtype=None
):
    """Random int4 gate_up [E, 2I, H] (up [E, I, H] if not gated) and down [E, H, I]: every
    code, each group's scale in [0.5, 1.5] / (6 sqrt(K)) and low about -7.5 scales (a GPTQ
    zero point), so the weights spread about 0 at ~K^-0.5; scale / low in `dtype` (float32)."""
    gen = torch.Generator().manual_seed(seed)

    def weight(n: int, k: int) -> Int4Weight:
        packed = torch.randint(0, 256, (experts, n, k // 2), generator=gen, dtype=torch.uint8)
        scale = (torch.rand(experts, n, k // 32, generator=gen) + 0.5) / (6 * k**0.5)
        low = -(7.5 + torch.randn(experts, n, k // 32, generator=gen)) * scale
        to = dict(device=device, dtype=dtype or torch.float32)
        return Int4Weight(packed.to(device), scale.to(**to), low.to(**to))

    return weight(2 * inter if gated else inter, hid), weight(hid, inter)


def test_int4_dequantize_is_the_hand_built_weight():
    """Int4Weight's layout, built by hand: k's code in byte k // 2 (even k in the low nibble),
    W[e, n, k] = code * scale[e, n, k // 32] + low[e, n, k // 32]."""
    one = Int4Weight(
        torch.tensor([[[0x21] + [0xF0] * 15 + [0x0E] * 16]], dtype=torch.uint8),  # K = 64
        torch.tensor([[[0.5, 2.0]]]),
        torch.tensor([[[-1.0, 3.0]]]),
    )
    want = torch.tensor([1, 2] + [0, 15] * 15 + [14, 0] * 16).float()
    want = want * torch.tensor([0.5] * 32 + [2.0] * 32) + torch.tensor([-1.0] * 32 + [3.0] * 32)
    assert torch.equal(one.dequantize(), want.view(1, 1, 64))
    experts, n, k = 3, 5, 96
    codes = torch.randint(0, 16, (experts, n, k))
    scale, low = torch.randn(experts, n, k // 32), torch.randn(experts, n, k // 32)
    packed = (codes[..., 0::2] + 16 * codes[..., 1::2]).to(torch.uint8)
    dense = torch.empty(experts, n, k)
    for e in range(experts):
        for r in range(n):
            for c in range(k):
                dense[e, r, c] = codes[e, r, c] * scale[e, r, c // 32] + low[e, r, c // 32]
    w = Int4Weight(packed, scale, low)
    torch.testing.assert_close(w.dequantize(), dense, rtol=0, atol=1e-6)
    assert torch.equal(w.dequantize(torch.bfloat16), w.dequantize().to(torch.bfloat16))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("tokens", "experts", "top_k"), [(1, 4, 2), (5, 8, 2), (19, 4, 3)])
def test_int4_experts_match_reference(seed, device, dtype, tokens, experts, top_k):
    """int4 weights decoded in the GEMMs (code * scale + low in fp32, rounded to x's dtype) give
    the reference on their fp32 values, and on those values rounded to x's dtype: with and
    without gpt-oss's biases and clamped SwiGLU; H = 96, I = 64 (K not a multiple of the tile),
    scale / low in x's dtype; in bf16 (19 tokens) also 32-wide K tiles and wide ones, and the
    dense kernel on the rounded values."""
    hid, inter = 96, 64
    gate_up, down = _int4_weights(experts, hid, inter, device, seed=tokens, dtype=dtype)
    x = torch.randn(tokens, hid, device=device).to(dtype)
    weights, ids = _route(tokens, experts, top_k, device)
    kwargs: dict = {}
    if tokens > 1:
        act = MoeActivation("swigluoai", alpha=1.702, limit=0.5)
        gb = torch.randn(experts, 2 * inter, device=device).to(dtype)
        kwargs = dict(
            gate_up_bias=gb, down_bias=torch.randn(experts, hid, device=device), activation=act
        )
    want = ref_fused_moe(x, gate_up, down, weights, ids, **kwargs)
    got = fused_moe(x, gate_up, down, weights, ids, **kwargs)
    _close(got, want, dtype)
    rounded = [w.dequantize(dtype) for w in (gate_up, down)]  # the weights the kernel multiplies
    _close(got, ref_fused_moe(x, *rounded, weights, ids, **kwargs), dtype)
    # The tile walks below once, on the shape with the most rows per expert (the interpreter is
    # slow; H and I, so the K and N walks, are the same at every shape).
    if dtype != torch.bfloat16 or tokens != 19:
        return
    for tiles in (MoeTiles(16, 16, 32, 4, 2), MoeTiles(16, 32, 128, 4, 2)):
        _close(fused_moe(x, gate_up, down, weights, ids, tiles=tiles, **kwargs), want, dtype)
    _close(fused_moe(x, *rounded, weights, ids, **kwargs), want, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_relu2_int4_experts_match_reference(seed, device, dtype):
    """Non-gated experts in int4 (up [E, I, H] alone, float32 scale / low under bf16 x, up's
    low a view with strides of its own), with an up bias: the reference on the weights rounded
    to x's dtype as the kernel rounds them (relu2 squares: bf16's rounding of the weights alone
    moves its sums past bf16's TOL)."""
    experts, top_k, tokens, hid, inter = 6, 2, 17, 64, 32
    relu2 = MoeActivation("relu2")
    up, down = _int4_weights(experts, hid, inter, device, seed=2, gated=False)
    wide = up.low.new_zeros(experts + 1, inter, hid // 32 + 3)
    wide[1:, :, : hid // 32] = up.low
    up = up._replace(low=wide[1:, :, : hid // 32])
    assert up.low.stride() != up.scale.stride()
    x = torch.randn(tokens, hid, device=device).to(dtype)
    weights, ids = _route(tokens, experts, top_k, device)
    bias = (torch.randn(experts, inter, device=device) * 0.1).to(dtype)
    kwargs = dict(gate_up_bias=bias, activation=relu2)
    rounded = [w.dequantize(dtype) for w in (up, down)]
    want = ref_fused_moe(x, *rounded, weights, ids, **kwargs)
    assert want.abs().max() > 0.1
    _close(fused_moe(x, up, down, weights, ids, **kwargs), want, dtype)


def test_int4_rejects_bad_arguments(device):
    gate_up, down = _int4_weights(4, 64, 32, device)
    x = torch.randn(3, 64, device=device)
    weights, ids = _route(3, 4, 2, device)
    kinds = "both dense, or both MXFP4, FP8 or int4"
    with pytest.raises(ValueError, match=kinds):
        fused_moe(x, gate_up, down.dequantize(), weights, ids)
    with pytest.raises(ValueError, match=kinds):
        fused_moe(x, gate_up, _mxfp4_weights(4, 64, 32, device)[1], weights, ids)
    with pytest.raises(ValueError, match="block_k >= 32"):
        fused_moe(x, gate_up, down, weights, ids, tiles=MoeTiles(16, 16, 16, 4, 2))
    with pytest.raises(ValueError, match=r"gate_up: int4 packed .* must be"):
        fused_moe(x, gate_up._replace(scale=gate_up.scale[..., :1]), down, weights, ids)
    with pytest.raises(ValueError, match=r"down: int4 packed .* must be"):
        fused_moe(x, gate_up, down._replace(low=down.low[:, :-1]), weights, ids)
    with pytest.raises(ValueError, match="K a multiple of 32"):  # K = 48: 24 bytes, 1 group
        bad = Int4Weight(down.packed[..., :8].repeat(1, 1, 3), down.scale, down.low)
        fused_moe(x, gate_up, bad, weights, ids)
    with pytest.raises(ValueError, match="uint8"):
        fused_moe(x, gate_up._replace(packed=gate_up.packed.int()), down, weights, ids)
    with pytest.raises(ValueError, match="scale / low float"):
        fused_moe(x, gate_up, down._replace(low=down.low.int()), weights, ids)
    with pytest.raises(ValueError, match=r"down \(4, 32, 32\) != \[E, H, I\]"):
        fused_moe(x, gate_up, _int4_weights(4, 32, 32, device)[1], weights, ids)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_small_tiles_walk_k_and_n_and_several_blocks_per_expert(seed, device, dtype):
    """16 x 16 x 16 tiles: the K loop runs several steps, several N tiles per GEMM (partial last
    ones), and an expert's group spans several blocks; weights as strided views, x a row view."""
    experts, top_k, tokens = 4, 2, 37
    tiles = MoeTiles(16, 16, 16, 4, 2)
    wide = torch.randn(tokens, 2 * HID, device=device).to(dtype)
    x = wide[:, HID:]  # rows of stride 2 * HID
    gate_up, down = _weights(experts + 1, dtype, device)
    gate_up, down = gate_up[1:], down[1:]  # not at the storage's start
    weights, ids = _route(tokens, experts, top_k, device, unused=2)  # 2 experts share 74 slots
    got = fused_moe(x, gate_up, down, weights, ids, tiles=tiles)
    _close(got, ref_fused_moe(x, gate_up, down, weights, ids), dtype)
    # Each token's result depends only on its own row and routing: a subset gives its rows.
    part = fused_moe(x[5:9], gate_up, down, weights[5:9], ids[5:9], tiles=tiles)
    _close(part, got[5:9], dtype)


def test_no_host_reads(device, monkeypatch):
    """The wrapper (alignment, buffers, the sum over k) reads nothing on the host: with the
    kernel launches stubbed out, not one host read happens."""
    launches = []

    class Stub:
        def __getitem__(self, grid):
            return lambda *args, **kwargs: launches.append(grid)

    monkeypatch.setattr(moe, "_moe_gemm_kernel", Stub())
    gate_up, down = _weights(8, torch.float32, device)
    x = torch.randn(5, HID, device=device)
    weights, ids = _route(5, 8, 2, device)
    reads: list[str] = []
    with spy_host_reads(reads.append):
        fused_moe(x, gate_up, down, weights, ids)
    assert reads == [] and len(launches) == 2


def test_rejects_bad_arguments(device):
    gate_up, down = _weights(4, torch.float32, device)
    x = torch.randn(3, HID, device=device)
    weights, ids = _route(3, 4, 2, device)
    with pytest.raises(ValueError, match="down"):
        fused_moe(x, gate_up, down[:, :, :-1], weights, ids)
    with pytest.raises(ValueError, match="dtype"):
        fused_moe(x.half(), gate_up, down, weights, ids)
    with pytest.raises(ValueError, match="topk_ids"):
        fused_moe(x, gate_up, down, weights, ids.float())
    with pytest.raises(ValueError, match="topk_weights"):
        fused_moe(x, gate_up, down, weights[:, :1], ids)
    with pytest.raises(ValueError, match="top-k 5"):
        fused_moe(x, gate_up, down, weights.repeat(1, 3)[:, :5], ids.repeat(1, 3)[:, :5])
    with pytest.raises(ValueError, match="tiles"):
        fused_moe(x, gate_up, down, weights, ids, tiles=MoeTiles(8, 16, 16, 4, 2))
    with pytest.raises(ValueError, match="gate_up_bias"):
        fused_moe(x, gate_up, down, weights, ids, gate_up_bias=torch.zeros(4, INTER))
    with pytest.raises(ValueError, match="down_bias"):
        fused_moe(x, gate_up, down, weights, ids, down_bias=torch.zeros(3, HID))
    with pytest.raises(ValueError, match="activation"):
        fused_moe(x, gate_up, down, weights, ids, activation=MoeActivation("quick_gelu"))
    assert fused_moe(x[:0], gate_up, down, weights[:0], ids[:0]).shape == (0, HID)


def test_gated_and_non_gated_shapes_are_checked(device):
    """A gated activation takes gate_up [E, 2I, H] (bias [E, 2I]), the non-gated relu2 the up
    weight [E, I, H] (bias [E, I]): each refuses the other's, dense or FP8."""
    gate_up, down = _weights(4, torch.float32, device)
    up = gate_up[:, :INTER]
    x = torch.randn(3, HID, device=device)
    weights, ids = _route(3, 4, 2, device)
    relu2 = MoeActivation("relu2")
    with pytest.raises(ValueError, match=r"!= \[E, I, H\] = \[4, 24, 40\] for 'relu2'"):
        fused_moe(x, gate_up, down, weights, ids, activation=relu2)
    with pytest.raises(ValueError, match=r"!= \[E, 2I, H\] = \[4, 48, 40\] for 'silu'"):
        fused_moe(x, up, down, weights, ids)
    with pytest.raises(ValueError, match="gate_up_bias"):
        fused_moe(x, up, down, weights, ids, gate_up_bias=gate_up[:, :, 0], activation=relu2)
    fp8_up, fp8_down = (Fp8Weight(*quantize_fp8_per_channel(w)) for w in (up, down))
    with pytest.raises(ValueError, match=r"\[E, 2I, H\]"):
        fused_moe(x, fp8_up, fp8_down, weights, ids)
    with pytest.raises(ValueError, match="'relu2' needs 24 rows"):
        ref_fused_moe(x, gate_up, down, weights, ids, activation=relu2)
    with pytest.raises(ValueError, match="'silu' needs 48 rows"):
        ref_fused_moe(x, up, down, weights, ids)


# Qwen3-30B-A3B's experts: hidden 2048, expert intermediate 768, 128 experts, top-8.
QWEN3_MOE = dict(hid=2048, inter=768, experts=128, top_k=8)


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [1, 16, 200, 1024])
def test_qwen3_30b_a3b_shapes(seed, tokens):
    device, dtype, c = torch.device("cuda"), torch.bfloat16, QWEN3_MOE
    x = torch.randn(tokens, c["hid"], device=device, dtype=dtype)
    gate_up, down = _weights(c["experts"], dtype, device, c["hid"], c["inter"])
    weights, ids = _route(tokens, c["experts"], c["top_k"], device, unused=8)
    got = fused_moe(x, gate_up, down, weights, ids)
    _close(got, ref_fused_moe(x, gate_up, down, weights, ids), dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [1, 64, 1024])
def test_gpt_oss_20b_mxfp4_shapes(seed, tokens):
    """gpt-oss-20b's experts (hidden 2880, intermediate 2880, 32 experts, top-4) in MXFP4 with
    biases and the clamped SwiGLU, against the reference on their exact values."""
    device, dtype = torch.device("cuda"), torch.bfloat16
    hid = inter = 2880
    gate_up, down = _mxfp4_weights(32, hid, inter, device)
    act = MoeActivation("swigluoai", alpha=1.702, limit=7.0)
    gb = torch.randn(32, 2 * inter, device=device, dtype=dtype) * 0.1
    db = torch.randn(32, hid, device=device, dtype=dtype) * 0.1
    x = torch.randn(tokens, hid, device=device, dtype=dtype)
    weights, ids = _route(tokens, 32, 4, device, unused=4)
    kw = dict(gate_up_bias=gb, down_bias=db, activation=act)
    got = fused_moe(x, gate_up, down, weights, ids, **kw)
    _close(got, ref_fused_moe(x, gate_up, down, weights, ids, **kw), dtype)


@pytest.mark.gpu
def test_cuda_graph_capture_and_replay(seed):
    """Captured once, replayed on new tokens and new routing: the result of an eager call."""
    device, dtype, c = torch.device("cuda"), torch.bfloat16, QWEN3_MOE
    tokens = 48
    gate_up, down = _weights(c["experts"], dtype, device, c["hid"], c["inter"])
    x = torch.randn(tokens, c["hid"], device=device, dtype=dtype)
    weights, ids = _route(tokens, c["experts"], c["top_k"], device, unused=0)
    fused_moe(x, gate_up, down, weights, ids)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fused_moe(x, gate_up, down, weights, ids)
    for _ in range(2):
        x.copy_(torch.randn_like(x))
        new_weights, new_ids = _route(tokens, c["experts"], c["top_k"], device, unused=0)
        weights.copy_(new_weights)
        ids.copy_(new_ids)
        graph.replay()
        torch.testing.assert_close(out, fused_moe(x, gate_up, down, weights, ids), rtol=0, atol=0)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens", [1, 33])
def test_gelu_matches_reference(seed, device, dtype, tokens):
    """Grok-1's experts: gelu(gate) * up with the exact (erf) GELU, against ref_fused_moe
    (itself torch's gelu), over small tiles too."""
    experts, top_k = 8, 2
    act = MoeActivation("gelu")
    x = (torch.randn(tokens, HID, device=device) * 2).to(dtype)  # gates reach GELU's bend
    gate_up, down = _weights(experts, dtype, device)
    weights, ids = _route(tokens, experts, top_k, device)
    got = fused_moe(x, gate_up, down, weights, ids, activation=act)
    _close(got, ref_fused_moe(x, gate_up, down, weights, ids, activation=act), dtype)
    tiles = MoeTiles(16, 16, 16, 4, 2)
    _close(fused_moe(x, gate_up, down, weights, ids, tiles=tiles, activation=act), got, dtype)
    # Exact GELU, not tanh's (~5e-4 off): against the erf formula in float64; float32 erf GELU
    # is ~1e-6 off where 1 + erf(g / sqrt 2) cancels (g near -3), so atol 1e-5.
    g, u = torch.randn(5, 7), torch.randn(5, 7)
    g64, u64 = g.double(), u.double()
    want = (0.5 * g64 * (1 + torch.erf(g64 / 2**0.5)) * u64).float()
    torch.testing.assert_close(moe_activation(g, u, act), want, rtol=1e-5, atol=1e-5)
