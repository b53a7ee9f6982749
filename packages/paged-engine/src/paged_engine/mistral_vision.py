"""Pixtral / Mistral Small 3.x vision checkpoints in Mistral's native format (vLLM's
`PixtralForConditionalGeneration` with config / load / tokenizer format "mistral"): params.json's
`vision_encoder` section, the consolidated `vision_encoder.*`, `vision_language_adapter.*`,
`patch_merger.*` and `pre_mm_projector_norm.*` tensors, tekken.json's [IMG] specials.

    wrapper = vision_wrapper_config(vision_params, text_config)  # LlavaConfig / Mistral3Config
    name = vision_hf_name("vision_encoder.transformer.layers.0.attention.wq.weight")
    processor = native_image_processor(path)                     # HF's Pixtral image processor

Each native checkpoint is mapped onto the HF form paged already runs (multimodal/pixtral.py),
as transformers' conversion scripts (convert_pixtral_weights_to_hf.py, convert_mistral3_...)
do, so the model code is shared:
    mm_projector_id ""            -> LlavaForConditionalGeneration, Pixtral tower (Pixtral-12B):
                                     w_in -> act -> w_out
    mm_projector_id "patch_merge" -> Mistral3ForConditionalGeneration (Mistral Small 3.1+):
                                     pre_mm_projector_norm -> patch_merger -> w_in -> act -> w_out
The tower's MLP is SiLU-gated and the adapter's act exact GELU (vLLM's VisionTransformer and
VisionLanguageAdapter); the vision wq / wk rows are permuted from Mistral's interleaved rotary
pairs to HF's halves like the text model's (mistral_format.rotate_half_rows). Refused by name:
a vision field paged does not map, a projector id other than those two, a norm without the
merger (or the reverse). The projector norm's eps is vLLM's 1e-5 whatever the text norm_eps
(HF's Mistral 3 takes the text's; Mistral Large 3's is 1e-6): the wrapper config carries it as
`projector_rms_norm_eps`, which multimodal/pixtral.py reads.

Images: vLLM's mistral tokenizer (mistral_common's ImageEncoder) shrinks an image to fit
`max_image_size` (tekken.json's `image` section, else params.json's), rounds its sides up to
whole units u = patch_size * spatial_merge_size, normalizes with CLIP's mean / std and writes
rows of [IMG], [IMG_BREAK] after each row, [IMG_END] last. Here HF's PixtralImageProcessor with
those settings and paged's Pixtral line layout do the same, with two differences in images
that are resized: HF floors the shrunk sides where mistral_common rounds them (a side whose
scaled length ends in .5 or more just past a unit boundary gets a line / column less here), and
pixels are resampled by PIL's bicubic (antialiased) rather than OpenCV's INTER_CUBIC. An image
that fits and whose sides are multiples of u is not resampled by either: the same pixels.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

VISION_FIELD = "vision_encoder"
PATCH_MERGE = "patch_merge"
_PROJECTOR_EPS = 1e-5  # vLLM's pre_mm_projector_norm
_KNOWN = {
    "hidden_size",
    "num_channels",
    "image_size",
    "max_image_size",
    "patch_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "rope_theta",
    "image_token_id",
    "image_break_token_id",
    "image_end_token_id",
    "adapter_bias",
    "spatial_merge_size",
    "add_pre_mm_projector_layer_norm",
    "mm_projector_id",
}
# (params.json id field, tekken special, mistral_common's default id)
_IMAGE_TOKENS = (
    ("image_token_id", "[IMG]", 10),
    ("image_break_token_id", "[IMG_BREAK]", 12),
    ("image_end_token_id", "[IMG_END]", 13),
)
_WHERE = "params.json vision_encoder"


def _field(vision: dict[str, Any], name: str, default: Any = None) -> Any:
    value = vision.get(name, default)
    if value is None:
        raise ValueError(f"{_WHERE}.{name} is missing")
    return value


def vision_wrapper_config(vision: dict[str, Any], text: Any) -> Any:
    """The HF wrapper config (LlavaConfig or Mistral3Config, Pixtral tower) of params.json's
    `vision_encoder` section around the text model's config `text`."""
    import transformers

    if not isinstance(vision, dict):
        raise ValueError(f"{_WHERE} must be a JSON object")
    vision = {k: v for k, v in vision.items() if v is not None}
    unknown = sorted(set(vision) - _KNOWN)
    if unknown:
        raise ValueError(f"{_WHERE} fields {unknown} are not mapped by paged")
    hidden = int(_field(vision, "hidden_size"))
    heads = int(_field(vision, "num_attention_heads"))
    tower = transformers.PixtralVisionConfig(
        hidden_size=hidden,
        intermediate_size=int(_field(vision, "intermediate_size")),
        num_hidden_layers=int(_field(vision, "num_hidden_layers")),
        num_attention_heads=heads,
        num_channels=int(vision.get("num_channels", 3)),
        image_size=int(_field(vision, "image_size")),
        patch_size=int(_field(vision, "patch_size")),
        head_dim=hidden // heads,
        hidden_act="silu",  # vLLM's native tower: w2(silu(w1 x) * w3 x)
        rope_parameters={"rope_type": "axial", "rope_theta": float(vision.get("rope_theta", 1e4))},
    )
    projector = vision.get("mm_projector_id", "")
    merge = vision.get("spatial_merge_size", 1)
    norm = bool(vision.get("add_pre_mm_projector_layer_norm", False))
    common: dict[str, Any] = {
        "text_config": text,
        "vision_config": tower,
        "multimodal_projector_bias": bool(vision.get("adapter_bias", True)),  # vLLM's default
        "projector_hidden_act": "gelu",
        "vision_feature_layer": -1,
        "tie_word_embeddings": bool(text.tie_word_embeddings),
        "dtype": getattr(text, "dtype", None),
    }
    image_id = int(vision.get("image_token_id", _IMAGE_TOKENS[0][2]))
    if projector == PATCH_MERGE:
        if not norm:
            raise ValueError(
                f"{_WHERE}.add_pre_mm_projector_layer_norm=false with mm_projector_id="
                f"{PATCH_MERGE!r} is not supported (Mistral 3 has both)"
            )
        if isinstance(merge, bool) or not isinstance(merge, int) or merge < 1:
            raise ValueError(f"{_WHERE}.spatial_merge_size={merge!r} must be a positive int")
        config = transformers.Mistral3Config(
            image_token_index=image_id, spatial_merge_size=merge, **common
        )
        config.architectures = ["Mistral3ForConditionalGeneration"]
        config.projector_rms_norm_eps = _PROJECTOR_EPS  # (not the text norm_eps, as in HF)
        return config
    if projector != "":
        raise ValueError(
            f"{_WHERE}.mm_projector_id={projector!r} is not supported: '' or {PATCH_MERGE!r}"
        )
    if norm or merge != 1:
        raise ValueError(
            f"{_WHERE}.add_pre_mm_projector_layer_norm / spatial_merge_size={merge!r} need "
            f"mm_projector_id={PATCH_MERGE!r}"
        )
    config = transformers.LlavaConfig(
        image_token_id=image_id, vision_feature_select_strategy="full", **common
    )
    config.architectures = ["LlavaForConditionalGeneration"]
    return config


