"""Gemma 1 (gemma-2b / 7b, CodeGemma): Gemma 2's decoder (models/gemma2.py) without its extras;
VaultGemma: Gemma 2 with Gemma 1's two norms a layer.

Two norms a layer (Llama's pre-norm layer with GemmaRMSNorm), attention scaled by head_dim^-0.5,
every layer global, no soft-caps; the embedding scaled by sqrt(hidden_size) and the GeGLU MLP as
Gemma 2's (transformers 5 maps the legacy hidden_act="gelu" of the original configs to the tanh
approximation when it reads the config). transformers 5 never reads `hidden_activation`, which
vLLM (and transformers 4.4x) read first: a config where the two name different activations is
refused by name.
"""

from __future__ import annotations

from paged_engine.models.gemma2 import Gemma2ForCausalLM
from paged_engine.models.utils import cfg_get


def check_gemma_activation(config) -> None:
    act = cfg_get(config, "hidden_act", "gelu_pytorch_tanh")
    act = "gelu_pytorch_tanh" if act == "gelu" else act  # the legacy name of the tanh GELU
    second = cfg_get(config, "hidden_activation", None)
    if second and second != act:
        raise ValueError(
            f"Gemma with hidden_activation={second!r} beside hidden_act={act!r} is not "
            "supported (transformers 5 runs hidden_act, vLLM hidden_activation)"
        )


class GemmaForCausalLM(Gemma2ForCausalLM):
    post_norms = False

    def __init__(self, config):
        check_gemma_activation(config)
        super().__init__(config)
        self.final_soft_cap = None  # Gemma 1 has none, whatever the config carries

    @classmethod
    def layer_types(cls, config) -> list[str]:
        return ["full_attention"] * config.num_hidden_layers

    @classmethod
    def attn_soft_cap(cls, config) -> float | None:
        return None


class VaultGemmaForCausalLM(Gemma2ForCausalLM):
    """VaultGemma (google/vaultgemma-1b): Gemma 2's attention, layer types and soft-caps on two
    norms a layer; its norm before the MLP is HF's `pre_feedforward_layernorm`."""

    post_norms = False

    def rename_weight(self, name: str) -> str:
        return name.replace(".pre_feedforward_layernorm.", ".post_attention_layernorm.")
