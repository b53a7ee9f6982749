"""Tencent Hunyuan, dense (`HunYuanDenseV1ForCausalLM`, "hunyuan_v1_dense": Hunyuan-0.5B / 1.8B /
4B / 7B) and MoE (`HunYuanMoEV1ForCausalLM`, "hunyuan_v1_moe": Hunyuan-A13B). Llama's pre-norm
decoder with these differences:

    attention  GQA, q / k / v / o biases when `attention_bias`; per-head RMSNorms on q and k
               *after* RoPE (Qwen3 norms before it): q = norm(rope(x W_q)), k = norm(rope(x W_k))
    rope       the checkpoints' rope_scaling {"type": "dynamic", "alpha": a} is NTK by a fixed
               alpha, a static table: base = rope_theta * a ** (d / (d - 2)), d = head_dim
               (layers/rotary.py's get_rope)
    mlp        dense: Llama's gated SiLU MLP of `intermediate_size`. MoE, in every layer:
               p = softmax(x @ W_g^T) in float32 (W_g kept in float32, as HF keeps it), the
               k = moe_topk largest renormalized to sum 1; experts gated SiLU MLPs of
               `intermediate_size`; plus a shared MLP every token goes through (not gated)

`moe_topk` may be a list (one per layer). HF sizes experts and the shared MLP by
`intermediate_size`; configs carrying the original remote code's `moe_intermediate_size` (per
layer) and `num_shared_expert` are read for those sizes (the released ones agree with HF's).
Checkpoint names: `self_attn.{query,key}_layernorm` (our q_norm / k_norm), the router
`mlp.gate.wg.weight`, per-expert `mlp.experts.M.{gate,up,down}_proj.weight` (transformers 5's
fused `mlp.experts.gate_up_proj` / `down_proj` load too) and `mlp.shared_mlp.*` (our
shared_experts). Tensor parallelism: DeepseekMoe's (experts and shared MLP split, one
all-reduce, the router replicated).
"""

from __future__ import annotations

import torch
from torch import nn

from paged_engine.layers.attention import AttentionMetadata
from paged_engine.layers.deepseek_moe import DeepseekMoe
from paged_engine.layers.rotary import RotaryEmbedding, get_rope
from paged_engine.models.deepseek_v2 import DeepseekModel
from paged_engine.models.llama import LlamaAttention, LlamaForCausalLM, LlamaMLP, llama_head_dim
from paged_engine.models.mixtral import check_silu, expert_rules, num_experts
from paged_engine.models.utils import CausalLMBase, cfg_get


def hunyuan_flags(config) -> dict[str, bool]:
    bias = bool(cfg_get(config, "attention_bias", False))
    return {"qkv_bias": bias, "o_bias": bias, "qk_norm": True, "mlp_bias": False, "sliding": False}


class HunYuanAttention(LlamaAttention):
    """Llama's attention with its per-head q / k norms applied after RoPE. Every layer attends to
    the whole context, so the layer index is not needed (DeepseekModel's (config, rope))."""

    def __init__(self, config, rope: RotaryEmbedding) -> None:
        super().__init__(config, 0, hunyuan_flags(config), rope)

    def forward(
        self,
        positions: torch.Tensor,  # [T]
        x: torch.Tensor,  # [T, D]
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        md: AttentionMetadata,
    ) -> torch.Tensor:
        t = x.shape[0]
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q, k = self.rotary_emb(positions, q, k)
        q = self.q_norm(q.view(t, -1, self.head_dim)).reshape(t, -1)
        k = self.k_norm(k.view(t, -1, self.head_dim)).reshape(t, -1)
        return self.o_proj(self.attn(q, k, v, kv_cache, md))


def _per_layer(value, layer_idx: int) -> int:
    return int(value[layer_idx] if isinstance(value, (list, tuple)) else value)


def hunyuan_moe_block(config, layer_idx: int) -> DeepseekMoe:
    inter = int(config.intermediate_size)
    expert_inter = _per_layer(cfg_get(config, "moe_intermediate_size", inter), layer_idx)
    shared = _per_layer(cfg_get(config, "num_shared_expert", 1), layer_idx)
    return DeepseekMoe(
        num_experts(config),
        _per_layer(config.moe_topk, layer_idx),
        config.hidden_size,
        expert_inter,
        shared * inter,
        sigmoid=False,
        correction_bias=False,
        renormalize=True,
    )


class HunYuanDenseV1ForCausalLM(CausalLMBase):
    stacked_params = LlamaForCausalLM.stacked_params
    ignored_weights = ("rotary_emb.inv_freq",)

    def __init__(self, config):
        check_silu(config, type(self).__name__)
        rope = get_rope(config, llama_head_dim(config))  # NTK-alpha: layers/rotary.py
        inner = DeepseekModel(config, type(self).build_mlp, HunYuanAttention, rope)
        super().__init__(config, inner)

    @classmethod
    def build_mlp(cls, config, layer_idx: int) -> nn.Module:
        return LlamaMLP(config, bias=False)

    def rename_weight(self, name: str) -> str:
        return name.replace(".query_layernorm.", ".q_norm.").replace(".key_layernorm.", ".k_norm.")


class HunYuanMoEV1ForCausalLM(HunYuanDenseV1ForCausalLM):
    def __init__(self, config):
        super().__init__(config)
        # Expert rules first: the shared MLP's ".gate_proj" would also match an expert's name.
        rules = expert_rules(num_experts(config), "gate_proj", "up_proj", "down_proj")
        self.stacked_params = (*rules, *type(self).stacked_params)

    @classmethod
    def build_mlp(cls, config, layer_idx: int) -> nn.Module:
        return hunyuan_moe_block(config, layer_idx)

    def rename_weight(self, name: str) -> str:
        name = super().rename_weight(name)
        return name.replace(".mlp.gate.wg.", ".mlp.gate.").replace(
            ".mlp.shared_mlp.", ".mlp.shared_experts."
        )
