"""OpenBMB MiniCPM3 (`MiniCPM3ForCausalLM`, model_type "minicpm3": MiniCPM3-4B).

DeepSeek-V2's multi-head latent attention (models/deepseek_v2.py: the latent KV cache, the
absorbed queries) with dense SiLU MLPs in every layer, and MiniCPM's three scalars as
transformers applies them: the token embedding times `scale_emb`, each attention and MLP
output times `scale_depth / sqrt(num_hidden_layers)` before its residual add, the final hidden
state divided by `hidden_size / dim_model_base` before the (tied) LM head. RoPE rotates NeoX
halves of the qk_rope_head_dim rotary part (MiniCPM3-4B: longrope). Checkpoints use
DeepSeek-V2's names.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from paged_engine.layers.rotary import RotaryEmbedding, get_rope
from paged_engine.models.deepseek_v2 import (
    DeepseekDecoderLayer,
    DeepseekModel,
    DeepseekV2ForCausalLM,
)
from paged_engine.models.llama import LlamaMLP
from paged_engine.models.mixtral import check_silu
from paged_engine.models.utils import CausalLMBase, cfg_get


def _scalar(config, name: str, default: float) -> float:
    value = cfg_get(config, name, None)
    value = default if value is None else value
    if isinstance(value, bool) or not isinstance(value, int | float) or value <= 0:
        raise ValueError(f"config.{name} must be a positive number, got {value!r}")
    return float(value)


def minicpm_scalars(config, scale_depth: float | None = None) -> dict[str, float]:
    """MiniCPM's scalars under Granite's names: the embedding times `scale_emb`, each residual
    add times scale_depth / sqrt(num_hidden_layers) (`scale_depth` the default when the config
    has none; None: sqrt(num_hidden_layers), a residual scale of 1), the last hidden state
    divided by hidden_size / dim_model_base."""
    root = math.sqrt(config.num_hidden_layers)
    depth = _scalar(config, "scale_depth", root if scale_depth is None else scale_depth)
    return {
        "embedding_multiplier": _scalar(config, "scale_emb", 1.0),
        "residual_multiplier": depth / root,
        "logits_scaling": config.hidden_size
        / _scalar(config, "dim_model_base", config.hidden_size),
    }


class MiniCPM3DecoderLayer(DeepseekDecoderLayer):
    def __init__(self, config, layer_idx, rope, mlp, attention_cls) -> None:
        super().__init__(config, layer_idx, rope, mlp, attention_cls)
        self.residual_scale = minicpm_scalars(config)["residual_multiplier"]

    def forward(self, positions, x, kv_cache, md) -> torch.Tensor:  # x: [T, D]
        m = self.residual_scale
        x = x + self.self_attn(positions, self.input_layernorm(x), kv_cache, md) * m
        return x + self.mlp(self.post_attention_layernorm(x)) * m


class MiniCPM3ForCausalLM(DeepseekV2ForCausalLM):
    def __init__(self, config) -> None:
        check_silu(config, type(self).__name__)
        cls = type(self)
        scalars = minicpm_scalars(config)
        inner = DeepseekModel(
            config,
            cls.build_mlp,
            cls.attention_cls,
            cls.build_rope(config),
            layer_cls=MiniCPM3DecoderLayer,
            embedding_multiplier=scalars["embedding_multiplier"],
        )
        CausalLMBase.__init__(self, config, inner)
        self.stacked_params = type(self).stacked_params  # no experts
        self.logits_scaling = scalars["logits_scaling"]

    @classmethod
    def build_rope(cls, config) -> RotaryEmbedding:
        return get_rope(config, config.qk_rope_head_dim, is_neox_style=True)

    @classmethod
    def build_mlp(cls, config, layer_idx: int) -> nn.Module:
        return LlamaMLP(config, bias=bool(getattr(config, "mlp_bias", False)))

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [N, D] -> [N, V] fp32
        return super().compute_logits(hidden / self.logits_scaling)
