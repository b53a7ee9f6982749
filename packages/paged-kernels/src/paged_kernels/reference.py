"""Plain-torch references for every kernel in paged_kernels.

They define the semantics the Triton kernels are tested against, and they are the engine's
attention path on machines without a CUDA device. Cache layout everywhere:

    key_cache, value_cache: [num_blocks, block_size, num_kv_heads, head_dim]
    slot = block_id * block_size + offset_in_block; slot -1 marks a padding token (skipped).

An fp8 cache (torch.float8_e4m3fn / float8_e5m2) holds x / scale, saturated to the format's
largest finite value and rounded to nearest even, with one scale per cache tensor (`k_scale`,
`v_scale`); readers dequantize to fp32 as stored * scale.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, NamedTuple

import torch

from paged_kernels._utils import FP8_DTYPES, FP8_FORMATS, check, check_kv_scales

if TYPE_CHECKING:
    import numpy as np


def ref_quantize(x: torch.Tensor, dtype: torch.dtype, scale: float = 1.0) -> torch.Tensor:
    """x in a cache's dtype: a plain cast, or for fp8 (x / scale) saturated and rounded to
    nearest even (the division is a multiply by the fp32 reciprocal, as in the kernel)."""
    if dtype not in FP8_DTYPES:
        return x.to(dtype)
    fmax = FP8_FORMATS[dtype][2]
    inv = torch.tensor(1.0 / scale, dtype=torch.float32, device=x.device)
    return (x.float() * inv).clamp_(-fmax, fmax).to(dtype)


def ref_dequantize(x: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
    """fp32 values of cache entries: fp8 ones times their scale (`fp8_to_float`)."""
    return fp8_to_float(x, scale) if x.dtype in FP8_DTYPES else x.float()


def fp8_to_float(x: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
    """fp32 x * scale of an fp8 tensor, from its bits: the same values as `x.float() * scale`
    (one rounding, of the product), about 4x faster than torch's fp8 cast on CPU.

    The byte, sign-extended to int32 and shifted so its exponent and mantissa bits land at the
    top of fp32's, reads as the fp8 value times 2^(BIAS - 127) (fp8 subnormals become fp32
    subnormals, exactly); one multiply by scale * 2^(127 - BIAS) undoes that. The NaN / inf
    codes never occur: writers saturate at the format's largest finite value. (Under
    torch.set_flush_denormal(True) the fp8 subnormals would read as 0.)"""
    man, bias, _ = FP8_FORMATS[x.dtype]
    shift = 23 - man  # the 7 low bits (exponent + mantissa) end at fp32's mantissa top
    mask = -(1 << 31) | (0x7F << shift)  # sign (bit 31 after sign extension) + those bits
    bits = x.view(torch.int8).to(torch.int32)
    bits.bitwise_left_shift_(shift).bitwise_and_(mask)
    factor = 2.0 ** (127 - bias)
    out = bits.view(torch.float32)
    if scale * factor < 2.0**127:  # one exact product, rounded once (as x.float() * scale)
        return out.mul_(scale * factor)
    return out.mul_(factor).mul_(scale)


def ref_write_kv_cache(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    slot_mapping: torch.Tensor,  # [num_tokens] int, -1 = padding
    *,
    k_scale: float = 1.0,  # fp8 caches: stored = key / k_scale
    v_scale: float = 1.0,
) -> None:
    check_kv_scales(key_cache.dtype, k_scale, v_scale)
    valid = slot_mapping >= 0
    slots = slot_mapping[valid].long()
    num_blocks, block_size = key_cache.shape[:2]
    for src, cache, scale in ((key, key_cache, k_scale), (value, value_cache, v_scale)):
        flat = cache.view(num_blocks * block_size, *cache.shape[2:])
        flat[slots] = ref_quantize(src[valid], cache.dtype, scale)


def ref_copy_blocks(
    key_caches: list[torch.Tensor],  # each [num_blocks, block_size, num_kv_heads, head_dim]
    value_caches: list[torch.Tensor],
    block_mapping: torch.Tensor,  # [num_pairs, 2] int, (src, dst) rows
) -> None:
    if block_mapping.numel() == 0:
        return
    src = block_mapping[:, 0].long()
    dst = block_mapping[:, 1].long()
    for cache in (*key_caches, *value_caches):
        cache[dst.to(cache.device)] = cache[src.to(cache.device)]


def ref_swap_blocks(
    src_cache: torch.Tensor,  # [num_src_blocks, ...] on one device
    dst_cache: torch.Tensor,  # [num_dst_blocks, ...] on another (or the same) device
    block_mapping: torch.Tensor,  # [num_pairs, 2] int, (src, dst) rows
) -> None:
    for src, dst in block_mapping.tolist():
        dst_cache[dst].copy_(src_cache[src])


def alibi_slopes(num_heads: int) -> torch.Tensor:
    """Standard ALiBi slopes (Press et al.), fp32 [num_heads]."""
    closest = 2 ** math.floor(math.log2(num_heads))
    base = 2.0 ** (-(2.0 ** -(math.log2(closest) - 3)))
    slopes = [base ** (i + 1) for i in range(closest)]
    if closest != num_heads:
        extra_base = 2.0 ** (-(2.0 ** -(math.log2(2 * closest) - 3)))
        slopes += [extra_base ** (2 * i + 1) for i in range(num_heads - closest)]
    return torch.tensor(slopes, dtype=torch.float32)


def gather_kv(
    cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_table: torch.Tensor,  # [max_blocks] int
    seq_len: int,
) -> torch.Tensor:  # [seq_len, num_kv_heads, head_dim]
    block_size = cache.shape[1]
    num_blocks = (seq_len + block_size - 1) // block_size
    blocks = cache[block_table[:num_blocks].long()]
    return blocks.reshape(-1, *cache.shape[2:])[:seq_len]


def ref_paged_attention(
    q: torch.Tensor,  # [num_q_tokens, num_heads, head_dim]
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_tables: torch.Tensor,  # [num_seqs, max_blocks_per_seq] int32
    cu_seqlens_q: torch.Tensor,  # [num_seqs + 1] int32, query rows of seq i: [cu[i], cu[i+1])
    seq_lens: torch.Tensor,  # [num_seqs] int32, context length incl. this step's query tokens
    scale: float,
    *,
    sliding_window: int | None = None,
    attention_chunk_size: int | None = None,
    soft_cap: float | None = None,
    alibi_slopes: torch.Tensor | None = None,  # [num_heads] fp32
    out: torch.Tensor | None = None,  # [num_q_tokens, num_heads, head_dim]
    k_scale: float = 1.0,  # fp8 caches: key = stored * k_scale
    v_scale: float = 1.0,
    sinks: torch.Tensor | None = None,  # [num_heads] float, one raw logit per query head
    key_ends: torch.Tensor | None = None,  # [num_q_tokens] int32/int64, exclusive key ends
) -> torch.Tensor:
    """Causal attention of each sequence's new query tokens over its paged K/V (an fp8 cache
    is dequantized on load).

    Invariant: the K/V of every position < seq_lens[i] (this step's tokens included) is already
    in the cache. Query row j of sequence i sits at position seq_len - q_len + j and attends to
    key positions k with k <= pos and, with a sliding window W, pos - k < W; with an attention
    chunk size C (chunked local attention), floor(k / C) == floor(pos / C).

    `key_ends` (Gemma 3: the tokens of one image attend both ways at prefill): query token t
    sees keys k <= max(pos, key_ends[t] - 1) instead of k <= pos; ends <= pos + 1 change
    nothing. The lower bounds (window, chunk: k >= pos - pos % C) and ALiBi's k - pos still use
    pos. Each key_ends[t] must be <= its sequence's seq_len.

    `sinks` (gpt-oss): each row's softmax of head h also runs over one extra logit sinks[h]
    (not scaled, capped, biased or windowed), whose probability multiplies no value:
    out = sum_k e^s_k v_k / (sum_k e^s_k + e^sinks[h]).
    """
    check_kv_scales(key_cache.dtype, k_scale, v_scale)
    num_heads = q.shape[1]
    num_kv_heads = key_cache.shape[2]
    group = num_heads // num_kv_heads
    if out is None:
        out = torch.empty_like(q)
    if key_ends is not None:
        check(
            key_ends.shape == (q.shape[0],),
            f"key_ends must be [num_q_tokens={q.shape[0]}], got {tuple(key_ends.shape)}",
        )
        check(
            key_ends.dtype in (torch.int32, torch.int64),
            f"key_ends must be int32/int64, got {key_ends.dtype}",
        )
        key_ends = key_ends.to(q.device, torch.int64)
    cu = cu_seqlens_q.tolist()
    lens = seq_lens.tolist()
    for i, seq_len in enumerate(lens):
        q_start, q_end = cu[i], cu[i + 1]
        q_len = q_end - q_start
        if q_len == 0:
            continue
        k = ref_dequantize(gather_kv(key_cache, block_tables[i], seq_len), k_scale)
        v = ref_dequantize(gather_kv(value_cache, block_tables[i], seq_len), v_scale)
        # [num_heads, seq_len, head_dim]: kv head h serves query heads h*group .. h*group+group-1
        k = k.transpose(0, 1).repeat_interleave(group, dim=0)
        v = v.transpose(0, 1).repeat_interleave(group, dim=0)
        qi = q[q_start:q_end].float().transpose(0, 1)  # [num_heads, q_len, head_dim]
        scores = torch.matmul(qi, k.transpose(1, 2)) * scale  # [num_heads, q_len, seq_len]
        if soft_cap is not None and soft_cap > 0:
            scores = soft_cap * torch.tanh(scores / soft_cap)
        q_pos = torch.arange(seq_len - q_len, seq_len, device=q.device)[:, None]
        k_pos = torch.arange(seq_len, device=q.device)[None, :]
        if alibi_slopes is not None:
            dist = (k_pos - q_pos).float()  # <= 0 for visible keys but those past pos (key_ends)
            scores = scores + alibi_slopes.to(q.device).float()[:, None, None] * dist
        if key_ends is None:
            mask = k_pos <= q_pos
        else:
            ends = key_ends[q_start:q_end, None]
            check(bool((ends <= seq_len).all()), f"key_ends of sequence {i} exceed {seq_len}")
            mask = k_pos <= torch.maximum(q_pos, ends - 1)
        if sliding_window is not None and sliding_window > 0:
            mask = mask & (q_pos - k_pos < sliding_window)
        if attention_chunk_size is not None and attention_chunk_size > 0:
            mask = mask & (k_pos >= q_pos - q_pos % attention_chunk_size)
        scores = scores.masked_fill(~mask, float("-inf"))
        if sinks is not None:  # one more column holding the sink; its probability is dropped
            sink = sinks.to(q.device).float()[:, None, None].expand(num_heads, q_len, 1)
            probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]
        else:
            probs = torch.softmax(scores, dim=-1)
        out[q_start:q_end] = torch.matmul(probs, v).transpose(0, 1).to(out.dtype)
    return out


# ---- Batch-invariant building blocks (gemm.py, norm.py, softmax.py): the same values, in
# torch's own reduction order (which may change with the batch).


def ref_mla_attention(
    q: torch.Tensor,  # [num_q_tokens, num_heads, latent + rope]
    cache: torch.Tensor,  # [num_blocks, block_size, 1, latent + rope]
    block_tables: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    *,
    latent_dim: int,
    k_scale: float = 1.0,
    out: torch.Tensor | None = None,  # [num_q_tokens, num_heads, >= latent_dim]
    **_: object,  # max_seqlen_q: the kernel's tile hint
) -> torch.Tensor:
    """Attention over a latent cache (multi-head latent attention): the cache is every head's
    key and its first `latent_dim` entries the value. Returns `out` with those columns set."""
    full = ref_paged_attention(
        q,
        cache,
        cache,
        block_tables,
        cu_seqlens_q,
        seq_lens,
        scale,
        k_scale=k_scale,
        v_scale=k_scale,
    )
    if out is None:
        return full[..., :latent_dim].contiguous()
    out[..., :latent_dim] = full[..., :latent_dim]
    return out


def ref_index_topk(
    index_q: torch.Tensor,
    cache: torch.Tensor,
    block_tables: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    seq_lens: torch.Tensor,
    *,
    key_offset: int,
    index_heads: int,
    index_dim: int,
    topk: int,
    max_seqlen_k: int,
    k_scale: float = 1.0,
) -> torch.Tensor:
    """DeepSeek Sparse Attention's indexer choice (sparse_mla.py's `index_topk`), one sequence
    at a time: the slots of each query row's `topk` visible keys by score, best first, ties to
    the earlier key, -1 padding; [num_q_tokens, min(topk, max_seqlen_k)] int32."""
    num_tokens, block_size = index_q.shape[0], cache.shape[1]
    k = min(topk, max_seqlen_k)
    out = torch.full((num_tokens, k), -1, dtype=torch.int32, device=index_q.device)
    cu, lens = cu_seqlens_q.tolist(), seq_lens.tolist()
    for s, length in enumerate(lens):
        first, end = cu[s], cu[s + 1]
        if first == end:
            continue
        table = block_tables[s, : -(-length // block_size)].long()
        slots = table[:, None] * block_size + torch.arange(block_size, device=table.device)
        slots = slots.flatten()[:length]  # [L]
        keys = ref_dequantize(cache.flatten(0, 1)[slots, 0, key_offset:][:, :index_dim], k_scale)
        q = index_q[first:end, : index_heads * index_dim].view(-1, index_heads, index_dim)
        w = index_q[first:end, index_heads * index_dim : index_heads * (index_dim + 1)]
        scores = torch.einsum("rhd,ld->rhl", q, keys) * index_dim**-0.5
        scores = torch.einsum("rh,rhl->rl", w, scores.relu())
        pos = torch.arange(length - (end - first), length, device=q.device)
        hidden = torch.arange(length, device=q.device) > pos[:, None]
        scores = scores.masked_fill(hidden, float("-inf"))
        values, order = scores.sort(dim=-1, descending=True, stable=True)
        n = min(k, length)
        chosen = torch.where(values[:, :n] > float("-inf"), slots[order[:, :n]], -1)
        out[first:end, :n] = chosen.to(torch.int32)
    return out


def ref_sparse_mla_attention(
    q: torch.Tensor,  # [num_q_tokens, num_heads, latent + rope]
    cache: torch.Tensor,  # [num_blocks, block_size, 1, >= latent + rope]
    indices: torch.Tensor,  # [num_q_tokens, K] slots, -1 = padding
    scale: float,
    *,
    latent_dim: int,
    k_scale: float = 1.0,
    sinks: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """`sparse_mla_attention` in float32 torch: each row's softmax over its slots' scores
    (and its head's sink), a row with neither outputting 0."""
    t, h, width = q.shape
    rows = ref_dequantize(cache.flatten(0, 1)[indices.long().clamp(min=0), 0, :width], k_scale)
    scores = torch.einsum("thd,tkd->thk", q.float(), rows) * scale  # [T, H, K]
    scores = scores.masked_fill((indices < 0)[:, None], float("-inf"))
    if sinks is not None:
        scores = torch.cat((scores, sinks.float()[None, :, None].expand(t, h, 1)), dim=-1)
    probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)[..., : indices.shape[1]]
    result = torch.einsum("thk,tkd->thd", probs, rows[..., :latent_dim])
    if out is None:
        out = torch.empty(t, h, latent_dim, dtype=q.dtype, device=q.device)
    out[..., :latent_dim] = result.to(out.dtype)
    return out


