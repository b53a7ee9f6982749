"""Baidu ERNIE 4.5 dense models (`Ernie4_5ForCausalLM`: ERNIE-4.5-0.3B): the Llama decoder with
two differences.

    rope    interleaved: each head rotates its (even, odd) dimension pairs (GPT-J / GLM style),
            not NeoX's halves; in float32 like HF's
    biases  one flag, `use_bias`, puts a bias on q / k / v / o and on the MLP's gate / up / down

Everything else is Llama's: pre-norm RMSNorm, GQA with an explicit `head_dim` (128 by default),
gated SiLU MLP, tied embeddings by default.
"""

from __future__ import annotations

from paged_engine.models.llama import LlamaForCausalLM, LlamaModel
from paged_engine.models.utils import CausalLMBase


def ernie_layer_flags(config) -> dict[str, bool]:
    """Llama's layer flags for ERNIE 4.5: `use_bias` on every attention and MLP projection."""
    bias = bool(getattr(config, "use_bias", False))
    return {"qkv_bias": bias, "o_bias": bias, "qk_norm": False, "mlp_bias": bias, "sliding": False}


class Ernie4_5ForCausalLM(LlamaForCausalLM):
    tie_default = True  # HF's Ernie4_5Config ties the embeddings unless told otherwise

    def __init__(self, config):
        inner = LlamaModel(config, self.layer_flags(config), is_neox_style=False)
        CausalLMBase.__init__(self, config, inner)

    @classmethod
    def layer_flags(cls, config) -> dict[str, bool]:
        return ernie_layer_flags(config)
