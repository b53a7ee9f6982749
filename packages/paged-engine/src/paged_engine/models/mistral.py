"""Mistral: the Llama architecture with a sliding attention window (config.sliding_window)."""

from __future__ import annotations

from paged_engine.models.llama import LlamaForCausalLM


class MistralForCausalLM(LlamaForCausalLM):
    """Llama's weights and layers, plus config.sliding_window (`layer_sliding_window`), which
    Llama ignores as HF's does. No biases whatever attention_bias / mlp_bias say (HF's
    Mistral and Ministral read neither)."""

    @classmethod
    def layer_flags(cls, config) -> dict[str, bool]:
        no_bias = {"qkv_bias": False, "o_bias": False, "mlp_bias": False}
        return {**super().layer_flags(config), **no_bias, "sliding": True}
