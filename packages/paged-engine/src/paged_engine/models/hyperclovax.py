"""NAVER HyperCLOVA X (`HyperCLOVAXForCausalLM`, model_type "hyperclovax": HyperCLOVAX-SEED-Think
-14B): Granite's decoder (models/granite.py) with Peri-LN and its logits scaled the other way,
as transformers runs it.

    layers     an RMSNorm on each sublayer's output too (`use_post_norm`, True by default; HF's
               `post_norm1` / `post_norm2`), before Granite's residual multiplier m:
                   x += m * post_norm1(attn(input_layernorm(x)))
                   x += m * post_norm2(mlp(post_attention_layernorm(x)))
               without it, Granite's layer
    logits     multiplied by `logits_scaling` (Granite divides by it)
    attention  scale `attention_multiplier`, head_dim^-0.5 when None (Granite's default is 1);
               an explicit `head_dim` may differ from hidden_size / num_attention_heads

The embedding multiplier, q / k / v / o biases (`attention_bias`) and MLP biases (`mlp_bias`)
are Granite's.
"""

from __future__ import annotations

import torch
from torch import nn

from paged_engine.layers.norm import RMSNorm
from paged_engine.layers.rotary import RotaryEmbedding
from paged_engine.models.granite import GraniteDecoderLayer, GraniteForCausalLM, granite_multiplier
from paged_engine.models.llama import llama_head_dim
from paged_engine.models.utils import CausalLMBase, cfg_get


class HyperCLOVAXDecoderLayer(GraniteDecoderLayer):
    """Granite's layer with an RMSNorm after each sublayer, inside the residual multiplier."""

    def __init__(
        self, config, layer_idx: int, flags: dict[str, bool], rope: RotaryEmbedding | None
    ) -> None:
        super().__init__(config, layer_idx, flags, rope)
        eps = cfg_get(config, "rms_norm_eps", 1e-6)
        self.post_norm1 = RMSNorm(config.hidden_size, eps)
        self.post_norm2 = RMSNorm(config.hidden_size, eps)

    def forward(self, positions, x, kv_cache, md) -> torch.Tensor:  # x: [T, D]
        m = self.residual_multiplier
        h = self.self_attn(positions, self.input_layernorm(x), kv_cache, md)
        x = x + self.post_norm1(h) * m
        return x + self.post_norm2(self.mlp(self.post_attention_layernorm(x))) * m


class HyperCLOVAXForCausalLM(GraniteForCausalLM):
    @classmethod
    def build_layer(
        cls, config, layer_idx: int, flags: dict[str, bool], rope: RotaryEmbedding | None
    ) -> nn.Module:
        peri_ln = bool(cfg_get(config, "use_post_norm", True))
        layer_cls = HyperCLOVAXDecoderLayer if peri_ln else GraniteDecoderLayer
        layer = layer_cls(config, layer_idx, flags, rope)
        default_scale = llama_head_dim(config) ** -0.5
        layer.self_attn.attn.scale = granite_multiplier(
            config, "attention_multiplier", default_scale
        )
        return layer

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [N, D] -> [N, V] fp32
        return CausalLMBase.compute_logits(self, hidden) * self.logits_scaling
