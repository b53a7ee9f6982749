"""Doge (`DogeForCausalLM`, SmallDoge): dynamic mask attention and the cross-domain MoE.

Llama's stack (models/llama.py: embedding, RoPE, final RMSNorm, LM head) with three changes,
each as transformers 5 runs it:

    residual   x = input_residual * x + attn(rmsnorm(x)); x = post_attention_residual * x +
               mlp(rmsnorm(x)): the residual stream scaled by a learned vector [D] each time.
    DMA        per-head RMSNorms of q and k before RoPE; every key j carries a bias per KV head
                   b_j = exp(A * softplus(dt_proj(v_j)))          (v_j: its values, all heads)
               added to its scores. A query keeps its causal keys (sliding_window: the last
               window of them), and of those only the keep_window_size of highest bias
               (transformers' top-k over the masked row keeps the same keys).
    CDMoE      (is_moe) a gated shared MLP plus product-key experts: router_gate gives 2 * K
               logits (K = floor(sqrt(num_experts))), the experts i * K + j of the top
               num_experts_per_tok sums x_i + y_j score, softmax-weighted;
               expert e adds act(down_embed[e] . x) * w_e * up_embed[e].

The bias reads the cached values, so the attention runs in float32 torch over the paged cache,
one sequence at a time (layers/torch_attention.py's helpers), recomputing each key's bias from
its cached value (no cache beside the KV). It reads the lengths on the host: CUDA graphs are
refused (enforce_eager=True), and so is an fp8 KV cache (the bias would read rounded values).
A CPU torch.compile runs it as the opaque attention operator (`TorchAttention`); with is_moe
the router's per-sequence split reads the lengths too, and the runner falls back to eager.

transformers' router splits the logits of a forward's N tokens as `.view(2, N, K)`, not per
token: x-scores of token t are the (t mod 2) half of token t // 2's logits, y-scores the
((N + t) mod 2) half of token (N + t) // 2's. Here each sequence's rows of a step are its
forward (HF's batch-1 `generate`: the whole prompt, then one token a step), so a prompt's
routing depends on how it is chunked: with is_moe, chunked prefill and prefix-cache hits give
other (valid) results than one prefill of the prompt, as batching does in transformers.

Refused by name: tensor parallelism, CUDA graphs, an fp8 KV cache, num_experts_per_tok above
K * K, keep_window_size < 1. attention_dropout / hidden_dropout are training-only (ignored).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from paged_engine.attention.cpu_backend import read_rows
from paged_engine.distributed.parallel_state import get_parallel_state
from paged_engine.layers.activation import get_act_fn
from paged_engine.layers.attention import Attention, AttentionMetadata
from paged_engine.layers.norm import RMSNorm
from paged_engine.layers.rotary import RotaryEmbedding
from paged_engine.layers.torch_attention import (
    TorchAttention,
    block_view,
    gather,
    step_sequences,
)
from paged_engine.models.llama import LlamaAttention, LlamaForCausalLM, LlamaMLP, LlamaModel
from paged_engine.models.utils import cfg_get

_MAX_SCORES = 2**24  # float32 scores held at once: query rows x heads x keys


def _check(config) -> None:
    if get_parallel_state().tp_size > 1:
        raise ValueError(
            "Doge is not served with tensor parallelism (tensor_parallel_size=1): its dynamic "
            "mask reads every KV head's values"
        )
    window = int(cfg_get(config, "keep_window_size", 2048))
    if window < 1:
        raise ValueError(f"Doge's keep_window_size must be >= 1, got {window}")


class DynamicMaskAttention(TorchAttention, Attention):
    """Doge's attention over the paged cache: writes the step's K/V, then per sequence reads its
    keys and values back, biases each key by `key_bias(its values)` and keeps each query's
    causal (windowed) keys of highest bias. Never traced: a compiled forward runs it as the
    opaque attention operator."""

    def __init__(
        self,
        num_heads: int,
        head_dim: int,
        num_kv_heads: int,
        key_bias: Callable[[torch.Tensor], torch.Tensor],  # values [L, KV, D] -> [KV, L] fp32
        keep_window: int,
        sliding_window: int | None,
    ) -> None:
        super().__init__(num_heads, head_dim, num_kv_heads, head_dim**-0.5)
        self.key_bias = key_bias
        self.keep_window = keep_window
        self.window = sliding_window  # (Attention's own sliding_window stays None)

    def attend(
        self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, pos: torch.Tensor
    ) -> torch.Tensor:
        """q [R, H, D] at positions `pos` [R] over one sequence's keys / values [L, KV, D]
        -> [R, H, D]."""
        r, h, d = q.shape
        length, kv = keys.shape[0], keys.shape[1]
        key_pos = torch.arange(length, device=q.device)
        visible = key_pos[None] <= pos[:, None]  # [R, L]
        if self.window is not None:
            visible &= key_pos[None] > pos[:, None] - self.window
        bias = self.key_bias(values)[:, None].expand(kv, r, length)
        bias = bias.masked_fill(~visible, float("-inf"))  # [KV, R, L]
        if length > self.keep_window:  # the keep_window visible keys of highest bias
            top = bias.topk(self.keep_window, dim=-1).indices
            kept = torch.zeros_like(bias, dtype=torch.bool).scatter_(-1, top, True)
            bias = bias.masked_fill(~kept, float("-inf"))
        qg = q.float().view(r, kv, h // kv, d)
        scores = torch.einsum("rkgd,lkd->krgl", qg, keys.float()) * self.scale
        probs = torch.softmax(scores + bias[:, :, None], dim=-1)  # [KV, R, G, L]
        out = torch.einsum("krgl,lkd->rkgd", probs, values.float())
        return out.reshape(r, h, d).to(q.dtype)

    def run(
        self,
        q: torch.Tensor,  # [T, H*D]
        k: torch.Tensor,  # [T, KV*D]
        v: torch.Tensor,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        attn_metadata: AttentionMetadata,
        kv_written: bool = False,
    ) -> torch.Tensor:  # [T, H*D]
        if q.is_cuda and torch.cuda.is_current_stream_capturing():
            raise ValueError("Doge's dynamic mask cannot run in a CUDA graph (enforce_eager=True)")
        md, (key_cache, value_cache) = attn_metadata, kv_cache
        t, d, hkv = q.shape[0], self.head_dim, self.num_kv_heads
        scales = {"k_scale": self.k_scale, "v_scale": self.v_scale}
        k, v = k.view(t, hkv, d), v.view(t, hkv, d)
        md.backend.write_kv(k, v, key_cache, value_cache, md.slot_mapping, **scales)
        keys, values = block_view(key_cache, md.backend), block_view(value_cache, md.backend)
        q = q.view(t, self.num_heads, d)
        out = torch.zeros_like(q)
        for _, first, end, length, blocks in step_sequences(md, keys.shape[1]):
            seq_k = read_rows(gather(keys, blocks, length), scales["k_scale"], q.dtype)
            seq_v = read_rows(gather(values, blocks, length), scales["v_scale"], q.dtype)
            step = max(1, _MAX_SCORES // (self.num_heads * length))  # query rows at a time
            for row0 in range(first, end, step):
                rows = slice(row0, min(row0 + step, end))
                # the sequence's last queries: row j sits at position length - end + j
                pos = torch.arange(rows.start, rows.stop, device=q.device) + (length - end)
                out[rows] = self.attend(q[rows], seq_k, seq_v, pos)
        return out.view(t, -1)


class DogeAttention(LlamaAttention):
    """Llama's q / k / v / o projections and per-head q / k norms, plus `A` [KV] and
    `dt_proj` [KV*D -> KV]: the dynamic mask (module docstring)."""

    def __init__(
        self, config, layer_idx: int, flags: dict[str, bool], rope: RotaryEmbedding | None
    ):
        super().__init__(config, layer_idx, flags, rope)
        kv_heads = self.kv_size // self.head_dim
        self.A = nn.Parameter(torch.zeros(kv_heads))
        self.dt_proj = nn.Linear(self.kv_size, kv_heads, bias=flags["qkv_bias"])
        self.attn = DynamicMaskAttention(
            self.q_size // self.head_dim,
            self.head_dim,
            kv_heads,
            self.key_bias,
            int(cfg_get(config, "keep_window_size", 2048)),
            cfg_get(config, "sliding_window", None),
        )

    def key_bias(self, values: torch.Tensor) -> torch.Tensor:  # [L, KV, D] -> [KV, L] fp32
        dt = F.softplus(self.dt_proj(values.reshape(values.shape[0], -1)))
        return torch.exp(self.A * dt).float().t()

    def forward(
        self, positions: torch.Tensor, x: torch.Tensor, kv_cache, md: AttentionMetadata
    ) -> torch.Tensor:
        t, d = x.shape[0], self.head_dim
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = self.q_norm(q.reshape(t, -1, d)).reshape(t, -1)
        k = self.k_norm(k.reshape(t, -1, d)).reshape(t, -1)
        q, k = self.rotary_emb(positions, q, k)
        return self.o_proj(self.attn(q, k, v, kv_cache, md))


class DogeCDMoE(LlamaMLP):
    """The shared gated MLP (LlamaMLP's weights) plus `router_gate`, `down_embed`, `up_embed`."""

    def __init__(self, config, bias: bool):
        super().__init__(config, bias)
        hidden, experts = config.hidden_size, int(config.num_experts)
        self.num_keys = math.floor(math.sqrt(experts))
        self.top_k = int(config.num_experts_per_tok)
        if not 1 <= self.top_k <= self.num_keys**2:
            raise ValueError(
                f"Doge's num_experts_per_tok must be in [1, {self.num_keys**2}], got {self.top_k}"
            )
        self.norm_topk_prob = bool(cfg_get(config, "norm_topk_prob", False))
        self.expert_act = get_act_fn(cfg_get(config, "hidden_act", "silu"), "hidden_act")
        self.router_gate = nn.Linear(hidden, 2 * self.num_keys, bias=False)
        self.down_embed = nn.Embedding(experts, hidden)
        self.up_embed = nn.Embedding(experts, hidden)

    def experts(self, x: torch.Tensor) -> torch.Tensor:
        """One forward's rows [N, D] (one sequence's, HF's view of them, module docstring)."""
        n, kk = x.shape[0], self.num_keys
        logits = self.router_gate(x).view(2, n, kk)
        (sx, sy), (ix, iy) = logits.topk(kk, dim=-1)
        scores = (sx[..., None] + sy[:, None]).view(n, -1)  # [N, K*K]
        ids = (ix[..., None] * kk + iy[:, None]).view(n, -1)
        top, where = scores.topk(self.top_k, dim=-1)
        chosen = ids.gather(-1, where)  # [N, k]
        weights = torch.softmax(top, dim=-1)
        if self.norm_topk_prob:
            weights = weights / weights.sum(-1, keepdim=True)
        gate = torch.einsum("nkd,nd->nk", self.down_embed(chosen), x)
        gate = self.expert_act(gate) * weights
        return torch.einsum("nk,nkd->nd", gate, self.up_embed(chosen))

    def forward_rows(self, x: torch.Tensor, md: AttentionMetadata) -> torch.Tensor:
        routed = torch.zeros_like(x)
        starts = md.cu_seqlens_q.tolist()
        for first, end in itertools.pairwise(starts):
            if end > first:
                routed[first:end] = self.experts(x[first:end])
        return super().forward(x) + routed


class DogeDecoderLayer(nn.Module):
    def __init__(self, config, layer_idx: int, flags: dict[str, bool], rope: RotaryEmbedding):
        super().__init__()
        eps = cfg_get(config, "rms_norm_eps", 1e-6)
        hidden = config.hidden_size
        self.input_layernorm = RMSNorm(hidden, eps)
        self.self_attn = DogeAttention(config, layer_idx, flags, rope)
        self.input_residual = nn.Parameter(torch.ones(hidden))
        self.post_attention_layernorm = RMSNorm(hidden, eps)
        moe = bool(cfg_get(config, "is_moe", False))
        self.mlp = (DogeCDMoE if moe else LlamaMLP)(config, flags["mlp_bias"])
        self.post_attention_residual = nn.Parameter(torch.ones(hidden))

    def forward(self, positions, x, kv_cache, md) -> torch.Tensor:  # x: [T, D]
        h = self.self_attn(positions, self.input_layernorm(x), kv_cache, md)
        x = self.input_residual * x + h
        y = self.post_attention_layernorm(x)
        y = self.mlp.forward_rows(y, md) if isinstance(self.mlp, DogeCDMoE) else self.mlp(y)
        return self.post_attention_residual * x + y


class DogeForCausalLM(LlamaForCausalLM):
    # the bias is computed from the cached values: an fp8 cache would round them
    fp8_kv_cache = False
    fp8_kv_refusal = "its dynamic mask is computed from the cached values"

    def __init__(self, config):
        _check(config)
        flags = {**self.layer_flags(config), "qk_norm": True}

        def build(i: int, rope: RotaryEmbedding) -> nn.Module:
            return DogeDecoderLayer(config, i, flags, rope)

        super(LlamaForCausalLM, self).__init__(config, LlamaModel(config, flags, build))
