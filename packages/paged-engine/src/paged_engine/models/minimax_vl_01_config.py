"""MiniMax-VL-01's remote config (`MiniMaxVL01ForConditionalGeneration`, model_type
"minimax_vl_01"; vLLM's transformers_utils/configs/minimax_vl_01.py and models/minimax_vl_01.py),
read as JSON into transformers' LlavaNextConfig: vLLM serves it as LLaVA-NeXT's model (a CLIP
tower without its post-norm, hidden_states[vision_feature_layer], the 2-layer projector with
biases, anyres tiles unpadded by transformers' `unpad_image`, `image_newline` after each row)
over the release's MiniMax-Text-01 (models/minimax.py). The architecture name is kept:
multimodal/archs.py maps it onto LLaVA-NeXT's encoder and its own image processor
(multimodal/minimax_vl_01.py), models/text_wrappers.py onto MiniMaxText01ForCausalLM.

    config.json field                     here
    vision_config (no model_type: CLIP)   LlavaNextConfig.vision_config
    text_config (minimax_text_01)         MiniMaxText01Config: the release's names, read by
                                          models/minimax.py as for MiniMaxText01ForCausalLM
    image_token_index, projector_hidden_act, vision_feature_layer,
    vision_feature_select_strategy,       as they are (the release's defaults where absent)
    image_grid_pinpoints
    process_image_mode                    "anyres" only (or absent): vLLM's path; the release
                                          processor's "resize" / "keepratio_resize" /
                                          "dynamic_res" are refused by name

Weights: the old LLaVA names (`vision_tower.vision_model.*`, `multi_modal_projector.linear_{1,2}`,
`image_newline`, `language_model.model.*`, `language_model.lm_head.*`).
"""

from __future__ import annotations

from typing import Any

import transformers
from transformers import PretrainedConfig

from paged_engine.models.remote_aliases import RawConfig

ARCH = "MiniMaxVL01ForConditionalGeneration"
MODE = "anyres"  # the one process_image_mode served (vLLM's)
# the release config class's defaults (vLLM's MiniMaxVL01Config)
DEFAULT_PINPOINTS = [[336, 672], [672, 336], [672, 672], [1008, 336], [336, 1008]]
_TOP = {
    "image_token_index": 32000,
    "projector_hidden_act": "gelu",
    "vision_feature_select_strategy": "default",
    "vision_feature_layer": -2,
}


class MiniMaxText01Config(PretrainedConfig):
    """The release's text config, its fields under its own names (models/minimax.py reads
    attn_type_list, layernorm_* factors, postnorm; `minimax_config` refuses what it does not
    run)."""

    model_type = "minimax_text_01"

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)


def check_mode(mode: Any, where: str) -> None:
    if mode is not None and mode != MODE:
        raise ValueError(
            f"{where} process_image_mode={mode!r} is not supported for {ARCH}: only {MODE!r} "
            "(vLLM's LLaVA-NeXT-style tiles) is served"
        )


def minimax_vl_01_config(raw: RawConfig) -> Any:
    """MiniMax-VL-01's config.json as LlavaNextConfig (architectures kept); ValueError naming
    a field this path does not run."""
    check_mode(raw.get("process_image_mode"), "config.json field")
    text, vision = raw.get("text_config"), raw.get("vision_config")
    for name, sub in (("text_config", text), ("vision_config", vision)):
        if not isinstance(sub, dict):
            raise ValueError(f"config.json field {name!r} must be an object, got {sub!r}")
    assert isinstance(text, dict) and isinstance(vision, dict)
    vision = {"model_type": "clip_vision_model", **vision}
    if vision["model_type"] != "clip_vision_model":
        raise ValueError(
            f"config.json field 'vision_config.model_type'={vision['model_type']!r} is not "
            f"supported for {ARCH}: 'clip_vision_model' (the release's tower)"
        )
    token = raw.get("image_token_index", _TOP["image_token_index"])
    if isinstance(token, bool) or not isinstance(token, int) or token < 0:
        raise ValueError(f"config.json field 'image_token_index' must be a token id, got {token!r}")
    fields = {k: raw.get(k) if raw.get(k) is not None else v for k, v in _TOP.items()}
    pinpoints = raw.get("image_grid_pinpoints") or DEFAULT_PINPOINTS
    text = {k: v for k, v in text.items() if k not in ("architectures", "auto_map", "model_type")}
    dtype = raw.get("dtype") or raw.get("torch_dtype")
    config = transformers.LlavaNextConfig(
        vision_config=vision,
        text_config=MiniMaxText01Config(**text),
        image_grid_pinpoints=[list(p) for p in pinpoints],
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        multimodal_projector_bias=True,  # vLLM's projector: biases, whatever the config says
        **fields,
        **({"dtype": dtype} if dtype else {}),
    )
    config.architectures = list(raw["architectures"])
    return config
