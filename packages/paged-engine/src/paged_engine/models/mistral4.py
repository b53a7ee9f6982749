"""Mistral 4 (`Mistral4ForCausalLM`, model_type "mistral4": the language model of Mistral
Small 4). DeepSeek-V3's layout (models/deepseek_v2.py): multi-head latent attention over a
latent KV cache, dense MLPs before `first_k_dense_replace`, then DeepSeek-style MoE layers with
shared experts; HF's checkpoint names are V3's, without `e_score_correction_bias`. It differs in:

- Attention temperature (Ministral 3's, models/ministral3.py): after RoPE, HF multiplies the
  query by 1 + beta * log(1 + floor(position / original_max_position_embeddings)), beta and
  the original length from rope_parameters (`llama_4_scaling_beta`). We multiply the absorbed
  query [W_UK^T q_nope, rope(q_pe)] by the same factor (float32, rounded to the query's dtype
  as HF does): a token's scores scale alike. The latent cache is untouched.
- Router (layers/deepseek_moe.py, chosen by model_type): softmax scores, no correction bias;
  groups ranked by the sum of their two best scores, `topk_group` of `n_group` kept, k experts
  among them; their scores renormalized when `norm_topk_prob`, times `routed_scaling_factor`.
  HF's router runs in the model dtype (its weight too, not float32), and so does ours.
- RoPE: HF's config gives head_dim = qk_nope_head_dim + qk_rope_head_dim and
  partial_rotary_factor = qk_rope_head_dim / head_dim, so the rope tables cover the
  qk_rope_head_dim rotary dims, as DeepSeek's do (checked). `rope_interleave` (default True)
  rotates (even, odd) pairs; False rotates HF's NeoX halves of the rotary dims.
"""

from __future__ import annotations

import torch

from paged_engine.layers.rotary import RotaryEmbedding, get_rope
from paged_engine.models.deepseek_v2 import DeepseekV2ForCausalLM, MlaAttention
from paged_engine.models.ministral3 import llama4_attn_scale, llama4_scaling


class Mistral4Attention(MlaAttention):
    """MLA with the absorbed queries scaled by position (Llama 4's attention temperature)."""

    def __init__(self, config, rope: RotaryEmbedding) -> None:
        super().__init__(config, rope)
        self.q_scaling = llama4_scaling(config)  # (beta, original length) or None

    def scale_queries(self, positions: torch.Tensor, q_full: torch.Tensor) -> torch.Tensor:
        if self.q_scaling is None:
            return q_full
        scale = llama4_attn_scale(positions, *self.q_scaling).to(q_full.dtype)
        return q_full * scale[:, None]


def mistral4_rope(config) -> RotaryEmbedding:
    """The shared rope: HF's over int(head_dim * partial_rotary_factor) dims of the qk head,
    which must be the qk_rope_head_dim rotary dims; applied to those parts alone."""
    head_dim = config.qk_nope_head_dim + config.qk_rope_head_dim
    if getattr(config, "head_dim", head_dim) != head_dim:  # HF sizes its rope by head_dim
        raise ValueError(
            f"config head_dim={config.head_dim} is not supported for Mistral 4: it must be "
            f"qk_nope_head_dim + qk_rope_head_dim = {head_dim}"
        )
    interleave = bool(getattr(config, "rope_interleave", True))
    rope = get_rope(config, head_dim, is_neox_style=not interleave)
    if rope.rotary_dim != config.qk_rope_head_dim:
        raise ValueError(
            f"Mistral 4's rope covers {rope.rotary_dim} of the {head_dim} qk dims "
            f"(partial_rotary_factor); expected qk_rope_head_dim={config.qk_rope_head_dim}"
        )
    rope.head_dim = rope.rotary_dim  # q_pe [T, H * rope] and k_pe [T, rope] come split off
    return rope


class Mistral4ForCausalLM(DeepseekV2ForCausalLM):
    """Mistral Small 4: DeepSeek-V3 with position-scaled queries and a softmax router."""

    attention_cls = Mistral4Attention

    @classmethod
    def build_rope(cls, config) -> RotaryEmbedding:
        return mistral4_rope(config)
