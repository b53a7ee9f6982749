"""Mistral: the Llama architecture with a sliding attention window (config.sliding_window)."""

from __future__ import annotations

from paged_engine.models.llama import LlamaForCausalLM


class MistralForCausalLM(LlamaForCausalLM):
    """Same weights and layers as Llama; `layer_sliding_window` reads config.sliding_window."""
