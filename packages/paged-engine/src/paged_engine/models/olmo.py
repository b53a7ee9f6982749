"""OLMo (`OlmoForCausalLM`: OLMo-1B-hf, OLMo-7B-hf, OLMo-7B-0424 / 0724-hf, OLMo-1.7).

Llama's decoder (grouped-query attention, NeoX RoPE, gated SiLU MLP) with LayerNorms that have
neither weight nor bias (eps 1e-5, the final norm too) in place of the RMSNorms, and, when
`clip_qkv` is set (OLMo-1.7 / 0424 / 0724: 8), q / k / v clamped to [-clip_qkv, clip_qkv] before
RoPE. Biases on q / k / v / o when `attention_bias`. OLMo 2 and 3 are models/olmo2.py and
models/olmo3.py.
"""

from __future__ import annotations

from paged_engine.layers.norm import LayerNorm
from paged_engine.layers.rotary import RotaryEmbedding
from paged_engine.models.dbrx import ClipQKVAttention
from paged_engine.models.llama import LlamaDecoderLayer, LlamaForCausalLM, LlamaModel
from paged_engine.models.utils import CausalLMBase

_EPS = 1e-5  # fixed in OLMo's parameter-free LayerNorm


def _plain_norm(d: int) -> LayerNorm:
    return LayerNorm(d, eps=_EPS, elementwise_affine=False)


class OlmoAttention(ClipQKVAttention):
    def __init__(self, config, layer_idx: int, flags: dict, rope: RotaryEmbedding) -> None:
        super().__init__(config, layer_idx, flags, rope, getattr(config, "clip_qkv", None))


class OlmoForCausalLM(LlamaForCausalLM):
    def __init__(self, config):
        flags = self.layer_flags(config)  # mlp_bias, which HF's never reads: config_ignored.py
        d = config.hidden_size

        def build(i: int, rope: RotaryEmbedding) -> LlamaDecoderLayer:
            layer = LlamaDecoderLayer(config, i, flags, rope, attention_cls=OlmoAttention)
            layer.input_layernorm = _plain_norm(d)
            layer.post_attention_layernorm = _plain_norm(d)
            return layer

        inner = LlamaModel(config, flags, build)
        inner.norm = _plain_norm(d)
        CausalLMBase.__init__(self, config, inner)