# consolidated name -> HF name (as transformers saves the wrapper), first match wins
_VISION_NAMES = (
    (r"vision_encoder\.transformer\.layers\.(\d+)\.attention\.w([qkvo])\.weight",
     r"vision_tower.transformer.layers.\1.attention.\2_proj.weight"),
    (r"vision_encoder\.transformer\.layers\.(\d+)\.feed_forward\.w1\.weight",
     r"vision_tower.transformer.layers.\1.feed_forward.gate_proj.weight"),
    (r"vision_encoder\.transformer\.layers\.(\d+)\.feed_forward\.w2\.weight",
     r"vision_tower.transformer.layers.\1.feed_forward.down_proj.weight"),
    (r"vision_encoder\.transformer\.layers\.(\d+)\.feed_forward\.w3\.weight",
     r"vision_tower.transformer.layers.\1.feed_forward.up_proj.weight"),
    (r"vision_encoder\.transformer\.layers\.(\d+)\.(attention_norm|ffn_norm)\.weight",
     r"vision_tower.transformer.layers.\1.\2.weight"),
    (r"vision_encoder\.(patch_conv|ln_pre)\.weight", r"vision_tower.\1.weight"),
    (r"vision_language_adapter\.w_in\.(weight|bias)", r"multi_modal_projector.linear_1.\1"),
    (r"vision_language_adapter\.w_out\.(weight|bias)", r"multi_modal_projector.linear_2.\1"),
    (r"patch_merger\.merging_layer\.weight",
     r"multi_modal_projector.patch_merger.merging_layer.weight"),
    (r"pre_mm_projector_norm\.weight", r"multi_modal_projector.norm.weight"),
)  # fmt: skip
_VISION_PREFIXES = ("vision_encoder.", "vision_language_adapter.", "patch_merger.", "pre_mm_")
_ROTARY = re.compile(r"vision_tower\.transformer\.layers\.\d+\.attention\.[qk]_proj\.weight")


