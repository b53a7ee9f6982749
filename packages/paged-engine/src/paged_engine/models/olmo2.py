"""OLMo 2 (`Olmo2ForCausalLM`: OLMo-2-1B / 7B / 13B / 32B).

The Llama decoder's projections, gated SiLU MLP and RoPE, with norms after the sublayers instead
of before them: x += post_attn_norm(attn(x)); x += post_ffw_norm(mlp(x)). q and k are
RMS-normalized right after their projection, each over the whole projection (all heads at once,
one weight of H*D / Hkv*D entries), before RoPE. Every RMSNorm multiplies by its weight in
float32 and rounds to the activation dtype once (HF's order).

Under tensor parallelism a rank holds only its heads' slice of q and k: the q / k norms add up
their partial sums of squares over the ranks (one small all-reduce a layer) and scale the slice
by their slice of the weight.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from paged_engine.distributed.communication import tp_all_reduce
from paged_engine.layers.attention import Attention, AttentionMetadata
from paged_engine.layers.embedding import VocabParallelEmbedding
from paged_engine.layers.linear import QKVParallelLinear, RowParallelLinear
from paged_engine.layers.norm import RMSNorm
from paged_engine.layers.rotary import RotaryEmbedding, get_rope
from paged_engine.models.llama import LlamaForCausalLM, LlamaMLP, llama_head_dim
from paged_engine.models.utils import CausalLMBase, cfg_get, make_layers


class Olmo2RMSNorm(RMSNorm):
    """y = round(weight * x / rms(x)), the product in float32 (float32 inputs: RMSNorm's path)."""

    round_before_weight = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: [..., D]
        if self.kernel is not None or x.dtype == torch.float32:
            return super().forward(x)
        y = torch.rms_norm(x.float(), self.weight.shape, None, self.eps)
        return (self.weight.float() * y).to(x.dtype)


class ShardedNorm(Olmo2RMSNorm):
    """This rank's slice [shard*n, (shard+1)*n) of a norm weight over a whole projection."""

    def __init__(self, local_size: int, eps: float, shard: int) -> None:
        super().__init__(local_size, eps)
        self.shard = shard
        self.weight.weight_loader = self._load

    def _load(self, param: nn.Parameter, w: torch.Tensor, shard_id=None) -> None:
        n = param.shape[0]
        if w.dim() != 1 or w.shape[0] < (self.shard + 1) * n:
            raise ValueError(f"norm weight {tuple(w.shape)} has no rows for shard {self.shard}")
        param.data.copy_(w[self.shard * n : (self.shard + 1) * n])


class Olmo2Attention(nn.Module):
    def __init__(self, config, rope: RotaryEmbedding):
        super().__init__()
        hidden = config.hidden_size
        num_heads = config.num_attention_heads
        num_kv_heads = cfg_get(config, "num_key_value_heads", num_heads)
        head_dim = llama_head_dim(config)
        bias = bool(getattr(config, "attention_bias", False))
        eps = cfg_get(config, "rms_norm_eps", 1e-6)
        self.qkv_proj = QKVParallelLinear(hidden, head_dim, num_heads, num_kv_heads, bias=bias)
        proj = self.qkv_proj
        local_heads, local_kv_heads = proj.num_heads, proj.num_kv_heads
        self.q_size, self.kv_size = local_heads * head_dim, local_kv_heads * head_dim
        self.o_proj = RowParallelLinear(num_heads * head_dim, hidden, bias=bias)
        self.rotary_emb = rope  # shared by all layers
        self.tp_size = proj.tp_size
        self.q_norm = ShardedNorm(self.q_size, eps, proj.tp_rank)
        self.k_norm = ShardedNorm(self.kv_size, eps, proj.tp_rank // proj.kv_replicas)
        # The whole projections' widths, and how many ranks hold each k head (replicated
        # when tp_size > num_kv_heads): the sums of squares over ranks count it that often.
        self.q_full, self.k_full = num_heads * head_dim, num_kv_heads * head_dim
        self.kv_replicas = proj.kv_replicas
        self.attn = Attention(local_heads, head_dim, local_kv_heads, head_dim**-0.5)

    def _norm_qk(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.tp_size == 1:
            return self.q_norm(q), self.k_norm(k)
        qf, kf = q.float(), k.float()
        sums = torch.stack((qf.pow(2).sum(-1), kf.pow(2).sum(-1)), dim=-1)  # [T, 2]
        sums = tp_all_reduce(sums)
        q_var = sums[:, :1] / self.q_full + self.q_norm.eps
        k_var = sums[:, 1:] / (self.k_full * self.kv_replicas) + self.k_norm.eps
        q = (qf * q_var.rsqrt() * self.q_norm.weight.float()).to(q.dtype)
        k = (kf * k_var.rsqrt() * self.k_norm.weight.float()).to(k.dtype)
        return q, k

    def forward(
        self,
        positions: torch.Tensor,  # [T]
        x: torch.Tensor,  # [T, D]
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        md: AttentionMetadata,
    ) -> torch.Tensor:
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q, k = self.rotary_emb(positions, *self._norm_qk(q, k))
        return self.o_proj(self.attn(q, k, v, kv_cache, md))


class Olmo2DecoderLayer(nn.Module):
    def __init__(self, config, rope: RotaryEmbedding, mlp: nn.Module | None = None):
        """`mlp`: the feed-forward block (FlexOlmo's MoE); default OLMo 2's gated SiLU MLP."""
        super().__init__()
        eps = cfg_get(config, "rms_norm_eps", 1e-6)
        self.self_attn = Olmo2Attention(config, rope)
        self.mlp = LlamaMLP(config, bias=False) if mlp is None else mlp
        self.post_attention_layernorm = Olmo2RMSNorm(config.hidden_size, eps)
        self.post_feedforward_layernorm = Olmo2RMSNorm(config.hidden_size, eps)

    def forward(self, positions, x, kv_cache, md) -> torch.Tensor:  # x: [T, D]
        x = x + self.post_attention_layernorm(self.self_attn(positions, x, kv_cache, md))
        return x + self.post_feedforward_layernorm(self.mlp(x))


class Olmo2Model(nn.Module):
    """Embedding, decoder layers (`build_layer(i)`; OLMo 2's, sharing one rope, by default),
    final norm."""

    def __init__(self, config, build_layer: Callable[[int], nn.Module] | None = None):
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        if build_layer is None:
            rope = get_rope(config, llama_head_dim(config), is_neox_style=True)
            self.rotary_emb = rope
            build_layer = lambda i: Olmo2DecoderLayer(config, rope)
        self.layers, self.stage = make_layers(config.num_hidden_layers, build_layer)
        self.norm = Olmo2RMSNorm(config.hidden_size, cfg_get(config, "rms_norm_eps", 1e-6))

    def forward(self, input_ids, positions, kv_caches, md, hidden=None) -> torch.Tensor:
        x = self.embed_tokens(input_ids) if hidden is None else hidden  # [T, D]
        for layer, kv_cache in zip(self.stage.layers(self.layers), kv_caches, strict=True):
            x = layer(positions, x, kv_cache, md)
        return self.norm(x) if self.stage.is_last else x


class Olmo2ForCausalLM(LlamaForCausalLM):
    def __init__(self, config):
        CausalLMBase.__init__(self, config, Olmo2Model(config))
