"""MiniCPM-V's remote config (`MiniCPMV`, model_type "minicpmv": openbmb/MiniCPM-Llama3-V-2_5,
openbmb/MiniCPM-V-2_6, openbmb/MiniCPM-V-4, openbmb/MiniCPM-V-4_5) read without its remote
code (models/remote_aliases.py's REMOTE_CONFIGS row), as vLLM's minicpmv.py reads it.

    config.json                                   -> MiniCPMVRemoteConfig
    version 2.5 / 2.6 / 4.0 / 4.5                 kept (the only ones served: see below);
        absent (2.5's first config.json): vLLM's guess, 2.0 where hidden_size 2304 and
        query_num 64, else 2.5
    the LM's fields at the top level              -> text_config: LlamaConfig (2.5: Llama 3,
                                                     no biases; 4.0: MiniCPM4-3B as vLLM's
                                                     MiniCPMV4_0 runs it, Llama's defaults,
                                                     head_dim), Qwen2Config (2.6),
                                                     Qwen3Config (4.5: head_dim, q / k norms)
    rope_scaling (4.0: MiniCPM4's LongRoPE)       -> rope_parameters {rope_type "longrope",
        short_factor, long_factor, original_max_position_embeddings}; layers/rotary.py picks
        the factor set as HF and vLLM do; other versions, other rope types: refused
    vision_config {hidden_size, image_size, intermediate_size, num_attention_heads,
        num_hidden_layers, patch_size; model_type "siglip" / "idefics2" (2.5)}
                                                  -> vision_config: Idefics2VisionConfig (the
        NaViT SigLIP-400M tower vLLM runs as its Idefics2VisionTransformer with tgt_sizes)
    query_num (64)                                kept: the resampler's queries, the run of
        placeholders of every view
    slice_config {max_slice_nums, scale_resolution, patch_size}, slice_mode, use_image_id
                                                  kept (the image processor's fallbacks; 2.5:
        the same fields at the top level; no image ids, whatever use_image_id says)
    (none: the release tokenizer's "<unk>")       image_token_id: the saved tokenizer's id
        (remote_aliases.saved_token_id), else 128244; the layout checks the tokenizer agrees

4.0 is 2.6 with MiniCPM4-3B for the LM: the same resampler (vLLM's Resampler2_5), the same
prompt (image ids, slices). MiniCPM4's muP scalars (scale_emb, scale_depth, dim_model_base) and
InfLLM-v2 `sparse_config`, where a config.json carries them, are not read: vLLM runs 4.0's LM as
its plain LlamaForCausalLM, which reads none of them.
4.5's resampler adds its 2-D positions to the values instead of the keys (vLLM's Resampler4_5
for images; its temporal positions are videos'): multimodal/minicpmv_remote.py reads `version`.
2.5 feeds its tower each view as one row of patches (the release and vLLM pass no target
sizes), so its position ids are bucketed along that row: multimodal/minicpmv_remote.py.
Refused by name: a `version` other than 2.5 / 2.6 / 4.0 / 4.5 (2.0: MiniCPM-V 2's timm SigLIP
tower resamples its position table with an antialiased bicubic no transformers class
reproduces, and its MiniCPM-2B LM scales embeddings and residuals),
drop_vision_last_layer true, slice_mode false, use_sliding_window true, rope_scaling set (4.0:
other than longrope), attention_bias / mlp_bias true (Llama LMs), a hidden_size the
resampler's 128-wide heads do not divide.
"""

from __future__ import annotations

from typing import Any

import transformers

from paged_engine.models.remote_aliases import RawConfig, field, qwen2_text_fields, vocab_token_id

IMAGE_TOKEN_ID = 128244  # "<unk>" in openbmb/MiniCPM-V-2_6's tokenizer
VERSIONS = ("2.5", "2.6", "4.0", "4.5")
_TEXT_CLASSES = {
    "2.5": "LlamaConfig",
    "2.6": "Qwen2Config",
    "4.0": "LlamaConfig",
    "4.5": "Qwen3Config",
}
# the versions with a Llama LM: the defaults of Llama 3 (2.5) and of LlamaConfig (4.0)
_LLAMA_DEFAULTS = {
    "2.5": {"rms_norm_eps": 1e-5, "max_position_embeddings": 8192, "rope_theta": 5e5},
    "4.0": {"rms_norm_eps": 1e-6, "max_position_embeddings": 2048, "rope_theta": 1e4},
}
_LONGROPE_KEYS = ("short_factor", "long_factor", "original_max_position_embeddings", "factor")
_LEGACY_SLICING = ("max_slice_nums", "scale_resolution", "patch_size")  # 2.5: top level
RESAMPLER_HEAD = 128  # vLLM: num_heads = embed_dim // 128
_VISION_INTS = (
    "hidden_size",
    "image_size",
    "intermediate_size",
    "num_attention_heads",
    "num_hidden_layers",
    "patch_size",
)


class MiniCPMVRemoteConfig(transformers.PretrainedConfig):
    """The wrapper: text_config (Qwen2 / Qwen3), vision_config (Idefics2's tower), the resampler and
    slicing fields."""

    model_type = "minicpmv"


def _refuse(name: str, value: Any, want: str) -> ValueError:
    return ValueError(f"MiniCPMV: config.json field {name}={value!r} is not supported: {want}")


