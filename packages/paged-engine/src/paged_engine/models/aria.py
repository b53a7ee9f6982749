"""Aria's text decoder (`AriaTextForCausalLM`, the language model of rhymes-ai/Aria): Llama's
attention (GQA, RoPE, no biases unless `attention_bias`) in Mixtral's pre-norm layer over a
fine-grained MoE in every layer, the routed experts beside always-on shared experts.

    router   logits = x @ W_r^T [T, E]; HF (AriaTextTopKRouter) takes the k largest logits and
             softmaxes those k alone, which is the top-k of the full softmax renormalized to
             sum 1: `SparseMoeBlock`'s route(renormalize=True) (float32)
    experts  E = moe_num_experts gated SiLU MLPs of `intermediate_size` (always SiLU, whatever
             hidden_act says), k = moe_topk a token
    shared   + a gated MLP of moe_num_shared_experts * intermediate_size every token goes
             through, ungated (qwen2_moe.SharedExpertMoeBlock with gated=False, as
             GraniteMoeShared's); its activation is hidden_act (SiLU only here)

Checkpoint names (transformers' save, the Hub's): `mlp.router.weight` [E, H] -> our `mlp.gate`,
`mlp.shared_experts.{gate,up,down}_proj` -> `mlp.shared_expert.*` (gate / up stacked by Llama's
rules), and the routed experts fused in HF's transposed layout, `mlp.experts.fc1.weight`
[E, H, 2I] (gate columns, then up) and `fc2.weight` [E, I, H] (transformers 5's in-memory
names `gate_up_proj` / `down_proj`, same layout): transposed here to FusedMoE's [E, 2I, H] /
[E, H, I]. The whole wrapper (AriaForConditionalGeneration) serves this class through
models/text_wrappers.py; its images run in multimodal/aria.py.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from paged_engine.layers.fused_moe import SparseMoeBlock
from paged_engine.models.llama import LlamaForCausalLM, LlamaModel
from paged_engine.models.mixtral import MoeDecoderLayer, check_silu
from paged_engine.models.qwen2_moe import SharedExpertMoeBlock
from paged_engine.models.utils import CausalLMBase

# (checkpoint substring, ours), applied in order
_RENAMES = (
    (".mlp.router.", ".mlp.gate."),
    (".mlp.shared_experts.", ".mlp.shared_expert."),
    (".mlp.experts.fc1.weight", ".mlp.experts.gate_up_proj"),
    (".mlp.experts.fc2.weight", ".mlp.experts.down_proj"),
)
# our fused expert parameters, loaded from HF's [E, in, out] layout by a transpose
_FUSED = (".mlp.experts.gate_up_proj", ".mlp.experts.down_proj")


def aria_moe_block(config) -> nn.Module:
    """The MoE MLP of an AriaTextConfig: routed experts plus the ungated shared MLP (none when
    moe_num_shared_experts is 0, as HF's zero-width one adds nothing)."""
    experts, top_k = int(config.moe_num_experts), int(config.moe_topk)
    hidden, inner = int(config.hidden_size), int(config.intermediate_size)
    shared = int(getattr(config, "moe_num_shared_experts", 0)) * inner
    if not shared:
        return SparseMoeBlock(experts, top_k, hidden, inner, renormalize=True)
    return SharedExpertMoeBlock(experts, top_k, hidden, inner, shared, True, gated=False)


class AriaTextForCausalLM(CausalLMBase):
    stacked_params = LlamaForCausalLM.stacked_params
    ignored_weights = ("rotary_emb.inv_freq",)

    def __init__(self, config) -> None:
        check_silu(config, type(self).__name__)
        if getattr(config, "mlp_bias", False):
            raise ValueError(f"{type(self).__name__} does not support mlp_bias=True")
        flags = LlamaForCausalLM.layer_flags(config)
        inner = LlamaModel(
            config,
            flags,
            lambda i, rope: MoeDecoderLayer(config, i, flags, rope, aria_moe_block(config)),
        )
        super().__init__(config, inner)

    def rename_weight(self, name: str) -> str:
        for theirs, ours in _RENAMES:
            name = name.replace(theirs, ours)
        return name

    def convert_weight(self, name: str, w: torch.Tensor) -> Iterable[tuple[str, torch.Tensor]]:
        yield name, (w.transpose(1, 2) if name.endswith(_FUSED) and w.dim() == 3 else w)
