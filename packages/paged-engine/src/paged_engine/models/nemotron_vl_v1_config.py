"""Llama Nemotron Nano VL v1's remote config (`Llama_Nemotron_Nano_VL`:
nvidia/Llama-3.1-Nemotron-Nano-VL-8B-V1) read without its remote code (models/remote_aliases.py's
REMOTE_CONFIGS row), as vLLM's nemotron_vl.py (LlamaNemotronVLChatModel) and its
transformers_utils/configs/nemotron_vl.py read it:

    config.json                          -> NemotronVLV1Config
    llm_config                              text_config: LlamaConfig (model_type llama)
    vision_config (C-RADIO, AutoModel)      vision_config: transformers' RadioConfig, built from
                                            vision_config.args as Nano VL v2's is
                                            (models/nemotron_nano_vl_config.py's radio_config)
    vision_config.args.gp                   the timm ViT's final norm: a LayerNorm after the
                                            blocks unless gp pools ("avg" / "avgmax" / "max":
                                            timm's norm is then an Identity)
    vit_hidden_size, projector_hidden_size, downsample_ratio      as they are (the config
                                            class's defaults 1280 / 4096 / 0.5)
    force_image_size, use_thumbnail         the tiles' side, the thumbnail after > 1 tile
    norm_mean / norm_std                    the RADIO input conditioner's (CLIP's by default:
                                            vLLM never loads the checkpoint's buffers)
    image_token_id                          the release tokenizer's "<image>" (remote_aliases'
                                            PLACEHOLDER_TOKENS row): each placeholder

Refused by name: ps_version other than "v2" (the config class's default is "v1": a transposed
grid), llm_config other than llama, a patch_size that differs from vision_config.patch_size,
force_image_size not a multiple of 2 x patch_size, and what radio_config refuses.
"""

from __future__ import annotations

from typing import Any

import transformers

from paged_engine.models.nemotron_nano_vl_config import radio_config, tile_fields
from paged_engine.models.remote_aliases import RawConfig, field, vocab_token_id

ARCH = "Llama_Nemotron_Nano_VL"
POOLED = ("avg", "avgmax", "max")  # timm global_pool values whose ViT has no final norm


class NemotronVLV1Config(transformers.PretrainedConfig):
    """The wrapper: text_config (Llama), vision_config (RadioConfig), projector and tiles."""

    model_type = "Llama_Nemotron_Nano_VL"


def _refuse(name: str, value: Any, want: str) -> ValueError:
    return ValueError(f"{ARCH}: config.json field {name}={value!r} is not supported: {want}")


def nemotron_vl_v1_config(raw: RawConfig) -> NemotronVLV1Config:
    """The translated config (see the module doc); ValueError naming a field not served."""
    if raw.get("ps_version", "v1") != "v2":
        raise _refuse("ps_version", raw.get("ps_version", "v1"), "'v2' (v1 transposes the grid)")
    llm = raw.get("llm_config") or raw.get("text_config")
    if not isinstance(llm, dict) or llm.get("model_type", "llama") != "llama":
        got = llm.get("model_type") if isinstance(llm, dict) else llm
        raise _refuse("llm_config.model_type", got, "'llama'")
    skip = ("auto_map", "_name_or_path", "model_type", "architectures")
    text = transformers.LlamaConfig(**{k: v for k, v in llm.items() if k not in skip})
    vision = raw.get("vision_config") or {}
    patch = field(vision, "patch_size", int, 16)
    if field(raw, "patch_size", int, patch) != patch:
        raise _refuse("patch_size", raw["patch_size"], f"{patch} (vision_config.patch_size)")
    radio = radio_config(vision, patch)
    side = field(raw, "force_image_size", int)
    if side % (2 * patch):
        raise _refuse("force_image_size", side, f"a multiple of 2 x patch_size ({2 * patch})")
    args = vision.get("args") or {}
    token = vocab_token_id(raw, "image_token_id", None, int(text.vocab_size), ARCH)
    return NemotronVLV1Config(
        architectures=[ARCH],
        text_config=text,
        vision_config=radio,
        vision_hidden_size=field(raw, "vit_hidden_size", int, 1280),
        projector_hidden_size=field(raw, "projector_hidden_size", int, 4096),
        vision_final_norm=args.get("gp") not in POOLED,
        **tile_fields(raw, side, ARCH),
        image_token_id=token,
        tie_word_embeddings=bool(text.tie_word_embeddings),
        bos_token_id=text.bos_token_id,
        eos_token_id=text.eos_token_id,
        pad_token_id=text.pad_token_id,
    )
