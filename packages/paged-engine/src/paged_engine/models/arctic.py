"""Snowflake Arctic (Snowflake/snowflake-arctic-instruct / -base; remote code, `ArcticForCausalLM`,
model_type "arctic"), served as vLLM's arctic.py serves it.

    attention  Llama's: no biases, head_dim = hidden_size / num_attention_heads, NeoX RoPE
    MLP        layer i is a MoE layer when (i + 1) % moe_layer_frequency == 0: Mixtral's block
               (softmax top-k, renormalized; experts of intermediate_size); the others a dense
               gated SiLU MLP of intermediate_size
    residual   a MoE layer of a config with use_residual (the Hub's parallel_attn_mlp_res) adds
               a dense MLP of hidden_size in parallel, and its MoE reads the layer's input:

        h   = x + attn(input_layernorm(x))
        out = h + residual_mlp(residual_layernorm(h)) + moe(post_attention_layernorm(x))

               (x the layer's input, not h); every other layer is Llama's pre-norm layer.

Checkpoint names: `block_sparse_moe.gate`, `block_sparse_moe.experts.M.{w1,w3,w2}` (gate, up,
down) for the experts, `block_sparse_moe.mlp.{w1,w3,w2}` for a dense layer's MLP,
`residual_mlp.{w1,w3,w2}` and `residual_layernorm`; ours are `mlp.*` with Llama's projection
names. DeepSpeed's FP quantization (config.json `quantization`) is refused by name, as are
configs the release's code and vLLM serve differently (one expert per token: vLLM does not
renormalize its weight, the release does).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from transformers import PretrainedConfig

from paged_engine.layers.fused_moe import SparseMoeBlock
from paged_engine.layers.norm import RMSNorm
from paged_engine.layers.rotary import RotaryEmbedding
from paged_engine.models.llama import LlamaForCausalLM, LlamaMLP, LlamaModel
from paged_engine.models.mixtral import MixtralForCausalLM, MoeDecoderLayer, expert_rules
from paged_engine.models.remote_aliases import field, llama_fields, refuse_unless
from paged_engine.models.utils import CausalLMBase

_ARCH = "ArcticForCausalLM"
# a dense MLP's projections (residual_mlp, a dense layer's block_sparse_moe.mlp) -> Llama's
_DENSE_NAMES = ((".w1.", ".gate_proj."), (".w3.", ".up_proj."), (".w2.", ".down_proj."))


def _use_residual(raw: dict[str, Any]) -> bool:
    """vLLM reads `use_residual`, the release's code `parallel_attn_mlp_res` (the Hub's
    config.json sets both); either alone serves, the two disagreeing is refused."""
    values = {n: field(raw, n, bool, False) for n in ("use_residual", "parallel_attn_mlp_res")}
    given = {n: v for n, v in values.items() if raw.get(n) is not None}
    if len(set(given.values())) > 1:
        raise ValueError(
            f"{_ARCH}: config.json fields 'use_residual' ({given['use_residual']}) and "
            f"'parallel_attn_mlp_res' ({given['parallel_attn_mlp_res']}) disagree"
        )
    return any(given.values())


def arctic_config(raw: dict[str, Any]) -> PretrainedConfig:
    """Arctic's config.json under the names our classes read (Llama's and Mixtral's, plus
    moe_layer_frequency and use_residual)."""
    for name in ("quantization", "quantization_config", "sliding_window", "rope_scaling"):
        refuse_unless(raw, _ARCH, name, (None,))
    refuse_unless(raw, _ARCH, "hidden_act", (None, "silu"))
    top_k = field(raw, "num_experts_per_tok", int, 1)
    if top_k < 2:
        raise ValueError(
            f"{_ARCH}: config.json field 'num_experts_per_tok'={top_k} is not supported: with "
            "one expert per token the release's code and vLLM weight it differently"
        )
    fields = {
        **llama_fields(raw, max_positions=4096, rms_norm_eps=1e-5),
        "rope_theta": field(raw, "rope_theta", float, 1e6),
        "hidden_act": "silu",
        "tie_word_embeddings": field(raw, "tie_word_embeddings", bool, False),
        "num_local_experts": field(raw, "num_local_experts", int, 8),
        "num_experts_per_tok": top_k,
        "moe_layer_frequency": field(raw, "moe_layer_frequency", int, 2),
        "use_residual": _use_residual(raw),
    }
    config = PretrainedConfig(**fields)
    config.model_type = "arctic"
    return config


def is_moe_layer(config, layer_idx: int) -> bool:
    return (layer_idx + 1) % config.moe_layer_frequency == 0


class ArcticResidualLayer(MoeDecoderLayer):
    """A MoE layer with the parallel dense residual MLP (module docstring). [T, D] -> [T, D].
    Its own forward: the model runs the residual stream whole (keeps_stream_apart is False)."""

    def __init__(
        self, config, layer_idx: int, flags: dict[str, bool], rope: RotaryEmbedding, mlp: nn.Module
    ) -> None:
        super().__init__(config, layer_idx, flags, rope, mlp)
        hidden = config.hidden_size
        self.residual_layernorm = RMSNorm(hidden, config.rms_norm_eps)
        self.residual_mlp = LlamaMLP(config, bias=False, intermediate_size=hidden)

    def forward(self, positions, x, kv_cache, md) -> torch.Tensor:
        h = x + self.self_attn(positions, self.input_layernorm(x), kv_cache, md)
        moe = self.mlp(self.post_attention_layernorm(x))  # the pre-attention input
        return h + self.residual_mlp(self.residual_layernorm(h)) + moe


class ArcticForCausalLM(MixtralForCausalLM):
    # expert_names: Mixtral's w1 / w3 / w2
    def __init__(self, config) -> None:
        flags = self.layer_flags(config)

        def build(i: int, rope: RotaryEmbedding) -> nn.Module:
            mlp = self.build_mlp(config, i)
            if config.use_residual and is_moe_layer(config, i):
                return ArcticResidualLayer(config, i, flags, rope, mlp)
            return MoeDecoderLayer(config, i, flags, rope, mlp)

        CausalLMBase.__init__(self, config, LlamaModel(config, flags, build))
        rules = expert_rules(config.num_local_experts, *self.expert_names)
        self.stacked_params = (*rules, *LlamaForCausalLM.stacked_params)

    @classmethod
    def layer_flags(cls, config) -> dict[str, bool]:
        return LlamaForCausalLM.layer_flags(config)  # no biases, full attention

    @classmethod
    def build_mlp(cls, config, layer_idx: int) -> nn.Module:
        if not is_moe_layer(config, layer_idx):
            return LlamaMLP(config, bias=False)
        return SparseMoeBlock(
            config.num_local_experts,
            config.num_experts_per_tok,
            config.hidden_size,
            config.intermediate_size,
            renormalize=True,
        )

    def rename_weight(self, name: str) -> str:
        name = name.replace(".block_sparse_moe.mlp.", ".mlp.")
        name = name.replace(".block_sparse_moe.", ".mlp.")
        if ".experts." in name:  # the stacked expert rules read w1 / w3 / w2
            return name
        for theirs, ours in _DENSE_NAMES:
            name = name.replace(theirs, ours)
        return name
