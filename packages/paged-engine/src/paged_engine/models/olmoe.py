"""AllenAI OLMoE (`OlmoeForCausalLM`: OLMoE-1B-7B-0924 / -0125, base and Instruct).

Llama's pre-norm layer (x += attn(norm(x)); x += moe(norm(x))) with OLMo 2's attention
(models/olmo2.py): q and k RMS-normalized over the whole projection (all heads at once) before
RoPE, the norms' sums of squares all-reduced under tensor parallelism. Then, with `clip_qkv`,
q, k and v are clamped to [-clip_qkv, clip_qkv] (after the norms). The MLP is a sparse MoE block
(layers/fused_moe.py) in every layer: softmax over `num_experts` in float32, top
`num_experts_per_tok`, renormalized when `norm_topk_prob` (False in the released checkpoints),
gated SiLU experts of `intermediate_size`.

FlexOlmo (`FlexOlmoForCausalLM`: FlexOlmo-7x7B-1T) puts the same MoE block in OLMo 2's
post-norm layer (x += norm(attn(x)); x += norm(moe(x))), without `clip_qkv`.

Checkpoints name experts `mlp.experts.M.{gate_proj,up_proj,down_proj}` and the router
`mlp.gate` (transformers 5 holds them fused in memory, `mlp.experts.gate_up_proj` /
`down_proj`: both load, as Mixtral's). The q / k norms multiply by their weight in float32 and
round once (OLMo 2's order; HF's OLMoE rounds before the weight: the same in float32, within a
rounding step in 16-bit dtypes).
"""

from __future__ import annotations

import torch
from torch import nn

from paged_engine.layers.fused_moe import SparseMoeBlock
from paged_engine.layers.rotary import RotaryEmbedding, get_rope
from paged_engine.models.llama import LlamaForCausalLM, LlamaModel, llama_head_dim
from paged_engine.models.mixtral import (
    MixtralForCausalLM,
    MoeDecoderLayer,
    check_silu,
    expert_rules,
    num_experts,
)
from paged_engine.models.olmo2 import Olmo2Attention, Olmo2DecoderLayer, Olmo2Model
from paged_engine.models.utils import CausalLMBase


class OlmoeAttention(Olmo2Attention):
    """OLMo 2's attention, clamping q / k / v to +-`clip_qkv` after the q / k norms."""

    def __init__(self, config, rope: RotaryEmbedding) -> None:
        head_dim, heads = llama_head_dim(config), config.num_attention_heads
        if head_dim * heads != config.hidden_size:  # HF's q norm is hidden_size wide
            raise ValueError(
                f"OLMoE needs head_dim * num_attention_heads == hidden_size={config.hidden_size}"
                f" (its q norm spans hidden_size), got head_dim={head_dim} x {heads} heads"
            )
        super().__init__(config, rope)
        clip = getattr(config, "clip_qkv", None)
        self.clip = None if clip is None else float(clip)

    def forward(self, positions, x, kv_cache, md) -> torch.Tensor:  # x: [T, D]
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q, k = self._norm_qk(q, k)
        if self.clip is not None:
            q, k, v = (t.clamp(-self.clip, self.clip) for t in (q, k, v))
        q, k = self.rotary_emb(positions, q, k)
        return self.o_proj(self.attn(q, k, v, kv_cache, md))


class OlmoeForCausalLM(MixtralForCausalLM):
    expert_names = ("gate_proj", "up_proj", "down_proj")

    def __init__(self, config) -> None:
        check_silu(config, type(self).__name__)
        cls = type(self)
        inner = LlamaModel(
            config,
            LlamaForCausalLM.layer_flags(config),  # unused: the layers are built here
            lambda i, rope: MoeDecoderLayer(
                config, i, {}, None, cls.build_mlp(config, i), cls.build_attention(config, rope)
            ),
        )
        CausalLMBase.__init__(self, config, inner)
        # Expert rules first: the dense rules' ".gate_proj" would also match an expert's name.
        rules = expert_rules(num_experts(config), *self.expert_names)
        self.stacked_params = (*rules, *cls.stacked_params)

    @classmethod
    def build_attention(cls, config, rope: RotaryEmbedding) -> nn.Module:
        """Each layer's attention (MiniCPM5-MoE's class picks its gated one)."""
        return OlmoeAttention(config, rope)

    @classmethod
    def build_mlp(cls, config, layer_idx: int) -> nn.Module:
        return SparseMoeBlock(
            num_experts(config),
            config.num_experts_per_tok,
            config.hidden_size,
            config.intermediate_size,
            renormalize=bool(getattr(config, "norm_topk_prob", False)),
        )


class FlexOlmoForCausalLM(OlmoeForCausalLM):
    def __init__(self, config) -> None:
        check_silu(config, type(self).__name__)
        cls = type(self)
        rope = get_rope(config, llama_head_dim(config), is_neox_style=True)
        inner = Olmo2Model(
            config, lambda i: Olmo2DecoderLayer(config, rope, cls.build_mlp(config, i))
        )
        inner.rotary_emb = rope
        CausalLMBase.__init__(self, config, inner)
        rules = expert_rules(num_experts(config), *self.expert_names)
        self.stacked_params = (*rules, *cls.stacked_params)
