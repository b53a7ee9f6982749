"""DeepSeek-VL2's remote config (`DeepseekVLV2ForCausalLM`, model_type "deepseek_vl_v2":
deepseek-ai/deepseek-vl2-tiny, -small, deepseek-vl2) read without its remote code
(models/remote_aliases.py's REMOTE_CONFIGS row), as vLLM's deepseek_vl2.py reads it.

    language_config, use_mla false (tiny)   -> text_config: DeepseekOcr2TextConfig (DeepSeek-V2
        under multi-head attention: DeepSeek-OCR v1's, deepseek_ocr_v1_config.mha_text_config)
    language_config, use_mla true (small)   -> text_config: transformers' DeepseekV2Config (MLA)
    vision_config {width, layers, heads, patch_size, image_size, mlp_ratio}
                                            -> vision_config: a SiglipVisionConfig (the release's
        timm SigLIP ViT: no class token, the head ignored, the final norm's output; MLP hidden
        int(width * mlp_ratio), tanh GELU, LayerNorm eps 1e-6)
    projector_config {projector_type "downsample_mlp_gelu", depth, mlp_ratio, downsample_ratio,
        input_dim, n_embed}                 -> projector_depth / _ratio / _downsample
    candidate_resolutions ([width, height] pairs, multiples of the first's width, which is the
        tile side and vision_config.image_size), tile_tag "2D", global_view_pos "head" / "tail"
    (none: the release tokenizer's "<image>") image_token_id: the saved tokenizer's id (vLLM
        looks it up: remote_aliases.saved_token_id), else 128815; the layout checks it agrees

Refused by name: topk_method other than "greedy" (deepseek-vl2's "noaux_tc": DeepSeek-V3's
router, unchecked here), MLA with a renormalizing router, moe_layer_freq or rope_scaling, the
MHA decoder's refusals (DeepSeek-OCR v1's), a projector other than "downsample_mlp_gelu" or
with token_pooling, a tile_tag other than "2D", a class token, a vision head that is not
ignored, global_pool "avg" (timm's tower then skips its final norm), select_layer other than
-1 (the release runs every layer). Absent vision_config fields take vLLM's tower, SigLIP
so400m-patch14-384 (vLLM builds it whatever the config says).
"""

from __future__ import annotations

from typing import Any

import transformers

from paged_engine.models.deepseek_ocr_v1_config import IMAGE_TOKEN_ID, mha_text_config
from paged_engine.models.remote_aliases import RawConfig, field, vocab_token_id

ARCH = "DeepseekVLV2ForCausalLM"
_VISION = {"width": 1152, "layers": 27, "heads": 16, "patch_size": 14, "image_size": 384}
_MLA_INTS = ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")
_MOE_INTS = ("n_routed_experts", "n_shared_experts", "num_experts_per_tok")
_MOE_INTS += ("moe_intermediate_size", "vocab_size", "hidden_size", "intermediate_size")
_MOE_INTS += ("num_hidden_layers", "num_attention_heads")


class DeepseekVLV2Config(transformers.PretrainedConfig):
    """The wrapper: text_config, vision_config (SigLIP), projector and tiling fields."""

    model_type = "deepseek_vl_v2"


def _refuse(name: str, value: Any, want: str) -> ValueError:
    return ValueError(f"{ARCH}: config.json field {name}={value!r} is not supported: {want}")


def _mla_config(raw: RawConfig, lang: RawConfig) -> transformers.DeepseekV2Config:
    src = {**{k: v for k, v in raw.items() if not isinstance(v, dict)}, **lang}
    if src.get("norm_topk_prob"):
        raise _refuse("norm_topk_prob", True, "false (transformers' DeepSeek-V2 router)")
    if src.get("scoring_func", "softmax") != "softmax":
        raise _refuse("scoring_func", src["scoring_func"], "'softmax'")
    if src.get("rope_scaling") is not None:
        raise _refuse("rope_scaling", src["rope_scaling"], "null")
    if field(src, "moe_layer_freq", int, 1) != 1:
        raise _refuse("moe_layer_freq", src["moe_layer_freq"], "1")
    fields = {k: field(src, k, int) for k in _MOE_INTS + _MLA_INTS}
    q_lora = src.get("q_lora_rank")
    return transformers.DeepseekV2Config(
        **fields,
        q_lora_rank=None if q_lora is None else field(src, "q_lora_rank", int),
        num_key_value_heads=field(src, "num_key_value_heads", int, fields["num_attention_heads"]),
        first_k_dense_replace=int(src.get("first_k_dense_replace") or 0),
        topk_method="greedy",
        n_group=src.get("n_group"),
        topk_group=src.get("topk_group"),
        routed_scaling_factor=field(src, "routed_scaling_factor", float, 1.0),
        rms_norm_eps=field(src, "rms_norm_eps", float, 1e-6),
        max_position_embeddings=field(src, "max_position_embeddings", int, 2048),
        rope_parameters={
            "rope_type": "default",
            "rope_theta": field(src, "rope_theta", float, 10000.0),
        },
        attention_bias=bool(src.get("attention_bias", False)),
        tie_word_embeddings=bool(src.get("tie_word_embeddings", False)),
        bos_token_id=src.get("bos_token_id", 0),
        eos_token_id=src.get("eos_token_id", 1),
        pad_token_id=src.get("pad_token_id"),
    )


