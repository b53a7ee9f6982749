"""GLM-4V's remote config (THUDM/glm-4v-9b: architectures ["ChatGLMModel"], model_type
"chatglm", with a `vision_config` section) read without its remote code, as vLLM's
ChatGLMConfig hands it to its GLM4VForCausalLM (glm4v.py).

    config.json                  -> a flat config: every text field as it is (models/chatglm.py
                                    reads ChatGLM's names; the loader adds Llama's), model_type
                                    "chatglm", architectures ["GLM4VForCausalLM"] (vLLM's name,
                                    which the image tables know)
    vision_config {hidden_size, num_heads, num_hidden_layers, intermediate_size, patch_size,
        image_size, in_channels (3), num_positions, layer_norm_eps, hidden_act ("gelu"),
        scaling_factor}          -> config.vision_config (checked; a PretrainedConfig)
    boi_token_id, eoi_token_id   <|begin_of_image|>, <|end_of_image|>
    pad_token_id                 <|endoftext|>: the image pad -> image_token_id

Refused by name: a vision_config field missing or of the wrong type, in_channels other than 3,
a hidden_act other than gelu (the release's), a hidden_size the heads do not divide, an
image_size the patch does not divide or whose patch grid is odd (the 2 x 2 stride-2 conv halves
it), num_positions other than grid^2 + 1 (the table is added whole, class token first), token
ids past the vocabulary.
"""

from __future__ import annotations

from typing import Any

from transformers import PretrainedConfig

from paged_engine.models.remote_aliases import RawConfig, field

ARCH = "GLM4VForCausalLM"
_INTS = (
    "hidden_size",
    "num_heads",
    "num_hidden_layers",
    "intermediate_size",
    "patch_size",
    "image_size",
    "num_positions",
)
_DROPPED = ("vision_config", "auto_map", "architectures", "model_type", "torch_dtype", "dtype")


def _refuse(name: str, value: Any, want: str) -> ValueError:
    return ValueError(f"config.json field 'vision_config.{name}' is {value!r}; served: {want}")


def vision_fields(raw: RawConfig) -> dict[str, Any]:
    """config.json's vision_config, checked (see the module doc)."""
    vision = raw.get("vision_config")
    if not isinstance(vision, dict):
        raise ValueError(f"config.json field 'vision_config' must be a dict, got {vision!r}")
    named = {f"vision_config.{k}": v for k, v in vision.items()}  # errors name the field
    out: dict[str, Any] = {k: field(named, f"vision_config.{k}", int) for k in _INTS}
    out["in_channels"] = field(named, "vision_config.in_channels", int, 3)
    out["layer_norm_eps"] = field(named, "vision_config.layer_norm_eps", float, 1e-6)
    out["scaling_factor"] = field(named, "vision_config.scaling_factor", float)
    out["hidden_act"] = field(named, "vision_config.hidden_act", str, "gelu")
    if out["in_channels"] != 3:
        raise _refuse("in_channels", out["in_channels"], "3 (RGB)")
    if out["hidden_act"] != "gelu":
        raise _refuse("hidden_act", out["hidden_act"], "'gelu' (the release's exact GELU)")
    if out["hidden_size"] % out["num_heads"]:
        raise _refuse("num_heads", out["num_heads"], f"a divisor of {out['hidden_size']}")
    if out["image_size"] % out["patch_size"]:
        raise _refuse("image_size", out["image_size"], f"a multiple of {out['patch_size']}")
    grid = out["image_size"] // out["patch_size"]
    if grid % 2:
        raise _refuse("image_size", out["image_size"], "an even patch grid (2 x 2 downsample)")
    if out["num_positions"] != grid * grid + 1:
        raise _refuse("num_positions", out["num_positions"], f"{grid * grid + 1} (grid^2 + 1)")
    return out


def image_tokens(vision: Any) -> int:
    """Feature rows an image becomes between boi and eoi: the patch grid halved, squared."""
    half = int(vision.image_size) // int(vision.patch_size) // 2
    return half * half


def glm4v_remote_config(raw: RawConfig) -> PretrainedConfig:
    """The translated config (see the module doc); ValueError naming a field not served."""
    vision = vision_fields(raw)
    vocab = field(raw, "padded_vocab_size", int)
    ids = {k: field(raw, k, int) for k in ("boi_token_id", "eoi_token_id", "pad_token_id")}
    for name, value in ids.items():
        if value >= vocab:
            raise ValueError(
                f"config.json field {name!r} is {value}; served: below padded_vocab_size {vocab}"
            )
    field(raw, "hidden_size", int)
    field(raw, "ffn_hidden_size", int)  # the GLU projector's width too
    config = PretrainedConfig(**{k: v for k, v in raw.items() if k not in _DROPPED})
    config.model_type = "chatglm"
    config.architectures = [ARCH]
    config.vision_config = PretrainedConfig(**vision)
    config.image_token_id = ids["pad_token_id"]
    return config
