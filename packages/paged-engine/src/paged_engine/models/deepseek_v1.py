"""DeepSeek-MoE v1 (deepseek-ai/deepseek-moe-16b-base / -chat; remote code, `DeepseekForCausalLM`,
model_type "deepseek"), served as vLLM's DeepseekForCausalLM serves it.

    attention  Llama's: no biases, head_dim = hidden_size / num_attention_heads, NeoX RoPE
               (rope_theta, the Llama-style rope_scaling)
    MLP        layer i is a MoE layer when n_routed_experts is set, i >= first_k_dense_replace
               and i % moe_layer_freq == 0; the others are dense gated SiLU MLPs of
               intermediate_size
    MoE        softmax over the n_routed_experts router logits, top num_experts_per_tok,
               renormalized to sum 1 when norm_topk_prob; experts of moe_intermediate_size;
               plus n_shared_experts ungated shared experts, held as one gated SiLU MLP of
               n_shared_experts * moe_intermediate_size every token goes through

So a MoE layer is Qwen2-MoE's block (models/qwen2_moe.py) with the shared expert's gate removed
(`SharedExpertMoeBlock(gated=False)`). Checkpoint names are HF's: `mlp.gate.weight`,
`mlp.experts.M.{gate,up,down}_proj.weight`, `mlp.shared_experts.*` (our `mlp.shared_expert.*`).

The release's own code renormalizes only when num_experts_per_tok > 1 (vLLM whenever
norm_topk_prob is set); with one expert per token the two disagree, and we follow vLLM.
"""

from __future__ import annotations

from typing import Any

from torch import nn
from transformers import PretrainedConfig

from paged_engine.layers.fused_moe import SparseMoeBlock
from paged_engine.models.llama import LlamaForCausalLM, LlamaMLP
from paged_engine.models.mixtral import MixtralForCausalLM, num_experts
from paged_engine.models.qwen2_moe import SharedExpertMoeBlock
from paged_engine.models.remote_aliases import field, llama_fields, refuse_unless


def _count(raw: dict[str, Any], name: str, default: int) -> int:
    """A config.json count that may be 0 (or null: `default`); ValueError naming it."""
    value = raw.get(name)
    if value is None:
        return default
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ValueError(f"config.json field {name!r} must be a non-negative int, got {value!r}")
    return value


def _rope(raw: dict[str, Any]) -> dict[str, Any]:
    """rope_theta and the Llama-style rope_scaling ({"type": ..., "factor": ...}) as one
    transformers 5 `rope_parameters` dict."""
    scaling = {k: v for k, v in field(raw, "rope_scaling", dict, {}).items() if k != "type"}
    kind = (raw.get("rope_scaling") or {}).get("type")
    scaling["rope_type"] = scaling.get("rope_type") or kind or "default"
    return {**scaling, "rope_theta": field(raw, "rope_theta", float, 10000.0)}


def deepseek_v1_config(raw: dict[str, Any]) -> PretrainedConfig:
    """DeepSeek-MoE v1's config.json under the names our classes read (Llama's, plus
    `num_experts` for n_routed_experts; DeepSeek's own MoE fields kept as they are)."""
    arch = "DeepseekForCausalLM"
    refuse_unless(raw, arch, "attention_bias", (None, False))
    refuse_unless(raw, arch, "scoring_func", (None, "softmax"))
    refuse_unless(raw, arch, "hidden_act", (None, "silu"))
    refuse_unless(raw, arch, "quantization_config", (None,))
    routed = _count(raw, "n_routed_experts", 0)
    fields = {
        **llama_fields(raw, max_positions=2048, rms_norm_eps=1e-6),
        "rope_parameters": _rope(raw),
        "hidden_act": "silu",
        "tie_word_embeddings": field(raw, "tie_word_embeddings", bool, False),
        "num_experts": routed,
        "n_shared_experts": _count(raw, "n_shared_experts", 0),
        "first_k_dense_replace": _count(raw, "first_k_dense_replace", 0),
        "moe_layer_freq": field(raw, "moe_layer_freq", int, 1),
        "norm_topk_prob": field(raw, "norm_topk_prob", bool, False),
    }
    if routed:
        fields["moe_intermediate_size"] = field(raw, "moe_intermediate_size", int)
        fields["num_experts_per_tok"] = field(raw, "num_experts_per_tok", int)
    config = PretrainedConfig(**fields)
    config.model_type = "deepseek"
    return config


def is_moe_layer(config, layer_idx: int) -> bool:
    """DeepSeek v1's rule: routed experts exist, past the first dense layers, every
    moe_layer_freq-th layer."""
    return (
        num_experts(config) > 0
        and layer_idx >= config.first_k_dense_replace
        and layer_idx % config.moe_layer_freq == 0
    )


class DeepseekForCausalLM(MixtralForCausalLM):
    expert_names = ("gate_proj", "up_proj", "down_proj")

    @classmethod
    def layer_flags(cls, config) -> dict[str, bool]:
        return LlamaForCausalLM.layer_flags(config)  # no biases, full attention

    @classmethod
    def build_mlp(cls, config, layer_idx: int) -> nn.Module:
        if not is_moe_layer(config, layer_idx):
            return LlamaMLP(config, bias=False)
        args = (
            num_experts(config),
            config.num_experts_per_tok,
            config.hidden_size,
            config.moe_intermediate_size,
        )
        shared = config.n_shared_experts * config.moe_intermediate_size
        if not shared:
            return SparseMoeBlock(*args, renormalize=config.norm_topk_prob)
        return SharedExpertMoeBlock(*args, shared, config.norm_topk_prob, gated=False)

    def rename_weight(self, name: str) -> str:
        return super().rename_weight(name).replace(".mlp.shared_experts.", ".mlp.shared_expert.")
