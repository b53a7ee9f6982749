"""Checkpoints that are Llama's decoder under other names or with one switch, as vLLM serves
them (its registry maps the same architectures to its Llama):

    ExaoneForCausalLM      LG EXAONE 3.0 / 3.5: Llama under GPT-2-style names (transformer.h.N
                           .attn.attention.*, ln_1 / ln_2, mlp.c_fc_0 / c_fc_1 / c_proj),
                           renamed at load as transformers does for model_type "exaone"
    InternLMForCausalLM    InternLM (v1): q / k / v / o biases from the config's `bias`
    CwmForCausalLM         Meta CWM: no biases, the `sliding_window` on the layers
                           `layer_types` calls "sliding_attention" (HF's CwmForCausalLM)
    MiMoForCausalLM        Xiaomi MiMo: Qwen2's decoder; its multi-token-prediction layers
                           (`model.mtp_layers.*`) are skipped
    LLaMAForCausalLM, AquilaForCausalLM / AquilaModel, XverseForCausalLM: Llama itself
                           (models/__init__.py maps the names)
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from paged_engine.models.llama import LlamaForCausalLM
from paged_engine.models.qwen2 import Qwen2ForCausalLM


class ExaoneForCausalLM(LlamaForCausalLM):
    renames = (
        ("transformer.wte.", "model.embed_tokens."),
        ("transformer.h.", "model.layers."),
        ("transformer.ln_f.", "model.norm."),
        (".attn.attention.out_proj.", ".self_attn.o_proj."),
        (".attn.attention.", ".self_attn."),
        (".ln_1.", ".input_layernorm."),
        (".ln_2.", ".post_attention_layernorm."),
        (".mlp.c_fc_0.", ".mlp.gate_proj."),
        (".mlp.c_fc_1.", ".mlp.up_proj."),
        (".mlp.c_proj.", ".mlp.down_proj."),
    )


class InternLMForCausalLM(LlamaForCausalLM):
    @classmethod
    def layer_flags(cls, config) -> dict[str, bool]:
        flags = super().layer_flags(config)
        bias = bool(getattr(config, "bias", False)) or flags["qkv_bias"]
        return {**flags, "qkv_bias": bias, "o_bias": bias}


class CwmForCausalLM(LlamaForCausalLM):
    @classmethod
    def layer_flags(cls, config) -> dict[str, bool]:
        return {**super().layer_flags(config), "sliding": True}


class MiMoForCausalLM(Qwen2ForCausalLM):
    def convert_weight(self, name: str, w: torch.Tensor) -> Iterable[tuple[str, torch.Tensor]]:
        if name.startswith("model.mtp_layers."):
            return ()
        return super().convert_weight(name, w)
