"""Phi-3.5-MoE (`PhimoeForCausalLM`: Phi-3.5-MoE-instruct, Phi-mini-MoE, Phi-tiny-MoE).

Mixtral's decoder (models/mixtral.py: GQA, RoPE, optional sliding window, a sparse MoE MLP in
every layer) with LayerNorms (weight and bias; eps from `rms_norm_eps`, the final norm too),
q / k / v / o biases when `attention_bias`, an LM head bias when `lm_head_bias`, and
SparseMixer's top-2 routing as transformers runs it at inference:

    first   the top expert; its weight is its softmax probability among the experts whose logit
            is within 2 * router_jitter_noise of the top one, relative to max(|logit|, top)
    second  the top expert of the others, weighted the same way against its own logit (the
            first expert masked out)

Long-context rope (longrope) as transformers' Phi-MoE computes it: always the short factors, the
cos / sin scaled by `long_mscale` when the sequence is longer than the original context, else by
`short_mscale`; one choice serves every sequence, made from the engine's max_model_len (see
layers/rotary.py `RotaryEmbedding`). Checkpoints name the router `mlp.router` (transformers 5)
or `block_sparse_moe.gate`, the experts fused or per expert (`w1` / `w3` / `w2`).
"""

from __future__ import annotations

import copy

import torch

from paged_engine.layers.fused_moe import SparseMoeBlock
from paged_engine.layers.norm import LayerNorm
from paged_engine.layers.rotary import RotaryEmbedding, context_len_or, rope_config
from paged_engine.models.llama import LlamaModel
from paged_engine.models.mixtral import (
    MixtralForCausalLM,
    MoeDecoderLayer,
    check_silu,
    expert_rules,
    num_experts,
)
from paged_engine.models.utils import CausalLMBase, cfg_get


def sparsemixer_top2(logits: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """SparseMixer's inference routing: (weights [T, 2], expert ids [T, 2]) from router logits
    [T, E], each weight its expert's probability among the logits near it (see the module)."""

    def pick(masked: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        top, idx = masked.max(dim=-1, keepdim=True)
        factor = logits.abs().clamp(min=top)
        far = (top - logits) / factor > 2 * eps
        probs = torch.softmax(masked.masked_fill(far, float("-inf")), dim=-1)
        return probs.gather(-1, idx), idx

    w1, e1 = pick(logits)
    w2, e2 = pick(logits.scatter(-1, e1, float("-inf")))
    return torch.cat((w1, w2), dim=-1), torch.cat((e1, e2), dim=-1)


class PhimoeMoe(SparseMoeBlock):
    def __init__(self, config) -> None:
        super().__init__(
            num_experts(config),
            2,
            config.hidden_size,
            config.intermediate_size,
            renormalize=False,
        )
        self.eps = float(cfg_get(config, "router_jitter_noise", 0.01))

    def select_experts(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return sparsemixer_top2(self.gate(x).float(), self.eps)


def _rope_view(config):
    """`config` with Phi-MoE's longrope spelled as the shared rope reads it: the short factors
    for both regimes and the regime's mscale as the cos / sin factor."""
    theta, scaling, partial = rope_config(config)
    if not scaling or (scaling.get("rope_type") or scaling.get("type")) not in ("longrope", "su"):
        return config
    original = int(scaling["original_max_position_embeddings"])
    max_position = int(config.max_position_embeddings)
    long = min(context_len_or(max_position), max_position) > original
    key = "long_mscale" if long else "short_mscale"
    if scaling.get(key) is None:
        raise ValueError(f"Phi-MoE longrope needs rope_parameters.{key}")
    view = copy.copy(config)
    view.rope_parameters = {
        **scaling,
        "rope_type": "longrope",
        "rope_theta": theta,
        "partial_rotary_factor": partial,
        "long_factor": scaling["short_factor"],
        "attention_factor": float(scaling[key]),
    }
    return view


class PhimoeForCausalLM(MixtralForCausalLM):
    def __init__(self, config):
        check_silu(config, type(self).__name__)
        if int(config.num_experts_per_tok) != 2:
            raise ValueError(
                f"PhimoeForCausalLM routes to 2 experts (SparseMixer), got num_experts_per_tok="
                f"{config.num_experts_per_tok}"
            )
        eps = float(cfg_get(config, "rms_norm_eps", 1e-5))
        d = config.hidden_size
        flags = self.layer_flags(config)
        view = _rope_view(config)

        def build(i: int, rope: RotaryEmbedding) -> MoeDecoderLayer:
            layer = MoeDecoderLayer(view, i, flags, rope, PhimoeMoe(config))
            layer.input_layernorm = LayerNorm(d, eps=eps)
            layer.post_attention_layernorm = LayerNorm(d, eps=eps)
            return layer

        inner = LlamaModel(view, flags, build)
        inner.norm = LayerNorm(d, eps=eps)
        self.head_bias = bool(cfg_get(config, "lm_head_bias", False))  # read by CausalLMBase
        CausalLMBase.__init__(self, config, inner)
        rules = expert_rules(num_experts(config), *self.expert_names)
        self.stacked_params = (*rules, *type(self).stacked_params)

    @classmethod
    def layer_flags(cls, config) -> dict[str, bool]:
        bias = bool(getattr(config, "attention_bias", False))
        return {**super().layer_flags(config), "qkv_bias": bias, "o_bias": bias}

    def rename_weight(self, name: str) -> str:
        return super().rename_weight(name).replace(".mlp.router.", ".mlp.gate.")
