"""IBM Granite "swash" MoE (`GraniteMoeSWAForCausalLM`, model_type "granitemoe_swa": e.g.
granite-swash-3b-a600m): GraniteMoeShared's MLP (models/granitemoeshared.py) under GraniteSWA's
attention (models/granite.py), as transformers runs them.

    attention  learnable per-head sinks (HF rescales the output by sigmoid(lse - sink), the same
               as one extra logit in the softmax's denominator: our SinkAttention), the
               `sliding_window` on the layers `layer_types` calls "sliding_attention" (by default
               all but every fourth), a RoPE base per layer from `layer_rope_theta` (0: NoPE)
    mlp        every layer sparse: top-k of the router's logits softmaxed over those k, experts of
               `intermediate_size`, plus the ungated-sum shared MLP when
               `shared_intermediate_size` > 0 (0, the default, means none)
    scalars    Granite's four: embedding / residual / attention multipliers and the logits
               divided by `logits_scaling`

Checkpoint names are GraniteMoeShared's (`block_sparse_moe.*`, `shared_mlp.*`) plus each
layer's `self_attn.sinks`; tensor parallelism splits the sinks with their heads.
"""

from __future__ import annotations

from torch import nn

from paged_engine.layers.rotary import RotaryEmbedding
from paged_engine.models.gpt_oss import SinkAttention
from paged_engine.models.granite import (
    GraniteDecoderLayer,
    GraniteSWAForCausalLM,
    granite_multiplier,
)
from paged_engine.models.granitemoeshared import GraniteMoeSharedForCausalLM
from paged_engine.models.mixtral import MoeDecoderLayer


class GraniteMoeSWADecoderLayer(MoeDecoderLayer):
    """GraniteMoe's layer (attention scale, residual multiplier) with sink attention."""

    def __init__(
        self,
        config,
        layer_idx: int,
        flags: dict[str, bool],
        rope: RotaryEmbedding | None,
        mlp: nn.Module,
    ) -> None:
        attention = SinkAttention(config, layer_idx, flags, rope)
        attention.attn.scale = granite_multiplier(config, "attention_multiplier")
        super().__init__(config, layer_idx, flags, rope, mlp, attention)
        self.residual_multiplier = granite_multiplier(config, "residual_multiplier")

    forward = GraniteDecoderLayer.forward  # x += m * attn(...); x += m * mlp(...)


class GraniteMoeSWAForCausalLM(GraniteSWAForCausalLM, GraniteMoeSharedForCausalLM):
    """GraniteSWA's windows and per-layer ropes (layer_flags, layer_builder) over
    GraniteMoeShared's MLP, names and silu check (build_mlp, rename / convert_weight,
    __init__)."""

    @classmethod
    def build_layer(
        cls, config, layer_idx: int, flags: dict[str, bool], rope: RotaryEmbedding | None
    ) -> nn.Module:
        return GraniteMoeSWADecoderLayer(config, layer_idx, flags, rope, cls.build_mlp(config))
