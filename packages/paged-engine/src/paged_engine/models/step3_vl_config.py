"""Step3-VL's remote config (`Step3VLForConditionalGeneration`, model_type "step3_vl":
stepfun-ai/step3) read without its remote code (models/remote_aliases.py's REMOTE_CONFIGS row),
with the defaults of vLLM's Step3VLConfig / Step3VisionEncoderConfig.

    config.json                                   -> Step3VLConfig (the wrapper)
    text_config                                   -> text_config: models/step3_text.py's
                                                     step3_text_config (model_type "step3_text")
    vision_config {hidden_size, intermediate_size, output_hidden_size, num_hidden_layers,
        num_attention_heads, num_channels, image_size, patch_size, hidden_act, layer_norm_eps}
                                                  -> vision_config (model_type TOWER_TYPE)
    image_token_id (128001, "<im_patch>"), understand_projector_stride (1), projector_bias (true)
                                                  kept

vLLM's processor writes a fixed 169 placeholders for the 728-pixel global view and 81 for each
504-pixel patch (multimodal/step3_vl.py); the tower (multimodal/step3_vl_encoder.py) makes
((S / p - 2) // stride + 1) halved (ceil) squared rows a view. A config whose geometry gives
other counts (the release's stride is 2; vLLM's default 1 gives 676 rows) cannot run images
anywhere: its vision_config.model_type says so (`unserved`) and the engine serves its text
model alone, naming the field in its warning.
"""

from __future__ import annotations

from typing import Any

import transformers

from paged_engine.models.remote_aliases import RawConfig, field
from paged_engine.models.step3_text import step3_text_config

ARCH = "Step3VLForConditionalGeneration"
TOWER_TYPE = "step3_vision_encoder"
IMAGE_TOKEN_ID = 128001  # "<im_patch>"
GLOBAL_SIDE, PATCH_SIDE = 728, 504  # vLLM's Step3VLProcessor: image_size, patch_size
GLOBAL_ROWS, PATCH_ROWS = 169, 81  # its num_image_feature_size, num_patch_feature_size
# vision_config field -> vLLM's Step3VisionEncoderConfig default
_VISION_INTS = {
    "hidden_size": 1792,
    "intermediate_size": 3072,
    "output_hidden_size": 4096,
    "num_hidden_layers": 63,
    "num_attention_heads": 16,
    "num_channels": 3,
    "image_size": 728,
    "patch_size": 14,
}
ACTIVATIONS = ("quick_gelu", "gelu", "gelu_pytorch_tanh", "silu")


class Step3VLConfig(transformers.PretrainedConfig):
    """The wrapper: text_config (Step3's decoder), vision_config (the ViT's fields)."""

    model_type = "step3_vl"


def view_rows(side: int, patch: int, stride: int) -> int:
    """Rows the tower and downsamplers make of a `side`-pixel view: the patch grid g = side //
    patch, vit_downsampler (kernel 2, `stride`), vit_downsampler2 (kernel 3, stride 2, pad 1)."""
    grid = side // patch
    first = (grid - 2) // stride + 1
    second = (first - 1) // 2 + 1
    return second * second


def unserved(vision: dict[str, Any], stride: int) -> str | None:
    """Why the tower's rows cannot fill vLLM's fixed placeholder runs (None: they can)."""
    patch, size = vision["patch_size"], vision["image_size"]
    if size != GLOBAL_SIDE:
        return f"vision_config.image_size={size} (the processor's global view is {GLOBAL_SIDE})"
    for side, want in ((GLOBAL_SIDE, GLOBAL_ROWS), (PATCH_SIDE, PATCH_ROWS)):
        got = view_rows(side, patch, stride)
        if side % patch or got != want:
            return (
                f"understand_projector_stride={stride} with vision_config.patch_size={patch} "
                f"makes {got} rows of a {side}-pixel view, not the processor's {want}"
            )
    return None


def _vision_config(raw: RawConfig, stride: int) -> transformers.PretrainedConfig:
    vision = raw.get("vision_config") or {}
    if not isinstance(vision, dict):
        raise ValueError(f"{ARCH}: config.json field vision_config must be a dict")
    fields: dict[str, Any] = {k: field(vision, k, int, d) for k, d in _VISION_INTS.items()}
    act = field(vision, "hidden_act", str, "quick_gelu")
    if act not in ACTIVATIONS:
        raise ValueError(
            f"{ARCH}: config.json field vision_config.hidden_act={act!r} is not supported "
            f"(only {', '.join(ACTIVATIONS)})"
        )
    if fields["hidden_size"] % fields["num_attention_heads"]:
        raise ValueError(
            f"{ARCH}: vision_config.hidden_size={fields['hidden_size']} is not a multiple of "
            f"vision_config.num_attention_heads={fields['num_attention_heads']}"
        )
    why = unserved(fields, stride)
    return transformers.PretrainedConfig(
        model_type=TOWER_TYPE if why is None else f"{TOWER_TYPE} unserved: {why}",
        hidden_act=act,
        layer_norm_eps=field(vision, "layer_norm_eps", float, 1e-5),
        **fields,
    )


def step3_vl_config(raw: RawConfig) -> Step3VLConfig:
    """The translated config (see the module doc); ValueError naming a field not served."""
    text = step3_text_config(raw)
    stride = field(raw, "understand_projector_stride", int, 1)
    if stride < 1:
        raise ValueError(f"{ARCH}: config.json field understand_projector_stride={stride} < 1")
    return Step3VLConfig(
        architectures=[ARCH],
        text_config=text,
        vision_config=_vision_config(raw, stride),
        image_token_id=field(raw, "image_token_id", int, IMAGE_TOKEN_ID),
        understand_projector_stride=stride,
        projector_bias=field(raw, "projector_bias", bool, True),
        hidden_size=text.hidden_size,
        bos_token_id=getattr(text, "bos_token_id", None),
        eos_token_id=getattr(text, "eos_token_id", None),
        pad_token_id=getattr(text, "pad_token_id", None),
        tie_word_embeddings=False,
    )
