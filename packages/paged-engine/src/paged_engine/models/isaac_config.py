"""Isaac's remote config (`IsaacForConditionalGeneration`, model_type "isaac":
PerceptronAI/Isaac-0.1) read without its remote code (models/remote_aliases.py's REMOTE_CONFIGS
row), as the remote modular_isaac.py and vLLM's isaac.py read it.

    config.json                                   -> IsaacConfig
    the LM's fields at the top level (IsaacConfig subclasses Qwen3Config)
                                                  -> text_config: Qwen3Config whose rope is
        M-RoPE over contiguous sections (head_dim / 4, head_dim / 8, head_dim / 8): the remote's
        IsaacRotaryEmbedding and vLLM's calculated_mrope_section, whatever rope_scaling says
    vision_config (pixel_shuffle_siglip2: Siglip2VisionConfig's fields, num_patches,
        pixel_shuffle_scale_factor)               -> vision_config: Siglip2VisionConfig
        (model_type siglip2_vision_model) carrying pixel_shuffle_scale_factor
    video_patch_size (or vision_patch_size), vision_max_num_patches, vision_min_num_patches,
        pixel_shuffle_scale, vision_token         -> kept: the image processor's settings
        (multimodal/isaac.py)
    image_token_id                                -> the tokenizer's <|image_pad|> (vLLM's
        replacement token; remote_aliases.PLACEHOLDER_TOKENS looks it up), else Qwen's 151655

Refused by name: rope_scaling other than the default rope (rope_type) or interleaved
(mrope_interleaved: the remote's sections are contiguous), use_sliding_window, head_dim not a
multiple of 8, vision_config.model_type other than pixel_shuffle_siglip2, a num_patches that is
not a square table, a processor patch size or pixel_shuffle_scale unlike the tower's.
"""

from __future__ import annotations

import math
from typing import Any

import transformers

from paged_engine.models.remote_aliases import (
    RawConfig,
    field,
    qwen3_text_fields,
    tower_fields,
    vocab_token_id,
)

ARCH = "IsaacForConditionalGeneration"
TOWER_TYPE = "pixel_shuffle_siglip2"
IMAGE_PAD, IMAGE_PAD_ID = "<|image_pad|>", 151655  # Qwen's; vLLM's prompt replacement token
# vision_config fields that Siglip2VisionConfig reads under the same names (the remote's defaults
# are Siglip2VisionConfig's)
_VISION_INTS = (
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_channels",
    "patch_size",
)


class IsaacConfig(transformers.PretrainedConfig):
    """The wrapper: text_config (Qwen3, M-RoPE), vision_config (SigLIP2 with pixel shuffle) and
    the image processor's settings."""

    model_type = "isaac"


def _refuse(name: str, value: Any, want: str) -> ValueError:
    return ValueError(f"{ARCH}: config.json field {name}={value!r} is not supported: {want}")


def _rope(raw: RawConfig, head_dim: int) -> dict[str, Any]:
    scaling = raw.get("rope_scaling")
    if scaling is not None:
        if not isinstance(scaling, dict):
            raise _refuse("rope_scaling", scaling, "null or a dict")
        kind = scaling.get("rope_type", scaling.get("type", "default"))
        if kind not in ("default", "mrope"):
            raise _refuse("rope_scaling.rope_type", kind, "'default' (the remote's plain rope)")
        if scaling.get("mrope_interleaved"):
            raise _refuse("rope_scaling.mrope_interleaved", True, "false (contiguous sections)")
    if head_dim % 8:
        raise _refuse("head_dim", head_dim, "a multiple of 8 (M-RoPE sections hd/4, hd/8, hd/8)")
    return {
        "rope_type": "default",
        "rope_theta": field(raw, "rope_theta", float, 1000000.0),
        "mrope_section": [head_dim // 4, head_dim // 8, head_dim // 8],
    }


def _text_config(raw: RawConfig) -> transformers.Qwen3Config:
    config = transformers.Qwen3Config(**qwen3_text_fields(raw, ARCH, 32768))
    # (set after construction: transformers' default-rope check does not know mrope_section)
    config.rope_parameters = _rope(raw, config.head_dim)
    return config


def _vision_config(raw: RawConfig) -> transformers.Siglip2VisionConfig:
    vision = tower_fields(raw, ARCH, TOWER_TYPE)
    defaults = transformers.Siglip2VisionConfig()
    fields = {k: field(vision, k, int, getattr(defaults, k)) for k in _VISION_INTS}
    patches = field(vision, "num_patches", int, 256)  # the remote's default
    if math.isqrt(patches) ** 2 != patches:
        raise _refuse("vision_config.num_patches", patches, "a square (the position table)")
    config = transformers.Siglip2VisionConfig(
        **fields,
        num_patches=patches,
        hidden_act=field(vision, "hidden_act", str, defaults.hidden_act),
        layer_norm_eps=field(vision, "layer_norm_eps", float, defaults.layer_norm_eps),
    )
    config.pixel_shuffle_scale_factor = field(vision, "pixel_shuffle_scale_factor", int, 1)
    return config


def isaac_config(raw: RawConfig) -> IsaacConfig:
    """The translated config (see the module doc); ValueError naming a field not served."""
    text = _text_config(raw)
    vision = _vision_config(raw)
    patch = field(raw, "video_patch_size", int, field(raw, "vision_patch_size", int, 16))
    if patch != vision.patch_size:
        want = f"vision_config.patch_size {vision.patch_size} (the tower's patches)"
        raise _refuse("video_patch_size", patch, want)
    shuffle = field(raw, "pixel_shuffle_scale", int, 1)
    if shuffle != vision.pixel_shuffle_scale_factor:
        want = f"vision_config.pixel_shuffle_scale_factor {vision.pixel_shuffle_scale_factor}"
        raise _refuse("pixel_shuffle_scale", shuffle, want)
    smallest = raw.get("vision_min_num_patches")
    token = vocab_token_id(raw, "image_token_id", IMAGE_PAD_ID, text.vocab_size, ARCH)
    dtype = raw.get("dtype") or raw.get("torch_dtype")
    return IsaacConfig(
        architectures=list(raw.get("architectures") or [ARCH]),
        text_config=text,
        vision_config=vision,
        image_token_id=token,
        vision_patch_size=patch,
        vision_max_num_patches=field(raw, "vision_max_num_patches", int, 256),
        vision_min_num_patches=None
        if smallest is None
        else field(raw, "vision_min_num_patches", int),
        pixel_shuffle_scale=shuffle,
        vision_token=field(raw, "vision_token", str, "<image>"),
        bos_token_id=text.bos_token_id,
        eos_token_id=text.eos_token_id,
        pad_token_id=text.pad_token_id,
        tie_word_embeddings=text.tie_word_embeddings,
        **({"dtype": dtype} if dtype is not None else {}),
    )
