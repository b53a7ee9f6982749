"""Phi-4-multimodal's remote config (`Phi4MMForCausalLM`, model_type "phi4mm":
microsoft/Phi-4-multimodal-instruct as the Hub ships it, with auto_map remote code) read as JSON
without running that code (models/remote_aliases.py's REMOTE_CONFIGS row), into transformers'
`Phi4MultimodalConfig`, the config paged's Phi-4-multimodal path reads (multimodal/phi4mm.py,
phi4mm_audio.py; weights and prompts: multimodal/phi4mm_remote.py). The field mapping is
transformers' convert_phi4_multimodal_weights_to_hf.py's; vLLM's phi4mm.py reads the same.

    config.json                               -> Phi4MultimodalConfig
    Phi-3 fields (hidden_size, rope_scaling, partial_rotary_factor, sliding_window ...)
                                                 as they are (rope_scaling -> rope_parameters)
    attention_bias / mlp_bias / lm_head_bias     false only (transformers' decoder has none)
    embd_layer.image_embd_layer {crop_size, use_hd_transform, with_learnable_separator,
        hd_transform_order "sub_glb", image_token_compression_cls "avg_pool_2d",
        projection_cls "mlp"}                    checked (what the remote code asserts)
    embd_layer.audio_embd_layer {compression_rate = time_reduction, downsample_rate,
        projection_cls "mlp", use_qformer / use_conv_downsample false}        checked
    img_processor (null; or {layer_idx, type_feature "patch"})  vision_config.feature_layer
    (none: the remote code and vLLM build SigLIP so400m-patch14-448)   vision_config
    audio_processor.config: attention_dim, attention_heads, linear_units, num_blocks,
        nemo_conv_settings.conv_channels, relative_attention_bias_args.t5_bias_max_distance /
        t5_bias_symmetric, depthwise_seperable_out_channel (sic) ...     audio_config
    vision_lora / speech_lora {r, lora_alpha, dp, layer}   not merged: the base checkpoint's
        lora_A / lora_B are dropped and the adapters served per request from the release's
        vision-lora/ and speech-lora/ directories (vLLM's way)
    (none: the remote code's and vLLM's constants)   image_token_id 200010, audio_token_id 200011

The tower: as for Phi-3-vision (models/phi3v_config.py), a checkpoint may give its geometry as a
top-level `vision_config` (hidden_size, intermediate_size, num_attention_heads,
num_hidden_layers; the release has none) with the 448-pixel crops of 14-pixel patches kept:
small test checkpoints use it. Refused by name: anything transformers' model computes otherwise
than the remote code, e.g. a chunked audio attention mask (`chunk_size` > 0: transformers adds
the chunk mask to the scores as +1 / +0, the remote code masks), or causal false.
"""

from __future__ import annotations

from typing import Any

import transformers

from paged_engine.models.remote_aliases import RawConfig

ARCH = "Phi4MMForCausalLM"
IMAGE_TOKEN_ID, AUDIO_TOKEN_ID = 200010, 200011  # <|endoftext10|>, <|endoftext11|> (vLLM's)
CROP, PATCH = 448, 14  # the remote image processor's and tower's fixed view and patch
# SigLIP so400m-patch14-448, what the remote code builds whatever the config says
_SO400M = {"hidden_size": 1152, "intermediate_size": 4304, "num_attention_heads": 16}
_SO400M |= {"num_hidden_layers": 27}
_GEOMETRY = tuple(_SO400M)
# field -> the value served (the remote code asserts or hard-codes the same)
_IMAGE_EMBD = {
    "crop_size": CROP,
    "use_hd_transform": True,
    "with_learnable_separator": True,
    "hd_transform_order": "sub_glb",
    "image_token_compression_cls": "avg_pool_2d",
    "projection_cls": "mlp",
}
_AUDIO_EMBD = {
    "downsample_rate": 1,
    "projection_cls": "mlp",
    "use_qformer": False,
    "use_conv_downsample": False,
}
# audio_processor.config: the remote name -> transformers' (the conversion script's renames)
_AUDIO_RENAMES = {
    "attention_dim": "hidden_size",
    "attention_heads": "num_attention_heads",
    "linear_units": "intermediate_size",
    "depthwise_seperable_out_channel": "depthwise_separable_out_channel",
}
_AUDIO_SAME = (
    "num_blocks",
    "activation",
    "conv_activation",
    "conv_glu_type",
    "chunk_size",
    "left_chunk",
    "ext_pw_out_channel",
    "depthwise_multiplier",
    "kernel_size",
    "input_size",
    "time_reduction",
)
# remote fields whose value transformers' conformer hard-codes
_AUDIO_FIXED = {
    "input_layer": "nemo_conv",
    "causal": True,
    "batch_norm": False,
    "bias_in_glu": True,
    "ext_pw_kernel_size": 1,
    "linear_glu_in_convm": False,
    "attention_group_size": 1,
    "chunk_se": 0,
}
_AUDIO_IGNORED = ("activation_checkpointing", "cnn_layer_norm", "dropout_rate")
_NEMO_FIXED = {"subsampling": "dw_striding", "subsampling_conv_chunking_factor": 1}
_NEMO_FIXED |= {"is_causal": False, "activation": "relu"}
_DROPPED = (
    "auto_map",
    "_name_or_path",
    "model_type",
    "transformers_version",
    "_attn_implementation",
    "vision_config",
    "embd_layer",
    "img_processor",
    "audio_processor",
    "vision_lora",
    "speech_lora",
    "attention_bias",
    "mlp_bias",
    "lm_head_bias",
    "full_attn_mod",
    "interpolate_factor",
)


