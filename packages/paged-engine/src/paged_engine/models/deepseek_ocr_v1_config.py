"""DeepSeek-OCR (v1)'s remote config (`DeepseekOCRForCausalLM`, model_type "deepseek_vl_v2":
deepseek-ai/DeepSeek-OCR) read without its remote code (models/remote_aliases.py's
REMOTE_CONFIGS row), as vLLM's deepseek_ocr.py reads it.

    config.json                                   -> DeepseekOCRConfig
    language_config (else the top level's copy)   -> text_config: DeepseekOcr2TextConfig
        (DeepSeek-V2 with use_mla false: plain multi-head attention, NeoX rope, the MoE of
        first_k_dense_replace / moe_layer_freq written out as mlp_layer_types)
    vision_config.width {"sam_vit_b": width, layers, heads, global_attn_indexes,
        downsample_channels; "clip-l-14-224": width, layers, heads, image_size, patch_size},
        vision_config.image_size (SAM's position grid x 16)    -> vision_config (geometry)
    projector_config {projector_type "linear", input_dim, n_embed}   checked, kept
    tile_tag "2D"                                                    checked
    (none: the release tokenizer's "<image>")     image_token_id: the saved tokenizer's id
        (vLLM looks it up: remote_aliases.saved_token_id), else 128815; the layout checks
        that the tokenizer's "<image>" agrees

The remote code and vLLM build SAM ViT-B and CLIP-L/14 whatever vision_config says; the
geometry read here is the release's (defaults are its values), so small test checkpoints can
shrink it. What vLLM also hard-codes stays fixed: SAM's 16-pixel patches, 14-token windows,
256-channel neck, MLP ratio 4; CLIP's MLP ratio 4, quick_gelu. Refused by name: MLA
(use_mla / qk_rope_head_dim), a renormalizing or non-softmax router, rope_scaling, a
projector other than "linear", a tile_tag other than "2D".
"""

from __future__ import annotations

from typing import Any

import transformers

from paged_engine.models.remote_aliases import RawConfig, field, vocab_token_id

IMAGE_TOKEN_ID = 128815  # "<image>" in deepseek-ai/DeepSeek-OCR's tokenizer
SAM_PATCH, SAM_WINDOW, SAM_NECK = 16, 14, 256
_SAM = {"width": 768, "layers": 12, "heads": 12, "global_attn_indexes": [2, 5, 8, 11]}
_SAM |= {"downsample_channels": [512, 1024]}
_CLIP = {"width": 1024, "layers": 24, "heads": 16, "image_size": 224, "patch_size": 14}
_TEXT_INTS = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "moe_intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "n_routed_experts",
    "n_shared_experts",
    "num_experts_per_tok",
)


class DeepseekOCRConfig(transformers.PretrainedConfig):
    """The wrapper: text_config, vision_config (geometry), projector and tile fields."""

    model_type = "deepseek_vl_v2"


def _refuse(name: str, value: Any, want: str, arch: str = "DeepseekOCRForCausalLM") -> ValueError:
    return ValueError(f"{arch}: config.json field {name}={value!r} is not supported: {want}")


def mha_text_config(
    raw: RawConfig, lang: RawConfig, arch: str = "DeepseekOCRForCausalLM"
) -> transformers.DeepseekOcr2TextConfig:
    """The DeepSeek-V2 MHA decoder of `lang` (over raw's top-level fields); also
    DeepSeek-VL2-tiny's (models/deepseek_vl2_config.py), refusals naming `arch`."""
    src = {**{k: v for k, v in raw.items() if not isinstance(v, dict)}, **lang}
    if src.get("use_mla") or src.get("qk_rope_head_dim") or src.get("kv_lora_rank"):
        want = "false (multi-head attention; MLA unchecked)"
        raise _refuse("use_mla", src.get("use_mla"), want, arch)
    if src.get("norm_topk_prob"):
        raise _refuse("norm_topk_prob", True, "false (weights not renormalized)", arch)
    if src.get("scoring_func", "softmax") != "softmax":
        raise _refuse("scoring_func", src["scoring_func"], "'softmax'", arch)
    if src.get("rope_scaling") is not None:
        raise _refuse("rope_scaling", src["rope_scaling"], "null", arch)
    fields = {k: field(src, k, int) for k in _TEXT_INTS}
    heads = fields["num_attention_heads"]
    fields["num_key_value_heads"] = field(src, "num_key_value_heads", int, heads)
    n = fields["num_hidden_layers"]
    first = int(src.get("first_k_dense_replace") or 0)
    freq = field(src, "moe_layer_freq", int, 1)
    fields["mlp_layer_types"] = [
        "sparse" if i >= first and i % freq == 0 else "dense" for i in range(n)
    ]
    method = src.get("topk_method", "greedy")
    for name in ("n_group", "topk_group"):
        if src.get(name) is not None:
            fields[name] = field(src, name, int)
    theta = field(src, "rope_theta", float, 10000.0)
    return transformers.DeepseekOcr2TextConfig(
        **fields,
        topk_method=method,
        routed_scaling_factor=field(src, "routed_scaling_factor", float, 1.0),
        rms_norm_eps=field(src, "rms_norm_eps", float, 1e-6),
        max_position_embeddings=field(src, "max_position_embeddings", int, 2048),
        hidden_act=src.get("hidden_act", "silu"),
        rope_parameters={"rope_type": "default", "rope_theta": theta},
        attention_bias=False,
        tie_word_embeddings=bool(src.get("tie_word_embeddings", False)),
        bos_token_id=src.get("bos_token_id", 0),
        eos_token_id=src.get("eos_token_id", 1),
        pad_token_id=src.get("pad_token_id"),
    )


