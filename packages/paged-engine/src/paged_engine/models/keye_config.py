"""Keye-VL's remote config (`KeyeForConditionalGeneration`, model_type "Keye":
Kwai-Keye/Keye-VL-8B-Preview) read without its remote code (models/remote_aliases.py's
REMOTE_CONFIGS row), as the remote configuration_keye.py and vLLM's keye.py read it.

    config.json                                   -> KeyeConfig
    the LM's fields at the top level (Qwen3's)    -> text_config: Qwen3Config whose rope is
        M-RoPE over contiguous sections rope_scaling.mrope_section (vLLM builds its
        Qwen3ForCausalLM from the same config, the rope by those sections; Qwen2-VL's layout)
    vision_config (siglip_vision_model: SigLIP's fields, spatial_merge_size)
                                                  -> vision_config: PaddleOCRVisionConfig
        (model_type paddleocr_vl_vision): PaddleOCR-VL's tower is Keye's (learned position table
        resized to the patch grid, 2-D rope with theta 10000 by (row, column), rotate-half)
    image_token_id, video_token_id, vision_start_token_id, vision_end_token_id -> kept

The projector (`mlp_AR`: LayerNorm per patch, 2 x 2 patches into one row, linear, GELU,
linear) is PaddleOCR-VL's too (multimodal/paddleocr_vl.py serves both).

Keye-VL-1.5 (`KeyeVL1_5ForConditionalGeneration`, vLLM's keye_vl1_5.py) reads the same fields
into the same config: its tower, image prompt and image positions are the Preview's; only its
projector differs (the LayerNorm over each merged 4 x width row: multimodal/keye.py). Its videos
(slow / fast frames) are refused as the Preview's are.

Refused by name: rope_scaling without three mrope_section sizes summing to head_dim / 2, or
interleaved (mrope_interleaved), use_sliding_window, vision_config.model_type other than
siglip_vision_model, spatial_merge_size other than 2 (the remote's projector merges 2 x 2
whatever the config says).
"""

from __future__ import annotations

from typing import Any

import transformers

from paged_engine.models.remote_aliases import (
    RawConfig,
    field,
    qwen3_text_fields,
    tower_fields,
    vocab_token_id,
)

ARCH = "KeyeForConditionalGeneration"
TOWER_TYPE = "siglip_vision_model"
MERGE = 2  # the remote's and vLLM's projector: merge_kernel_size (2, 2)
# Qwen's vision tokens (the release's config.json ids)
_TOKENS = {
    "image_token_id": 151655,
    "video_token_id": 151656,
    "vision_start_token_id": 151652,
    "vision_end_token_id": 151653,
}
# vision_config fields PaddleOCRVisionConfig reads under the same names (its defaults are the
# remote KeyeVisionConfig's: SigLIP-so400m's)
_VISION_INTS = (
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_channels",
    "image_size",
    "patch_size",
)


class KeyeConfig(transformers.PretrainedConfig):
    """The wrapper: text_config (Qwen3, M-RoPE), vision_config (Keye's SigLIP tower) and the
    vision token ids."""

    model_type = "Keye"


def _refuse(name: str, value: Any, want: str) -> ValueError:
    return ValueError(f"{ARCH}: config.json field {name}={value!r} is not supported: {want}")


def _rope(raw: RawConfig, head_dim: int) -> dict[str, Any]:
    scaling = raw.get("rope_scaling")
    if not isinstance(scaling, dict):
        raise _refuse("rope_scaling", scaling, "a dict with mrope_section (M-RoPE)")
    if scaling.get("mrope_interleaved"):
        raise _refuse("rope_scaling.mrope_interleaved", True, "false (contiguous sections)")
    section = scaling.get("mrope_section")
    if (
        not isinstance(section, list)
        or len(section) != 3
        or not all(isinstance(s, int) and s > 0 for s in section)
        or sum(section) * 2 != head_dim
    ):
        want = f"three positive sizes summing to head_dim / 2 ({head_dim // 2})"
        raise _refuse("rope_scaling.mrope_section", section, want)
    return {
        "rope_type": "default",
        "rope_theta": field(raw, "rope_theta", float, 1000000.0),
        "mrope_section": list(section),
    }


def _text_config(raw: RawConfig) -> transformers.Qwen3Config:
    config = transformers.Qwen3Config(**qwen3_text_fields(raw, ARCH, 40960))
    # (set after construction: transformers' default-rope check does not know mrope_section)
    config.rope_parameters = _rope(raw, config.head_dim)
    return config


def _vision_config(raw: RawConfig) -> transformers.PaddleOCRVisionConfig:
    vision = tower_fields(raw, ARCH, TOWER_TYPE)
    merge = field(vision, "spatial_merge_size", int, MERGE)
    if merge != MERGE:
        raise _refuse("vision_config.spatial_merge_size", merge, f"{MERGE} (the projector's)")
    defaults = transformers.PaddleOCRVisionConfig()
    return transformers.PaddleOCRVisionConfig(
        **{k: field(vision, k, int, getattr(defaults, k)) for k in _VISION_INTS},
        hidden_act=field(vision, "hidden_act", str, defaults.hidden_act),
        layer_norm_eps=field(vision, "layer_norm_eps", float, defaults.layer_norm_eps),
        spatial_merge_size=merge,
        # the remote's tower rotates with SigLIPRotaryEmbedding's fixed theta
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    )


def keye_vl1_5_config(raw: RawConfig) -> KeyeConfig:
    """Keye-VL-1.5: the Preview's fields and refusals (architectures kept: the image encoder
    picks the merged-row projector by them)."""
    return keye_config(raw)


def keye_config(raw: RawConfig) -> KeyeConfig:
    """The translated config (see the module doc); ValueError naming a field not served."""
    text = _text_config(raw)
    vision = _vision_config(raw)
    tokens = {k: vocab_token_id(raw, k, v, text.vocab_size, ARCH) for k, v in _TOKENS.items()}
    dtype = raw.get("dtype") or raw.get("torch_dtype")
    return KeyeConfig(
        architectures=list(raw.get("architectures") or [ARCH]),
        text_config=text,
        vision_config=vision,
        **tokens,
        bos_token_id=text.bos_token_id,
        eos_token_id=text.eos_token_id,
        pad_token_id=text.pad_token_id,
        tie_word_embeddings=text.tie_word_embeddings,
        **({"dtype": dtype} if dtype is not None else {}),
    )
