"""Vision-language releases whose config.json names the class vLLM registers for them rather
than transformers' (vLLM's registry `_MULTIMODAL_MODELS`), read as JSON into the transformers
config of the family paged serves (models/remote_aliases.py's REMOTE_CONFIGS rows; no remote
code runs). The architecture name is kept: multimodal/archs.py and models/text_wrappers.py map
it onto the family's image path and text model.

    config.json architecture            what it is                    served as
    LightOnOCRForConditionalGeneration  lightonai/LightOnOCR-1B-1025: LightOnOcrConfig
      (model_type "mistral3")           Mistral 3's config fields     (multimodal/lighton_ocr.py)
    InternS1ForConditionalGeneration    internlm/Intern-S1, -mini:    InternVLConfig
      (model_type "interns1")           InternVL's fields and names   (multimodal/internvl.py)

LightOnOCR-1B-1025 ships a Mistral3Config (text_config qwen3, vision_config pixtral); vLLM runs
it as Mistral 3's model with LightOnOCR's weight names (`model.vision_encoder.*`,
`model.vision_projection.*`, `model.language_model.*`, `lm_head.*`: transformers'
LightOnOcrForConditionalGeneration's names too) and LightOnOCR's prompt (a plain run of image
tokens, no break / end rows). LightOnOcrConfig holds the same model minus Mistral 3's switches;
each switch is served at the value LightOnOCR's model hard-codes and refused by name otherwise:

    Mistral3Config field                 LightOnOcr's model         here
    vision_feature_layer                 the last layer             -1 (or absent)
    projector_hidden_act                 GELU (exact)               "gelu" (or absent)
    multimodal_projector_bias            bias-free linears          False (or absent)
    image_token_index / image_token_id   image_token_id             either name
    spatial_merge_size                   spatial_merge_size         as it is
    text_config.tie_word_embeddings      tie_word_embeddings        vLLM ties by the text model

Refused with the other families' rules: a vision tower that is not Pixtral's
(multimodal/lighton_ocr.py), a text model that is not Qwen3 (models/text_wrappers.py).

Intern-S1's remote config is transformers' InternVLConfig under another model_type (vLLM serves
`InternS1ForConditionalGeneration` and transformers' `InternVLForConditionalGeneration` with one
class, interns1.py, and one weight mapping: `model.vision_tower.*`,
`model.multi_modal_projector.*`, `model.language_model.*`, `lm_head.*`), its images through
transformers' InternVLProcessor (GotOcr2 tiles, <img> / <IMG_CONTEXT> run / </img>). Read here:
vision_config's InternVLVisionConfig fields (a field that is not one is refused by name),
text_config (qwen3_moe: Intern-S1; qwen3: Intern-S1-mini), image_token_id, downsample_ratio,
projector_hidden_act, vision_feature_layer / _select_strategy; the head tied by text_config
alone, as vLLM builds the text model. vLLM's tower takes its q / k norms' eps from
vision_config.layer_norm_eps, InternVL's is 1e-6: with use_qk_norm another eps is refused.
The release's tokenizer is its own remote class (scientific sub-vocabularies): the engine loads
it as for any checkpoint (trust_remote_code decides).
"""

from __future__ import annotations

from typing import Any

import transformers

from paged_engine.models.remote_aliases import RawConfig

LIGHTON_OCR = "LightOnOCRForConditionalGeneration"
# Mistral 3's switch -> the one value LightOnOCR's model runs
_LIGHTON_FIXED: dict[str, Any] = {
    "vision_feature_layer": -1,
    "projector_hidden_act": "gelu",
    "multimodal_projector_bias": False,
}
INTERN_S1 = "InternS1ForConditionalGeneration"
# vision_config keys that name or describe the remote class, not the tower's maths
_VISION_META = (
    "architectures",
    "auto_map",
    "model_type",
    "_name_or_path",
    "torch_dtype",
    "dtype",
    "transformers_version",
    "drop_path_rate",
)
# InternVLConfig fields Intern-S1's config.json holds under the same names
_INTERN_S1_TOP = (
    "downsample_ratio",
    "projector_hidden_act",
    "vision_feature_layer",
    "vision_feature_select_strategy",
    "image_seq_length",
)
_QK_NORM_EPS = 1e-6  # multimodal/internvl.py's q / k RMSNorm eps (vLLM's: the tower's eps)