def _vision_config(raw: RawConfig) -> transformers.PretrainedConfig:
    vision = raw.get("vision_config") or {}
    width = vision.get("width") or {}
    if not isinstance(width, dict):
        raise _refuse("vision_config.width", width, "a dict of the two towers' geometry")
    sam = {**_SAM, **(width.get("sam_vit_b") or {})}
    clip = {**_CLIP, **(width.get("clip-l-14-224") or {})}
    side = field(vision, "image_size", int, 1024)
    if side % SAM_PATCH:
        raise _refuse("vision_config.image_size", side, f"a multiple of {SAM_PATCH}")
    down = sam["downsample_channels"]
    if not (isinstance(down, list) and len(down) == 2):
        raise _refuse("vision_config.width.sam_vit_b.downsample_channels", down, "two ints")
    if clip["width"] != down[1]:  # SAM's last conv feeds CLIP in place of its patches
        raise _refuse("vision_config.width.clip-l-14-224.width", clip["width"], f"{down[1]}")
    glob = [int(i) for i in sam["global_attn_indexes"]]
    if any(not 0 <= i < sam["layers"] for i in glob):
        raise _refuse("vision_config.width.sam_vit_b.global_attn_indexes", glob, "layer ids")
    return transformers.PretrainedConfig(
        sam_width=int(sam["width"]),
        sam_layers=int(sam["layers"]),
        sam_heads=int(sam["heads"]),
        sam_global=glob,
        sam_image_size=side,
        downsample_channels=[int(down[0]), int(down[1])],
        clip=transformers.CLIPVisionConfig(
            hidden_size=int(clip["width"]),
            intermediate_size=4 * int(clip["width"]),
            num_attention_heads=int(clip["heads"]),
            num_hidden_layers=int(clip["layers"]),
            image_size=int(clip["image_size"]),
            patch_size=int(clip["patch_size"]),
            hidden_act="quick_gelu",
            layer_norm_eps=1e-5,
        ),
    )


def deepseek_ocr_v1_config(raw: RawConfig) -> DeepseekOCRConfig:
    """The translated config (see the module doc); ValueError naming a field not served."""
    lang = raw.get("language_config") or {}
    text = mha_text_config(raw, lang)
    vision = _vision_config(raw)
    if raw.get("tile_tag", "2D") != "2D":
        raise _refuse("tile_tag", raw["tile_tag"], "'2D' (vLLM's only one)")
    proj = raw.get("projector_config") or {}
    if proj.get("projector_type", "linear") != "linear":
        raise _refuse("projector_config.projector_type", proj["projector_type"], "'linear'")
    want_in = vision.downsample_channels[1] + vision.clip.hidden_size
    if field(proj, "input_dim", int, want_in) != want_in:
        raise _refuse("projector_config.input_dim", proj["input_dim"], f"{want_in}")
    if field(proj, "n_embed", int, text.hidden_size) != text.hidden_size:
        raise _refuse("projector_config.n_embed", proj["n_embed"], f"{text.hidden_size}")
    token = vocab_token_id(
        raw, "image_token_id", IMAGE_TOKEN_ID, text.vocab_size, "DeepseekOCRForCausalLM"
    )
    return DeepseekOCRConfig(
        architectures=list(raw.get("architectures") or ["DeepseekOCRForCausalLM"]),
        text_config=text,
        vision_config=vision,
        projector_input_dim=want_in,
        image_token_id=token,
        tile_tag="2D",
        bos_token_id=text.bos_token_id,
        eos_token_id=text.eos_token_id,
        pad_token_id=text.pad_token_id,
        tie_word_embeddings=text.tie_word_embeddings,
    )