def vision_hf_name(name: str) -> str | None:
    """The HF name of a consolidated vision tensor; None for a text tensor; ValueError for a
    vision tensor paged does not know."""
    if not name.startswith(_VISION_PREFIXES):
        return None
    for pattern, new in _VISION_NAMES:
        if re.fullmatch(pattern, name):
            return re.sub(pattern, new, name)
    raise ValueError(f"load_format='mistral': unknown tensor {name!r} in the consolidated weights")


def wrapped_text_name(name: str) -> str:
    """A text model's HF name (model.*, lm_head.*) as transformers saves the wrapper's."""
    return "language_model." + name


def rotary_vision_weight(hf_name: str) -> bool:
    """Whether `hf_name` is a vision tower's q_proj / k_proj weight (rows to permute)."""
    return _ROTARY.fullmatch(hf_name) is not None


def native_image_processor(path: Path) -> Any:
    """HF's Pixtral image processor as vLLM's mistral tokenizer would resize and normalize
    (see the module docstring): tekken.json's `image` section, else params.json's vision
    fields. ValueError where tekken.json's image specials are not params.json's ids."""
    import transformers
    from transformers.utils import is_torchvision_available

    from paged_engine.mistral_format import read_params
    from paged_engine.tekken import TEKKEN_FILE, read_tekken

    vision = read_params(path)[VISION_FIELD]
    merge = int(vision.get("spatial_merge_size", 1))
    patch = int(vision["patch_size"])
    size = int(vision.get("max_image_size") or vision["image_size"])
    tekken = path / TEKKEN_FILE
    if tekken.is_file():
        image = json.loads(tekken.read_text(encoding="utf-8")).get("image") or {}
        patch = int(image.get("image_patch_size", patch))
        size = int(image.get("max_image_size", size))
        if int(image.get("spatial_merge_size", merge)) != merge:
            raise ValueError(
                f"tekken.json image.spatial_merge_size={image['spatial_merge_size']} is not "
                f"{_WHERE}.spatial_merge_size={merge}"
            )
        _, specials, _ = read_tekken(tekken)
        for field, token, default in _IMAGE_TOKENS:
            want = int(vision.get(field, default))
            if token in specials and specials.index(token) != want:
                raise ValueError(
                    f"{_WHERE}.{field}={want} but tekken.json has {token} at "
                    f"{specials.index(token)}"
                )
    if patch != int(vision["patch_size"]):
        raise ValueError(
            f"tekken.json image.image_patch_size={patch} is not {_WHERE}.patch_size="
            f"{vision['patch_size']}"
        )
    cls = (
        transformers.PixtralImageProcessor
        if is_torchvision_available()
        else transformers.PixtralImageProcessorPil
    )
    unit = patch * merge  # the line layout passes this as the patch size too
    return cls(size={"longest_edge": size}, patch_size={"height": unit, "width": unit})


def native_vision(path: Path) -> bool:
    """Whether `path` is a native vision checkpoint read from params.json: no config.json
    (vLLM's "auto" reading) and a `vision_encoder` section."""
    from paged_engine.mistral_format import native_section

    return native_section(path, VISION_FIELD)
