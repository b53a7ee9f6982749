"""Mistral: the Llama architecture with a sliding attention window (config.sliding_window)."""

from __future__ import annotations

from paged_engine.models.llama import LlamaForCausalLM


class MistralForCausalLM(LlamaForCausalLM):
    """Llama's weights and layers, plus config.sliding_window (`layer_sliding_window`), which
    Llama ignores as HF's does. No biases: config_ignored.py sets attention_bias / mlp_bias,
    which HF's Mistral and Ministral never read."""

    @classmethod
    def layer_flags(cls, config) -> dict[str, bool]:
        return {**super().layer_flags(config), "sliding": True}
