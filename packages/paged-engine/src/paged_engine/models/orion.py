"""Orion (`OrionForCausalLM`, model_type "orion": OrionStarAI Orion-14B Base / Chat / LongChat /
RAG), a remote-code release that vLLM's orion.py serves.

Llama's decoder (grouped-query attention without biases, full NeoX rope, a gated MLP of
`hidden_act` without biases) with LayerNorms (weight and bias) for the two norms of each layer
and the final one, their epsilon the config's `rms_norm_eps`. Llama's tensor names. That is
transformers' StableLmForCausalLM with partial_rotary_factor 1, no q / k / v biases, sequential
residuals and no q / k norms: the layers here are StableLM's (models/stablelm.py,
models/starcoder2.py's LayerNorm decoder layer). Tensor parallelism splits heads and MLP rows
as Llama's do.
"""

from __future__ import annotations

from torch import nn

from paged_engine.layers.rotary import RotaryEmbedding, rope_config
from paged_engine.models.llama import LlamaAttention, LlamaForCausalLM, LlamaMLP
from paged_engine.models.starcoder2 import LayerNormDecoderLayer, LayerNormLlamaModel
from paged_engine.models.utils import CausalLMBase, cfg_get


class OrionForCausalLM(LlamaForCausalLM):
    # rope tables some checkpoints carry (ColossalAI's): recomputed here
    ignored_weights = ("rotary_emb.inv_freq", "rotary_emb.cos_cached", "rotary_emb.sin_cached")

    def __init__(self, config):
        partial = rope_config(config)[2]
        if partial != 1.0:  # Orion's code rotates whole heads
            raise ValueError(f"Orion with partial_rotary_factor={partial} is not supported")
        flags = self.layer_flags(config)
        eps = float(cfg_get(config, "rms_norm_eps", 1e-5))  # a LayerNorm's, despite the name

        def build(i: int, rope: RotaryEmbedding) -> nn.Module:
            attn = LlamaAttention(config, i, flags, rope)
            mlp = LlamaMLP(config, bias=False)
            return LayerNormDecoderLayer(config.hidden_size, eps, attn, mlp, parallel=False)

        CausalLMBase.__init__(self, config, LayerNormLlamaModel(config, eps, build))

    @classmethod
    def layer_flags(cls, config) -> dict[str, bool]:
        return {
            "qkv_bias": False,
            "o_bias": False,
            "qk_norm": False,
            "mlp_bias": False,
            "sliding": False,
        }
