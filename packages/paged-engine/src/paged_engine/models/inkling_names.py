"""The Inkling releases' checkpoint names (`model.llm.*`, which transformers also writes when it
saves an Inkling wrapper or an Inkling 2 model) mapped to our parameter names; facts read from
transformers' conversion tables for "inkling_mm_model", "inkling2_text" and
"inkling2_loop_text". Each table is (regex, replacement) applied in order to the whole name.

Layout changes beside the names: the releases interleave gate and up rows (g0 u0 g1 u1 ..,
`split_pairs` makes gate | up halves); Inkling 1's dense `w13_dn` and shared `shared_w13_weight`
then split into gate_proj / up_proj; Inkling 2's `attn_res.attn_queries.i` belongs to layer
i + 1 (layer 0 has no attention input); Inkling 2 Loop's two message-query tensors fill one
parameter (`MESSAGE_QUERY_RULES`, the model's stacked rules).
"""

from __future__ import annotations

import re

import torch

_PREFIX: tuple[tuple[str, str], ...] = (
    (r"^model\.llm\.unembed\.", "lm_head."),
    (r"^model\.llm\.embed\.", "model.embed_tokens."),
    (r"^model\.llm\.embed_norm\.", "model.embed_tokens.embed_norm."),
    (r"^model\.llm\.", "model."),
)

INKLING: tuple[tuple[str, str], ...] = (
    *_PREFIX,
    (r"shared_w2_weight$", "down_proj"),
    (r"mlp\.experts\.w13_weight$", "mlp.experts.gate_up_proj"),
    (r"mlp\.experts\.w2_weight$", "mlp.experts.down_proj"),
    (r"mlp\.w2_md\.", "mlp.down_proj."),
    (r"mlp\.gate\.bias$", "mlp.gate.e_score_correction_bias"),
    (r"\.attn\.wq_du\.", ".self_attn.q_proj."),
    (r"\.attn\.w(k|v)_dv\.", r".self_attn.\1_proj."),
    (r"\.attn\.wr_du\.", ".self_attn.r_proj."),
    (r"\.attn\.wo_ud\.", ".self_attn.o_proj."),
    (r"\.attn\.(k|v)_sconv\.weight$", r".self_attn.\1_sconv.conv1d.weight"),
    (r"\.attn\.", ".self_attn."),  # q_norm, k_norm, rel_logits_proj
    (r"(attn|mlp)_sconv\.weight$", r"\1_sconv.conv1d.weight"),
    (r"mlp_norm\.", "post_attention_layernorm."),
    (r"attn_norm\.", "input_layernorm."),
)

INKLING2: tuple[tuple[str, str], ...] = (
    *_PREFIX,
    (r"controllers\.attn\.", "q_message_gate."),
    (r"controllers\.(k|v|mlp)\.", r"\1_message_gate."),
    (r"_message_gate\.down_weight$", "_message_gate.down_proj.weight"),
    (r"_message_gate\.gain_weight$", "_message_gate.message_gate_proj.weight"),
    (r"_message_gate\.forget_weight$", "_message_gate.forget_gate_proj.weight"),
    (r"mlp\.experts\.w13_weight$", "mlp.experts.gate_up_proj"),
    (r"mlp\.experts\.w2_weight$", "mlp.experts.down_proj"),
    (r"mlp\.gate\.bias$", "mlp.gate.e_score_correction_bias"),
    (r"\.attn\.", ".self_attn."),
    (r"self_attn\.wq_du\.", "self_attn.q_proj.linear."),
    (r"self_attn\.w(k|v)_dv\.", r"self_attn.\1_proj.linear."),
    (r"self_attn\.(k|v)_sconv\.", r"self_attn.\1_proj.sconv."),
    (r"self_attn\.rel_logits_proj\.", "self_attn.relative_position_bias."),
    (r"self_attn\.wr_du\.", "self_attn.relative_position_bias.linear."),
    (r"self_attn\.q_l2_clip\.", "self_attn.q_proj.norm."),
    (r"self_attn\.rel_l2_clip\.", "self_attn.relative_position_bias.norm."),
    (r"self_attn\.wo_ud\.", "self_attn.o_proj.linear."),
    (r"self_attn\.gate_attn\.", "self_attn.o_proj.gate_proj."),
    (r"self_attn\.attn_sink_proj\.", "self_attn.sink_proj."),
    (r"attn_sconv\.", "post_attention_convolution."),
    (r"mlp_sconv\.", "post_mlp_convolution."),
    (r"(convolution|sconv)\.weight$", r"\1.conv1d.weight"),
    (r"(convolution|sconv)\.static_w$", r"\1.static_weight"),
    (r"(convolution|sconv)\.weight_proj$", r"\1.weight_proj.weight"),
    (r"mlp_norm\.", "post_attention_layernorm."),
    (r"attn_norm\.", "input_layernorm."),
    (r"(q|k|v)_input_norm\.", r"\1_input_layernorm."),
    (r"attn_res\.mlp_queries\.(\d+)$", r"layers.\1.mlp_input.query"),
    (r"attn_res\.output_query$", "final_input.query"),
)

# Inkling 2 Loop: (our parameter, checkpoint name, shard): the [query, mlp] and [key, value]
# message-query rows of each looped layer
MESSAGE_QUERY_RULES = (
    ("message_input.query", "middle_cycle_cross_pass_queries", 0),
    ("message_input.query", "middle_cycle_cross_pass_kv_queries", 1),
)


def _mapped(name: str, table: tuple[tuple[str, str], ...]) -> str:
    for pattern, replacement in table:
        name = re.sub(pattern, replacement, name)
    return name


def split_pairs(w: torch.Tensor, dim: int) -> torch.Tensor:
    """Rows interleaved in pairs along `dim` (a0 b0 a1 b1 ..) -> halves (a.. | b..)."""
    shape = list(w.shape)
    shape[dim : dim + 1] = [shape[dim] // 2, 2]
    return w.reshape(shape).transpose(dim, dim + 1).reshape(w.shape)


def inkling2_name(name: str) -> str:
    name = _mapped(name, INKLING2)
    return re.sub(
        r"attn_res\.attn_queries\.(\d+)$",
        lambda m: f"layers.{int(m.group(1)) + 1}.attention_input.query",
        name,
    )


def inkling_weights(name: str, w: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    """One Inkling 1 release tensor -> our (name, tensor) pairs."""
    if name.endswith("mlp.w13_dn.weight"):  # dense gate | up, rows interleaved
        gate, up = split_pairs(w, 0).chunk(2, dim=0)
        stem = _mapped(name, INKLING).removesuffix("w13_dn.weight")
        return [(f"{stem}gate_proj.weight", gate), (f"{stem}up_proj.weight", up)]
    if name.endswith("shared_experts.shared_w13_weight"):  # [S, 2I, H] interleaved
        gate, up = split_pairs(w, 1).chunk(2, dim=1)
        stem = _mapped(name, INKLING).removesuffix("shared_w13_weight")
        return [(f"{stem}gate_proj", gate), (f"{stem}up_proj", up)]
    name = _mapped(name, INKLING)
    if name.endswith("mlp.experts.gate_up_proj"):
        w = split_pairs(w, 1)
    return [(name, w)]
