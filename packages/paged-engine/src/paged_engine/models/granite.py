"""IBM Granite 3.x dense models (`GraniteForCausalLM`): the Llama decoder with four scalars.

embedding_multiplier   the token embedding is multiplied by it (first pipeline stage)
residual_multiplier    each attention / MLP output is multiplied by it before the residual add
attention_multiplier   the attention scale itself (in place of head_dim^-0.5)
logits_scaling         the logits are divided by it

GraniteSWA (`GraniteSWAForCausalLM`) adds, per layer: learnable per-head attention sinks (a
softmax over the keys and one sink logit, gpt-oss's), the `sliding_window` on the layers
`layer_types` calls "sliding_attention", and a RoPE base from `layer_rope_theta` (0: no
positional encoding on that layer). GraniteMoeSWA (models/granitemoe_swa.py) puts
GraniteMoeShared's MLP in these layers through the `build_layer` hook.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from paged_engine.layers.rotary import RotaryEmbedding, get_rope, rope_config
from paged_engine.models.gpt_oss import SinkAttention
from paged_engine.models.llama import (
    LlamaAttention,
    LlamaDecoderLayer,
    LlamaForCausalLM,
    LlamaModel,
    llama_head_dim,
)
from paged_engine.models.utils import CausalLMBase, cfg_get


def granite_multiplier(config, name: str, default: float = 1.0) -> float:
    """One of the four scalars (`default` when the config omits it); ValueError naming a bad
    one."""
    value = cfg_get(config, name, default)
    if isinstance(value, bool) or not isinstance(value, int | float) or value <= 0:
        raise ValueError(f"config.{name} must be a positive number, got {value!r}")
    return float(value)


class GraniteDecoderLayer(LlamaDecoderLayer):
    def __init__(
        self,
        config,
        layer_idx: int,
        flags: dict[str, bool],
        rope: RotaryEmbedding | None,
        attention_cls: type[LlamaAttention] = LlamaAttention,
    ):
        super().__init__(config, layer_idx, flags, rope, attention_cls)
        self.self_attn.attn.scale = granite_multiplier(config, "attention_multiplier")
        self.residual_multiplier = granite_multiplier(config, "residual_multiplier")

    def forward(self, positions, x, kv_cache, md) -> torch.Tensor:  # x: [T, D]
        m = self.residual_multiplier
        x = x + self.self_attn(positions, self.input_layernorm(x), kv_cache, md) * m
        return x + self.mlp(self.post_attention_layernorm(x)) * m


class GraniteForCausalLM(LlamaForCausalLM):
    def __init__(self, config):
        cls = type(self)
        flags = cls.layer_flags(config)
        inner = LlamaModel(
            config,
            flags,
            cls.layer_builder(config, flags),
            embedding_multiplier=granite_multiplier(config, "embedding_multiplier"),
        )
        CausalLMBase.__init__(self, config, inner)
        self.logits_scaling = granite_multiplier(config, "logits_scaling")

    @classmethod
    def layer_builder(cls, config, flags: dict[str, bool]) -> Callable[..., nn.Module]:
        """(layer index, the model's rope) -> that decoder layer."""
        return lambda i, rope: cls.build_layer(config, i, flags, rope)

    @classmethod
    def build_layer(
        cls, config, layer_idx: int, flags: dict[str, bool], rope: RotaryEmbedding | None
    ) -> nn.Module:
        """Decoder layer `layer_idx` (the MoE variants swap the MLP; `rope` None: NoPE)."""
        return GraniteDecoderLayer(config, layer_idx, flags, rope)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [N, D] -> [N, V] fp32
        return super().compute_logits(hidden) / self.logits_scaling


class GraniteSWAForCausalLM(GraniteForCausalLM):
    @classmethod
    def layer_flags(cls, config) -> dict[str, bool]:
        return {**super().layer_flags(config), "sliding": True}  # windows by layer_types

    @classmethod
    def layer_builder(cls, config, flags: dict[str, bool]) -> Callable[..., nn.Module]:
        base, _, _ = rope_config(config)
        thetas = getattr(config, "layer_rope_theta", None) or [base] * config.num_hidden_layers
        if len(thetas) != config.num_hidden_layers:
            raise ValueError(f"config.layer_rope_theta needs a base a layer, got {thetas}")
        ropes: dict[float, RotaryEmbedding] = {}  # one per base, shared by its layers
        d = llama_head_dim(config)

        def build(i: int, rope: RotaryEmbedding) -> nn.Module:
            theta = float(thetas[i])
            if theta and theta not in ropes:
                ropes[theta] = rope if theta == float(base) else get_rope(config, d, base=theta)
            own = ropes.get(theta) if theta else None  # 0: NoPE
            return cls.build_layer(config, i, flags, own)

        return build

    @classmethod
    def build_layer(
        cls, config, layer_idx: int, flags: dict[str, bool], rope: RotaryEmbedding | None
    ) -> nn.Module:
        """Granite's layer with sink attention (GraniteMoeSWA swaps the MLP)."""
        return GraniteDecoderLayer(config, layer_idx, flags, rope, SinkAttention)
