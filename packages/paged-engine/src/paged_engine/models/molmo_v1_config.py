"""Molmo v1's remote config (`MolmoForCausalLM`, model_type "molmo": allenai/Molmo-7B-D-0924,
Molmo-72B-0924, Molmo-7B-O-0924) read without its remote code (models/remote_aliases.py's
REMOTE_CONFIGS row), as vLLM's molmo.py reads it.

    config.json (the release's MolmoConfig)        -> MolmoV1Config
        embedding_size (else vocab_size) rows + 128 extra ids (the image tokens: the remote
        code's additional_vocab_size, hard-coded), hidden_size, num_hidden_layers,
        num_attention_heads, num_key_value_heads, intermediate_size (the fused up | gate
        width: the MLP's inner size is half of it), layer_norm_eps, rope_theta,
        max_position_embeddings                     -> text_config: Qwen2Config / Olmo2Config
    the vision backbone: none in config.json (the remote code and vLLM hard-code OpenAI's
        CLIP ViT-L/14-336 with 23 layers, vit_layers [-2, -9]); optional `vision_backbone`
        {image_default_input_size, image_patch_size, image_emb_dim, image_num_heads,
        image_num_layers, image_mlp_dim, image_norm_eps} and `vit_layers` (the remote code's
        FullMolmoConfig names) shrink it for small test checkpoints
                                                    -> vision_config: CLIPVisionConfig
    image token ids: the release tokenizer's (vLLM's defaults for the Qwen2 tokenizer);
        config.json fields image_patch_token_id / image_start_token_id / image_end_token_id /
        image_col_token_id, for another tokenizer, override them (the layout checks them
        against the tokenizer's <im_patch> / <im_start> / <im_end> / <im_col>)

Served (vLLM's two layer kinds): qkv_bias true, pre-norm layers, no q / k norms: Qwen2's
decoder (Molmo-7B-D, Molmo-72B; text_config a Qwen2Config); attention_layer_norm and
norm_after true, qkv_bias false: OLMo 2's (q / k RMS-normed over the whole projection, each
sublayer's output normed before its residual add: vLLM's MolmoDecoderNormAfterLayer, for
Molmo-7B-O's OLMo; text_config an Olmo2Config). Refused by name: the other combinations of
those three fields, moe_* fields without block_type "moe", clip_qkv, weight_tying, a
layer_norm_type other than "rms", an odd patch count a crop side (the remote code pads the
pooling grid with zero features, which the attention pooling here does not take).
block_type "moe" (MolmoE-1B): OLMoE's decoder, its text config read by models/molmoe_config.py.
"""

from __future__ import annotations

from typing import Any

import transformers

from paged_engine.models.molmoe_config import is_molmoe, molmoe_text_config, molmoe_token_ids
from paged_engine.models.remote_aliases import RawConfig, field

ARCH = "MolmoForCausalLM"
EXTRA_VOCAB = 128  # the remote code's additional_vocab_size (hard-coded)
# vLLM's ids of the release (Qwen2) tokenizer's image tokens
TOKEN_IDS = {
    "image_patch_token_id": 152066,
    "image_start_token_id": 152067,
    "image_end_token_id": 152064,
    "image_col_token_id": 152065,
}
# the remote code's VisionBackboneConfig (OpenAI CLIP ViT-L/14-336 less its last layer)
_VISION = {
    "image_default_input_size": [336, 336],
    "image_patch_size": 14,
    "image_emb_dim": 1024,
    "image_num_heads": 16,
    "image_num_layers": 23,
    "image_mlp_dim": 4096,
    "image_norm_eps": 1e-5,
}
VIT_LAYERS = [-2, -9]


class MolmoV1Config(transformers.PretrainedConfig):
    """The wrapper: text_config (Qwen2), vision_config (CLIP), vit_layers, image token ids."""

    model_type = "molmo"


def _refuse(name: str, value: Any, want: str) -> ValueError:
    return ValueError(f"{ARCH}: config.json field {name}={value!r} is not supported: {want}")


def _decoder(raw: RawConfig) -> str:
    """ "qwen2" or "olmo2" (see the module); ValueError naming the field of a Molmo v1 variant
    whose decoder is neither."""
    moe = sorted(k for k in raw if k.startswith("moe_") and raw[k] is not None)
    if moe:
        raise _refuse(moe[0], raw[moe[0]], "unset without block_type 'moe' (MolmoE's)")
    qk_norm, after = bool(raw.get("attention_layer_norm")), bool(raw.get("norm_after"))
    if qk_norm != after:
        want = "equal to norm_after (Qwen2's decoder: both false; OLMo 2's: both true)"
        raise _refuse("attention_layer_norm", qk_norm, want)
    bias = bool(raw.get("qkv_bias", False))
    if bias == after:
        want = "true with pre-norm layers (Qwen2's), false with norm_after (OLMo 2's)"
        raise _refuse("qkv_bias", bias, want)
    if raw.get("clip_qkv") is not None:
        raise _refuse("clip_qkv", raw["clip_qkv"], "null")
    if raw.get("weight_tying") or raw.get("tie_word_embeddings"):
        raise _refuse("weight_tying", True, "false (the head has fewer rows than the table)")
    if raw.get("layer_norm_type", "rms") != "rms":
        raise _refuse("layer_norm_type", raw["layer_norm_type"], "'rms'")
    return "olmo2" if after else "qwen2"


