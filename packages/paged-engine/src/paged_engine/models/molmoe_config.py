"""MolmoE-1B's text config (`MolmoForCausalLM` with block_type "moe": allenai/MolmoE-1B-0924,
remote code config_molmoe.py / modeling_molmoe.py) read without its remote code, for
models/molmo_v1_config.py, which reads the rest (the CLIP tower, vit_layers, the image ids).

The release's config.json carries OLMo's training names (its LLM is OLMoE-1B-7B-0924):

    d_model, n_heads, n_kv_heads (null: n_heads), n_layers -> hidden_size, num_attention_heads,
        num_key_value_heads, num_hidden_layers (HF's names are read where those are absent)
    mlp_hidden_size (else mlp_ratio * d_model): the SwiGLU's fused width; each expert's inner
        size is half of it (megablocks' ffn_hidden_size)          -> intermediate_size
    moe_num_experts, moe_top_k                 -> num_experts, num_experts_per_tok
    embedding_size (else vocab_size) rows, then additional_vocab_size (128) image ids
    layer_norm_eps, rope_theta, max_position_embeddings (else max_sequence_length)
                                               -> an OlmoeConfig (models/olmoe.py's decoder)

Served: OLMoE's layer exactly as transformers' OlmoeForCausalLM runs it: pre-norm RMSNorm
layers, q and k RMS-normed over the whole projection (attention_layer_norm), NeoX rope
(rope_impl "llama"), softmax top-k routing without renormalizing, gated SiLU experts, no
biases, an untied head. Refused by name: attention_layer_norm false, norm_after, clip_qkv (the
remote code clamps before the q / k norms, transformers' OLMoE after them), rope_impl other
than "llama" (the remote code's default "cockatoo" turns adjacent pairs), qkv_bias /
include_bias, moe_shared_expert, moe_interleave (dense blocks between), moe_dropless false
(capacity-limited experts), alibi, multi_query_attention, weight_tying, non-RMS norms, and
image-side variants the encoder does not run (image_pooling_2d / _h / _w, image_projector,
image_padding_embed, use_cls_feature).

The image token ids default to the release tokenizer's layout past the table (as Qwen2's
release places them past its 152064 rows: <im_end>, <im_col>, <im_patch>, <im_start>);
multimodal/molmo_v1.py checks them against the tokenizer, and config.json fields
image_*_token_id override them.
"""

from __future__ import annotations

from typing import Any

import transformers

from paged_engine.models.remote_aliases import RawConfig, field

ARCH = "MolmoForCausalLM"
# the offsets past embedding_size of <im_patch>, <im_start>, <im_end>, <im_col>
_TOKEN_OFFSETS = {
    "image_patch_token_id": 2,
    "image_start_token_id": 3,
    "image_end_token_id": 0,
    "image_col_token_id": 1,
}
# (field, the only value served, what it means) for fields checked when present
_FIXED: tuple[tuple[str, Any, str], ...] = (
    ("attention_layer_norm", True, "true (OLMoE's q / k norms)"),
    ("norm_after", False, "false (OLMoE's pre-norm layers)"),
    ("qkv_bias", False, "false (OLMoE has no biases)"),
    ("include_bias", False, "false (OLMoE has no biases)"),
    ("moe_shared_expert", False, "false (OLMoE has no shared expert)"),
    ("moe_interleave", False, "false (every block a MoE block)"),
    ("moe_dropless", True, "true (no token dropped by an expert capacity)"),
    ("multi_query_attention", False, "false (n_kv_heads sets the KV heads)"),
    ("alibi", False, "false (rope)"),
    ("normalize_input_embeds", False, "false"),
    ("scale_logits", False, "false"),
    ("weight_tying", False, "false (the head has fewer rows than the table)"),
    ("layer_norm_type", "rms", "'rms'"),
    ("rope", True, "true"),
    ("rope_impl", "llama", "'llama' (NeoX halves; 'cockatoo' pairs are not served)"),
    ("activation_type", "swiglu", "'swiglu'"),
    ("attention_layer_norm_with_affine", True, "true"),
    ("layer_norm_with_affine", True, "true"),
    ("image_pooling_2d", "attention-meanq", "'attention-meanq' (mean-query pooling)"),
    ("image_projector", "mlp", "'mlp' (the SwiGLU projector)"),
    ("image_padding_embed", "pad_and_partial_pad", "'pad_and_partial_pad'"),
    ("image_pooling_h", 2, "2 (2 x 2 pooling windows)"),
    ("image_pooling_w", 2, "2 (2 x 2 pooling windows)"),
    ("use_cls_feature", False, "false"),
)


