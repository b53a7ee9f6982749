"""dots.ocr's remote config (`DotsOCRForCausalLM`, model_type "dots_ocr": rednote-hilab/dots.ocr)
read without its remote code (models/remote_aliases.py's REMOTE_CONFIGS row), as vLLM's
dots_ocr.py reads it.

    config.json                                   -> DotsOCRConfig
    the LM's fields at the top level (DotsOCRConfig subclasses Qwen2Config)
                                                  -> text_config: Qwen2Config
    vision_config {embed_dim, hidden_size, intermediate_size, num_hidden_layers,
        num_attention_heads, num_channels, patch_size, spatial_merge_size,
        temporal_patch_size, rms_norm_eps, use_bias, post_norm, is_causal}
                                                  -> vision_config (model_type "dots_vit";
        num_channels also as in_channels, the name Qwen2-VL's patch counting reads)
    image_token_id (151665, "<|imgpad|>"), video_token_id    kept

The tower (multimodal/dots_ocr.py) is a NaViT: patches of every frame embedded from the first
frame alone, RMSNorm, full-attention blocks with Qwen2-VL's 2-D rope, a post-trunk RMSNorm
(post_norm), Qwen2-VL's LayerNorm patch merger to vision_config.hidden_size, which must be the
LM's hidden size (vLLM slices the tower's rows to it: a no-op only then). Refused by name:
is_causal true (vLLM's tower attends both ways), use_bias true and post_norm false (vLLM
builds them; not the release's, so unchecked here), rope_scaling, use_sliding_window, a
vision_config.hidden_size other than the LM's.
"""

from __future__ import annotations

from typing import Any

import transformers

from paged_engine.models.remote_aliases import RawConfig, field, qwen2_text_fields, vocab_token_id

ARCH = "DotsOCRForCausalLM"
TOWER_TYPE = "dots_vit"
IMAGE_TOKEN_ID, VIDEO_TOKEN_ID = 151665, 151656  # "<|imgpad|>", "<|video_pad|>"
# vision_config field -> the release's default (vLLM's DotsVisionConfig)
_VISION_INTS = {
    "embed_dim": 1536,
    "hidden_size": 1536,
    "intermediate_size": 4224,
    "num_hidden_layers": 42,
    "num_attention_heads": 12,
    "num_channels": 3,
    "patch_size": 14,
    "spatial_merge_size": 2,
    "temporal_patch_size": 1,
}


class DotsOCRConfig(transformers.PretrainedConfig):
    """The wrapper: text_config (Qwen2), vision_config (the NaViT tower's fields)."""

    model_type = "dots_ocr"


def _refuse(name: str, value: Any, want: str) -> ValueError:
    return ValueError(f"{ARCH}: config.json field {name}={value!r} is not supported: {want}")


def _text_config(raw: RawConfig) -> transformers.Qwen2Config:
    return transformers.Qwen2Config(**qwen2_text_fields(raw, ARCH))


def _vision_config(raw: RawConfig, text_hidden: int) -> transformers.PretrainedConfig:
    vision = raw.get("vision_config") or {}
    if not isinstance(vision, dict):
        raise _refuse("vision_config", vision, "a dict (the NaViT tower's fields)")
    fields = {k: field(vision, k, int, d) for k, d in _VISION_INTS.items()}
    if vision.get("is_causal"):
        raise _refuse("vision_config.is_causal", True, "false (vLLM's tower attends both ways)")
    # the release's values, the only ones checked against a reference
    if vision.get("use_bias", False):
        raise _refuse("vision_config.use_bias", vision["use_bias"], "false (the release's)")
    if not vision.get("post_norm", True):
        raise _refuse("vision_config.post_norm", vision["post_norm"], "true (the release's)")
    if fields["hidden_size"] != text_hidden:
        want = f"the LM's hidden_size {text_hidden}"
        raise _refuse("vision_config.hidden_size", fields["hidden_size"], want)
    return transformers.PretrainedConfig(
        model_type=TOWER_TYPE,
        **fields,
        in_channels=fields["num_channels"],
        rms_norm_eps=field(vision, "rms_norm_eps", float, 1e-5),
        use_bias=False,
        post_norm=True,
    )


def dots_ocr_config(raw: RawConfig) -> DotsOCRConfig:
    """The translated config (see the module doc); ValueError naming a field not served."""
    text = _text_config(raw)
    vision = _vision_config(raw, text.hidden_size)
    token = vocab_token_id(raw, "image_token_id", IMAGE_TOKEN_ID, text.vocab_size, ARCH)
    dtype = raw.get("dtype") or raw.get("torch_dtype")  # the release's bfloat16 for "auto"
    return DotsOCRConfig(
        architectures=list(raw.get("architectures") or [ARCH]),
        text_config=text,
        vision_config=vision,
        image_token_id=token,
        video_token_id=field(raw, "video_token_id", int, VIDEO_TOKEN_ID),
        bos_token_id=text.bos_token_id,
        eos_token_id=text.eos_token_id,
        pad_token_id=text.pad_token_id,
        tie_word_embeddings=text.tie_word_embeddings,
        **({"dtype": dtype} if dtype is not None else {}),
    )
