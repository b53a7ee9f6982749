"""The language model of NVIDIA Cosmos3 Edge (`Cosmos3EdgeForConditionalGeneration`,
text_config model_type "cosmos3_edge_text"), served text-only through models/text_wrappers.py.

Its text model is Llama's decoder (GQA attention with `attention_bias` and an explicit
head_dim, pre-norm RMSNorms, untied head) around a two-matrix MLP without a gate,
fc2(act(fc1(x))) with `hidden_act` "relu2" and `mlp_bias`: Arcee's (models/arcee.py), whose
`up_proj` / `down_proj` are transformers' `mlp.fc1` / `mlp.fc2`. Its rope is Qwen3-VL's
interleaved M-RoPE with the plain inv_freq (transformers requires rope_type "default"): one
position on all three axes for text, so the ordinary rope (the wrapper's `mrope` flag).

The release's own names (transformers' conversion mapping) load too: the decoder at the top
level (`embed_tokens.`, `layers.`, `norm.`: text_wrappers.py's renames) with the attention's
`to_q` / `to_k` / `to_v` / `to_out`; the image / video generator's weights the release carries
beside the reasoner (`*_moe_gen`, `add_[qkv]_proj`, `time_embedder`, `action_*`, ...), which
transformers drops at load, are dropped here by name.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

import torch

from paged_engine.models.arcee import ArceeForCausalLM

# the generator's weights (transformers' _COSMOS3_EDGE_DROPPED_GENERATOR_KEYS): the layers'
# under `model.` after the wrapper's renames, the others at the top level or under it
_GENERATOR = re.compile(
    r"^(model\.)?(action_modality_embed$|action_proj_(in|out)\.|time_embedder\.|proj_(in|out)\."
    r"|norm_moe_gen\.|layers\.\d+\.(input_layernorm_moe_gen|post_attention_layernorm_moe_gen"
    r"|mlp_moe_gen)\.|layers\.\d+\.self_attn\.(add_[qkv]_proj|to_add_out|norm_added_[qk]"
    r"|k_norm_und_for_gen)\.)"
)


class Cosmos3EdgeTextForCausalLM(ArceeForCausalLM):
    """Arcee's decoder under transformers' Cosmos3 Edge names."""

    renames = (
        (".mlp.fc1.", ".mlp.up_proj."),
        (".mlp.fc2.", ".mlp.down_proj."),
        (".self_attn.to_q.", ".self_attn.q_proj."),
        (".self_attn.to_k.", ".self_attn.k_proj."),
        (".self_attn.to_v.", ".self_attn.v_proj."),
        (".self_attn.to_out.", ".self_attn.o_proj."),
    )

    def __init__(self, config) -> None:
        act = getattr(config, "hidden_act", None) or "relu2"
        if act != "relu2":
            raise ValueError(
                f"Cosmos3 Edge's text model with hidden_act={act!r} is not supported (relu2 only)"
            )
        super().__init__(config)

    def load_weights(
        self, weights: Iterable[tuple[str, torch.Tensor]], strict: bool = True
    ) -> set[str]:
        kept = ((n, w) for n, w in weights if not _GENERATOR.match(n))
        return super().load_weights(kept, strict)