def ref_matmul(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """x @ weight.T (+ bias) in x's dtype, accumulated in fp32."""
    out = x.float() @ weight.float().t()
    return (out if bias is None else out + bias.float()).to(x.dtype)


def ref_rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    weight_offset: float = 0.0,
    *,
    round_before_weight: bool | None = None,
) -> torch.Tensor:
    """fp32 statistics; 16-bit inputs round the normalised row and (weight + offset) to their
    dtype before the product (paged_engine's RMSNorm), or with `round_before_weight=False`
    only the fp32 product, once (Gemma's)."""
    y = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + eps)
    w = weight.float() + weight_offset
    if x.dtype != torch.float32 and round_before_weight is not False:
        y, w = y.to(x.dtype).float(), w.to(x.dtype).float()
    return (y * w).to(x.dtype)


def ref_layer_norm(
    x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None, eps: float
) -> torch.Tensor:
    w = None if weight is None else weight.float()
    b = None if bias is None else bias.float()
    return torch.nn.functional.layer_norm(x.float(), x.shape[-1:], w, b, eps).to(x.dtype)


def ref_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x + residual), x + residual): the sum rounded to x's dtype, then normalised."""
    total = x + residual
    return ref_rms_norm(total, weight, eps), total


def ref_logsumexp(x: torch.Tensor) -> torch.Tensor:
    """[rows, N] -> [rows, 1] fp32."""
    return x.float().logsumexp(-1, keepdim=True)


