"""Cohere Compass (`CohereCompassForCausalLM`, model_type "cohere_compass_text": the language
model of North-Micro-Vision; its vision wrapper `CohereCompassForConditionalGeneration` loads
through models/text_wrappers.py, its images through multimodal/qwen2_vl.py, Qwen3-VL's tower).

Command R7B's decoder (models/cohere.py `Cohere2ForCausalLM`: one LayerNorm without bias read
by attention and MLP in parallel, x = x + attn(h) + mlp(h); logits times `logit_scale`) with
the rope of Qwen3-VL's text model, as transformers runs it:

    rope       one per config.layer_types type, from rope_parameters[type] (its rope_theta and
               scaling); a type whose entry is None is NoPE. NeoX halves (`rotate_half`), not
               Cohere's interleaved pairs. The entry's M-RoPE sections (always interleaved T / H /
               W as Qwen3-VL's, [24, 20, 20] by default) see one position on all three axes
               for text, where they are the plain rope; the wrapper's images
               (multimodal/qwen2_vl.py) give them 3-D positions
    window     "sliding_attention" layers see the last `sliding_window` keys (all of them when
               the config sets none); unlike Cohere 2, a global layer rotates when its type
               has rope parameters, and a sliding one need not
    logits     lm_head(h) * logit_scale, 1 when the config leaves it None

Refused by name: a layer_types entry other than full / sliding attention, and rope_parameters
not given per layer type (transformers' rotary embedding indexes it by type and fails).
"""

from __future__ import annotations

from types import SimpleNamespace

from torch import nn

from paged_engine.layers.rotary import RotaryEmbedding, get_rope
from paged_engine.models.cohere import Cohere2ForCausalLM, CohereDecoderLayer
from paged_engine.models.gemma2 import gemma_layer_types
from paged_engine.models.laguna import LayerTypeRopeModel
from paged_engine.models.llama import llama_head_dim
from paged_engine.models.utils import CausalLMBase

_DEFAULT_SECTION = (24, 20, 20)  # transformers' when a layer type's entry names none


def compass_ropes(config) -> dict[str, dict | None]:
    """rope_parameters' entry for each layer type (None: that type is NoPE)."""
    types = gemma_layer_types(config, every=1)
    params = getattr(config, "rope_parameters", None) or {}
    missing = [t for t in dict.fromkeys(types) if t not in params]
    if missing:
        raise ValueError(
            f"Cohere Compass: config.rope_parameters has no entry for layer types {missing} "
            "(it must hold one dict, or None for NoPE, per layer type)"
        )
    return {t: params[t] for t in dict.fromkeys(types)}


def mrope_view(config, params: dict) -> SimpleNamespace:
    """What `get_rope` reads of one layer type's rope, as transformers reads it: always
    interleaved M-RoPE, of `mrope_section` (default [24, 20, 20], any sum)."""
    section = params.get("mrope_section") or list(_DEFAULT_SECTION)
    return SimpleNamespace(
        rope_parameters={**params, "mrope_section": section, "mrope_interleaved": True},
        max_position_embeddings=config.max_position_embeddings,
    )


class CohereCompassForCausalLM(Cohere2ForCausalLM):
    def __init__(self, config) -> None:
        flags = self.layer_flags(config)
        types = gemma_layer_types(config, every=1)
        ropes = compass_ropes(config)
        window = getattr(config, "sliding_window", None)
        head_dim = llama_head_dim(config)
        cls = type(self)

        def build_rope(layer_type: str) -> RotaryEmbedding:
            params = ropes[layer_type]
            if params is None:  # a NoPE type still gets a table (one a type), never read
                return RotaryEmbedding(head_dim, head_dim, 1, 10000.0)
            return get_rope(mrope_view(config, params), head_dim, is_neox_style=True)

        def build(i: int, rope: RotaryEmbedding) -> nn.Module:
            kind = types[i]
            sliding = kind == "sliding_attention" and window is not None
            layer_rope = rope if ropes[kind] is not None else None
            mlp, norm = cls.build_mlp(config, i), cls.build_norm(config)
            return CohereDecoderLayer(
                config, i, flags, layer_rope, int(window) if sliding else None, mlp, norm
            )

        inner = LayerTypeRopeModel(config, build, build_rope)
        inner.norm = cls.build_norm(config)  # Cohere's LayerNorm in place of the RMSNorm
        CausalLMBase.__init__(self, config, inner)
        scale = getattr(config, "logit_scale", None)
        self.logit_scale = 1.0 if scale is None else float(scale)
