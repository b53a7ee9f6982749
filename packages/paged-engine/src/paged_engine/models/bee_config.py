"""Bee-8B's remote config (`BeeForConditionalGeneration`, model_type "bee": Open-Bee/Bee-8B-RL,
Bee-8B-SFT; vLLM's models/bee.py), read as JSON into transformers' LlavaOnevisionConfig. vLLM
serves Bee as LLaVA-OneVision's model (a SigLIP tower, anyres tiles scaled down past
"anyres_max_N", `image_newline` after each row) over a Qwen3 decoder, with its own projector
(multimodal/bee.py) and LLaVA-NeXT's placeholder count on every image. The architecture name is
kept: multimodal/archs.py maps it onto multimodal/bee.py, models/text_wrappers.py onto
Qwen3ForCausalLM.

    config.json field                     here
    text_config (qwen3)                   LlavaOnevisionConfig.text_config (another model_type
                                          is refused by name)
    vision_config (siglip_vision_model)   LlavaOnevisionConfig.vision_config (another tower is
                                          refused by name)
    image_token_index / image_token_id    image_token_id (either name)
    image_grid_pinpoints, vision_aspect_ratio, vision_feature_layer (one layer: Bee's
    projector normalizes one tower width), vision_feature_select_strategy: as they are
    (LlavaOnevisionConfig's defaults where absent, vLLM's too)
    projector_hidden_act, multimodal_projector_bias   not read: Bee's projector is GELU
                                          (exact) with biases whatever they say, as vLLM's

Weights: transformers' LLaVA-OneVision names (`model.vision_tower.*`,
`model.multi_modal_projector.{pre_norm,linear_1,linear_2}.*`, `model.image_newline`,
`model.language_model.*`, `lm_head.*`), as vLLM's Bee mapper reads them.
"""

from __future__ import annotations

from typing import Any

import transformers

from paged_engine.models.remote_aliases import RawConfig

ARCH = "BeeForConditionalGeneration"
TEXT_TYPE = "qwen3"
VISION_TYPE = "siglip_vision_model"
# read as they are (LlavaOnevisionConfig's defaults where absent)
_TOP = ("image_grid_pinpoints", "vision_aspect_ratio", "vision_feature_select_strategy")
_DROPPED = ("architectures", "auto_map", "_name_or_path", "transformers_version")


def _sub(raw: RawConfig, name: str, model_type: str) -> dict[str, Any]:
    sub = raw.get(name)
    if not isinstance(sub, dict):
        raise ValueError(f"config.json field {name!r} must be an object, got {sub!r}")
    kind = sub.get("model_type", model_type)
    if kind != model_type:
        raise ValueError(
            f"config.json field '{name}.model_type'={kind!r} is not supported for {ARCH}: "
            f"{model_type!r} (the release's)"
        )
    return {k: v for k, v in sub.items() if k not in _DROPPED}


def bee_config(raw: RawConfig) -> Any:
    """Bee's config.json as LlavaOnevisionConfig (architectures kept); ValueError naming a
    field this path does not run."""
    text = _sub(raw, "text_config", TEXT_TYPE)
    vision = _sub(raw, "vision_config", VISION_TYPE)
    token = raw.get("image_token_id", raw.get("image_token_index"))
    if isinstance(token, bool) or not isinstance(token, int) or token < 0:
        raise ValueError(f"config.json field 'image_token_index' must be a token id, got {token!r}")
    layer = raw.get("vision_feature_layer", -1)
    if isinstance(layer, list) and len(layer) == 1:
        layer = layer[0]
    if isinstance(layer, bool) or not isinstance(layer, int):
        raise ValueError(
            f"config.json field 'vision_feature_layer'={layer!r} is not supported for {ARCH}: "
            "one layer (its projector's pre_norm normalizes one tower width)"
        )
    fields = {k: raw[k] for k in _TOP if raw.get(k) is not None}
    video = raw.get("video_token_id", raw.get("video_token_index"))
    if isinstance(video, int) and not isinstance(video, bool):
        fields["video_token_index"] = video
    dtype = raw.get("dtype") or raw.get("torch_dtype")
    tie = raw.get("tie_word_embeddings", text.get("tie_word_embeddings", False))
    config = transformers.LlavaOnevisionConfig(
        text_config={"model_type": TEXT_TYPE, **text},
        vision_config={"model_type": VISION_TYPE, **vision},
        image_token_index=token,
        vision_feature_layer=layer,
        projector_hidden_act="gelu",  # Bee's projector (multimodal/bee.py), as vLLM's
        multimodal_projector_bias=True,
        tie_word_embeddings=bool(tie),
        **fields,
        **({"dtype": dtype} if dtype else {}),
    )
    config.architectures = list(raw["architectures"])
    return config
