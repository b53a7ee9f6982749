"""Ministral 3 text decoder (`Ministral3ForCausalLM`: the language model of Ministral-3 3B / 8B /
14B, model_type "ministral3").

Mistral's decoder (models/mistral.py, i.e. Llama's layers and weights; head_dim is explicit and
differs from hidden_size / num_attention_heads: 128 for 3072 / 32 heads) with two differences:

- Llama-4-style attention temperature: after RoPE, q is multiplied per token by
  1 + beta * log(1 + floor(position / original_max_position_embeddings)), beta being
  rope_parameters["llama_4_scaling_beta"]; 1 within the original context, growing by steps
  past it. The factor is computed in float32 and rounded to q's dtype before the product (HF's
  order). k and v are untouched, so the KV cache holds what it holds for Mistral.
- The rope is YaRN (rope_parameters, with mscale == mscale_all_dim, i.e. cos / sin unscaled),
  computed by layers/rotary.py like any other.

config.sliding_window (None in the released checkpoints) applies to every layer: HF's
Ministral 3 ignores layer_types and use_sliding_window.

The released Hub checkpoints are `Mistral3ForConditionalGeneration` (a Pixtral vision encoder
around this decoder, with it as text_config); this class serves text-only checkpoints whose
config.architectures names `Ministral3ForCausalLM`.
"""

from __future__ import annotations

import torch

from paged_engine.layers.attention import AttentionMetadata
from paged_engine.layers.rotary import RotaryEmbedding
from paged_engine.models.llama import LlamaAttention, LlamaDecoderLayer, LlamaModel
from paged_engine.models.mistral import MistralForCausalLM
from paged_engine.models.utils import CausalLMBase, cfg_get


def llama4_attn_scale(positions: torch.Tensor, beta: float, original: int) -> torch.Tensor:
    """[T] float32: 1 + beta * log(1 + floor(positions / original))."""
    return 1 + beta * torch.log(1 + torch.floor(positions / original))


def llama4_scaling(config) -> tuple[float, int] | None:
    """(beta, original_max_position_embeddings) of the q scaling, or None where beta is unset or
    0 (no scaling); ValueError when beta comes without the original context length."""
    params = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None)
    params = params or {}
    beta = params.get("llama_4_scaling_beta")
    if not beta:
        return None
    original = params.get("original_max_position_embeddings")
    if not original:
        raise ValueError(
            "config.rope_parameters llama_4_scaling_beta needs original_max_position_embeddings"
        )
    return float(beta), int(original)


class Ministral3Attention(LlamaAttention):
    """Llama's attention (no q/k norms, Mistral's flags) with q scaled by position after RoPE."""

    def __init__(self, config, layer_idx: int, flags: dict[str, bool], rope: RotaryEmbedding):
        super().__init__(config, layer_idx, flags, rope)
        window = cfg_get(config, "sliding_window", None)
        self.attn.sliding_window = int(window) if window else None  # every layer, as HF's
        self.q_scaling = llama4_scaling(config)

    def forward(
        self,
        positions: torch.Tensor,  # [T]
        x: torch.Tensor,  # [T, D]
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        md: AttentionMetadata,
    ) -> torch.Tensor:
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q, k = self.rotary_emb(positions, q, k)  # [T, H*D], [T, Hkv*D]
        if self.q_scaling is not None:
            scale = llama4_attn_scale(positions, *self.q_scaling).to(q.dtype)
            q = q * scale[:, None]
        return self.o_proj(self.attn(q, k, v, kv_cache, md))


class Ministral3ForCausalLM(MistralForCausalLM):
    def __init__(self, config) -> None:
        flags = self.layer_flags(config)
        attn = Ministral3Attention
        inner = LlamaModel(
            config, flags, lambda i, rope: LlamaDecoderLayer(config, i, flags, rope, attn)
        )
        CausalLMBase.__init__(self, config, inner)