def _text_config(raw: RawConfig) -> Any:
    lang = raw.get("language_config") or {}
    src = {**{k: v for k, v in raw.items() if not isinstance(v, dict)}, **lang}
    method = src.get("topk_method", "greedy")
    if method != "greedy":
        raise _refuse("topk_method", method, "'greedy' (DeepSeek-V3's noaux_tc router unchecked)")
    return _mla_config(raw, lang) if src.get("use_mla") else mha_text_config(raw, lang, ARCH)


def _vision_config(raw: RawConfig) -> transformers.SiglipVisionConfig:
    vision = raw.get("vision_config") or {}
    if vision.get("class_token"):
        raise _refuse("vision_config.class_token", True, "false (SigLIP has none)")
    if vision.get("ignore_head", True) is not True:
        raise _refuse("vision_config.ignore_head", vision["ignore_head"], "true")
    if vision.get("global_pool", "map") == "avg":  # timm then drops the final norm
        raise _refuse("vision_config.global_pool", "avg", "'map' (the final norm kept)")
    if vision.get("select_layer", -1) != -1:
        raise _refuse("vision_config.select_layer", vision["select_layer"], "-1 (every layer)")
    geo = {k: field(vision, k, int, v) for k, v in _VISION.items()}
    ratio = field(vision, "mlp_ratio", float, 3.7362)
    if geo["width"] % geo["heads"]:
        raise _refuse("vision_config.heads", geo["heads"], f"a divisor of {geo['width']}")
    return transformers.SiglipVisionConfig(
        hidden_size=geo["width"],
        intermediate_size=int(geo["width"] * ratio),
        num_hidden_layers=geo["layers"],
        num_attention_heads=geo["heads"],
        image_size=geo["image_size"],
        patch_size=geo["patch_size"],
        hidden_act="gelu_pytorch_tanh",
        layer_norm_eps=1e-6,
    )


def _resolutions(raw: RawConfig, side: int) -> list[tuple[int, int]]:
    pairs = raw.get("candidate_resolutions")
    if not isinstance(pairs, list) or not pairs:
        raise _refuse("candidate_resolutions", pairs, "a list of [width, height] pairs")
    out = []
    for pair in pairs:
        ok = isinstance(pair, list | tuple) and len(pair) == 2
        if not ok or any(isinstance(v, bool) or not isinstance(v, int) or v <= 0 for v in pair):
            raise _refuse("candidate_resolutions", pair, "[width, height] positive ints")
        out.append((int(pair[0]), int(pair[1])))
    if out[0][0] != side:  # the processor's tile side is the first width
        raise _refuse("candidate_resolutions", out[0], f"a first width of {side} (image_size)")
    if any(w % side or h % side for w, h in out):
        raise _refuse("candidate_resolutions", out, f"multiples of {side}")
    return out


def deepseek_vl2_config(raw: RawConfig) -> DeepseekVLV2Config:
    """The translated config (see the module doc); ValueError naming a field not served."""
    text = _text_config(raw)
    vision = _vision_config(raw)
    if raw.get("tile_tag", "2D") != "2D":
        raise _refuse("tile_tag", raw["tile_tag"], "'2D' (vLLM's only one)")
    view_pos = raw.get("global_view_pos", "head")
    if view_pos not in ("head", "tail"):
        raise _refuse("global_view_pos", view_pos, "'head' or 'tail'")
    proj = raw.get("projector_config") or {}
    kind = proj.get("projector_type", "downsample_mlp_gelu")
    if kind != "downsample_mlp_gelu":
        raise _refuse("projector_config.projector_type", kind, "'downsample_mlp_gelu'")
    if proj.get("token_pooling"):
        raise _refuse("projector_config.token_pooling", True, "false")
    if field(proj, "input_dim", int, vision.hidden_size) != vision.hidden_size:
        raise _refuse("projector_config.input_dim", proj["input_dim"], f"{vision.hidden_size}")
    if field(proj, "n_embed", int, text.hidden_size) != text.hidden_size:
        raise _refuse("projector_config.n_embed", proj["n_embed"], f"{text.hidden_size}")
    token = vocab_token_id(raw, "image_token_id", IMAGE_TOKEN_ID, text.vocab_size, ARCH)
    return DeepseekVLV2Config(
        architectures=list(raw.get("architectures") or [ARCH]),
        text_config=text,
        vision_config=vision,
        projector_depth=field(proj, "depth", int, 2),
        projector_ratio=field(proj, "mlp_ratio", int, 1),
        downsample_ratio=field(proj, "downsample_ratio", int, 2),
        candidate_resolutions=_resolutions(raw, vision.image_size),
        global_view_pos=view_pos,
        image_token_id=token,
        tile_tag="2D",
        bos_token_id=text.bos_token_id,
        eos_token_id=text.eos_token_id,
        pad_token_id=text.pad_token_id,
        tie_word_embeddings=text.tie_word_embeddings,
    )