# ---- Layer epilogues (rotary.py, activation.py): fused forms of paged_engine's torch layers


def ref_rope_qk(
    qkv: torch.Tensor,
    positions: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    num_q_heads: int,
    num_kv_heads: int,
    head_dim: int,
    *,
    is_neox_style: bool = True,
    q_weight: torch.Tensor | None = None,
    k_weight: torch.Tensor | None = None,
    eps: float = 1e-6,
    weight_offset: float = 0.0,
    round_before_weight: bool | None = None,
) -> torch.Tensor:
    """A copy of qkv [T, W] with its q and k heads (normalised as ref_rms_norm, then) rotated
    in float32: o1 = x1 cos - x2 sin, o2 = x2 cos + x1 sin over the first R = 2 * cos.shape[1]
    dims."""
    t, hq, hk = qkv.shape[0], num_q_heads, num_kv_heads
    out = qkv.clone()
    heads = out[:, : (hq + hk) * head_dim].view(t, hq + hk, head_dim)
    if q_weight is not None and k_weight is not None:
        kw = dict(round_before_weight=round_before_weight)
        heads[:, :hq] = ref_rms_norm(heads[:, :hq], q_weight, eps, weight_offset, **kw)
        heads[:, hq:] = ref_rms_norm(heads[:, hq:], k_weight, eps, weight_offset, **kw)
    r = 2 * cos.shape[1]
    rot = heads[..., :r].float()
    c, s = cos[positions].unsqueeze(1), sin[positions].unsqueeze(1)  # [T, 1, R/2]
    x1, x2 = rot.chunk(2, dim=-1) if is_neox_style else (rot[..., 0::2], rot[..., 1::2])
    o1, o2 = x1 * c - x2 * s, x2 * c + x1 * s
    rotated = torch.cat((o1, o2), -1) if is_neox_style else torch.stack((o1, o2), -1).flatten(-2)
    heads[..., :r] = rotated.to(qkv.dtype)
    return out


def ref_silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x [..., 2I] = (gate | up) -> silu(gate) * up [..., I], each op rounded to x's dtype."""
    gate, up = x.chunk(2, dim=-1)
    return torch.nn.functional.silu(gate) * up


# ---- Sampling (sampling.py)


def ref_gumbel_race(
    x: torch.Tensor, u: torch.Tensor, temperature: torch.Tensor | None = None
) -> torch.Tensor:
    """[N] int64: per row the first argmax of x / T - log(-log u) (u: the race's uniforms, as
    `uniform_noise` writes them), in float32."""
    x = x.float()
    if temperature is not None:
        x = x / temperature.reshape(-1, 1)
    return (x - torch.log(-torch.log(u))).max(dim=-1).indices


# ---- Mixture of experts (moe.py)


class MoeActivation(NamedTuple):
    """The experts' activation. Gated ones act on (gate, up) projections, the halves of a
    gate_up weight [E, 2I, H] (gate rows, then up rows):

    silu       silu(g) * u
    gelu_tanh  gelu(g) * u, GELU's tanh approximation (Gemma 4's experts)
    gelu       gelu(g) * u, the exact (erf) GELU (Grok-1's experts)
    swigluoai  (clamp(u, -limit, limit) + 1) * g' * sigmoid(alpha * g'),  g' = min(g, limit)
               (gpt-oss; alpha and limit from its config's swiglu_alpha / swiglu_limit)

    A non-gated one acts on the up projection h alone, gate_up then being up [E, I, H]:

    relu2      relu(h)^2  (Nemotron-H / Nemotron 3 MoE experts)
    """

    name: str = "silu"
    alpha: float = 1.702
    limit: float = 7.0

    @property
    def gated(self) -> bool:
        """Whether it acts on (gate, up): the first projection has 2I rows, else I."""
        return self.name in GATED_MOE_ACTIVATIONS


GATED_MOE_ACTIVATIONS = ("silu", "swigluoai", "gelu_tanh", "gelu")
MOE_ACTIVATIONS = (*GATED_MOE_ACTIVATIONS, "relu2")
SILU = MoeActivation()


def check_moe_activation(act: MoeActivation) -> None:
    check(act.name in MOE_ACTIVATIONS, f"activation must be one of {MOE_ACTIVATIONS}: {act.name!r}")


def moe_activation(gate: torch.Tensor, up: torch.Tensor | None, act: MoeActivation) -> torch.Tensor:
    """act(gate, up), elementwise in the inputs' dtype; a non-gated act takes its projection as
    `gate` and up=None."""
    check((up is not None) == act.gated, f"{act.name!r}: up must be given iff gated")
    if act.name == "relu2":
        return torch.relu(gate).square()
    if act.name == "silu":
        return torch.nn.functional.silu(gate) * up
    if act.name == "gelu_tanh":
        return torch.nn.functional.gelu(gate, approximate="tanh") * up
    if act.name == "gelu":
        return torch.nn.functional.gelu(gate) * up
    gate = gate.clamp(max=act.limit)
    up = up.clamp(-act.limit, act.limit)
    return (up + 1) * gate * torch.sigmoid(gate * act.alpha)


class Mxfp4Weight(NamedTuple):
    """A weight W [..., N, K] in MXFP4 (OCP microscaling FP4, gpt-oss's experts):

    blocks  uint8 [..., N, K/2]   two E2M1 codes a byte, the even position in the low nibble
    scales  uint8 [..., N, K/32]  a power of two per 32 values, biased by 127 (E8M0)

    W[..., n, k] = E2M1[code k] * 2^(scales[..., n, k // 32] - 127); E2M1 codes 0-7 are +0,
    0.5, 1, 1.5, 2, 3, 4, 6 and codes 8-15 the same negated. K is a multiple of 32."""

    blocks: torch.Tensor
    scales: torch.Tensor


