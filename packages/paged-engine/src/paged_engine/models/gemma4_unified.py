"""Gemma 4 Unified text models (`Gemma4UnifiedForCausalLM`, and the language model of
`Gemma4UnifiedForConditionalGeneration`, the encoder-free multimodal model, served text-only).

The decoder is Gemma 4's dense one (models/gemma4.py), which we reuse whole: transformers builds
its layer from Gemma 2's four-norm layer with Gemma 4's attention and MLP and the layer's
`layer_scalar`, i.e. exactly our `Gemma4Layer` without its optional parts. Each piece as
transformers runs it:

    norms      RMSNorm scaling by `weight` in float32 (Gemma 3n's); values get a weightless
               norm; q / k norms before RoPE; attention scale 1
    geometry   full layers take `global_head_dim` and (with `attention_k_eq_v`)
               `num_global_key_value_heads` from `per_layer_config`; k_eq_v full layers' values
               are their key projection
    rope       per layer type: sliding layers the default rope (theta 10k by default), full
               layers "proportional" rope on `partial_rotary_factor` of the head
    KV sharing the last `num_kv_shared_layers` layers read the KV of the last earlier
               non-shared layer of their type and, with `use_double_wide_mlp`, have an MLP
               twice as wide
    scalar     each layer's output times its `layer_scalar` (a saved buffer)
    head       embedding x sqrt(hidden), tied lm_head, `final_logit_softcapping`

What Gemma 4 has and this architecture does not: per-layer inputs (PLE) and the MoE block;
transformers' config deletes those fields. A config that sets them anyway is refused by name
(`hidden_size_per_layer_input`, `enable_moe_block`) rather than served as something the
reference never runs. Also refused, as for Gemma 4: `use_bidirectional_attention="all"`,
pipeline parallelism with KV-shared layers, an fp8 KV cache with KV-shared layers.

Images (multimodal/gemma4_unified.py): transformers builds the wrapper's masks with
`create_masks_for_generate` and the image blocks, so, unlike Gemma 4, an image's soft tokens see
each other both ways on the full layers too (`md.key_ends` on every layer: `Gemma4UnifiedModel`);
on the sliding layers its block is OR-ed after the window, which the engine's key ends (the
window's lower bound kept) give only for a run within the window: a longer run is refused by
name (text_config.sliding_window, multimodal/gemma4_unified.py `image_tokens`).

Text-only serving of the wrapper is exact: with no image / video / audio ids, its default
`use_bidirectional_attention="vision"` mask is the causal (and sliding) mask, the embedding is
the text model's, and its logits are lm_head soft-capped as the text model's.
"""

from __future__ import annotations

import torch

from paged_engine.models.gemma4 import Gemma4ForCausalLM, Gemma4Model
from paged_engine.models.utils import cfg_get

# Gemma 4 fields this architecture's config removes (its transformers config raises on them)
_ABSENT_FIELDS = ("hidden_size_per_layer_input", "enable_moe_block")


class Gemma4UnifiedModel(Gemma4Model):
    """Gemma 4's decoder without per-layer inputs, images' two-way rows on every layer."""

    def forward(self, input_ids, positions, kv_caches, md, hidden=None) -> torch.Tensor:
        x = self.embed_input_ids(input_ids) if hidden is None else hidden
        start = self.stage.start
        for i in range(start, self.stage.end):
            x = self.layers[i](positions, x, kv_caches[self.sources[i] - start], md, None)
        return self.norm(x) if self.stage.is_last else x


class Gemma4UnifiedForCausalLM(Gemma4ForCausalLM):
    """Gemma 4's dense decoder, no per-layer inputs, no MoE block."""

    model_cls = Gemma4UnifiedModel

    def __init__(self, config) -> None:
        for field in _ABSENT_FIELDS:
            if cfg_get(config, field, None):
                raise ValueError(
                    f"Gemma4UnifiedForCausalLM: {field}={cfg_get(config, field, None)!r} is "
                    "not part of this architecture (transformers' Gemma 4 Unified never reads it)"
                )
        super().__init__(config)