def _text_config(raw: RawConfig, kind: str) -> transformers.PretrainedConfig:
    fused = field(raw, "intermediate_size", int)
    if fused % 2:
        raise _refuse("intermediate_size", fused, "even (the fused up | gate width)")
    heads = field(raw, "num_attention_heads", int)
    rows = field(raw, "embedding_size", int, field(raw, "vocab_size", int))
    common = dict(
        vocab_size=rows,
        hidden_size=field(raw, "hidden_size", int),
        intermediate_size=fused // 2,
        num_hidden_layers=field(raw, "num_hidden_layers", int),
        num_attention_heads=heads,
        num_key_value_heads=field(raw, "num_key_value_heads", int, heads),
        max_position_embeddings=field(raw, "max_position_embeddings", int, 4096),
        rms_norm_eps=field(raw, "layer_norm_eps", float, 1e-5),
        rope_parameters={
            "rope_type": "default",
            "rope_theta": field(raw, "rope_theta", float, 10000.0),
        },
        hidden_act="silu",
        tie_word_embeddings=False,
    )
    if kind == "qwen2":
        text = transformers.Qwen2Config(**common, use_sliding_window=False)
    else:  # models/molmo2.py's OLMo 2 path: q / k normed whole, each sublayer normed after
        text = transformers.Olmo2Config(**common, attention_bias=False)
        text.qk_norm_type, text.norm_after = "olmo", True
    text.additional_vocab_size = EXTRA_VOCAB
    return text


def _vision_config(raw: RawConfig) -> tuple[transformers.CLIPVisionConfig, list[int]]:
    backbone = raw.get("vision_backbone") or {}
    if not isinstance(backbone, dict):
        raise _refuse("vision_backbone", backbone, "a dict of the tower's geometry")
    v = {**_VISION, **backbone}
    size = v["image_default_input_size"]
    if not (isinstance(size, list) and len(size) == 2 and size[0] == size[1]):
        raise _refuse("vision_backbone.image_default_input_size", size, "a square [S, S]")
    side, patch = int(size[0]), int(v["image_patch_size"])
    if side % patch or (side // patch) % 2:
        want = "an even number of patches a side (2 x 2 pooling without padding)"
        raise _refuse("vision_backbone.image_default_input_size", size, want)
    layers = int(v["image_num_layers"])
    vit_layers = [int(k) for k in raw.get("vit_layers") or VIT_LAYERS]
    if not vit_layers or not all(-layers <= k < layers for k in vit_layers):
        raise _refuse("vit_layers", vit_layers, f"indices of the {layers} tower layers")
    clip = transformers.CLIPVisionConfig(
        hidden_size=int(v["image_emb_dim"]),
        intermediate_size=int(v["image_mlp_dim"]),
        num_attention_heads=int(v["image_num_heads"]),
        num_hidden_layers=layers,
        image_size=side,
        patch_size=patch,
        hidden_act="quick_gelu",
        layer_norm_eps=float(v["image_norm_eps"]),
    )
    return clip, vit_layers


def molmo_v1_config(raw: RawConfig) -> MolmoV1Config:
    """The translated config (see the module doc); ValueError naming a field not served."""
    if is_molmoe(raw):  # MolmoE-1B: OLMoE's decoder (models/molmoe_config.py)
        text, ids = molmoe_text_config(raw), molmoe_token_ids(raw)
    else:
        text = _text_config(raw, _decoder(raw))
        ids = {k: field(raw, k, int, v) for k, v in TOKEN_IDS.items()}
    vision, vit_layers = _vision_config(raw)
    eos = raw.get("eos_token_id")
    return MolmoV1Config(
        architectures=[ARCH],
        text_config=text,
        vision_config=vision,
        vit_layers=vit_layers,
        image_token_id=ids["image_patch_token_id"],  # the placeholder: <im_patch>
        image_tokens=[ids[k] for k in TOKEN_IDS],  # <im_patch>, <im_start>, <im_end>, <im_col>
        bos_token_id=raw.get("bos_token_id"),
        eos_token_id=eos,
        pad_token_id=raw.get("pad_token_id"),
        tie_word_embeddings=False,
    )
