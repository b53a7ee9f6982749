"""OLMo 3 (`Olmo3ForCausalLM`: Olmo-3-7B / 32B, base, Instruct and Think).

OLMo 2's decoder (models/olmo2.py: norms after the sublayers, whole-projection q / k RMSNorms
before RoPE, float32 norm products), with two kinds of attention layer from config.layer_types:
`sliding_attention` layers see only the last config.sliding_window keys (themselves included),
`full_attention` layers the whole context. Without layer_types every fourth layer is full, the
others slide (HF's default); sliding layers without a sliding_window (which transformers 5 cannot
run) are refused by name.

Each kind has its own rope. transformers >= 5 keeps them in config.rope_parameters, one dict
per layer type: the rope scaling (YaRN in the long-context checkpoints) is the full layers'
only, the sliding layers rotate unscaled. Both are read as HF stores them (when a config names
rope_theta outside rope_parameters, transformers 5 gives it to the full layers and its default
500000 to the sliding ones; the released checkpoints use 500000 anyway). Configs of older
transformers carry one rope_theta and rope_scaling: the full layers take both, the sliding
layers rope_theta alone (what those versions ran).

Under tensor parallelism everything is OLMo 2's: the window and the rope are per layer, not per
rank.
"""

from __future__ import annotations

from paged_engine.layers.rotary import RotaryEmbedding, get_rope, plain_rope, rope_config
from paged_engine.models.gemma2 import check_sliding_has_window, gemma_layer_types
from paged_engine.models.llama import llama_head_dim
from paged_engine.models.olmo2 import Olmo2DecoderLayer, Olmo2ForCausalLM, Olmo2Model
from paged_engine.models.utils import CausalLMBase, cfg_get

_LAYER_TYPES = ("full_attention", "sliding_attention")


def olmo3_ropes(config, head_dim: int, types: list[str]) -> dict[str, RotaryEmbedding]:
    """One rope per layer type in `types` (each instance shared by that type's layers)."""
    params = getattr(config, "rope_parameters", None) or {}
    if any(isinstance(params.get(t), dict) for t in _LAYER_TYPES):  # transformers >= 5
        return {t: get_rope(config, head_dim, is_neox_style=True, layer_type=t) for t in set(types)}
    ropes: dict[str, RotaryEmbedding] = {}
    if "full_attention" in types:
        ropes["full_attention"] = get_rope(config, head_dim, is_neox_style=True)
    if "sliding_attention" in types:  # the same base, never scaled
        theta, _, partial = rope_config(config)
        ropes["sliding_attention"] = plain_rope(
            head_dim=head_dim,
            rotary_dim=int(head_dim * partial),
            max_position=int(config.max_position_embeddings),
            base=theta,
            is_neox_style=True,
        )
    return ropes


class Olmo3DecoderLayer(Olmo2DecoderLayer):
    """OLMo 2's layer; `sliding_window` None attends to the whole context."""

    def __init__(self, config, rope: RotaryEmbedding, sliding_window: int | None) -> None:
        super().__init__(config, rope)
        self.self_attn.attn.sliding_window = sliding_window  # read at every attention call


def olmo3_model(config) -> Olmo2Model:
    """OLMo 2's stack of Olmo3DecoderLayers: each layer type its window and rope."""
    types = gemma_layer_types(config, every=4)
    check_sliding_has_window(config, types, "OLMo 3")
    window = cfg_get(config, "sliding_window", None)
    window = int(window) if window else None
    ropes = olmo3_ropes(config, llama_head_dim(config), types)  # each shared by its type's layers

    def build(i: int) -> Olmo3DecoderLayer:
        sliding = window if types[i] == "sliding_attention" else None
        return Olmo3DecoderLayer(config, ropes[types[i]], sliding)

    return Olmo2Model(config, build)


class Olmo3ForCausalLM(Olmo2ForCausalLM):
    def __init__(self, config) -> None:
        CausalLMBase.__init__(self, config, olmo3_model(config))
