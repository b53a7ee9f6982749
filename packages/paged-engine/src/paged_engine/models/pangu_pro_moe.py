"""Pangu Pro MoE (PanguProMoEForCausalLM, IntervitensInc/pangu-pro-moe-model: remote code,
model_type PanGuMoE): Llama-shaped attention with biases on q / k / v / o, and in every layer
a Mixture of Grouped Experts (MoGE) MLP with a shared expert. vLLM itself has no such class;
vllm-ascend's pangu_moe.py (and omni-infer's) serve it, and we follow that math.

    router   probs = softmax(x @ W_gate^T) [T, E] in float32 over all E experts; the experts
             form k = num_experts_per_tok contiguous groups of E / k, and a token takes its
             best expert in each group (so every group, and every device holding one, gets
             exactly one expert per token); expert e's weight is probs[e] * router_scale[e]
             (a learned [1, E] parameter `mlp.router_scale`), never renormalized
    experts  gated SiLU MLPs of `moe_intermediate_size` (`mlp.experts.M.{gate,up,down}_proj`),
             run by the shared fused MoE (layers/fused_moe.py)
    shared   `mlp.shared_expert.{gate,up,down}_proj` of `shared_expert_intermediate_size`,
             added to the experts' sum without a gate (none where the size is 0)

Where we differ from vllm-ascend: its grouping offsets step by k (arange(0, E, k)), right only
where E = k * k (the release: 64 experts, k = 8); we step by the group size E / k, the grouping
its view(T, k, E / k) already reads.

The config.json (no transformers class) is translated here through remote_aliases. Its switches
without a reference are refused by name: dense `mlp_only_layers`, `rope_scaling`, openPangu's
`sandwich_norm`, a `head_dim` other than hidden / heads. openPangu's later MoE releases
(PanguProMoEV2ForCausalLM, PanguUltraMoEForCausalLM: vLLM's openpangu.py, sigmoid routing and
MLA) are models/openpangu_moe.py's.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from transformers import PretrainedConfig

from paged_engine.distributed.communication import tp_all_reduce
from paged_engine.layers.deepseek_moe import SharedExpertsMLP
from paged_engine.layers.fused_moe import SparseMoeBlock
from paged_engine.models.mixtral import num_experts
from paged_engine.models.qwen2_moe import Qwen2MoeForCausalLM
from paged_engine.models.remote_aliases import field, llama_fields, refuse_unless

ARCH = "PanguProMoEForCausalLM"


def moge_route(
    logits: torch.Tensor,  # [T, E]
    groups: int,
    router_scale: torch.Tensor,  # [1, E] or [E]
) -> tuple[torch.Tensor, torch.Tensor]:
    """MoGE routing -> (weights [T, groups] float32, expert ids [T, groups] int64): the softmax
    over all E experts, the best expert of each of `groups` contiguous groups, its probability
    times router_scale."""
    t, e = logits.shape
    probs = torch.softmax(logits.float(), dim=-1)
    best, local = probs.view(t, groups, e // groups).max(dim=-1)  # [T, G] each
    ids = local + torch.arange(0, e, e // groups, device=logits.device)  # group g: g * E / G
    return best * router_scale.reshape(-1).float()[ids], ids


class MoGEMoeBlock(SparseMoeBlock):
    """The MLP of a Pangu Pro MoE layer: MoGE-routed experts plus an ungated shared expert,
    one all-reduce for both. [T, H] -> [T, H]."""

    def __init__(
        self,
        num_experts: int,
        top_k: int,
        hidden_size: int,
        intermediate_size: int,
        shared_intermediate_size: int,
    ) -> None:
        super().__init__(num_experts, top_k, hidden_size, intermediate_size, renormalize=False)
        if num_experts % top_k:
            raise ValueError(
                f"{ARCH}: num_experts_per_tok={top_k} groups must divide the {num_experts} experts"
            )
        self.router_scale = nn.Parameter(torch.ones(1, num_experts))
        self.shared_expert = (
            SharedExpertsMLP(hidden_size, shared_intermediate_size)
            if shared_intermediate_size > 0
            else None
        )

    def select_experts(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return moge_route(self.gate(x), self.top_k, self.router_scale)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = self.select_experts(x)
        out = self.experts(x, weights, ids)
        if self.shared_expert is not None:  # this rank's partial sum, like the experts'
            out = out + self.shared_expert(x)
        return tp_all_reduce(out) if self.experts.tp_size > 1 else out


def pangu_pro_moe_config(raw: dict[str, Any]) -> PretrainedConfig:
    """Pangu Pro MoE's config.json (its PanGuMoEConfig's fields and defaults) under the names
    our classes read."""
    refuse_unless(raw, ARCH, "hidden_act", (None, "silu"))
    refuse_unless(raw, ARCH, "rope_scaling", (None,))
    refuse_unless(raw, ARCH, "sandwich_norm", (None, False))
    refuse_unless(raw, ARCH, "quantization_config", (None,))
    if raw.get("mlp_only_layers"):
        refuse_unless(raw, ARCH, "mlp_only_layers", (None,))
    experts = field(raw, "num_experts", int, 64)
    top_k = field(raw, "num_experts_per_tok", int, 8)
    if experts < 1 or not 1 <= top_k <= experts or experts % top_k:
        raise ValueError(
            f"{ARCH}: config.json field 'num_experts_per_tok' ({top_k}) must divide "
            f"num_experts ({experts}) into its expert groups"
        )
    moe_size = field(raw, "moe_intermediate_size", int, 1344)
    sizes = llama_fields({"intermediate_size": moe_size, **raw}, 4096, 1e-5)
    head_dim = sizes["hidden_size"] // sizes["num_attention_heads"]
    if field(raw, "head_dim", int, head_dim) != head_dim:
        raise ValueError(
            f"{ARCH}: config.json field 'head_dim'={raw['head_dim']} is not supported (only "
            f"hidden_size / num_attention_heads = {head_dim})"
        )
    shared = field(raw, "shared_expert_intermediate_size", int, 5376)
    if shared < 0:
        raise ValueError(f"{ARCH}: config.json field 'shared_expert_intermediate_size' < 0")
    rope = {"rope_type": "default", "rope_theta": field(raw, "rope_theta", float, 1e6)}
    config = PretrainedConfig(
        **sizes,
        head_dim=head_dim,
        hidden_act="silu",
        rope_parameters=rope,
        tie_word_embeddings=field(raw, "tie_word_embeddings", bool, False),
        num_experts=experts,
        num_experts_per_tok=top_k,
        moe_intermediate_size=moe_size,
        shared_expert_intermediate_size=shared,
    )
    config.model_type = "PanGuMoE"
    return config


class PanguProMoEForCausalLM(Qwen2MoeForCausalLM):
    """Qwen2-MoE's decoder (per-expert checkpoint names, shared expert) with q / k / v / o
    biases, full attention and the MoGE block in every layer."""

    @classmethod
    def layer_flags(cls, config) -> dict[str, bool]:
        return {
            "qkv_bias": True,
            "o_bias": True,
            "qk_norm": False,
            "mlp_bias": False,
            "sliding": False,
        }

    @classmethod
    def sparse_block(cls, config) -> nn.Module:
        return MoGEMoeBlock(
            num_experts(config),
            config.num_experts_per_tok,
            config.hidden_size,
            config.moe_intermediate_size,
            config.shared_expert_intermediate_size,
        )