_E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def check_mxfp4(w: Mxfp4Weight, what: str = "MXFP4 weight") -> None:
    blocks, scales = w
    check(
        blocks.dtype == torch.uint8 and scales.dtype == torch.uint8,
        f"{what}: blocks / scales must be uint8, got {blocks.dtype} / {scales.dtype}",
    )
    check(
        blocks.dim() >= 2
        and scales.shape[:-1] == blocks.shape[:-1]
        and blocks.shape[-1] == 16 * scales.shape[-1],
        f"{what}: blocks {tuple(blocks.shape)} must be [..., N, K/2] and scales "
        f"{tuple(scales.shape)} [..., N, K/32]",
    )


def dequantize_mxfp4(w: Mxfp4Weight, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The values of an MXFP4 weight, [..., N, K] in `dtype` on its device (exact in fp32;
    in bf16 / fp16 too while the scales stay in their range)."""
    check_mxfp4(w)
    blocks, scales = w
    table = torch.tensor(_E2M1, dtype=torch.float32, device=blocks.device)
    codes = torch.stack((blocks & 0x0F, blocks >> 4), dim=-1).flatten(-2)  # [..., N, K]
    values = table[codes.long()].unflatten(-1, (-1, 32))  # [..., N, K/32, 32]
    exponents = (scales.to(torch.int32) - 127).to(torch.float32).unsqueeze(-1)
    return torch.ldexp(values, exponents).flatten(-2).to(dtype)


def ref_fused_moe(
    x: torch.Tensor,  # [T, H]
    gate_up: torch.Tensor | Mxfp4Weight | Fp8Weight,  # [E, 2I, H]: gate rows, then up; [E, I, H]
    down: torch.Tensor | Mxfp4Weight | Fp8Weight,  # [E, H, I]
    topk_weights: torch.Tensor,  # [T, k] float
    topk_ids: torch.Tensor,  # [T, k] int in [0, E)
    *,
    gate_up_bias: torch.Tensor | None = None,  # [E, 2I], or [E, I] when not gated
    down_bias: torch.Tensor | None = None,  # [E, H]
    activation: MoeActivation = SILU,
) -> torch.Tensor:  # [T, H] in x's dtype
    """sum_j w_tj * (down_e(act(gate_e x_t, up_e x_t)) + b_e), e = topk_ids[t, j] (a non-gated
    act: down_e(act(up_e x_t)), gate_up the up weight alone): each used expert over its (token,
    choice) pairs, in fp32; the activation rounds to x's dtype before the down projection, and
    the sum over a token's k choices rounds once. MXFP4, FP8 or int4 weights (both projections)
    multiply as their exact values."""
    check_moe_activation(activation)
    if isinstance(gate_up, Mxfp4Weight):
        gate_up, down = dequantize_mxfp4(gate_up), dequantize_mxfp4(down)
    if isinstance(gate_up, (Fp8Weight, Int4Weight)):
        gate_up, down = gate_up.dequantize(), down.dequantize()
    rows = (2 if activation.gated else 1) * down.shape[-1]
    check(
        gate_up.shape[-2] == rows,
        f"gate_up {tuple(gate_up.shape)}: {activation.name!r} needs {rows} rows "
        f"({'2I' if activation.gated else 'I'}, down {tuple(down.shape)})",
    )
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    for e in topk_ids.unique().tolist():
        tokens, choices = (topk_ids == e).nonzero(as_tuple=True)
        h = x[tokens].float() @ gate_up[e].float().t()
        if gate_up_bias is not None:
            h += gate_up_bias[e].float()
        gate, up = h.chunk(2, dim=-1) if activation.gated else (h, None)
        act = moe_activation(gate, up, activation).to(x.dtype).float()
        y = act @ down[e].float().t()
        if down_bias is not None:
            y += down_bias[e].float()
        out.index_add_(0, tokens, y * topk_weights[tokens, choices, None].float())
    return out.to(x.dtype)


# ---- FP8 weights (gemm.py's fp8_linear)

FP8_E4M3_MAX = 448.0


def quantize_fp8_per_channel(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w [..., N, K] -> (float8_e4m3fn [..., N, K], float32 scale [..., N]): each row scaled so
    its largest |value| maps to e4m3's largest, 448 (round to nearest even); a zero row keeps
    scale 1."""
    amax = w.detach().float().abs().amax(dim=-1)
    scale = torch.where(amax > 0, amax / FP8_E4M3_MAX, torch.ones_like(amax))
    q = (w.float() / scale[..., None]).clamp_(-FP8_E4M3_MAX, FP8_E4M3_MAX)
    return q.to(torch.float8_e4m3fn), scale


class Fp8Weight(NamedTuple):
    """Stacked experts' weights in FP8: `weight` float8_e4m3fn [E, N, K] and `scale` float32
    [E, N], one per output row: W = weight * scale[..., None] (`quantize_fp8_per_channel`)."""

    weight: torch.Tensor
    scale: torch.Tensor

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return (self.weight.float() * self.scale.float()[..., None]).to(dtype)


INT4_GROUP = 32  # inputs (along K) per scale / low pair


class Int4Weight(NamedTuple):
    """Stacked experts' weights in 4 bits (a GPTQ / AWQ checkpoint's codes, kept): `packed`
    uint8 [E, N, K/2] (k's code in byte k // 2, even k in the low nibble), `scale` and `low`
    [E, N, K/32]: W[e, n, k] = code * scale[e, n, k // 32] + low[e, n, k // 32]."""

    packed: torch.Tensor
    scale: torch.Tensor
    low: torch.Tensor

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        codes = torch.stack((self.packed & 15, self.packed >> 4), dim=-1).flatten(-2).float()
        groups = codes.unflatten(-1, (-1, INT4_GROUP))
        w = groups * self.scale.float()[..., None] + self.low.float()[..., None]
        return w.flatten(-2).to(dtype)


def ref_fp8_linear(
    x: torch.Tensor,  # [M, K]
    weight: torch.Tensor,  # [N, K] float8_e4m3fn
    scale: torch.Tensor,  # [N] float32
    bias: torch.Tensor | None = None,  # [N]
) -> torch.Tensor:  # [M, N] in x's dtype
    """(x @ weight^T in fp32) * scale + bias, rounded once to x's dtype."""
    out = (x.float() @ weight.float().t()) * scale.float()
    if bias is not None:
        out += bias.float()
    return out.to(x.dtype)


# ---- 4-bit group-quantized weights (int4_linear): codes 0-15, one (scale, low) pair a group.


def check_int4(
    x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, low: torch.Tensor
) -> None:
    """int4_linear's argument shapes and dtypes (ValueError naming them)."""
    check(x.dim() == 2, f"x must be [M, K], got {tuple(x.shape)}")
    k = x.shape[1]
    check(k % INT4_GROUP == 0, f"x {tuple(x.shape)}: K={k} is not a multiple of {INT4_GROUP}")
    check(packed.dim() == 2, f"packed must be [N, K // 2], got {tuple(packed.shape)}")
    n = packed.shape[0]
    groups = (n, k // INT4_GROUP)
    check(
        packed.shape[1] == k // 2,
        f"packed {tuple(packed.shape)} must be [N, K // 2] = [{n}, {k // 2}] "
        f"for x {tuple(x.shape)}",
    )
    check(
        scale.shape == groups and low.shape == groups,
        f"scale {tuple(scale.shape)} and low {tuple(low.shape)} must be [N, K // {INT4_GROUP}] "
        f"= {list(groups)} for x {tuple(x.shape)} and packed {tuple(packed.shape)}",
    )
    floats = (torch.float16, torch.bfloat16, torch.float32)
    check(x.dtype in floats, f"x must be float16 / bfloat16 / float32, got {x.dtype}")
    check(packed.dtype == torch.uint8, f"packed must be uint8, got {packed.dtype}")
    check(
        scale.dtype in floats and low.dtype in floats,
        f"scale / low must be float16 / bfloat16 / float32, got {scale.dtype} / {low.dtype}",
    )


def ref_int4_linear(
    x: torch.Tensor,  # [M, K] float16 / bfloat16 / float32
    packed: torch.Tensor,  # [N, K // 2] uint8: k's code in byte k // 2, even k in the low nibble
    scale: torch.Tensor,  # [N, K // 32]
    low: torch.Tensor,  # [N, K // 32]
) -> torch.Tensor:  # [M, N] in x's dtype
    """x @ w^T in fp32, rounded once to x's dtype, where w[n, k] = code(n, k) * scale[n, k // 32]
    + low[n, k // 32] (fp32) and code(n, k) = (packed[n, k // 2] >> 4 * (k % 2)) & 15."""
    check_int4(x, packed, scale, low)
    codes = torch.stack((packed & 15, packed >> 4), dim=-1).flatten(-2).float()  # [N, K]
    groups = codes.unflatten(-1, (-1, INT4_GROUP))  # [N, K // 32, 32]
    w = (groups * scale.float()[..., None] + low.float()[..., None]).flatten(-2)
    return (x.float() @ w.t()).to(x.dtype)


# ---- Multi-LoRA (lora.py): slots [T] hold each token's adapter slot, -1 for none.


def lora_segments(
    slots: torch.Tensor | np.ndarray,  # [T] int, each in [-1, num_slots)
    num_slots: int,
) -> tuple[torch.Tensor, torch.Tensor]:  # token_idx [T] int32, seg_start [num_slots + 1] int32
    """Per-token slots -> the segment layout of lora_shrink / lora_expand: slot l's tokens are
    token_idx[seg_start[l] : seg_start[l + 1]] in their original order; tokens without an
    adapter (-1) follow seg_start[num_slots], in no segment. On slots' device (numpy: the CPU).
    Range-checks slots, which reads two values on the host (a sync on a GPU)."""
    if not isinstance(slots, torch.Tensor):
        slots = torch.as_tensor(slots)
    check(slots.dim() == 1, f"slots must be 1-D [T], got shape {tuple(slots.shape)}")
    check(
        not (slots.is_floating_point() or slots.is_complex() or slots.dtype == torch.bool),
        f"slots must be integers, got {slots.dtype}",
    )
    check(num_slots >= 0, f"num_slots must be >= 0, got {num_slots}")
    if slots.numel():
        lo, hi = int(slots.min()), int(slots.max())
        check(
            lo >= -1 and hi < num_slots,
            f"slots must be in [-1, {num_slots}) (num_slots={num_slots}), got values in "
            f"[{lo}, {hi}]",
        )
    keys = torch.where(slots < 0, num_slots, slots.long())  # no adapter sorts last
    sorted_keys, order = torch.sort(keys, stable=True)
    bounds = torch.arange(num_slots + 1, device=slots.device)
    seg_start = torch.searchsorted(sorted_keys, bounds)  # tokens with a smaller slot
    return order.to(torch.int32), seg_start.to(torch.int32)


def _slot_rows(slots: torch.Tensor | np.ndarray, device: torch.device) -> dict[int, torch.Tensor]:
    """{slot: its tokens' rows} for every slot >= 0 that some token uses."""
    slots = torch.as_tensor(slots, device=device)
    return {
        slot: (slots == slot).nonzero().squeeze(1) for slot in slots.unique().tolist() if slot >= 0
    }


def ref_lora_shrink(
    x: torch.Tensor,  # [T, K]
    lora_a: torch.Tensor,  # [L, R, K]
    slots: torch.Tensor | np.ndarray,  # [T] int, -1 = no adapter
) -> torch.Tensor:  # [T, R] float32; rows without an adapter are 0
    """x[t] @ lora_a[slots[t]]^T in fp32."""
    out = torch.zeros(x.shape[0], lora_a.shape[1], dtype=torch.float32, device=x.device)
    for slot, rows in _slot_rows(slots, x.device).items():
        out[rows] = x[rows].float() @ lora_a[slot].float().t()
    return out


def ref_lora_expand(
    s: torch.Tensor,  # [T, R] float32
    lora_b: torch.Tensor,  # [L, N, R]
    slots: torch.Tensor | np.ndarray,  # [T] int, -1 = no adapter
    y: torch.Tensor,  # [T, N], updated in place
) -> torch.Tensor:  # y
    """y[t] += s[t] @ lora_b[slots[t]]^T: s rounded to lora_b's dtype, fp32 products and sum,
    one rounding to y's dtype; rows without an adapter untouched."""
    for slot, rows in _slot_rows(slots, y.device).items():
        delta = s[rows].to(lora_b.dtype).float() @ lora_b[slot].float().t()
        y[rows] = (y[rows].float() + delta).to(y.dtype)
    return y


# ---- Gated DeltaNet / Kimi Delta Attention linear attention (linear_attention.py): sequence i owns
# tokens
# [cu_seqlens[i], cu_seqlens[i + 1]) and row state_slots[i] of the state pools (-1: padding,
# skipped); has_initial_state[i] False starts it from zeros. Slots are distinct in a batch.


def ref_causal_conv1d(
    x: torch.Tensor,  # [T, C]
    weight: torch.Tensor,  # [C, K]
    bias: torch.Tensor | None,  # [C]
    conv_state: torch.Tensor,  # [num_slots, C, K - 1], oldest input first; updated in place
    cu_seqlens: torch.Tensor,  # [S + 1] int
    state_slots: torch.Tensor,  # [S] int, -1 = padding
    has_initial_state: torch.Tensor,  # [S] bool
    activation: str | None = "silu",
) -> torch.Tensor:  # [T, C] in x's dtype
    """Causal depthwise conv per sequence over xin = [context, its inputs], the context being
    the slot's K - 1 stored inputs (zeros without an initial state): out[t] = act(bias +
    sum_j weight[:, j] * xin[t + j]) in fp32. The slot then holds xin's last K - 1 entries; an
    empty sequence leaves it untouched. Rows of padding sequences hold the conv with a zero
    context (the kernel leaves them unwritten).

    The whole batch at once: entry p of a sequence's xin is one row of a table [a zero row,
    x's T rows, the S * (K - 1) context rows], so each tap, and the new states, are a gather."""
    check(activation in (None, "silu"), f"activation must be 'silu' or None: {activation!r}")
    num_tokens, channels = x.shape
    ctx_len = weight.shape[1] - 1
    device = x.device
    cu = cu_seqlens.to(device=device, dtype=torch.long)
    starts, lens = cu[:-1], cu[1:] - cu[:-1]
    slots = state_slots.to(device=device, dtype=torch.long)
    num_seqs = slots.shape[0]
    if num_seqs == 0:
        return torch.zeros_like(x)
    use_ctx = (slots >= 0) & has_initial_state.to(device)
    if num_tokens == num_seqs and bool(((lens == 1) & (slots >= 0)).all()):
        # decode: one token a sequence, the window is its context and the token
        ctx = conv_state[slots].float()  # [S, C, K - 1]
        ctx = torch.where(use_ctx[:, None, None], ctx, 0.0)  # not a product: may hold NaN
        window = torch.cat([ctx, x[cu[:-1]].float()[:, :, None]], dim=2)  # [S, C, K]
        out = (window * weight.float()).sum(-1)
        if bias is not None:
            out += bias.float()
        conv_state[slots] = window[:, :, 1:].to(conv_state.dtype)
        out = torch.nn.functional.silu(out) if activation == "silu" else out
        return out.to(x.dtype)
    ctx = conv_state[slots.clamp(min=0)].float().transpose(1, 2)  # [S, K - 1, C]
    zero = torch.zeros(1, channels, dtype=torch.float32, device=device)
    table = torch.cat([zero, x.float(), ctx.reshape(-1, channels)])

    def rows(seq: torch.Tensor, start: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
        """Table rows of xin[p] of sequences seq (first input at token `start`)."""
        from_x = 1 + start + p - ctx_len
        from_ctx = torch.where(use_ctx[seq], 1 + num_tokens + seq * ctx_len + p, 0)
        return torch.where(p >= ctx_len, from_x, from_ctx)

    token = torch.arange(num_tokens, device=device)
    seq = torch.searchsorted(cu[1:], token, right=True).clamp(max=num_seqs - 1)
    local = token - starts[seq]
    out = torch.zeros(num_tokens, channels, dtype=torch.float32, device=device)
    if bias is not None:
        out += bias.float()
    for j in range(ctx_len + 1):
        out += table[rows(seq, starts[seq], local + j)] * weight[:, j].float()
    if activation == "silu":
        out = torch.nn.functional.silu(out)

    written = (slots >= 0) & (lens > 0)
    seqs = written.nonzero().squeeze(1)
    p = lens[seqs, None] + torch.arange(ctx_len, device=device)  # [n, K - 1]
    new = table[rows(seqs[:, None], starts[seqs, None], p)]  # [n, K - 1, C]
    conv_state[slots[seqs]] = new.transpose(1, 2).to(conv_state.dtype)
    return out.to(x.dtype)


# Sequences up to this long take the token-by-token update (batched over sequences, one step a
# token position); longer ones the chunked form.
DELTA_STEP_MAX_LEN = 16
DELTA_CHUNK = 64
# Chunk size of the per-key-channel decay's chunked form, whose pairwise decays are [size, size,
# Dk] a chunk and head.
KDA_CHUNK = 32


class _Chunks:
    """Sequences (first token rows `starts`, lengths `lens`) cut into chunks of `size` tokens,
    zero-padded: chunk row first[i] + c holds tokens [c * size, (c + 1) * size) of sequence i."""

    def __init__(self, starts: torch.Tensor, lens: torch.Tensor, size: int) -> None:
        device = lens.device
        self.size = size
        self.num_chunks = (lens + size - 1) // size
        self.first = self.num_chunks.cumsum(0) - self.num_chunks  # each sequence's first row
        self.total = int(self.num_chunks.sum())
        seq = torch.repeat_interleave(torch.arange(len(lens), device=device), lens)
        pos = torch.arange(len(seq), device=device) - (lens.cumsum(0) - lens)[seq]
        self.src = starts[seq] + pos  # token rows
        self.dst = self.first[seq] * size + pos  # padded rows

    def gather(self, x: torch.Tensor) -> torch.Tensor:  # [T, H, ...] -> [chunks, H, size, ...]
        buf = x.new_zeros(self.total * self.size, *x.shape[1:])
        buf[self.dst] = x[self.src]
        return buf.view(self.total, self.size, *x.shape[1:]).transpose(1, 2)

    def scatter(self, chunked: torch.Tensor, out: torch.Tensor) -> None:
        """The inverse of gather, into `out`'s token rows."""
        flat = chunked.transpose(1, 2).reshape(self.total * self.size, *out.shape[1:])
        out[self.src] = flat[self.dst]


def _l2norm(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + 1e-6)


def _delta_steps(q, k, v, g, beta, state, starts, lens, out) -> None:
    """The recurrence token by token for n sequences at once: state [n, Hv, Dk, Dv] fp32 (in
    place), their first tokens `starts` [n], lengths `lens` [n]; q, k, v, g, beta, out fp32 per
    token, q already scaled and both grouped to the value heads.

    With a = exp(g): k^T (a S) = a k^T S and o = q^T (a S + k d^T) = a q^T S + (q . k) d, so
    one product reads both q^T S and k^T S off the old state, and S is updated in place. A
    per-key-channel g [T, Hv, Dk] decays S's rows: a S becomes diag(a) S, read through q * a and
    k * a."""
    dk, dv = state.shape[2:]
    per_k = g.dim() == 3
    for p in range(int(lens.max())):
        seqs = (lens > p).nonzero().squeeze(1)
        tok = starts[seqs] + p
        s = state if len(seqs) == len(state) else state[seqs]  # decode: every sequence
        qt, kt = q[tok], k[tok]  # [m, Hv, Dk]
        if per_k:
            decay = g[tok].exp()  # [m, Hv, Dk]
            read = torch.stack([qt * decay, kt * decay], dim=-2) @ s  # [m, Hv, 2, Dv]
            delta = (v[tok] - read[..., 1, :]) * beta[tok][..., None]
            out[tok] = read[..., 0, :] + (qt * kt).sum(-1, keepdim=True) * delta
        else:
            decay = g[tok].exp()[..., None]  # [m, Hv, 1]
            read = torch.stack([qt, kt], dim=-2) @ s  # [m, Hv, 2, Dv]
            delta = (v[tok] - decay * read[..., 1, :]) * beta[tok][..., None]
            out[tok] = decay * read[..., 0, :] + (qt * kt).sum(-1, keepdim=True) * delta
        s.mul_(decay[..., None]).view(-1, dk, dv).baddbmm_(
            kt.reshape(-1, dk, 1), delta.reshape(-1, 1, dv)
        )
        if s is not state:
            state[seqs] = s


def _delta_chunks(q, k, v, g, beta, state, starts, lens, out) -> None:
    """The same recurrence in chunks of DELTA_CHUNK tokens (arguments as _delta_steps).

    Within a chunk started from state S0, with gamma_t = exp(G_t), G the inclusive cumsum of g,
    and D[t, s] = gamma_t / gamma_s for s <= t (0 above the diagonal), unrolling the recurrence
    gives S_t = gamma_t S0 + sum_{s <= t} D[t, s] k_s d_s^T for the written values d_t =
    beta_t (v_t - gamma_t k_t^T S0 - sum_{s < t} D[t, s] (k_t . k_s) d_s), i.e. the unit lower
    triangular system (I + diag(beta) strict_tril(D * K K^T)) d = beta V - (beta gamma K) S0,
    solved once for both right-hand sides: d = U - W S0. Then O = (gamma Q) S0 + (D * Q K^T) d,
    and the chunk's last state is gamma_C S0 + (K * gamma_C / gamma)^T d. Every chunk of every
    sequence is solved at once; only the scan over chunk index is sequential. Chunks are padded
    with g = beta = k = 0 tokens, which leave S unchanged."""
    size = DELTA_CHUNK
    device = q.device
    chunks = _Chunks(starts, lens, size)
    num_chunks, first = chunks.num_chunks, chunks.first
    qc, kc, vc, gc, bc = (chunks.gather(t) for t in (q, k, v, g, beta))
    log_gamma = gc.cumsum(-1)  # [chunks, Hv, size]
    lower = torch.ones(size, size, dtype=torch.bool, device=device).tril()
    # exp of a masked difference: never above 1, so nothing overflows however strong the decay.
    decay = (log_gamma[..., :, None] - log_gamma[..., None, :]).masked_fill(~lower, -torch.inf)
    decay = decay.exp()
    system = (kc @ kc.transpose(-1, -2) * decay).tril(-1) * bc[..., None]
    system += torch.eye(size, device=device)
    rhs = torch.cat([vc * bc[..., None], kc * (bc * log_gamma.exp())[..., None]], dim=-1)
    u, w = torch.linalg.solve_triangular(system, rhs, upper=False, unitriangular=True).split(
        [vc.shape[-1], kc.shape[-1]], dim=-1
    )
    attn = qc @ kc.transpose(-1, -2) * decay
    q_decayed = qc * log_gamma.exp()[..., None]
    k_decayed = kc * (log_gamma[..., -1:] - log_gamma).exp()[..., None]
    chunk_decay = log_gamma[..., -1].exp()[..., None, None]
    out_c = torch.empty_like(vc)
    for c in range(int(num_chunks.max())):
        seqs = (num_chunks > c).nonzero().squeeze(1)
        rows = first[seqs] + c
        s0 = state[seqs]
        d = u[rows] - w[rows] @ s0
        out_c[rows] = q_decayed[rows] @ s0 + attn[rows] @ d
        state[seqs] = s0 * chunk_decay[rows] + k_decayed[rows].transpose(-1, -2) @ d
    chunks.scatter(out_c, out)


def _kda_chunks(q, k, v, g, beta, state, starts, lens, out) -> None:
    """_delta_chunks with a per-key-channel decay g [T, Hv, Dk], in chunks of KDA_CHUNK tokens.

    The same unrolling with G_t the inclusive cumsum of g per channel: the decay between tokens
    s <= t is the vector exp(G_t - G_s), so k_t . k_s becomes sum_c k_t[c] k_s[c] exp(G_t[c] -
    G_s[c]) (likewise q_t . k_s), gamma_t S0 becomes diag(exp(G_t)) S0 and the last state
    diag(exp(G_C)) S0 + (K * exp(G_C - G))^T d. The pairwise decays ([size, size, Dk] a chunk and
    head) are built for one chunk index at a time, inside the scan."""
    size = KDA_CHUNK
    device = q.device
    chunks = _Chunks(starts, lens, size)
    num_chunks, first = chunks.num_chunks, chunks.first
    qc, kc, vc, gc, bc = (chunks.gather(t) for t in (q, k, v, g, beta))
    log_gamma = gc.cumsum(-2)  # [chunks, Hv, size, Dk]
    lower = torch.ones(size, size, dtype=torch.bool, device=device).tril()[..., None]
    eye = torch.eye(size, device=device)
    out_c = torch.empty_like(vc)
    for c in range(int(num_chunks.max())):
        seqs = (num_chunks > c).nonzero().squeeze(1)
        rows = first[seqs] + c
        lg, qr, kr, br = log_gamma[rows], qc[rows], kc[rows], bc[rows]
        # exp of a masked difference: never above 1, so nothing overflows however strong the decay
        decay = (lg[..., :, None, :] - lg[..., None, :, :]).masked_fill(~lower, -torch.inf).exp()
        kk = torch.einsum("nhtsc,nhsc->nhts", kr[..., :, None, :] * decay, kr)
        system = kk.tril(-1) * br[..., None] + eye
        rhs = torch.cat([vc[rows] * br[..., None], kr * br[..., None] * lg.exp()], dim=-1)
        u, w = torch.linalg.solve_triangular(system, rhs, upper=False, unitriangular=True).split(
            [vc.shape[-1], kc.shape[-1]], dim=-1
        )
        attn = torch.einsum("nhtsc,nhsc->nhts", qr[..., :, None, :] * decay, kr)
        s0 = state[seqs]
        d = u - w @ s0
        out_c[rows] = (qr * lg.exp()) @ s0 + attn @ d
        last = lg[..., -1:, :]  # [n, Hv, 1, Dk]
        k_decayed = kr * (last - lg).exp()
        state[seqs] = s0 * last.exp().transpose(-1, -2) + k_decayed.transpose(-1, -2) @ d
    chunks.scatter(out_c, out)


def ref_gated_delta_rule(
    q: torch.Tensor,  # [T, Hk, Dk]
    k: torch.Tensor,  # [T, Hk, Dk]
    v: torch.Tensor,  # [T, Hv, Dv], Hv a multiple of Hk
    g: torch.Tensor,  # [T, Hv] or [T, Hv, Dk] (KDA) log decay (<= 0)
    beta: torch.Tensor,  # [T, Hv]
    ssm_state: torch.Tensor,  # [num_slots, Hv, Dk, Dv], updated in place
    cu_seqlens: torch.Tensor,  # [S + 1] int
    state_slots: torch.Tensor,  # [S] int, -1 = padding
    has_initial_state: torch.Tensor,  # [S] bool
    scale: float | None = None,
    use_qk_l2norm: bool = True,
) -> torch.Tensor:  # [T, Hv, Dv] in v's dtype
    """The gated delta rule per sequence and value head h (key head h // (Hv // Hk)), in fp32:
    per token, q and k L2-normalised (x * rsqrt(|x|^2 + 1e-6)) if use_qk_l2norm, q scaled
    (default Dk ** -0.5), then S *= exp(g); S += k (beta (v - k^T S))^T; o = q^T S. A g of
    [T, Hv, Dk] decays each key channel (row of S) by its own exp(g) (Kimi Delta Attention). S
    starts at the slot's state (or zeros) and is stored back in the pool's dtype; empty and
    padding sequences leave the pools untouched (padding rows of the output are 0).

    Sequences of up to DELTA_STEP_MAX_LEN tokens (decode) run token by token, batched over the
    sequences; longer ones in chunks (_delta_chunks, _kda_chunks for a per-channel g). Reads the
    batch layout on the host."""
    num_k_heads, dk = q.shape[1:]
    num_v_heads = v.shape[1]
    group = num_v_heads // num_k_heads
    device, out_dtype = v.device, v.dtype
    q, k = q.float(), k.float()
    if use_qk_l2norm:
        q, k = _l2norm(q), _l2norm(k)
    q = (q * (dk**-0.5 if scale is None else scale)).repeat_interleave(group, dim=1)
    k = k.repeat_interleave(group, dim=1)
    v, g, beta = v.float(), g.float(), beta.float()
    out = torch.zeros_like(v)

    cu = cu_seqlens.to(device=device, dtype=torch.long)
    starts, lens = cu[:-1], cu[1:] - cu[:-1]
    slots = state_slots.to(device=device, dtype=torch.long)
    live = (slots >= 0) & (lens > 0)
    short = lens <= DELTA_STEP_MAX_LEN
    chunked = _kda_chunks if g.dim() == 3 else _delta_chunks
    for run, chosen in ((_delta_steps, live & short), (chunked, live & ~short)):
        seqs = chosen.nonzero().squeeze(1)
        if seqs.numel() == 0:
            continue
        state = ssm_state[slots[seqs]].float()  # a copy: [n, Hv, Dk, Dv]
        fresh = ~has_initial_state.to(device)[seqs]
        state[fresh] = 0.0  # not a product: the row's old contents may be NaN
        run(q, k, v, g, beta, state, starts[seqs], lens[seqs], out)
        ssm_state[slots[seqs]] = state.to(ssm_state.dtype)
    return out.to(out_dtype)


# Mamba2 (SSD): sequences up to this long go token by token, longer ones in chunks of SSD_CHUNK.
SSD_STEP_MAX_LEN = 16
SSD_CHUNK = 64


def _ssd_steps(x, dt, a, b, c, state, starts, lens, out) -> None:
    """The scan token by token for n sequences at once: state [n, H, P, N] fp32 (in place);
    x [T, H, P], dt [T, H], b and c [T, H, N] (grouped to the heads), a [H], out [T, H, P]."""
    for p in range(int(lens.max())):
        seqs = (lens > p).nonzero().squeeze(1)
        tok = starts[seqs] + p
        s = state if len(seqs) == len(state) else state[seqs]  # decode: every sequence
        step = dt[tok]  # [m, H]
        s.mul_(torch.exp(step * a)[..., None, None])
        s.add_((step[..., None] * x[tok])[..., None] * b[tok][:, :, None, :])
        out[tok] = (s @ c[tok][..., None]).squeeze(-1)
        if s is not state:
            state[seqs] = s


def _ssd_chunks(x, dt, a, b, c, state, starts, lens, out) -> None:
    """The same scan in chunks (arguments as _ssd_steps). With L_t the inclusive cumsum of
    dt * a over a chunk started from state S0, and u_s = dt_s x_s:
    y_t = e^{L_t} S0 c_t + sum_{s <= t} e^{L_t - L_s} (c_t . b_s) u_s and the chunk's last state
    is e^{L_C} S0 + sum_s e^{L_C - L_s} u_s b_s^T. Padding tokens (dt = 0) change nothing."""
    chunks = _Chunks(starts, lens, SSD_CHUNK)
    size, device = SSD_CHUNK, x.device
    uc = chunks.gather(x * dt[..., None])  # [chunks, H, size, P]
    bc, cc = chunks.gather(b), chunks.gather(c)  # [chunks, H, size, N]
    log_decay = chunks.gather(dt * a).cumsum(-1)  # [chunks, H, size]
    lower = torch.ones(size, size, dtype=torch.bool, device=device).tril()
    decay = (log_decay[..., :, None] - log_decay[..., None, :]).masked_fill(~lower, -torch.inf)
    y_in = (cc @ bc.transpose(-1, -2) * decay.exp()) @ uc
    c_decayed = cc * log_decay.exp()[..., None]
    u_tail = uc * (log_decay[..., -1:] - log_decay).exp()[..., None]
    chunk_decay = log_decay[..., -1].exp()[..., None, None]
    out_c = torch.empty_like(uc)
    for k in range(int(chunks.num_chunks.max())):
        seqs = (chunks.num_chunks > k).nonzero().squeeze(1)
        rows = chunks.first[seqs] + k
        s0 = state[seqs]
        out_c[rows] = y_in[rows] + c_decayed[rows] @ s0.transpose(-1, -2)
        state[seqs] = s0 * chunk_decay[rows] + u_tail[rows].transpose(-1, -2) @ bc[rows]
    chunks.scatter(out_c, out)


def ref_ssd_scan(
    x: torch.Tensor,  # [T, H, P]
    dt: torch.Tensor,  # [T, H] step sizes (softplus and bias applied)
    A: torch.Tensor,  # [H] negative
    B: torch.Tensor,  # [T, G, N], H a multiple of G
    C: torch.Tensor,  # [T, G, N]
    ssm_state: torch.Tensor,  # [num_slots, H, P, N], updated in place
    cu_seqlens: torch.Tensor,  # [S + 1] int
    state_slots: torch.Tensor,  # [S] int, -1 = padding
    has_initial_state: torch.Tensor,  # [S] bool
) -> torch.Tensor:  # [T, H, P] float32
    """Mamba2's selective scan per sequence and head h (group h // (H // G)), in fp32:
    S = exp(dt A) S + dt x (x) B;  y = S . C  (the D skip is the caller's). S starts at the
    slot's state (or zeros) and is stored back in the pool's dtype; empty and padding sequences
    leave the pool untouched (their output rows are 0). Sequences of up to SSD_STEP_MAX_LEN
    tokens run token by token, batched over the sequences; longer ones in chunks."""
    num_heads, groups = x.shape[1], B.shape[1]
    check(num_heads % groups == 0, f"heads ({num_heads}) must be a multiple of groups ({groups})")
    device = x.device
    x, dt, a = x.float(), dt.float(), A.float()
    b = B.float().repeat_interleave(num_heads // groups, dim=1)
    c = C.float().repeat_interleave(num_heads // groups, dim=1)
    out = torch.zeros_like(x)
    cu = cu_seqlens.to(device=device, dtype=torch.long)
    starts, lens = cu[:-1], cu[1:] - cu[:-1]
    slots = state_slots.to(device=device, dtype=torch.long)
    live = (slots >= 0) & (lens > 0)
    short = lens <= SSD_STEP_MAX_LEN
    for run, chosen in ((_ssd_steps, live & short), (_ssd_chunks, live & ~short)):
        seqs = chosen.nonzero().squeeze(1)
        if seqs.numel() == 0:
            continue
        state = ssm_state[slots[seqs]].float()  # a copy: [n, H, P, N]
        state[~has_initial_state.to(device)[seqs]] = 0.0  # the row may hold anything
        run(x, dt, a, b, c, state, starts[seqs], lens[seqs], out)
        ssm_state[slots[seqs]] = state.to(ssm_state.dtype)
    return out


# Mamba1 (mamba1.py): the batch layout of the linear attention ops above.


def _selective_steps(u, dt, a, b, c, state, starts, lens, out) -> None:
    """Mamba1's scan token by token for n sequences at once, sorted longest first, so the ones
    still running at a step are a prefix and their states a view: state [n, D, N] fp32 (in
    place), u = dt x and dt [T, D], a [D, N], b and c [T, N], out [T, D]."""
    lengths = lens.tolist()
    running = len(lengths)
    for p in range(lengths[0]):
        while lengths[running - 1] <= p:
            running -= 1
        s, tok = state[:running], starts[:running] + p
        s.mul_(torch.exp(dt[tok][:, :, None] * a))
        s.addcmul_(u[tok][:, :, None], b[tok][:, None, :])
        out[tok] = (s @ c[tok][:, :, None]).squeeze(-1)


def ref_selective_scan(
    x: torch.Tensor,  # [T, D]
    dt: torch.Tensor,  # [T, D] step sizes (softplus and bias applied)
    A: torch.Tensor,  # [D, N] negative
    B: torch.Tensor,  # [T, N]
    C: torch.Tensor,  # [T, N]
    ssm_state: torch.Tensor,  # [num_slots, D, N], updated in place
    cu_seqlens: torch.Tensor,  # [S + 1] int
    state_slots: torch.Tensor,  # [S] int, -1 = padding
    has_initial_state: torch.Tensor,  # [S] bool
) -> torch.Tensor:  # [T, D] float32
    """Mamba1's selective scan per sequence, in fp32: h = exp(dt A) * h + (dt x) B^T (h: [D,
    N]); y = h C (the D skip and the gate are the caller's). h starts at the slot's state (or
    zeros) and is stored back in the pool's dtype; empty and padding sequences leave the pool
    untouched (their output rows are 0).

    Token by token, batched over the sequences (one step a token position): every state entry
    decays at its own rate, so a chunked form would need pairwise decays [size, size, D, N] a
    chunk, more work than the steps. Reads the batch layout on the host."""
    device = x.device
    dt, a = dt.float(), A.float()
    u, b, c = x.float() * dt, B.float(), C.float()
    out = torch.zeros_like(u)
    cu = cu_seqlens.to(device=device, dtype=torch.long)
    starts, lens = cu[:-1], cu[1:] - cu[:-1]
    slots = state_slots.to(device=device, dtype=torch.long)
    seqs = ((slots >= 0) & (lens > 0)).nonzero().squeeze(1)
    if seqs.numel() == 0:
        return out
    seqs = seqs[lens[seqs].argsort(descending=True, stable=True)]
    state = ssm_state[slots[seqs]].float()  # a copy: [n, D, N]
    state[~has_initial_state.to(device)[seqs]] = 0.0  # the row may hold anything
    _selective_steps(u, dt, a, b, c, state, starts[seqs], lens[seqs], out)
    ssm_state[slots[seqs]] = state.to(ssm_state.dtype)
    return out
