"""Arcee AFMoE (`AfmoeForCausalLM`, model_type "afmoe": Trinity-Nano / Trinity-Mini).

A decoder with norms on both sides of each sublayer (x += norm(attn(norm(x))); x +=
norm(mlp(norm(x))), OLMo 2's RMSNorm: the weight multiplies in float32) and:

    attention  GQA with per-head q / k RMSNorms and an output gate, sigmoid(gate_proj(x)) times
               the attention output before o_proj (one gate per channel); the `layer_types`
               "sliding_attention" layers see the last `sliding_window` keys and rotate q and k,
               the "full_attention" ones (every `global_attn_every_n_layers`-th) see everything
               without positional encoding
    mlp        the first `num_dense_layers` layers: a gated SiLU MLP of intermediate_size; then
               DeepSeek-V3's MoE (layers/deepseek_moe.py) with one group: sigmoid scores, the top
               num_experts_per_tok of scores + expert_bias, renormalized, times `route_scale`,
               plus num_shared_experts * moe_intermediate_size of shared experts

With `mup_enabled` the token embedding is multiplied by sqrt(hidden_size). Checkpoints name the
router `mlp.router.gate`, its balance bias `mlp.expert_bias`, the experts
`mlp.experts.M.{gate,up,down}_proj` and the shared experts `mlp.shared_experts.*`.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from paged_engine.layers.linear import ColumnParallelLinear
from paged_engine.layers.rotary import RotaryEmbedding
from paged_engine.models.exaone_moe import shared_expert_moe
from paged_engine.models.llama import LlamaAttention, LlamaForCausalLM, LlamaMLP, LlamaModel
from paged_engine.models.mixtral import MixtralForCausalLM, check_silu, expert_rules, num_experts
from paged_engine.models.olmo2 import Olmo2RMSNorm
from paged_engine.models.utils import CausalLMBase, cfg_get, layer_sliding_window


class AfmoeAttention(LlamaAttention):
    """Llama's attention with OLMo 2's per-head q / k norms, a window on the sliding layers,
    NoPE on the global ones, and an elementwise sigmoid gate on the attention's output."""

    def __init__(self, config, layer_idx: int, rope: RotaryEmbedding) -> None:
        bias = bool(getattr(config, "attention_bias", False))
        flags = {"qkv_bias": bias, "o_bias": bias, "qk_norm": True, "sliding": True}
        window = layer_sliding_window(config, layer_idx)
        super().__init__(config, layer_idx, flags, rope if window is not None else None)
        eps, d = cfg_get(config, "rms_norm_eps", 1e-5), self.head_dim
        self.q_norm, self.k_norm = Olmo2RMSNorm(d, eps), Olmo2RMSNorm(d, eps)
        # the checkpoint's `self_attn.gate_proj` (renamed: the MLPs' ".gate_proj" rule stacks)
        heads = config.num_attention_heads
        self.out_gate = ColumnParallelLinear(config.hidden_size, heads * d, bias=False)

    def forward(self, positions, x, kv_cache, md) -> torch.Tensor:  # x: [T, D]
        t, d = x.shape[0], self.head_dim
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = self.q_norm(q.reshape(t, -1, d)).reshape(t, -1)
        k = self.k_norm(k.reshape(t, -1, d)).reshape(t, -1)
        if self.rotary_emb is not None:  # global layers: NoPE
            q, k = self.rotary_emb(positions, q, k)
        out = self.attn(q, k, v, kv_cache, md) * torch.sigmoid(self.out_gate(x))
        return self.o_proj(out)


class AfmoeDecoderLayer(nn.Module):
    def __init__(self, config, layer_idx: int, rope: RotaryEmbedding, mlp: nn.Module) -> None:
        super().__init__()
        eps, d = cfg_get(config, "rms_norm_eps", 1e-5), config.hidden_size
        self.self_attn = AfmoeAttention(config, layer_idx, rope)
        self.mlp = mlp
        self.input_layernorm = Olmo2RMSNorm(d, eps)
        self.post_attention_layernorm = Olmo2RMSNorm(d, eps)
        self.pre_mlp_layernorm = Olmo2RMSNorm(d, eps)
        self.post_mlp_layernorm = Olmo2RMSNorm(d, eps)

    def forward(self, positions, x, kv_cache, md) -> torch.Tensor:  # x: [T, D]
        h = self.self_attn(positions, self.input_layernorm(x), kv_cache, md)
        x = x + self.post_attention_layernorm(h)
        return x + self.post_mlp_layernorm(self.mlp(self.pre_mlp_layernorm(x)))


class AfmoeForCausalLM(MixtralForCausalLM):
    expert_names = ("gate_proj", "up_proj", "down_proj")

    def __init__(self, config) -> None:
        check_silu(config, type(self).__name__)
        cls = type(self)
        mup = bool(getattr(config, "mup_enabled", False))
        inner = LlamaModel(
            config,
            LlamaForCausalLM.layer_flags(config),  # unused: the layers are built here
            lambda i, rope: AfmoeDecoderLayer(config, i, rope, cls.build_mlp(config, i)),
            embedding_multiplier=math.sqrt(config.hidden_size) if mup else None,
        )
        inner.norm = Olmo2RMSNorm(config.hidden_size, cfg_get(config, "rms_norm_eps", 1e-5))
        CausalLMBase.__init__(self, config, inner)
        # Expert rules first: the dense rules' ".gate_proj" would also match an expert's name.
        rules = expert_rules(num_experts(config), *self.expert_names)
        self.stacked_params = (*rules, *cls.stacked_params)

    @classmethod
    def build_mlp(cls, config, layer_idx: int) -> nn.Module:
        if layer_idx < int(cfg_get(config, "num_dense_layers", 1) or 0):
            return LlamaMLP(config, bias=False)
        return shared_expert_moe(config, float(cfg_get(config, "route_scale", 1.0) or 1.0))

    def rename_weight(self, name: str) -> str:
        name = name.replace(".self_attn.gate_proj.", ".self_attn.out_gate.")
        name = name.replace(".mlp.router.gate.", ".mlp.gate.")
        name = name.replace(".mlp.expert_bias", ".mlp.gate.e_score_correction_bias")
        return super().rename_weight(name)
