"""SmolLM3 (HuggingFaceTB/SmolLM3-3B, `SmolLM3ForCausalLM`): Llama in which some layers attend
without rotary embeddings (NoPE): `no_rope_layers[i]` is 1 for a layer with rope, 0 without
(transformers fills it with a NoPE layer every `no_rope_layer_interval`, 4 by default). With
`use_sliding_window`, the layers `layer_types` marks sliding attend within `sliding_window`.
"""

from __future__ import annotations

from paged_engine.models.llama import LlamaDecoderLayer, LlamaForCausalLM, LlamaModel
from paged_engine.models.utils import CausalLMBase, cfg_get


def rope_layers(config) -> list[bool]:
    """Whether each layer rotates q and k."""
    flags = getattr(config, "no_rope_layers", None)
    n = config.num_hidden_layers
    if flags is None:
        interval = int(cfg_get(config, "no_rope_layer_interval", 4))
        flags = [int((i + 1) % interval != 0) for i in range(n)]
    if len(flags) != n:
        raise ValueError(f"no_rope_layers has {len(flags)} entries for {n} num_hidden_layers")
    return [bool(f) for f in flags]


class SmolLM3ForCausalLM(LlamaForCausalLM):
    def __init__(self, config) -> None:
        flags = self.layer_flags(config)
        uses_rope = rope_layers(config)
        inner = LlamaModel(
            config,
            flags,
            lambda i, rope: LlamaDecoderLayer(config, i, flags, rope if uses_rope[i] else None),
        )
        CausalLMBase.__init__(self, config, inner)

    @classmethod
    def layer_flags(cls, config) -> dict[str, bool]:
        return {
            **LlamaForCausalLM.layer_flags(config),
            "sliding": bool(getattr(config, "use_sliding_window", False)),
        }
