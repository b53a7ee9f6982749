"""Phi-3-vision / Phi-3.5-vision's remote config (`Phi3VForCausalLM`, model_type "phi3_v":
microsoft/Phi-3-vision-128k-instruct, microsoft/Phi-3.5-vision-instruct) read without its
remote code (models/remote_aliases.py's REMOTE_CONFIGS row), as vLLM reads it.

    config.json                      -> Phi3VConfig (transformers' Phi3Config, flat)
    Phi-3 fields (hidden_size, rope_scaling ...)   as they are ("su" rope: "longrope")
    embd_layer {embedding_cls "image", use_hd_transform, with_learnable_separator,
                hd_transform_order "sub_glb", projection_cls "mlp"}     checked, kept
    img_processor {image_dim_out, num_img_tokens, layer_idx (-2), type_feature "patch",
                   model_name, name}                                    checked, kept
    (none: the remote code and vLLM hard-code ViT-L/14-336)   vision_config: CLIPVisionConfig
    (none: vLLM's constant)                                   image_token_id = 32044

The tower: the remote code and vLLM build CLIP ViT-L/14-336 whatever the config says. A
checkpoint may give its tower's geometry as a top-level `vision_config` (CLIPVisionConfig's
fields: hidden_size, intermediate_size, num_attention_heads, num_hidden_layers; the releases
have none) with the HD math's fixed 336-pixel crops of 14-pixel patches kept: small test
checkpoints use it. Refused by name: anything the HD path (multimodal/phi3v.py) does not run.
"""

from __future__ import annotations

from typing import Any

import transformers

from paged_engine.models.remote_aliases import RawConfig

IMAGE_TOKEN_ID = 32044  # vLLM's _IMAGE_TOKEN_ID (the remote processor writes -1, -2, ...)
CROP, PATCH = 336, 14  # the HD transform's crop side and CLIP's patch: 24 x 24 patches a crop
# CLIP ViT-L/14-336 (openai/clip-vit-large-patch14-336), what the remote code builds
_VIT_L_336 = {
    "hidden_size": 1024,
    "intermediate_size": 4096,
    "num_attention_heads": 16,
    "num_hidden_layers": 24,
    "hidden_act": "quick_gelu",
    "layer_norm_eps": 1e-5,
    "image_size": CROP,
    "patch_size": PATCH,
    "projection_dim": 768,
}
_GEOMETRY = ("hidden_size", "intermediate_size", "num_attention_heads", "num_hidden_layers")
# embd_layer field -> the value served (the remote code asserts the same)
_EMBD = {
    "embedding_cls": "image",
    "use_hd_transform": True,
    "with_learnable_separator": True,
    "hd_transform_order": "sub_glb",
    "projection_cls": "mlp",
}


class Phi3VConfig(transformers.Phi3Config):
    """Phi-3's fields with the wrapper's own (embd_layer, img_processor, vision_config)."""

    model_type = "phi3_v"


def _refuse(name: str, value: Any, want: str) -> ValueError:
    return ValueError(
        f"Phi3VForCausalLM: config.json field {name}={value!r} is not supported: {want}"
    )


def check_image_fields(raw: RawConfig) -> tuple[dict[str, Any], dict[str, Any]]:
    """(embd_layer, img_processor) of a servable config; ValueError naming the field."""
    embd, img = raw.get("embd_layer"), raw.get("img_processor")
    if not isinstance(embd, dict) or not isinstance(img, dict):
        raise ValueError("Phi3VForCausalLM: config.json needs embd_layer and img_processor dicts")
    for name, want in _EMBD.items():
        got = embd.get(name)
        if got != want:
            raise _refuse(f"embd_layer.{name}", got, repr(want))
    if img.get("type_feature", "patch") != "patch":
        raise _refuse("img_processor.type_feature", img["type_feature"], "'patch' (CLS dropped)")
    layer = img.get("layer_idx", -2)
    if isinstance(layer, bool) or not isinstance(layer, int):
        raise _refuse("img_processor.layer_idx", layer, "an int")
    for name in ("image_dim_out", "num_img_tokens"):
        if not isinstance(img.get(name), int) or isinstance(img.get(name), bool):
            raise _refuse(f"img_processor.{name}", img.get(name), "an int")
    merged = (CROP // PATCH // 2) ** 2
    if img["num_img_tokens"] != merged:
        raise _refuse("img_processor.num_img_tokens", img["num_img_tokens"], f"{merged}")
    return embd, img


def vision_config(raw: RawConfig, img: dict[str, Any]) -> transformers.CLIPVisionConfig:
    """ViT-L/14-336, or the checkpoint's own geometry (see the module doc)."""
    given = raw.get("vision_config") or {}
    if not isinstance(given, dict):
        raise _refuse("vision_config", given, "a dict of CLIPVisionConfig fields")
    for name in ("image_size", "patch_size"):
        want = _VIT_L_336[name]
        if given.get(name, want) != want:
            raise _refuse(f"vision_config.{name}", given[name], f"{want} (the HD crops' math)")
    fields = {**_VIT_L_336, **{k: given[k] for k in (*_GEOMETRY, "hidden_act") if k in given}}
    if "layer_norm_eps" in given:
        fields["layer_norm_eps"] = given["layer_norm_eps"]
    vision = transformers.CLIPVisionConfig(**fields)
    if img["image_dim_out"] != vision.hidden_size:
        raise _refuse(
            "img_processor.image_dim_out",
            img["image_dim_out"],
            f"{vision.hidden_size} (the tower's width)",
        )
    layers, layer = int(vision.num_hidden_layers), int(img.get("layer_idx", -2))
    if not -layers <= layer < 0:  # hidden_states[layer_idx], as the releases' -2
        raise _refuse("img_processor.layer_idx", layer, f"a negative index in [-{layers}, -1]")
    return vision


def phi3v_config(raw: RawConfig) -> Phi3VConfig:
    """The translated config (see the module doc); ValueError naming a field not served."""
    _, img = check_image_fields(raw)
    vision = vision_config(raw, img)
    drop = ("auto_map", "_name_or_path", "model_type", "transformers_version", "vision_config")
    fields = {k: v for k, v in raw.items() if k not in drop}
    if "torch_dtype" in fields and "dtype" not in fields:
        fields["dtype"] = fields.pop("torch_dtype")
    rope = fields.get("rope_scaling")
    if isinstance(rope, dict) and rope.get("type") == "su":  # Phi-3's first name for longrope
        fields["rope_scaling"] = {**rope, "type": "longrope"}
    vocab = int(fields.get("vocab_size", 32064))
    if vocab <= IMAGE_TOKEN_ID:
        raise _refuse("vocab_size", vocab, f"above {IMAGE_TOKEN_ID} (the image placeholder id)")
    config = Phi3VConfig(**fields)
    config.vision_config = vision
    config.image_token_id = IMAGE_TOKEN_ID
    return config
