"""GLM-4 dense models (`Glm4ForCausalLM`: GLM-4-9B-0414 / 32B-0414, GLM-Z1-9B / 32B), and the
earlier GLM-4 / Helium models without the extra norms (`GlmForCausalLM`, `HeliumForCausalLM`).

Llama's attention and gated SiLU MLP (models/llama.py) with three differences:

    norms    four RMSNorms a layer, one before and one after each sublayer:
                 x += post_self_attn_layernorm(attn(input_layernorm(x)))
                 x += post_mlp_layernorm(mlp(post_attention_layernorm(x)))
             (as in Llama, HF's `post_attention_layernorm` is the norm *before* the MLP)
    rope     GPT-J style (interleaved (even, odd) pairs) over the first
             head_dim * partial_rotary_factor dims of each head (0.5 in every GLM-4 config);
             the other dims pass through unrotated
    biases   q / k / v have biases when `attention_bias` (True by default); o_proj never has one

The checkpoint fuses gate | up into one `mlp.gate_up_proj` [2I, D]: loading splits it into its
halves, so that under tensor parallelism each rank takes its slice of both.

`GlmForCausalLM` (glm-4-9b-chat-hf, glm-edge) is the same model with Llama's two norms a layer;
`HeliumForCausalLM` (Kyutai Helium-1) is that again with full interleaved rope (its
partial_rotary_factor is 1), separate gate / up matrices, no q / k / v biases by default and MLP
biases when `mlp_bias` (GLM's MLPs have none whatever the config says).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from paged_engine.layers.norm import RMSNorm
from paged_engine.layers.rotary import RotaryEmbedding
from paged_engine.models.llama import LlamaDecoderLayer, LlamaForCausalLM, LlamaModel
from paged_engine.models.utils import CausalLMBase, cfg_get, check_heads_span_hidden


class Glm4DecoderLayer(LlamaDecoderLayer):
    def __init__(self, config, layer_idx: int, flags: dict[str, bool], rope: RotaryEmbedding):
        super().__init__(config, layer_idx, flags, rope)
        eps = cfg_get(config, "rms_norm_eps", 1e-6)
        self.post_self_attn_layernorm = RMSNorm(config.hidden_size, eps)
        self.post_mlp_layernorm = RMSNorm(config.hidden_size, eps)

    def forward(self, positions, x, kv_cache, md) -> torch.Tensor:  # x: [T, D]
        attn = self.self_attn(positions, self.input_layernorm(x), kv_cache, md)
        x = x + self.post_self_attn_layernorm(attn)
        mlp = self.mlp(self.post_attention_layernorm(x))
        return x + self.post_mlp_layernorm(mlp)


class Glm4ForCausalLM(LlamaForCausalLM):
    def __init__(self, config):
        flags = self.layer_flags(config)
        inner = LlamaModel(
            config,
            flags,
            lambda i, rope: Glm4DecoderLayer(config, i, flags, rope),
            is_neox_style=False,
        )
        CausalLMBase.__init__(self, config, inner)

    @classmethod
    def layer_flags(cls, config) -> dict[str, bool]:
        # q / k / v follow attention_bias, o_proj never has one; GLM's MLPs have no biases
        # whatever mlp_bias says, Helium's read it (config_ignored.py sets GLM's False)
        return {**super().layer_flags(config), "o_bias": False}

    def convert_weight(self, name: str, w: torch.Tensor) -> Iterable[tuple[str, torch.Tensor]]:
        if ".gate_up_proj." in name:  # rows [gate: I | up: I] -> the stacked gate / up rules
            gate, up = w.chunk(2, dim=0)
            yield name.replace(".gate_up_proj.", ".gate_proj."), gate
            yield name.replace(".gate_up_proj.", ".up_proj."), up
        else:
            yield name, w


class GlmForCausalLM(Glm4ForCausalLM):
    """GLM-4's attention flags and interleaved partial rope on Llama's pre-norm layers."""

    def __init__(self, config):
        if getattr(config, "model_type", None) == "helium":
            check_heads_span_hidden(config, "Helium")  # its o_proj is hidden x hidden
        inner = LlamaModel(config, self.layer_flags(config), is_neox_style=False)
        CausalLMBase.__init__(self, config, inner)