def _refuse(name: str, value: Any, want: str) -> ValueError:
    return ValueError(f"{ARCH}: config.json field {name}={value!r} is not supported: {want}")


def _dict(raw: dict[str, Any], name: str, path: str) -> dict[str, Any]:
    value = raw.get(name)
    if not isinstance(value, dict):
        raise _refuse(f"{path}{name}", value, "a dict")
    return value


def _check_fixed(given: dict[str, Any], want: dict[str, Any], path: str) -> None:
    for name, value in want.items():
        if name in given and given[name] != value:
            raise _refuse(f"{path}{name}", given[name], repr(value))


def _int(value: Any, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise _refuse(name, value, "an int")
    return value


def vision_config(raw: RawConfig) -> transformers.Phi4MultimodalVisionConfig:
    """The so400m tower (or the checkpoint's geometry, see the module) and img_processor's
    feature layer."""
    embd = _dict(raw, "embd_layer", "")
    if embd.get("embedding_cls", "image_audio") != "image_audio":
        raise _refuse("embd_layer.embedding_cls", embd["embedding_cls"], "'image_audio'")
    image = _dict(embd, "image_embd_layer", "embd_layer.")
    _check_fixed(image, _IMAGE_EMBD, "embd_layer.image_embd_layer.")
    img = raw.get("img_processor")
    if img is not None and not isinstance(img, dict):
        raise _refuse("img_processor", img, "null or a dict (SigLIP so400m is built)")
    img = img or {}
    if img.get("type_feature", "patch") != "patch":
        raise _refuse("img_processor.type_feature", img["type_feature"], "'patch'")
    layer = _int(img.get("layer_idx", -2), "img_processor.layer_idx")
    given = raw.get("vision_config") or {}
    if not isinstance(given, dict):
        raise _refuse("vision_config", given, "a dict of the tower's geometry")
    for name, want in (("image_size", CROP), ("patch_size", PATCH)):
        if given.get(name, want) != want:
            raise _refuse(f"vision_config.{name}", given[name], f"{want} (the remote HD math)")
    fields = {
        **_SO400M,
        **{k: _int(given[k], f"vision_config.{k}") for k in _GEOMETRY if k in given},
    }
    layers = fields["num_hidden_layers"]
    if not -layers <= layer < 0:  # hidden_states[layer_idx], as the release's -2
        raise _refuse("img_processor.layer_idx", layer, f"a negative index in [-{layers}, -1]")
    return transformers.Phi4MultimodalVisionConfig(
        **fields,
        image_size=CROP,
        patch_size=PATCH,
        crop_size=CROP,
        feature_layer=layer,
        image_token_id=IMAGE_TOKEN_ID,
    )


def audio_config(raw: RawConfig) -> transformers.Phi4MultimodalAudioConfig:
    """audio_processor.config under transformers' names; ValueError naming a field the
    conformer does not run as transformers' does."""
    processor = _dict(raw, "audio_processor", "")
    given = _dict(processor, "config", "audio_processor.")
    path = "audio_processor.config."
    known = {*_AUDIO_RENAMES, *_AUDIO_SAME, *_AUDIO_FIXED, *_AUDIO_IGNORED}
    known |= {"nemo_conv_settings", "relative_attention_bias_args", "encoder_embedding_config"}
    unknown = sorted(set(given) - known)
    if unknown:
        raise _refuse(f"{path}{unknown[0]}", given[unknown[0]], "a field transformers' model has")
    _check_fixed(given, _AUDIO_FIXED, path)
    fields = {new: given[old] for old, new in _AUDIO_RENAMES.items() if old in given}
    fields |= {k: given[k] for k in _AUDIO_SAME if k in given}
    if int(fields.get("chunk_size", -1)) > 0:
        raise _refuse(
            f"{path}chunk_size",
            fields["chunk_size"],
            "<= 0 (the release's -1: full attention; transformers adds a chunk mask as "
            "+1 / +0 where the remote code masks)",
        )
    nemo = given.get("nemo_conv_settings") or {}
    _check_fixed(nemo, _NEMO_FIXED, f"{path}nemo_conv_settings.")
    extra = sorted(set(nemo) - {*_NEMO_FIXED, "conv_channels"})
    if extra:
        raise _refuse(f"{path}nemo_conv_settings.{extra[0]}", nemo[extra[0]], "not read")
    if "conv_channels" in nemo:
        fields["nemo_conv_channels"] = _int(nemo["conv_channels"], f"{path}nemo_conv_settings")
    bias = given.get("relative_attention_bias_args") or {}
    if bias.get("type") != "t5":
        raise _refuse(f"{path}relative_attention_bias_args.type", bias.get("type"), "'t5'")
    fields["bias_max_distance"] = bias.get("t5_bias_max_distance", 1000)
    fields["bias_symmetric"] = bias.get("t5_bias_symmetric", False)
    norm = (given.get("encoder_embedding_config") or {}).get("input_size")
    if norm is not None and norm != fields.get("input_size", 80):
        raise _refuse(f"{path}encoder_embedding_config.input_size", norm, "input_size")
    embd = _dict(_dict(raw, "embd_layer", ""), "audio_embd_layer", "embd_layer.")
    _check_fixed(embd, _AUDIO_EMBD, "embd_layer.audio_embd_layer.")
    if embd.get("embedding_cls", "audio") != "audio":
        raise _refuse("embd_layer.audio_embd_layer.embedding_cls", embd["embedding_cls"], "'audio'")
    rate, reduction = embd.get("compression_rate"), fields.get("time_reduction", 8)
    if rate != reduction:
        raise _refuse("embd_layer.audio_embd_layer.compression_rate", rate, f"{reduction}")
    if reduction < 2 or reduction & (reduction - 1):
        raise _refuse(f"{path}time_reduction", reduction, "a power of 2")
    return transformers.Phi4MultimodalAudioConfig(
        **fields, downsample_rate=1, audio_token_id=AUDIO_TOKEN_ID
    )


def phi4mm_config(raw: RawConfig) -> transformers.Phi4MultimodalConfig:
    """The translated config (see the module doc); ValueError naming a field not served."""
    for name in ("attention_bias", "mlp_bias", "lm_head_bias"):
        if raw.get(name):
            raise _refuse(name, raw[name], "false (transformers' Phi-4-multimodal has no bias)")
    for name in ("full_attn_mod", "interpolate_factor"):
        if raw.get(name, 1) != 1:
            raise _refuse(name, raw[name], "1")
    for name in ("vision_lora", "speech_lora"):
        lora = raw.get(name)
        if lora is not None and not (isinstance(lora, dict) and isinstance(lora.get("r"), int)):
            raise _refuse(name, lora, "a dict with the adapter's rank r")
    vision, audio = vision_config(raw), audio_config(raw)
    fields = {k: v for k, v in raw.items() if k not in _DROPPED}
    if "torch_dtype" in fields and "dtype" not in fields:
        fields["dtype"] = fields.pop("torch_dtype")
    vocab = _int(fields.get("vocab_size", 200064), "vocab_size")
    if vocab <= AUDIO_TOKEN_ID:
        raise _refuse("vocab_size", vocab, f"above {AUDIO_TOKEN_ID} (the placeholder ids)")
    rope = fields.get("rope_scaling")
    if isinstance(rope, dict) and rope.get("type") in ("su", "yarn"):  # Phi-3's longrope names
        fields["rope_scaling"] = {**rope, "type": "longrope"}
    config = transformers.Phi4MultimodalConfig(
        **fields, vision_config=vision.to_dict(), audio_config=audio.to_dict()
    )
    config.architectures = [ARCH]
    return config
