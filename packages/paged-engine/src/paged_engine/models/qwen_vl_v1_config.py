"""Qwen-VL's remote config (Qwen/Qwen-VL, Qwen/Qwen-VL-Chat: architectures ["QWenLMHeadModel"],
model_type "qwen", with a `visual` section) read without its remote code, as vLLM's qwen.py
hands such a config to its QwenVLForConditionalGeneration (qwen_vl.py).

    config.json                       -> a flat config: Qwen v1's text fields (models/qwen_v1.py's
                                         qwen_v1_config), architectures
                                         ["QwenVLForConditionalGeneration"] (vLLM's name, which
                                         the image tables know)
    visual {width, layers, heads, mlp_ratio, image_size, patch_size, output_dim,
        image_start_id, n_queries (256)}
                                      -> config.visual (checked ints / float, n_queries added)
    image_start_id (151857)           <img>; </img> and the image pad are the next two ids
                                      -> image_token_id: the pad (image_start_id + 2)

Refused by name: a `visual` field missing or of the wrong type, output_dim other than the
text hidden_size or not a multiple of the resampler's 128-wide heads, an image_size the patch
does not divide, a patch grid whose half-grid squared is not n_queries (vLLM's prompt takes
(image_size // patch_size // 2)^2 pads an image, its resampler n_queries rows: they must
agree), n_queries not a square, ids past the vocabulary.
"""

from __future__ import annotations

import math
from typing import Any

from transformers import PretrainedConfig

from paged_engine.models.qwen_v1 import qwen_v1_config
from paged_engine.models.remote_aliases import RawConfig, field

ARCH = "QwenVLForConditionalGeneration"
RESAMPLER_HEAD = 128  # vLLM: num_heads = output_dim // 128
_INTS = ("width", "layers", "heads", "image_size", "patch_size", "output_dim", "image_start_id")


def _refuse(name: str, value: Any, want: str) -> ValueError:
    return ValueError(f"config.json field 'visual.{name}' is {value!r}; served: {want}")


def visual_fields(raw: RawConfig, hidden: int, vocab: int) -> dict[str, Any]:
    """config.json's `visual` section, checked (see the module doc)."""
    visual = raw.get("visual")
    if not isinstance(visual, dict):
        raise ValueError(f"config.json field 'visual' must be a dict, got {visual!r}")
    named = {f"visual.{k}": v for k, v in visual.items()}  # errors name "visual.<field>"
    out: dict[str, Any] = {k: field(named, f"visual.{k}", int) for k in _INTS}
    out["mlp_ratio"] = field(named, "visual.mlp_ratio", float)
    out["n_queries"] = field(named, "visual.n_queries", int, 256)
    if out["output_dim"] != hidden:
        raise _refuse("output_dim", out["output_dim"], f"the text hidden_size {hidden}")
    if out["output_dim"] % RESAMPLER_HEAD:
        raise _refuse("output_dim", out["output_dim"], f"a multiple of {RESAMPLER_HEAD}")
    if out["width"] % out["heads"]:
        raise _refuse("heads", out["heads"], f"a divisor of width {out['width']}")
    if out["image_size"] % out["patch_size"]:
        raise _refuse("image_size", out["image_size"], f"a multiple of {out['patch_size']}")
    side = math.isqrt(out["n_queries"])
    if side * side != out["n_queries"]:
        raise _refuse("n_queries", out["n_queries"], "a square")
    half = out["image_size"] // out["patch_size"] // 2
    if half * half != out["n_queries"]:
        raise _refuse(
            "image_size",
            out["image_size"],
            f"(image_size // patch_size // 2)^2 == n_queries {out['n_queries']}",
        )
    if out["image_start_id"] + 2 >= vocab:
        raise _refuse("image_start_id", out["image_start_id"], f"+ 2 below vocab_size {vocab}")
    return out


def qwen_vl_v1_config(raw: RawConfig) -> PretrainedConfig:
    """The translated config (see the module doc); ValueError naming a field not served."""
    config = qwen_v1_config(raw)
    visual = visual_fields(raw, config.hidden_size, config.vocab_size)
    config.architectures = [ARCH]
    config.visual = visual
    config.image_token_id = visual["image_start_id"] + 2
    return config
