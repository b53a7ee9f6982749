"""HyperCLOVA X SEED Vision v1's remote config (`HCXVisionForCausalLM`, model_type
"hyperclovax_vlm": naver-hyperclovax/HyperCLOVAX-SEED-Vision-Instruct-3B), read as JSON
without its remote code (models/remote_aliases.py's REMOTE_CONFIGS row), as vLLM's
hyperclovax_vision.py and its vendored HCXVisionConfig read it. Served on text only: the
decoder is built from text_config, as vLLM's `init_vllm_registered_model(hf_config=text_config)`
builds it, and models/text_wrappers.py drops the vision half.

    config.json field                     here
    text_config (llama / hyperclovax)     text_config: LlamaConfig / HyperCLOVAXConfig (another
                                          model_type is refused by name: vLLM also takes gpt2)
    vision_config (SigLIP / CLIP)         dropped (no tower is built)
    mm_projector_type, anyres, unpad,     kept, not read: images are refused by the input
    possible_resolutions, max_num_grids,  processor (multi_modal_data), see below
    num_queries_vis_abstractor_*,
    use_nth_layer, proj_pos_emb, ...
    tie_word_embeddings                   text_config's alone (the wrapper holds a whole
                                          *ForCausalLM: text_wrappers' nested_head)

Weights: `language_model.model.*` / `language_model.lm_head.*` (text_wrappers' renames);
`vision_model.*`, `mm_projector.*` and `image_newline` are passed over.

Why images are not served: the release's projector (mm_projector_type "cabstractor") is
Honeybee's C-Abstractor, two timm `RegStage`s (depthwise bottlenecks with squeeze-excitation and
channel LayerNorm2d) around an adaptive pool; no transformers class computes it (transformers'
RegNet uses BatchNorm), so it cannot be checked against a transformers reference here. The
"linear" / "mlp" / "inverted_mlp" projectors vLLM also builds would fit LLaVA-NeXT's model, but
their prompts need the release's remote image processor (tiling, resizing, its own
`vision_query_lengths` count), which has no transformers equivalent either.
"""

from __future__ import annotations

import transformers

from paged_engine.models.remote_aliases import RawConfig

ARCH = "HCXVisionForCausalLM"
TEXT_TYPES = {"llama": transformers.LlamaConfig, "hyperclovax": transformers.HyperCLOVAXConfig}
_DROPPED = ("architectures", "auto_map", "_name_or_path", "transformers_version", "model_type")
_MUP = ("embedding_multiplier", "logits_scaling", "attention_multiplier", "residual_multiplier")
# the wrapper's own fields, carried as they are (vLLM's names; none is read on text)
_KEPT = (
    "mm_projector_type",
    "anyres",
    "unpad",
    "max_num_grids",
    "possible_resolutions",
    "use_nth_layer",
    "img_start_id",
)


class HCXVisionV1Config(transformers.PretrainedConfig):
    """The wrapper: text_config (Llama or HyperCLOVA X) and the vision fields, unread."""

    model_type = "hyperclovax_vlm"


def hcx_vision_v1_config(raw: RawConfig) -> HCXVisionV1Config:
    """The translated config (see the module doc); ValueError naming text_config when it is
    missing or of a model_type not served."""
    text = raw.get("text_config")
    if not isinstance(text, dict):
        raise ValueError(f"{ARCH}: config.json field 'text_config' must be an object, got {text!r}")
    kind = text.get("model_type")
    if kind not in TEXT_TYPES:
        raise ValueError(
            f"{ARCH}: config.json field 'text_config.model_type'={kind!r} is not supported: "
            f"{' or '.join(map(repr, TEXT_TYPES))}"
        )
    # the remote HyperCLOVAXConfig takes null muP scalars for its defaults (1.0, an attention
    # scale of head_dim^-0.5), which transformers' class refuses: left out, its defaults agree
    fields = {k: v for k, v in text.items() if k not in _DROPPED}
    fields = {k: v for k, v in fields.items() if k not in _MUP or v is not None}
    text_config = TEXT_TYPES[kind](**fields)
    dtype = raw.get("dtype") or raw.get("torch_dtype") or text.get("torch_dtype")
    return HCXVisionV1Config(
        architectures=[ARCH],
        text_config=text_config,
        **{k: raw[k] for k in _KEPT if k in raw},
        bos_token_id=text_config.bos_token_id,
        eos_token_id=text_config.eos_token_id,
        pad_token_id=text_config.pad_token_id,
        **({"dtype": dtype} if dtype else {}),
    )
