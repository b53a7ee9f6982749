"""Molmo v1's text decoder (`MolmoForCausalLM`, remote code: Molmo-7B-D / 72B / 7B-O-0924),
served inside the wrapper (models/text_wrappers.py; config: models/molmo_v1_config.py; images:
multimodal/molmo_v1.py).

The decoder is Qwen2's (q / k / v biases, a bias-free o_proj, pre-norm RMSNorm layers, SwiGLU,
rope; Molmo-7B-D / 72B) or OLMo 2's (no biases, q / k RMS-normed over the whole projection,
`attn_norm` / `ff_norm` after each sublayer: norm_after, Molmo-7B-O; models/molmo2.py's
"olmo" path, text_config.qk_norm_type) under the release's fused names, with Molmo2's wider
token table: the Hub's
`model.transformer.wte.embedding` (embedding_size rows) then `new_embedding` (128 image ids
the head never scores: their logits are -inf), which models/molmo2.py's class already reads.

    model.transformer.blocks.N.att_proj (q | k | v stacked)  -> self_attn.q / k / v_proj
    .attn_out -> self_attn.o_proj     .ff_proj (up | gate stacked) -> mlp.up / gate_proj
    .ff_out -> mlp.down_proj          .attn_norm / .ff_norm -> input / post_attention_layernorm
    model.transformer.ln_f -> model.norm      model.transformer.ff_out -> lm_head
"""

from __future__ import annotations

from paged_engine.models.molmo2 import Molmo2TextForCausalLM


class MolmoV1TextForCausalLM(Molmo2TextForCausalLM):
    renames = (
        ("model.transformer.ff_out.", "lm_head."),  # before the layers' own ff_out
        ("model.transformer.blocks.", "model.layers."),
        ("model.transformer.ln_f.", "model.norm."),
        (".att_proj.", ".self_attn.att_proj."),
        (".attn_out.", ".self_attn.o_proj."),
        (".ff_proj.", ".mlp.ff_proj."),
        (".ff_out.", ".mlp.down_proj."),
        (".q_norm.", ".self_attn.q_norm."),  # OLMo 2's (attention_layer_norm)
        (".k_norm.", ".self_attn.k_norm."),
    )

    @classmethod
    def layer_flags(cls, config) -> dict[str, bool]:
        """Qwen2's: q / k / v biases only, no q / k norms, every layer full attention."""
        return {
            "qkv_bias": True,
            "o_bias": False,
            "qk_norm": False,
            "mlp_bias": False,
            "sliding": False,
        }
