"""Qwen3-Next and Qwen3.5 (dense and MoE): hybrid stacks of Gated DeltaNet linear attention
(layers/gated_delta_net.py) and gated full attention, `config.layer_types` saying which layer is
which (3 linear : 1 full in the released models).

    x += mixer(norm(x));  x += mlp(norm(x))        norms: y = x / rms(x) * (1 + w) in float32

The full-attention layers: q_proj yields each head's query and an output gate side by side
([H, 2 * D]); q and k get a per-head (1 + w) RMSNorm, partial RoPE (partial_rotary_factor,
0.25), and the attention output is scaled by sigmoid(gate) before o_proj. Only these layers
hold a paged KV cache (the model's kv_caches list has one entry per full-attention layer, in
order); the linear ones carry a recurrent state per sequence instead (worker/recurrent_state.py).

MLPs: Qwen3-Next and Qwen3.5-MoE use Qwen2-MoE's block (softmax top-k experts plus a sigmoid-gated
shared expert; Qwen3-MoE's rule for which layers are sparse), Qwen3.5 a dense gated SiLU MLP.
Qwen3.5's M-RoPE equals plain RoPE for text positions (the three position ids coincide).
Multi-token-prediction weights (`mtp.*`) are skipped here; speculative_config {"method": "mtp"}
loads the layer as a draft head (models/mtp.py). Qwen3.5 checkpoints are vision-language
wrappers; their language model loads through models/multimodal_text.py.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from paged_engine.layers.attention import Attention, AttentionMetadata
from paged_engine.layers.gated_delta_net import GDN_PROJ_RULES, GatedDeltaNet
from paged_engine.layers.linear import QKVParallelLinear, RowParallelLinear
from paged_engine.layers.norm import GemmaRMSNorm
from paged_engine.layers.rotary import RotaryEmbedding, get_rope
from paged_engine.models.hybrid import LINEAR_LAYER_TYPES, HybridModel, layer_types
from paged_engine.models.llama import LlamaForCausalLM, LlamaMLP, llama_head_dim
from paged_engine.models.mixtral import check_silu, expert_rules, num_experts
from paged_engine.models.qwen2_moe import shared_expert_block
from paged_engine.models.qwen3_moe import is_sparse_layer
from paged_engine.models.utils import CausalLMBase, cfg_get


class GatedAttention(nn.Module):
    """Full attention with a per-head output gate and (1 + w) q / k norms (`qk_norm`; without
    them, MiniCPM5-MoE's)."""

    def __init__(self, config, rope: RotaryEmbedding, qk_norm: bool = True) -> None:
        super().__init__()
        hidden, num_heads = config.hidden_size, config.num_attention_heads
        num_kv_heads = cfg_get(config, "num_key_value_heads", num_heads)
        head_dim = llama_head_dim(config)
        bias = bool(getattr(config, "attention_bias", False))
        # q_proj's rows are [query | gate] per head: as 2H half-width heads, a rank's share is
        # whole heads with their gates.
        self.qkv_proj = QKVParallelLinear(hidden, head_dim, 2 * num_heads, num_kv_heads, bias)
        self.num_heads = self.qkv_proj.num_heads // 2  # this rank's
        self.num_kv_heads = self.qkv_proj.num_kv_heads
        self.head_dim = head_dim
        eps = cfg_get(config, "rms_norm_eps", 1e-6)
        self.q_norm = GemmaRMSNorm(head_dim, eps) if qk_norm else None
        self.k_norm = GemmaRMSNorm(head_dim, eps) if qk_norm else None
        self.rotary_emb = rope
        self.attn = Attention(self.num_heads, head_dim, self.num_kv_heads, head_dim**-0.5)
        self.o_proj = RowParallelLinear(num_heads * head_dim, hidden, bias)

    def forward(
        self,
        positions: torch.Tensor,
        x: torch.Tensor,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        md: AttentionMetadata,
    ) -> torch.Tensor:
        t, h, hkv, d = x.shape[0], self.num_heads, self.num_kv_heads, self.head_dim
        qg, k, v = self.qkv_proj(x).split([2 * h * d, hkv * d, hkv * d], dim=-1)
        q, gate = qg.view(t, h, 2 * d).split([d, d], dim=-1)
        if self.q_norm is not None:
            q = self.q_norm(q)
            k = self.k_norm(k.reshape(t, hkv, d)).reshape(t, hkv * d)
        q = q.reshape(t, h * d)
        q, k = self.rotary_emb(positions, q, k)
        out = self.attn(q, k, v, kv_cache, md) * torch.sigmoid(gate.reshape(t, h * d))
        return self.o_proj(out)


class HybridDecoderLayer(nn.Module):
    def __init__(self, config, layer_idx: int, rope: RotaryEmbedding, mlp: nn.Module) -> None:
        super().__init__()
        self.is_linear = layer_types(config)[layer_idx] in LINEAR_LAYER_TYPES
        if self.is_linear:
            self.linear_attn = GatedDeltaNet(config, layer_idx)
        else:
            self.self_attn = GatedAttention(config, rope)
        self.mlp = mlp
        eps = cfg_get(config, "rms_norm_eps", 1e-6)
        self.input_layernorm = GemmaRMSNorm(config.hidden_size, eps)
        self.post_attention_layernorm = GemmaRMSNorm(config.hidden_size, eps)

    def forward(self, positions, x, kv_cache, md) -> torch.Tensor:  # x: [T, D]
        h = self.input_layernorm(x)
        if self.is_linear:
            h = self.linear_attn(h, md)
        else:
            h = self.self_attn(positions, h, kv_cache, md)
        x = x + h
        return x + self.mlp(self.post_attention_layernorm(x))


def _dense_mlp(config, layer_idx: int) -> nn.Module:
    return LlamaMLP(config, bias=False)


def _moe_mlp(config, layer_idx: int) -> nn.Module:
    if not is_sparse_layer(config, layer_idx):
        return LlamaMLP(config, bias=False)
    # Qwen3.5-MoE's router always renormalizes; its config has no norm_topk_prob
    return shared_expert_block(config, renormalize_default=True)


class Qwen3_5ForCausalLM(CausalLMBase):
    """Qwen3.5 (dense): the hybrid stack with dense MLPs."""

    stacked_params = (*GDN_PROJ_RULES, *LlamaForCausalLM.stacked_params)
    ignored_weights = ("rotary_emb.inv_freq",)
    build_mlp = staticmethod(_dense_mlp)

    def __init__(self, config) -> None:
        check_silu(config, type(self).__name__)
        build_mlp = type(self).build_mlp
        rope = get_rope(config, llama_head_dim(config))
        eps = cfg_get(config, "rms_norm_eps", 1e-6)
        inner = HybridModel(
            config,
            lambda i: HybridDecoderLayer(config, i, rope, build_mlp(config, i)),
            GemmaRMSNorm(config.hidden_size, eps),
            rope,
        )
        super().__init__(config, inner)

    def load_weights(
        self, weights: Iterable[tuple[str, torch.Tensor]], strict: bool = True
    ) -> set[str]:
        # Multi-token-prediction modules (`mtp.*`): the MTP draft head's (models/mtp.py).
        return super().load_weights(
            ((n, w) for n, w in weights if not n.startswith("mtp.")), strict
        )


class Qwen3NextForCausalLM(Qwen3_5ForCausalLM):
    """Qwen3-Next (80B-A3B) and Qwen3.5-MoE: the hybrid stack with shared-expert MoE MLPs."""

    build_mlp = staticmethod(_moe_mlp)

    def __init__(self, config) -> None:
        super().__init__(config)
        # Per-expert checkpoint names first (the dense ".gate_proj" rule would match them too).
        rules = expert_rules(num_experts(config), "gate_proj", "up_proj", "down_proj")
        self.stacked_params = (*rules, *type(self).stacked_params)


Qwen3_5MoeForCausalLM = Qwen3NextForCausalLM
