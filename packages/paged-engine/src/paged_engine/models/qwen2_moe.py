"""Qwen2-MoE (Qwen1.5-MoE-A2.7B, Qwen2-57B-A14B): Qwen2's attention (bias on q, k, v; optional
sliding-window layers) with sparse MoE MLPs that add a shared expert.

    mlp(x) = experts(x) + sigmoid(shared_expert_gate(x)) * shared_expert(x)

`experts` is the routed part (softmax top-k, renormalized when `norm_topk_prob`; experts of
`moe_intermediate_size`), `shared_expert` a dense gated SiLU MLP of
`shared_expert_intermediate_size` every token goes through, and `shared_expert_gate` a [1, H]
projection giving each token the shared expert's weight. Which layers are sparse follows
Qwen3-MoE's rule (`decoder_sparse_step`, `mlp_only_layers`); dense ones have `intermediate_size`.

Tensor parallelism splits the shared expert like a dense MLP (gate / up rows, down columns). Its
gate is per token and replicated, so gate * (sum of the ranks' partials) is the sum of the gated
partials: the block adds the shared partial to the experts' and all-reduces once.
"""

from __future__ import annotations

import torch
from torch import nn

from paged_engine.distributed.communication import tp_all_reduce
from paged_engine.layers.deepseek_moe import SharedExpertsMLP
from paged_engine.layers.fused_moe import MoeRouter, SparseMoeBlock
from paged_engine.models.mixtral import num_experts
from paged_engine.models.qwen3_moe import Qwen3MoeForCausalLM


class SharedExpertMoeBlock(SparseMoeBlock):
    """SparseMoeBlock plus a shared expert every token goes through, one all-reduce for both.
    [T, H] -> [T, H]. `gated`: the shared expert's output is scaled by
    sigmoid(shared_expert_gate(x)) (Qwen2-MoE); ungated it is added as is (GraniteMoeShared)."""

    def __init__(
        self,
        num_experts: int,
        top_k: int,
        hidden_size: int,
        intermediate_size: int,
        shared_intermediate_size: int,
        renormalize: bool,
        gated: bool = True,
    ) -> None:
        super().__init__(num_experts, top_k, hidden_size, intermediate_size, renormalize)
        self.shared_expert = SharedExpertsMLP(hidden_size, shared_intermediate_size)
        # a replicated [1, H] projection
        self.shared_expert_gate = MoeRouter(1, hidden_size) if gated else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = self.select_experts(x)
        shared = self.shared_expert(x)  # this rank's partial sum, like the experts'
        if self.shared_expert_gate is not None:
            shared = torch.sigmoid(self.shared_expert_gate(x)) * shared
        out = self.experts(x, weights, ids) + shared
        return tp_all_reduce(out) if self.experts.tp_size > 1 else out


class Qwen2MoeForCausalLM(Qwen3MoeForCausalLM):
    @classmethod
    def layer_flags(cls, config) -> dict[str, bool]:
        return {
            "qkv_bias": bool(getattr(config, "qkv_bias", True)),
            "o_bias": False,
            "qk_norm": False,
            "mlp_bias": False,
            "sliding": True,
        }

    @classmethod
    def sparse_block(cls, config) -> nn.Module:
        return shared_expert_block(config, renormalize_default=False)


def shared_expert_block(config, renormalize_default: bool) -> SharedExpertMoeBlock:
    """The block of a Qwen2-MoE-style config (also Qwen3-Next / Qwen3.5-MoE's); `norm_topk_prob`
    decides the renormalization, `renormalize_default` where the config has none."""
    return SharedExpertMoeBlock(
        num_experts(config),
        config.num_experts_per_tok,
        config.hidden_size,
        config.moe_intermediate_size,
        config.shared_expert_intermediate_size,
        renormalize=bool(getattr(config, "norm_topk_prob", renormalize_default)),
    )
