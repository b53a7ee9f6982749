"""TeleChat2 (Tele-AI, remote code: `TeleChat2ForCausalLM`, `TeleChatForCausalLM`): the Llama
decoder under BLOOM-style names, as vLLM's telechat2.py serves it.

    transformer.word_embeddings            -> model.embed_tokens
    transformer.h.N.self_attention.query   -> self_attn.q_proj (no bias)
    .self_attention.key_value              -> k_proj / v_proj: rows [k, v] per KV head
    .self_attention.dense                  -> o_proj (with bias)
    .mlp.gate_proj / up_proj / down_proj   -> the same (only down_proj has a bias)
    input_layernorm / post_attention_layernorm, transformer.ln_f (RMSNorm) -> Llama's norms

Config (telechat2_config): n_head / n_layer / ffn_hidden_size / layer_norm_epsilon for Llama's
names; NeoX rope with rope_theta (10000 when absent, as vLLM). The release's remote code
extrapolates past `training_seqlen` (its own rope and logn scaling there), which vLLM ignores;
we serve exactly, so the context stops at training_seqlen when the config has one.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn
from transformers import PretrainedConfig

from paged_engine.layers.linear import RowParallelLinear
from paged_engine.layers.rotary import RotaryEmbedding
from paged_engine.models.llama import (
    LlamaDecoderLayer,
    LlamaForCausalLM,
    LlamaMLP,
    LlamaModel,
    llama_head_dim,
)
from paged_engine.models.remote_aliases import common_fields, field
from paged_engine.models.utils import CausalLMBase


def telechat2_config(raw: dict[str, Any]) -> PretrainedConfig:
    """TeleChat2's config.json under the names models/llama.py reads."""
    hidden = field(raw, "hidden_size", int)
    heads = field(raw, "n_head", int)
    context = field(raw, "max_position_embeddings", int, field(raw, "seq_length", int, 8192))
    if raw.get("training_seqlen") is not None:
        context = min(context, field(raw, "training_seqlen", int))
    fields = {
        **common_fields(raw),
        "vocab_size": field(raw, "vocab_size", int),
        "hidden_size": hidden,
        "num_attention_heads": heads,
        "num_key_value_heads": field(raw, "num_key_value_heads", int, heads),
        "head_dim": hidden // heads,
        "num_hidden_layers": field(raw, "n_layer", int),
        "intermediate_size": field(raw, "ffn_hidden_size", int),
        "rms_norm_eps": field(raw, "layer_norm_epsilon", float, 1e-5),
        "rope_theta": field(raw, "rope_theta", float, 10000.0),
        "max_position_embeddings": context,
        "hidden_act": "silu",
        "tie_word_embeddings": field(raw, "tie_word_embeddings", bool, False),
    }
    if heads % fields["num_key_value_heads"] or hidden % heads:
        raise ValueError(
            f"config.json fields 'n_head' ({heads}) and 'num_key_value_heads' "
            f"({fields['num_key_value_heads']}) must divide hidden_size ({hidden}) and n_head"
        )
    config = PretrainedConfig(**fields)
    config.model_type = "telechat"
    return config


class TeleChat2MLP(LlamaMLP):
    """Llama's gated MLP with a bias on down_proj alone."""

    def __init__(self, config) -> None:
        super().__init__(config, bias=False)
        self.down_proj = RowParallelLinear(config.intermediate_size, config.hidden_size, True)


class TeleChat2ForCausalLM(LlamaForCausalLM):
    renames = (
        ("transformer.word_embeddings.", "model.embed_tokens."),
        ("transformer.h.", "model.layers."),
        ("transformer.ln_f.", "model.norm."),
        (".self_attention.query.", ".self_attn.q_proj."),
        (".self_attention.key_value.", ".self_attn.key_value."),
        (".self_attention.dense.", ".self_attn.o_proj."),
    )

    def __init__(self, config) -> None:
        flags = {**self.layer_flags(config), "qkv_bias": False, "o_bias": True}

        def build(i: int, rope: RotaryEmbedding) -> nn.Module:
            layer = LlamaDecoderLayer(config, i, flags, rope)
            layer.mlp = TeleChat2MLP(config)
            return layer

        CausalLMBase.__init__(self, config, LlamaModel(config, flags, build))

    def convert_weight(self, name: str, w: torch.Tensor) -> Iterable[tuple[str, torch.Tensor]]:
        if ".self_attn.key_value." not in name:
            yield name, w
            return
        d, kv_heads = llama_head_dim(self.config), self.config.num_key_value_heads
        if w.shape[0] != 2 * kv_heads * d:
            raise ValueError(f"{name}: {w.shape[0]} rows, expected {kv_heads} x 2 x {d}")
        rows = w.reshape(kv_heads, 2, d, *w.shape[1:])  # per KV head: [k, v]
        for i, shard in enumerate("kv"):
            part = rows[:, i].reshape(kv_heads * d, *w.shape[1:])
            yield name.replace(".key_value.", f".{shard}_proj."), part
