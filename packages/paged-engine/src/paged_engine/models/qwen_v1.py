"""Qwen (v1: Qwen-1.8B / 7B / 14B / 72B, `QWenLMHeadModel`, remote code): the Llama decoder
with q / k / v biases (HF's Qwen2 with as many KV heads as heads) under GPT-2-style names, as
vLLM's qwen.py serves it.

    transformer.wte                     -> model.embed_tokens
    transformer.h.N.ln_1 / ln_2         -> input_layernorm / post_attention_layernorm (RMSNorm)
    .attn.c_attn  [q | k | v] rows      -> q_proj / k_proj / v_proj (weight and bias)
    .attn.c_proj                        -> o_proj (bias only without `no_bias`)
    .mlp.w2 / .mlp.w1 / .mlp.c_proj     -> gate_proj / up_proj / down_proj: Qwen's MLP is
                                           c_proj(w1(x) * silu(w2(x))), so w2 is the gate
    transformer.ln_f                    -> model.norm

Config (qwen_v1_config): kv_channels is head_dim, layer_norm_epsilon the RMSNorm eps,
rotary_emb_base / rotary_pct the rope's base and rotary share, and intermediate_size counts w1
and w2 together (each is half of it).

Context: the smaller of max_position_embeddings and seq_length, as vLLM derives max_model_len
(the smallest of its length keys present, seq_length among them), whatever the flags say:
Qwen-14B's 8192 / 2048 gives 2048 in both; Qwen-1.8B / 7B / 72B set both equal. A longer
max_model_len is refused by the engine's length check (vLLM refuses it too unless
VLLM_ALLOW_LONG_MAX_MODEL_LEN is set). use_logn_attn (queries scaled by
log_seq_length(position + 1)) and use_dynamic_ntk (a rope base that grows with the whole
sequence's length) act only past seq_length, so within the context the model is exactly the
plain one; vLLM's qwen.py runs neither (plain rope, no logn scale), which past seq_length would
differ from the remote code: that range is not served here.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from transformers import PretrainedConfig

from paged_engine.models.llama import LlamaForCausalLM, llama_head_dim
from paged_engine.models.remote_aliases import common_fields, field


def qwen_v1_config(raw: dict[str, Any]) -> PretrainedConfig:
    """Qwen's config.json under the names models/llama.py reads."""
    hidden = field(raw, "hidden_size", int)
    heads = field(raw, "num_attention_heads", int)
    inter = field(raw, "intermediate_size", int)
    if inter % 2:
        raise ValueError(
            f"config.json field 'intermediate_size' counts w1 and w2 together and must be "
            f"even, got {inter}"
        )
    # vLLM's max_model_len: the smallest length key present (2048 when there is none)
    present = [k for k in ("max_position_embeddings", "seq_length") if raw.get(k) is not None]
    context = min((field(raw, k, int) for k in present), default=2048)
    if field(raw, "hidden_act", str, "silu") != "silu":
        raise ValueError(f"config.json field 'hidden_act' must be silu, got {raw['hidden_act']!r}")
    fields = {
        **common_fields(raw),
        "model_type": "qwen",
        "vocab_size": field(raw, "vocab_size", int),
        "hidden_size": hidden,
        "num_attention_heads": heads,
        "num_key_value_heads": heads,
        "head_dim": field(raw, "kv_channels", int, hidden // heads),
        "num_hidden_layers": field(raw, "num_hidden_layers", int),
        "intermediate_size": inter // 2,
        "rms_norm_eps": field(raw, "layer_norm_epsilon", float, 1e-6),
        "rope_theta": field(raw, "rotary_emb_base", float, 10000.0),
        "partial_rotary_factor": field(raw, "rotary_pct", float, 1.0),
        "max_position_embeddings": context,
        "hidden_act": "silu",
        "no_bias": field(raw, "no_bias", bool, True),
        "tie_word_embeddings": field(raw, "tie_word_embeddings", bool, False),
    }
    config = PretrainedConfig(**fields)
    config.model_type = "qwen"
    return config


class QWenLMHeadModel(LlamaForCausalLM):
    renames = (
        ("transformer.wte.", "model.embed_tokens."),
        ("transformer.h.", "model.layers."),
        ("transformer.ln_f.", "model.norm."),
        (".attn.c_attn.", ".self_attn.c_attn."),
        (".attn.c_proj.", ".self_attn.o_proj."),
        (".ln_1.", ".input_layernorm."),
        (".ln_2.", ".post_attention_layernorm."),
        (".mlp.w2.", ".mlp.gate_proj."),
        (".mlp.w1.", ".mlp.up_proj."),
        (".mlp.c_proj.", ".mlp.down_proj."),
    )

    @classmethod
    def layer_flags(cls, config) -> dict[str, bool]:
        bias = not bool(getattr(config, "no_bias", True))  # c_proj, w1, w2
        return {**super().layer_flags(config), "qkv_bias": True, "o_bias": bias, "mlp_bias": bias}

    def convert_weight(self, name: str, w: torch.Tensor) -> Iterable[tuple[str, torch.Tensor]]:
        if ".self_attn.c_attn." not in name:
            yield name, w
            return
        size = self.config.num_attention_heads * llama_head_dim(self.config)
        if w.shape[0] != 3 * size:
            raise ValueError(f"{name}: {w.shape[0]} rows, expected 3 x {size}")
        for shard, part in zip("qkv", w.split(size), strict=True):
            yield name.replace(".c_attn.", f".{shard}_proj."), part
