"""Ovis2.5's Hub release (AIDC-AI/Ovis2.5-2B / -9B: config.json architectures `Ovis2_5`, remote
code; vLLM's ovis2_5.py and siglip2navit.py) read as JSON into transformers' Ovis2_5Config, the
architecture name kept (multimodal/archs.py maps it onto multimodal/ovis2_5_hub.py's images,
models/text_wrappers.py onto the Qwen3 decoder). No remote code runs.

    config.json                         Ovis2_5Config
    llm_config (qwen3)                  text_config; its tie_word_embeddings ties the head
    hidden_size                         (must equal llm_config.hidden_size, as the remote asserts)
    visual_vocab_size                   vision_config.vocab_size (the last 4 rows: indicators)
    vit_config (siglip2_navit):
      hidden_size, intermediate_size,   the same names
      num_hidden_layers, num_attention_heads, num_channels, image_size, patch_size,
      hidden_act, layer_norm_eps, window_size, temporal_patch_size
      hidden_stride                     spatial_merge_size
      fullatt_block_indexes "a|b"       layer_types: full_attention at those layers,
                                        window_attention elsewhere; null (the releases): all full
      (the 2-D rope's theta)            rope_parameters {"axial", 10000} (the remote's fixed one)
    image_token_id                      151655, Qwen's <|image_pad|>: vLLM's IMAGE_PAD_TOKEN_ID_MAP
                                        for a qwen2 / qwen3 text model (the prompt's atoms)

The remote tower's switches are served at the releases' values and refused by name otherwise:
vit_config.model_type other than siglip2_navit, num_patches > 0 (a Linear patch embedding over
naflex patches), preserve_original_pe or use_rope false, temporal_patch_size other than 1.
"""

from __future__ import annotations

from typing import Any

import transformers

from paged_engine.models.remote_aliases import RawConfig, field

ARCH = "Ovis2_5"
IMAGE_PAD = "<|image_pad|>"
IMAGE_PAD_ID = 151655  # vLLM's IMAGE_PAD_TOKEN_ID_MAP["qwen3"] (and "qwen2")
ROPE_THETA = 10000.0  # the remote VisionRotaryEmbedding's default, never configured
INDICATORS = 4  # the remote's INDICATOR_IDS: image start / end, video start / end
# vit_config fields that keep their names
_SAME = (
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_channels",
    "image_size",
    "patch_size",
    "window_size",
)
# the remote tower's switch -> the value the releases (and transformers' port) run
_FIXED: dict[str, Any] = {
    "model_type": "siglip2_navit",
    "preserve_original_pe": True,
    "use_rope": True,
    "temporal_patch_size": 1,
}


def _object(raw: RawConfig, name: str) -> dict[str, Any]:
    sub = raw.get(name)
    if not isinstance(sub, dict):
        raise ValueError(f"config.json field {name!r} must be an object, got {sub!r}")
    return sub


def _layer_types(indexes: Any, layers: int) -> list[str]:
    """The remote's fullatt_block_indexes ("0|7|15", or null: every layer full) as layer_types."""
    if indexes is None or indexes == "":
        return ["full_attention"] * layers
    try:
        full = {int(i) for i in str(indexes).split("|")}
    except ValueError:
        raise ValueError(
            f"config.json field 'vit_config.fullatt_block_indexes'={indexes!r} must be layer "
            "numbers joined by '|'"
        ) from None
    if not full <= set(range(layers)):
        raise ValueError(
            f"config.json field 'vit_config.fullatt_block_indexes'={indexes!r} names a layer "
            f"outside 0..{layers - 1}"
        )
    return ["full_attention" if i in full else "window_attention" for i in range(layers)]


def vision_fields(vit: dict[str, Any]) -> dict[str, Any]:
    """vit_config (siglip2_navit) as Ovis2_5VisionConfig's fields (the vocab set by the caller);
    ValueError naming a switch the releases do not take."""
    for name, served in _FIXED.items():
        value = vit.get(name, served)
        if value != served:
            raise ValueError(
                f"config.json field 'vit_config.{name}'={value!r} is not supported by {ARCH}: "
                f"{served!r} (the released tower)"
            )
    if int(vit.get("num_patches", -1)) > 0:
        raise ValueError(
            f"config.json field 'vit_config.num_patches'={vit['num_patches']!r} is not "
            f"supported by {ARCH}: -1 (a Conv2d patch embedding; the releases')"
        )
    out = {name: field(vit, name, int) for name in _SAME}
    out["spatial_merge_size"] = field(vit, "hidden_stride", int)
    out["hidden_act"] = field(vit, "hidden_act", str, "gelu_pytorch_tanh")
    out["layer_norm_eps"] = field(vit, "layer_norm_eps", float, 1e-6)
    out["temporal_patch_size"] = 1
    out["layer_types"] = _layer_types(vit.get("fullatt_block_indexes"), out["num_hidden_layers"])
    out["rope_parameters"] = {"rope_type": "axial", "rope_theta": ROPE_THETA}
    return out


def ovis2_5_hub_config(raw: RawConfig) -> Any:
    """Ovis2.5's config.json as transformers' Ovis2_5Config (see the module); ValueError naming
    the field the releases' model does not run."""
    llm = {
        k: v
        for k, v in _object(raw, "llm_config").items()
        if k not in ("architectures", "auto_map", "_name_or_path")
    }
    if llm.get("model_type") not in ("qwen3",):
        raise ValueError(
            f"config.json field 'llm_config.model_type'={llm.get('model_type')!r} is not "
            f"supported by {ARCH}: 'qwen3' (Ovis2.5-2B / -9B)"
        )
    hidden = field(raw, "hidden_size", int, llm.get("hidden_size"))
    if hidden != llm.get("hidden_size"):
        raise ValueError(
            f"config.json field 'hidden_size'={hidden} differs from llm_config.hidden_size="
            f"{llm.get('hidden_size')}"
        )
    vocab = field(raw, "visual_vocab_size", int)
    if vocab <= INDICATORS:
        raise ValueError(
            f"config.json field 'visual_vocab_size'={vocab} must exceed the {INDICATORS} "
            "indicator tokens"
        )
    vision = vision_fields(_object(raw, "vit_config"))
    vision.update(vocab_size=vocab, num_visual_indicator_tokens=INDICATORS)
    dtype = raw.get("dtype") or raw.get("torch_dtype")
    config = transformers.Ovis2_5Config(
        text_config=llm,
        vision_config=vision,
        image_token_id=IMAGE_PAD_ID,
        tie_word_embeddings=bool(llm.get("tie_word_embeddings", False)),
        **({"dtype": dtype} if dtype else {}),
    )
    config.architectures = list(raw["architectures"])
    return config