def _sub_config(raw: RawConfig, name: str) -> dict[str, Any]:
    sub = raw.get(name)
    if not isinstance(sub, dict):
        raise ValueError(f"config.json field {name!r} must be an object, got {sub!r}")
    return sub


def lighton_ocr_config(raw: RawConfig) -> Any:
    """LightOnOCR-1B's Mistral3-style config.json as transformers' LightOnOcrConfig (the
    architecture name kept); ValueError naming a field whose value the model does not run."""
    for name, served in _LIGHTON_FIXED.items():
        value = raw.get(name)
        if value is not None and value != served:
            raise ValueError(
                f"config.json field {name!r}={value!r} is not supported by {LIGHTON_OCR}: "
                f"{served!r} (LightOnOCR's projector and tower read-out)"
            )
    token = raw.get("image_token_id", raw.get("image_token_index"))
    if isinstance(token, bool) or not isinstance(token, int) or token < 0:
        raise ValueError(f"config.json field 'image_token_id' must be a token id, got {token!r}")
    text = _sub_config(raw, "text_config")
    vision = _sub_config(raw, "vision_config")
    dtype = raw.get("dtype") or raw.get("torch_dtype")
    config = transformers.LightOnOcrConfig(
        text_config={k: v for k, v in text.items() if k != "architectures"},
        vision_config=vision,
        image_token_id=token,
        spatial_merge_size=raw.get("spatial_merge_size", 2),
        tie_word_embeddings=bool(text.get("tie_word_embeddings", False)),
        **({"dtype": dtype} if dtype else {}),
    )
    config.architectures = list(raw["architectures"])
    return config


def intern_s1_config(raw: RawConfig) -> Any:
    """Intern-S1's config.json (model_type "interns1") as transformers' InternVLConfig (the
    architecture name kept); ValueError naming a vision field InternVL's tower does not hold or
    a q / k norm eps it does not run."""
    text = _sub_config(raw, "text_config")
    vision = dict(_sub_config(raw, "vision_config"))
    for name in _VISION_META:
        vision.pop(name, None)
    known = transformers.InternVLVisionConfig().to_dict()
    for name in vision:
        if name not in known:
            raise ValueError(
                f"config.json field 'vision_config.{name}' is not supported by {INTERN_S1} "
                "(not a field of InternVL's tower)"
            )
    eps = vision.get("layer_norm_eps", known["layer_norm_eps"])
    if vision.get("use_qk_norm") and eps != _QK_NORM_EPS:
        raise ValueError(
            f"config.json field 'vision_config.layer_norm_eps'={eps!r} with use_qk_norm is not "
            f"supported by {INTERN_S1}: {_QK_NORM_EPS} (InternVL's q / k norm eps)"
        )
    token = raw.get("image_token_id")
    if isinstance(token, bool) or not isinstance(token, int) or token < 0:
        raise ValueError(f"config.json field 'image_token_id' must be a token id, got {token!r}")
    fields = {k: raw[k] for k in _INTERN_S1_TOP if raw.get(k) is not None}
    dtype = raw.get("dtype") or raw.get("torch_dtype")
    config = transformers.InternVLConfig(
        text_config={k: v for k, v in text.items() if k not in ("architectures", "auto_map")},
        vision_config=vision,
        image_token_id=token,
        tie_word_embeddings=bool(text.get("tie_word_embeddings", False)),  # vLLM: the text model's
        **fields,
        **({"dtype": dtype} if dtype else {}),
    )
    config.architectures = list(raw["architectures"])
    return config