def version(raw: RawConfig) -> str:
    """The release's `version` as written ("2.6"; absent: vLLM's guess from hidden_size and
    query_num); ValueError naming it unless served."""
    value = raw.get("version")
    if value is None:  # vLLM's get_version_by_config
        two = raw.get("hidden_size") == 2304 and raw.get("query_num") == 64
        value = 2.0 if two else 2.5
    text = f"{float(value):.1f}" if isinstance(value, (int, float)) else str(value)
    if isinstance(value, bool) or text not in VERSIONS:
        raise _refuse("version", value, f"one of {VERSIONS} (MiniCPM-V 2.5 / 2.6 / 4.0 / 4.5)")
    return text


def _longrope(scaling: Any) -> dict[str, Any]:
    """4.0's rope_scaling (MiniCPM4's LongRoPE) as rope_parameters entries; {} where null."""
    if scaling is None:
        return {}
    kind = isinstance(scaling, dict) and (scaling.get("rope_type") or scaling.get("type"))
    factors = kind and all(isinstance(scaling.get(k), list) for k in _LONGROPE_KEYS[:2])
    if kind != "longrope" or not factors:
        raise _refuse("rope_scaling", scaling, "null or longrope with short / long_factor lists")
    kept = {k: scaling[k] for k in _LONGROPE_KEYS if scaling.get(k) is not None}
    return {"rope_type": "longrope", **kept}


def _text_config(raw: RawConfig, version: str) -> transformers.PretrainedConfig:
    rope: dict[str, Any] = {}
    if version in _LLAMA_DEFAULTS:  # Llama: its own defaults, no biases, no sliding window
        raw = {**_LLAMA_DEFAULTS[version], **{k: v for k, v in raw.items() if v is not None}}
        for name in ("attention_bias", "mlp_bias"):
            if raw.get(name):
                raise _refuse(name, True, "false (Llama's, as the release has it)")
        if version == "4.0":  # a copy: the caller's dict keeps its rope_scaling
            rope = _longrope(raw.pop("rope_scaling", None))
    fields = qwen2_text_fields(raw, "MiniCPMV")
    fields["rope_parameters"] |= rope
    if version in _LLAMA_DEFAULTS:
        del fields["use_sliding_window"]
    if version in ("4.0", "4.5"):  # a head_dim of their own (MiniCPM4-3B: 2560 / 32 = 80)
        heads = fields["num_attention_heads"]
        fields["head_dim"] = field(raw, "head_dim", int, fields["hidden_size"] // heads)
    if version == "4.5" and raw.get("attention_bias"):  # Qwen3: no attention bias
        raise _refuse("attention_bias", True, "false (Qwen3's)")
    return getattr(transformers, _TEXT_CLASSES[version])(**fields)


def _vision_config(raw: RawConfig) -> transformers.Idefics2VisionConfig:
    vision = raw.get("vision_config")
    if not isinstance(vision, dict):
        raise _refuse("vision_config", vision, "a dict (the SigLIP tower's fields)")
    if vision.get("model_type", "siglip") not in ("siglip", "siglip_vision_model", "idefics2"):
        raise _refuse("vision_config.model_type", vision["model_type"], "'siglip' / 'idefics2'")
    fields = {k: field(vision, k, int) for k in _VISION_INTS}
    return transformers.Idefics2VisionConfig(
        **fields,
        num_channels=field(vision, "num_channels", int, 3),
        layer_norm_eps=field(vision, "layer_norm_eps", float, 1e-6),
        hidden_act=vision.get("hidden_act", "gelu_pytorch_tanh"),
    )


def minicpmv_remote_config(raw: RawConfig) -> MiniCPMVRemoteConfig:
    """The translated config (see the module doc); ValueError naming a field not served."""
    text_version = version(raw)
    if raw.get("drop_vision_last_layer"):
        raise _refuse("drop_vision_last_layer", True, "false (the releases' own)")
    if not raw.get("slice_mode", True):
        raise _refuse("slice_mode", False, "true (the releases' own)")
    text = _text_config(raw, text_version)
    if text.hidden_size % RESAMPLER_HEAD:
        raise _refuse("hidden_size", text.hidden_size, f"a multiple of {RESAMPLER_HEAD}")
    token = vocab_token_id(raw, "image_token_id", IMAGE_TOKEN_ID, text.vocab_size, "MiniCPMV")
    slices = raw.get("slice_config") or {}
    if not isinstance(slices, dict):
        raise _refuse("slice_config", slices, "a dict")
    if text_version == "2.5":
        slices = {k: raw[k] for k in _LEGACY_SLICING if raw.get(k) is not None} | slices
    return MiniCPMVRemoteConfig(
        architectures=list(raw.get("architectures") or ["MiniCPMV"]),
        version=text_version,
        text_config=text,
        vision_config=_vision_config(raw),
        query_num=field(raw, "query_num", int, 64),
        slice_config=dict(slices),
        use_image_id=bool(raw.get("use_image_id", True)) and text_version != "2.5",
        image_token_id=token,
        bos_token_id=text.bos_token_id,
        eos_token_id=text.eos_token_id,
        pad_token_id=text.pad_token_id,
        tie_word_embeddings=text.tie_word_embeddings,
    )
