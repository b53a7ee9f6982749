"""Baidu ERNIE 4.5 MoE text models (`Ernie4_5_MoeForCausalLM`: ERNIE-4.5-21B-A3B,
ERNIE-4.5-300B-A47B): ERNIE 4.5's decoder (models/ernie4_5.py: interleaved rope, `use_bias`)
with DeepSeek-style MoE MLPs (layers/deepseek_moe.py) in some layers.

    sparse   layer i when start <= i <= end and (i + 1) % moe_layer_interval == 0
             (moe_layer_start_index, moe_layer_end_index; end -1: the last layer); the others
             have a dense gated SiLU MLP of `intermediate_size`
    router   float32: p = softmax(x @ W_g^T) over the moe_num_experts experts; the k = moe_k
             experts with the largest p + e_score_correction_bias are chosen, weighted by their
             unbiased p divided by max(sum, moe_norm_min) (ErnieRouter: a floor above moe_k /
             moe_num_experts, the least that sum can be, leaves the weights short of 1). No
             groups, no scaling (DeepseekRouter with sigmoid=False and the correction bias)
    experts  gated SiLU experts of `moe_intermediate_size`, never biased, plus
             moe_num_shared_experts * moe_intermediate_size of shared experts every token goes
             through (biased when `use_bias`)
    head     lm_head has a bias when `use_bias` (the embedding is tied by default)

Checkpoint names: per-expert `mlp.experts.M.{gate,up,down}_proj.weight` or transformers 5's fused
`mlp.experts.gate_up_proj` / `down_proj`; the router `mlp.gate.weight` [E, H] and its bias
`mlp.moe_statics.e_score_correction_bias` [1, E] (`mlp.gate.moe_statics.*` in transformers 5),
loaded as the router's [E] float32 `e_score_correction_bias`. Multi-token-prediction weights
(`mtp*`) are skipped, as HF skips them (models/mtp_more.py runs them as a draft). Tensor
parallelism: DeepseekMoe's (experts and shared experts split like dense MLPs, one all-reduce,
the router replicated).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from paged_engine.layers.deepseek_moe import DeepseekMoe, DeepseekRouter, SharedExpertsMLP
from paged_engine.layers.embedding import ParallelLMHead
from paged_engine.layers.rotary import RotaryEmbedding
from paged_engine.models.ernie4_5 import ernie_layer_flags
from paged_engine.models.llama import LlamaForCausalLM, LlamaMLP, LlamaModel
from paged_engine.models.mixtral import MoeDecoderLayer, check_silu, expert_rules
from paged_engine.models.utils import CausalLMBase, cfg_get


def is_moe_layer(config, layer_idx: int) -> bool:
    interval = int(cfg_get(config, "moe_layer_interval", 1))
    if interval < 1:
        raise ValueError(f"moe_layer_interval must be a positive integer, got {interval!r}")
    start = int(cfg_get(config, "moe_layer_start_index", 1))
    end = int(cfg_get(config, "moe_layer_end_index", -1))
    if end == -1:
        end = config.num_hidden_layers - 1
    return (layer_idx + 1) % interval == 0 and start <= layer_idx <= end


class ErnieRouter(DeepseekRouter):
    """DeepseekRouter's softmax routing with the correction bias, its k weights divided by
    max(their sum, `norm_min`) (HF's moe_norm_min). x [T, H] -> (weights [T, k], ids [T, k])."""

    def __init__(self, num_experts: int, hidden_size: int, top_k: int, norm_min: float) -> None:
        super().__init__(num_experts, hidden_size, top_k, sigmoid=False, renormalize=False)
        self.norm_min = norm_min

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        weights, ids = super().forward(x)
        return weights / weights.sum(dim=-1, keepdim=True).clamp(min=self.norm_min), ids


def ernie_moe_block(config) -> DeepseekMoe:
    inter = int(config.moe_intermediate_size)
    experts, top_k = int(config.moe_num_experts), int(config.moe_k)
    block = DeepseekMoe(
        experts,
        top_k,
        config.hidden_size,
        inter,
        0,  # the shared experts are set below (they may carry biases)
        sigmoid=False,
        correction_bias=True,
    )
    norm_min = float(cfg_get(config, "moe_norm_min", 1e-12))
    block.gate = ErnieRouter(experts, config.hidden_size, top_k, norm_min)
    shared = int(cfg_get(config, "moe_num_shared_experts", 2))
    if shared:
        bias = bool(getattr(config, "use_bias", False))
        block.shared_experts = SharedExpertsMLP(config.hidden_size, shared * inter, bias=bias)
    return block


class Ernie4_5_MoeForCausalLM(CausalLMBase):
    tie_default = True
    stacked_params = LlamaForCausalLM.stacked_params
    ignored_weights = ("rotary_emb.inv_freq",)

    def __init__(self, config):
        check_silu(config, type(self).__name__)
        flags = ernie_layer_flags(config)

        def build_layer(i: int, rope: RotaryEmbedding) -> nn.Module:
            if is_moe_layer(config, i):
                mlp = ernie_moe_block(config)
            else:
                mlp = LlamaMLP(config, bias=flags["mlp_bias"])
            return MoeDecoderLayer(config, i, flags, rope, mlp)

        super().__init__(config, LlamaModel(config, flags, build_layer, is_neox_style=False))
        if getattr(config, "use_bias", False):  # HF's lm_head is biased too
            head = ParallelLMHead(config.vocab_size, config.hidden_size, bias=True)
            if self.tie_word_embeddings:
                head.tie_to(self.model.embed_tokens)
            self.lm_head = head
        # Expert rules first: the dense MLP's ".gate_proj" would also match an expert's name.
        rules = expert_rules(int(config.moe_num_experts), "gate_proj", "up_proj", "down_proj")
        self.stacked_params = (*rules, *type(self).stacked_params)

    def rename_weight(self, name: str) -> str:
        return name.replace(".mlp.gate.moe_statics.", ".mlp.gate.").replace(
            ".mlp.moe_statics.", ".mlp.gate."
        )

    def convert_weight(self, name: str, w: torch.Tensor) -> Iterable[tuple[str, torch.Tensor]]:
        if name.endswith(".e_score_correction_bias"):
            w = w.reshape(-1)  # [1, E] -> [E]
        yield name, w

    def load_weights(
        self, weights: Iterable[tuple[str, torch.Tensor]], strict: bool = True
    ) -> set[str]:
        return super().load_weights(((n, w) for n, w in weights if "mtp" not in n), strict)
