"""Ling / Ring 2.5 (`BailingHybridForCausalLM`, model_type "bailing_hybrid"): Kimi Linear's
hybrid (models/kimi_linear.py: delta-attention layers among MLA layers, DeepSeek-V3's MoE after
dense layers, pre-norm residuals) with these differences, each as transformers runs it:

    linear     GLM-5.3-Flash's delta attention (layers/glm5_next_attention.py) with one-matrix
               gates: the forget gate's pre-activation is f_proj(x) + dt_bias (no bottleneck),
               bounded below by kda_lower_bound when kda_safe_gate (else Kimi's softplus);
               the output norm is gated by sigmoid(g_proj(x)). Heads: num_attention_heads of
               head_dim; conv width short_conv_kernel_size
    MLA        DeepSeek-V3's (models/deepseek_v2.py: interleaved rope over qk_rope_head_dim,
               rope_theta), each head's output times sigmoid(g_proj(x))[h] (float32 sigmoid,
               rounded to the model dtype) before the output projection
    layers     `layer_types` (every layer_group_size-th is "full_attention"), `mlp_layer_types`
               ("dense" below first_k_dense_replace)
    SwiGLU     routed experts clip after the activation: min(silu(gate), L) * clamp(up, -L, L)
               with L = expert_swiglu_limit_list[i], the shared expert with
               share_expert_swiglu_limit_list[i] (0: no clipping); dense MLPs never clip

The router is DeepSeek-V3's (sigmoid, `expert_bias` as the correction bias, num_expert_group
groups, renormalized when moe_renormalize, times routed_scaling_factor). Checkpoint names: Ling's
(`word_embeddings`, `attention.` with `dense` as the output projection, separate q / k / v
convs, `gate.expert_bias`) and transformers' in-memory ones (`self_attn.`, `forget_gate.`,
fused `conv1d`) load; the checkpoint's MTP layers (indices from num_hidden_layers) are skipped.
A layer with a routed-expert limit runs its experts grouped in torch (models/glm5_next.py
`ActExperts`, eager only: CUDA graphs are refused when captured); the others use the fused MoE.
Refused by name: tie_word_embeddings=True (transformers never ties this head), a hidden_act
other than SiLU.
"""

from __future__ import annotations

import torch
from torch import nn

from paged_engine.layers.activation import ClampedSiluAndMul
from paged_engine.layers.deepseek_moe import DeepseekMoe, num_routed_experts
from paged_engine.layers.glm5_next_attention import Glm5NextDeltaAttention
from paged_engine.layers.kda import KDA_CONV_RULES
from paged_engine.layers.linear import ColumnParallelLinear
from paged_engine.layers.norm import RMSNorm
from paged_engine.layers.rotary import RotaryEmbedding, get_rope
from paged_engine.models.deepseek_v2 import MlaAttention
from paged_engine.models.glm5_next import with_activation
from paged_engine.models.hybrid import LINEAR_LAYER_TYPES, HybridModel, layer_types
from paged_engine.models.kimi_linear import KimiDecoderLayer
from paged_engine.models.llama import LlamaMLP
from paged_engine.models.mixtral import check_silu, expert_rules
from paged_engine.models.utils import CausalLMBase


class BailingDeltaAttention(Glm5NextDeltaAttention):
    """Delta attention with one-matrix forget and output gates (`f_proj`, `g_proj`)."""

    def __init__(self, config, layer_idx: int) -> None:
        bound = float(config.kda_lower_bound) if config.kda_safe_gate else None
        super().__init__(config, layer_idx, bound)
        del self.f_a_proj, self.f_b_proj, self.g_a_proj, self.g_b_proj
        self.f_proj = ColumnParallelLinear(config.hidden_size, self.full, bias=False)
        self.g_proj = ColumnParallelLinear(config.hidden_size, self.full, bias=False)

    def gate_input(self, x: torch.Tensor) -> torch.Tensor:
        return self.f_proj(x)

    def output_gate(self, x: torch.Tensor) -> torch.Tensor:
        return self.g_proj(x)