def _refuse(name: str, value: Any, want: str) -> ValueError:
    return ValueError(f"{ARCH} (MolmoE): config.json field {name}={value!r} is not served: {want}")


def is_molmoe(raw: RawConfig) -> bool:
    """A MolmoE release: its blocks are OLMoE's mixture-of-experts blocks."""
    return raw.get("block_type") == "moe"


def _either(raw: RawConfig, olmo: str, hf: str, default: int | None = None) -> int:
    """The OLMo-named field, else the HF-named one, else `default`."""
    return field(raw, olmo if raw.get(olmo) is not None else hf, int, default)


def molmoe_text_config(raw: RawConfig) -> transformers.OlmoeConfig:
    """The OlmoeConfig of a MolmoE config.json (see the module); ValueError naming a field the
    decoder does not run."""
    for name, want, meaning in _FIXED:
        value = raw.get(name)
        if value is not None and value != want:
            raise _refuse(name, value, meaning)
    if raw.get("clip_qkv") is not None:
        raise _refuse("clip_qkv", raw["clip_qkv"], "null (clamped before the q / k norms)")
    if raw.get("tie_word_embeddings"):
        raise _refuse("tie_word_embeddings", True, "false (the head has fewer rows than the table)")
    if raw.get("head_dim") is not None:
        raise _refuse("head_dim", raw["head_dim"], "null (d_model / n_heads)")
    hidden = _either(raw, "d_model", "hidden_size")
    heads = _either(raw, "n_heads", "num_attention_heads")
    if hidden % heads:
        raise _refuse("n_heads", heads, f"a divisor of d_model={hidden}")
    if raw.get("mlp_hidden_size") is not None:
        fused = field(raw, "mlp_hidden_size", int)
    else:
        fused = field(raw, "mlp_ratio", int, 4) * hidden
    if fused % 2:
        raise _refuse("mlp_hidden_size", fused, "even (the fused up | gate width)")
    experts = field(raw, "moe_num_experts", int)
    top_k = field(raw, "moe_top_k", int)
    if top_k > experts:
        raise _refuse("moe_top_k", top_k, f"at most moe_num_experts={experts}")
    rows = field(raw, "embedding_size", int, field(raw, "vocab_size", int))
    max_pos = raw.get("max_position_embeddings") or raw.get("max_sequence_length")
    text = transformers.OlmoeConfig(
        vocab_size=rows,
        hidden_size=hidden,
        intermediate_size=fused // 2,
        num_hidden_layers=_either(raw, "n_layers", "num_hidden_layers"),
        num_attention_heads=heads,
        num_key_value_heads=_either(raw, "n_kv_heads", "num_key_value_heads", heads),
        max_position_embeddings=int(max_pos or 4096),
        rms_norm_eps=field(raw, "layer_norm_eps", float, 1e-5),
        rope_parameters={
            "rope_type": "default",
            "rope_theta": field(raw, "rope_theta", float, 10000.0),
        },
        num_experts=experts,
        num_experts_per_tok=top_k,
        norm_topk_prob=False,
        clip_qkv=None,
        hidden_act="silu",
        attention_bias=False,
        tie_word_embeddings=False,
    )
    text.additional_vocab_size = field(raw, "additional_vocab_size", int, 128)
    return text


def molmoe_token_ids(raw: RawConfig) -> dict[str, int]:
    """The image token ids: config.json's fields, else past the table (see the module)."""
    rows = field(raw, "embedding_size", int, field(raw, "vocab_size", int))
    return {k: field(raw, k, int, rows + off) for k, off in _TOKEN_OFFSETS.items()}
