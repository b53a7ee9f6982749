"""Kimi-VL's remote config (`KimiVLForConditionalGeneration`, model_type "kimi_vl":
moonshotai/Kimi-VL-A3B-Instruct, -Thinking, -Thinking-2506) read without its remote code
(models/remote_aliases.py's REMOTE_CONFIGS row) into transformers' Kimi_K25Config, whose
image path (multimodal/kimi_k25.py, moonvit.py) is the same maths for a still image:

    config.json (remote)                       -> Kimi_K25Config
    text_config (deepseek_v3)                     text_config (DeepSeek-V3's fields as they are)
    vision_config (moonvit): patch_size,          vision_config (kimi_k25_vision): the same
      num_attention_heads, num_hidden_layers,       fields; pos_emb_height / pos_emb_width;
      hidden_size, intermediate_size,               hidden_act "gelu_pytorch_tanh" and rope
      merge_kernel_size, init_pos_emb_height /      theta 10000 (what the remote MoonViT and
      init_pos_emb_width                            vLLM's moonvit.py hard-code)
    (none: the remote projector hard-codes them)  projection_hidden_size = vision hidden_size,
                                                  projection_layer_norm_eps = 1e-5
    media_placeholder_token_id                    image_token_id
    (none)                                        tie_word_embeddings: text_config's (False)

The remote MoonViT rotates q / k pairwise with angles (col f_j, row f_j) per frequency
f_j = 10000 ** (-4j / head_dim), as transformers' Kimi K2.5 tower does once its wqkv rows are
permuted (moonvit.py); its learned position grid is resampled bicubically (align_corners
False) and its projector is LayerNorm -> 2 x 2 blocks concatenated -> Linear -> GELU (erf) ->
Linear. Refused by name: a text_config other than deepseek_v3 or whose router is not
DeepSeek-V3's (topk_method "noaux_tc", scoring_func "sigmoid").
"""

from __future__ import annotations

from typing import Any

import transformers

from paged_engine.models.remote_aliases import RawConfig, field

ARCH = "KimiVLForConditionalGeneration"
_ROPE_THETA = 10000.0  # the remote Rope2DPosEmb's theta_base
_VISION_ACT = "gelu_pytorch_tanh"  # the remote MoonViT's activation (not in its config)
_PROJECTOR_EPS = 1e-5  # the remote KimiVLMultiModalProjector's pre_norm eps
_VISION_FIELDS = (
    "patch_size",
    "num_attention_heads",
    "num_hidden_layers",
    "hidden_size",
    "intermediate_size",
)
# text_config field -> the only value DeepSeek-V3's decoder (models/deepseek_v3.py) runs
_ROUTER = {"topk_method": "noaux_tc", "scoring_func": "sigmoid"}


def _refuse(name: str, value: Any, want: str) -> ValueError:
    return ValueError(f"{ARCH}: config.json field {name}={value!r} is not supported: {want}")


def kimi_vl_config(raw: RawConfig) -> Any:
    """The translated config (see the module doc); ValueError naming a field not served."""
    vision, text = raw.get("vision_config"), raw.get("text_config")
    if not isinstance(vision, dict) or not isinstance(text, dict):
        raise ValueError(f"{ARCH}: config.json needs vision_config and text_config dicts")
    if text.get("model_type", "deepseek_v3") != "deepseek_v3":
        raise _refuse("text_config.model_type", text["model_type"], "'deepseek_v3'")
    for name, want in _ROUTER.items():
        if text.get(name, want) != want:
            raise _refuse(f"text_config.{name}", text[name], repr(want))
    fields = {name: vision[name] for name in _VISION_FIELDS if name in vision}
    fields["pos_emb_height"] = field(vision, "init_pos_emb_height", int, 64)
    fields["pos_emb_width"] = field(vision, "init_pos_emb_width", int, 64)
    fields["merge_kernel_size"] = list(vision.get("merge_kernel_size") or (2, 2))
    fields["hidden_act"] = _VISION_ACT
    fields["rope_parameters"] = {"rope_type": "axial", "rope_theta": _ROPE_THETA}
    drop = ("auto_map", "_name_or_path", "architectures", "transformers_version")
    text = {k: v for k, v in text.items() if k not in drop}
    dtype = raw.get("dtype") or raw.get("torch_dtype")
    config = transformers.Kimi_K25Config(
        text_config=text,
        vision_config=fields,
        projection_hidden_size=int(fields.get("hidden_size", 1152)),
        projection_layer_norm_eps=_PROJECTOR_EPS,
        image_token_id=field(raw, "media_placeholder_token_id", int, 163605),
        tie_word_embeddings=bool(text.get("tie_word_embeddings", False)),
        **({"dtype": dtype} if dtype else {}),
    )
    config.architectures = [ARCH]
    return config