class HeadGatedMlaAttention(MlaAttention):
    """DeepSeek-V3's MLA, each head's output scaled by sigmoid(g_proj(x)) before o_proj."""

    def __init__(self, config, rope: RotaryEmbedding) -> None:
        super().__init__(config, rope)
        heads = int(config.num_attention_heads)
        self.g_proj = ColumnParallelLinear(config.hidden_size, heads, bias=False)

    def gate_heads(self, gate_in: torch.Tensor, o: torch.Tensor) -> torch.Tensor:  # [T, H, v]
        gate = torch.sigmoid(self.g_proj(gate_in).float()).to(gate_in.dtype)  # [T, H_local]
        return o * gate.unsqueeze(-1)


def _clip(limits, layer_idx: int) -> nn.Module | None:
    limit = float((limits or [0] * (layer_idx + 1))[layer_idx])
    return ClampedSiluAndMul(limit, after_silu=True) if limit else None


def bailing_mlp(config, layer_idx: int) -> nn.Module:
    kinds = list(config.mlp_layer_types)
    if len(kinds) != config.num_hidden_layers or kinds[layer_idx] not in ("dense", "sparse"):
        raise ValueError(f"mlp_layer_types must be 'dense' / 'sparse' a layer, got {kinds}")
    if kinds[layer_idx] == "dense":
        return LlamaMLP(config, bias=False)
    routed = _clip(config.swiglu_limits, layer_idx)
    shared = _clip(config.swiglu_limits_shared, layer_idx)
    return with_activation(DeepseekMoe.from_config(config), routed, shared)


class BailingDecoderLayer(KimiDecoderLayer):
    """Kimi Linear's pre-norm layer (its forward) over Ling's mixers and MLPs."""

    def __init__(self, config, layer_idx: int, rope: RotaryEmbedding) -> None:
        nn.Module.__init__(self)
        self.is_linear = layer_types(config)[layer_idx] in LINEAR_LAYER_TYPES
        if self.is_linear:
            self.self_attn = BailingDeltaAttention(config, layer_idx)
        else:
            self.self_attn = HeadGatedMlaAttention(config, rope)
        self.mlp = bailing_mlp(config, layer_idx)
        eps = float(config.rms_norm_eps)
        self.input_layernorm = RMSNorm(config.hidden_size, eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps)


class BailingHybridForCausalLM(CausalLMBase):
    stacked_params = (
        *KDA_CONV_RULES,
        (".gate_up_proj", ".gate_proj", 0),
        (".gate_up_proj", ".up_proj", 1),
    )
    renames = (
        ("model.word_embeddings.", "model.embed_tokens."),
        (".attention.", ".self_attn."),
        (".self_attn.dense.", ".self_attn.o_proj."),
        (".self_attn.forget_gate.", ".self_attn."),
        (".mlp.gate.expert_bias", ".mlp.gate.e_score_correction_bias"),
    )
    ignored_weights = ("rotary_emb.inv_freq",)

    def __init__(self, config) -> None:
        check_silu(config, type(self).__name__)
        if getattr(config, "tie_word_embeddings", False):
            raise ValueError(
                "tie_word_embeddings=True is not supported: transformers never ties "
                "BailingHybrid's lm_head"
            )
        rope = get_rope(config, int(config.qk_rope_head_dim), is_neox_style=False)
        norm = RMSNorm(config.hidden_size, float(config.rms_norm_eps))
        inner = HybridModel(config, lambda i: BailingDecoderLayer(config, i, rope), norm, rope)
        super().__init__(config, inner)
        # Expert rules first: the dense and shared MLPs' ".gate_proj" also matches an expert's.
        rules = expert_rules(num_routed_experts(config), "gate_proj", "up_proj", "down_proj")
        self.stacked_params = (*rules, *type(self).stacked_params)
