"""OpenCUA's remote config (`OpenCUAForConditionalGeneration`, model_type "opencua":
xlangai/OpenCUA-7B / -32B) read without its remote code (models/remote_aliases.py's
REMOTE_CONFIGS row), as vLLM's opencua.py and its OpenCUAConfig read it.

    config.json                                   -> OpenCUAConfig
    text_config (model_type "qwen2")              -> text_config: Qwen2Config (default rope at
        plain 1-D positions: OpenCUA replaced Qwen2.5-VL's M-RoPE by 1-D RoPE, and vLLM runs
        the decoder as its Qwen2ForCausalLM)
    vision_config (model_type "qwen2_5_vl")       -> Qwen2_5_VLVisionConfig (the tower and its
        merger, multimodal/opencua.py; `in_chans` read as in_channels where that is absent)
    the placeholder "<|media_placeholder|>"       -> image_token_id: the checkpoint tokenizer's
        id for that text (remote_aliases' PLACEHOLDER_TOKENS lookup, as vLLM looks it up in the
        vocabulary first), else media_placeholder_token_id, else 151664

A config.json that sets image_token_id itself has it taken over media_placeholder_token_id
(vLLM reads only the latter; the release sets only the latter). Refused by name: a text_config
other than Qwen2's, its rope_scaling / use_sliding_window (qwen2_text_fields), a head_dim other
than hidden_size / num_attention_heads (vLLM's Qwen2 derives it), a tower other than
Qwen2.5-VL's, an out_hidden_size other than the decoder's hidden_size, a placeholder id past the
vocabulary, a top-level rms_norm_eps other than 1e-6 (vLLM's tower norms read it; the release
has none).
"""

from __future__ import annotations

from typing import Any

import transformers

from paged_engine.models.remote_aliases import RawConfig, qwen2_text_fields, vocab_token_id

ARCH = "OpenCUAForConditionalGeneration"
PLACEHOLDER = "<|media_placeholder|>"
PLACEHOLDER_ID = 151664  # the release's media_placeholder_token_id
TOWER_TYPES = ("qwen2_5_vl", "qwen2_5_vl_vision")
TOWER_EPS = 1e-6  # the tower's norm eps (HF's, qwen2_vl_vision.py's)
# fields of a sub-config that are not settings
_DROPPED = ("architectures", "model_type", "_name_or_path", "auto_map", "transformers_version")


class OpenCUAConfig(transformers.PretrainedConfig):
    """The wrapper: text_config (Qwen2), vision_config (Qwen2.5-VL's tower), image_token_id."""

    model_type = "opencua"


def _refuse(name: str, value: Any, want: str) -> ValueError:
    return ValueError(f"{ARCH}: config.json field {name}={value!r} is not supported: {want}")


def _section(raw: RawConfig, name: str) -> dict[str, Any]:
    section = raw.get(name)
    if not isinstance(section, dict):
        raise _refuse(name, section, "a dict")
    return section


def _text_config(raw: RawConfig) -> transformers.Qwen2Config:
    text = _section(raw, "text_config")
    kind = text.get("model_type", "qwen2")
    if kind != "qwen2":
        raise _refuse("text_config.model_type", kind, "'qwen2' (vLLM runs it as Qwen2)")
    config = transformers.Qwen2Config(**qwen2_text_fields(text, ARCH))
    head_dim = text.get("head_dim")
    derived = config.hidden_size // config.num_attention_heads
    if head_dim is not None and head_dim != derived:
        raise _refuse("text_config.head_dim", head_dim, f"hidden_size / heads = {derived}")
    return config


def _vision_config(raw: RawConfig, text_hidden: int) -> transformers.Qwen2_5_VLVisionConfig:
    vision = _section(raw, "vision_config")
    kind = vision.get("model_type", "qwen2_5_vl")
    if kind not in TOWER_TYPES:
        raise _refuse("vision_config.model_type", kind, "Qwen2.5-VL's tower ('qwen2_5_vl')")
    fields = {k: v for k, v in vision.items() if k not in _DROPPED}
    if "in_channels" not in fields and "in_chans" in fields:
        fields["in_channels"] = fields["in_chans"]
    config = transformers.Qwen2_5_VLVisionConfig(**fields)
    if config.out_hidden_size != text_hidden:
        want = f"the decoder's hidden_size {text_hidden}"
        raise _refuse("vision_config.out_hidden_size", config.out_hidden_size, want)
    return config


def opencua_config(raw: RawConfig) -> OpenCUAConfig:
    """The translated config (see the module doc); ValueError naming a field not served."""
    eps = raw.get("rms_norm_eps")
    if eps is not None and eps != TOWER_EPS:  # vLLM's tower norms would take it
        raise _refuse("rms_norm_eps", eps, f"absent or {TOWER_EPS} (the tower's norms)")
    text = _text_config(raw)
    vision = _vision_config(raw, text.hidden_size)
    name = "image_token_id" if raw.get("image_token_id") is not None else None
    name = name or "media_placeholder_token_id"
    token = vocab_token_id(raw, name, PLACEHOLDER_ID, text.vocab_size, ARCH)
    dtype = raw.get("dtype") or raw.get("torch_dtype")
    return OpenCUAConfig(
        architectures=list(raw.get("architectures") or [ARCH]),
        text_config=text,
        vision_config=vision,
        image_token_id=token,
        bos_token_id=text.bos_token_id,
        eos_token_id=text.eos_token_id,
        pad_token_id=text.pad_token_id,
        tie_word_embeddings=text.tie_word_embeddings,
        **({"dtype": dtype} if dtype is not None else {}),
    )
