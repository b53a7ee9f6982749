"""xAI's Grok-1 (hpcai-tech/grok-1, keyfan/grok-1-hf; remote code, `Grok1ModelForCausalLM` or
`Grok1ForCausalLM`), served as vLLM's grok1.py serves it (its `GrokForCausalLM`, Grok-1 path).

    embedding  embed_tokens(ids) * embedding_multiplier_scale
    attention  GQA with NeoX RoPE (rope_theta), head_dim = hidden_size / num_attention_heads;
               scores q.k * head_dim^-0.5 soft-capped at attn_logit_softcapping (30 when
               absent, 0 none); o_proj's output times attn_output_multiplier (1 when absent)
    layer      four RMSNorms: x += post_attn_norm(attn(pre_attn_norm(x)));
               x += post_moe_norm(moe(pre_moe_norm(x)))
    MoE        router logits soft-capped at router_logit_softcapping (30 when absent), softmax,
               top num_experts_per_tok, renormalized; experts down(gelu(linear x) * linear_v x)
               with the exact (erf) GELU, `linear_1` the down projection
    logits     lm_head(h) * output_multiplier_scale (the head tied when tie_word_embeddings,
               the release's default)

The release's own code scales the scores by attn_output_multiplier and leaves o_proj's output
alone, caps the scores at `max_attn_value`, and neither caps nor renormalizes the router: on
the release's config (attn_output_multiplier = 128^-0.5 = head_dim^-0.5) vLLM's extra output
factor and renormalization are per-token scales the next RMSNorm removes up to its eps, and the
router cap is near the identity. We follow vLLM; a `max_attn_value` other than the cap vLLM
applies is refused by name.

Checkpoint names: `attn.{q,k,v,o}_proj`, `moe_block.gate`, `moe_block.experts.M.{linear,
linear_v,linear_1}` (gate, up, down), the norms' `scale` (ours `weight`). Grok-2's fields
(residual_moe, moe_intermediate_size: a dense MLP beside the MoE, unrenormalized routing), a
final logit cap, rope scaling and non-renormalized routing have no reference here and are
refused by name.

The experts run through the fused MoE (`MoeActivation("gelu")`, paged_kernels' erf branch).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from transformers import PretrainedConfig

from paged_engine.layers.attention import AttentionMetadata
from paged_engine.layers.embedding import VocabParallelEmbedding
from paged_engine.layers.fused_moe import SparseMoeBlock, route
from paged_engine.layers.norm import RMSNorm
from paged_engine.layers.rotary import RotaryEmbedding, get_rope
from paged_engine.models.gemma2 import GemmaAttention
from paged_engine.models.mixtral import expert_rules
from paged_engine.models.remote_aliases import field, llama_fields, refuse_unless
from paged_engine.models.utils import QKV_PROJ_RULES, CausalLMBase, make_layers, soft_cap
from paged_kernels import MoeActivation

# vLLM's defaults for the fields a Grok config may omit (the release's values)
_EMBEDDING_SCALE = 78.38367176906169
_OUTPUT_SCALE = 0.5773502691896257
_CAP = 30.0


def _cap(raw: dict[str, Any], name: str) -> float:
    """A soft cap as vLLM reads it: absent 30, negative 0; 0 means none."""
    return max(field(raw, name, float, _CAP), 0.0)


def grok1_config(raw: dict[str, Any]) -> PretrainedConfig:
    """Grok-1's config.json under the names our classes read, with vLLM's defaults."""
    arch = next(a for a in raw["architectures"] if a.startswith("Grok1"))
    for name in ("residual_moe", "moe_intermediate_size"):  # Grok-2's MoE
        refuse_unless(raw, arch, name, (None, False))
    for name in ("final_logit_softcapping", "rope_scaling", "quantization_config"):
        refuse_unless(raw, arch, name, (None,))
    refuse_unless(raw, arch, "rope_type", (None, "default", "original"))
    for name in ("moe_router_renormalize", "moe_renormalize"):
        refuse_unless(raw, arch, name, (None, True))
    sizes = llama_fields(raw, max_positions=8192, rms_norm_eps=1e-5)
    # vLLM's, whatever a head_dim field says: refused if it differs
    head_dim = sizes["hidden_size"] // sizes["num_attention_heads"]
    refuse_unless(raw, arch, "head_dim", (None, head_dim))
    attn_cap = _cap(raw, "attn_logit_softcapping")
    if raw.get("max_attn_value") is not None and field(raw, "max_attn_value", float) != attn_cap:
        raise ValueError(
            f"{arch}: config.json field 'max_attn_value'={raw['max_attn_value']!r} is not "
            f"supported: vLLM caps the attention scores at attn_logit_softcapping ({attn_cap})"
        )
    # the release's num_experts, else num_local_experts (vLLM's order)
    name = "num_experts" if raw.get("num_experts") is not None else "num_local_experts"
    fields = {
        **sizes,
        "head_dim": head_dim,
        "rope_theta": field(raw, "rope_theta", float, 10000.0),
        "tie_word_embeddings": field(raw, "tie_word_embeddings", bool, True),
        "num_local_experts": field(raw, name, int, 8),
        "num_experts_per_tok": field(raw, "num_experts_per_tok", int, 2),
        "attn_logit_softcapping": attn_cap,
        "router_logit_softcapping": _cap(raw, "router_logit_softcapping"),
        "attn_output_multiplier": field(raw, "attn_output_multiplier", float, 1.0),
        "embedding_multiplier_scale": field(
            raw, "embedding_multiplier_scale", float, _EMBEDDING_SCALE
        ),
        "output_multiplier_scale": field(raw, "output_multiplier_scale", float, _OUTPUT_SCALE),
    }
    config = PretrainedConfig(**fields)
    config.model_type = "grok-1"
    return config


class Grok1MoE(SparseMoeBlock):
    """Softmax top-k over soft-capped router logits, renormalized; exact-GELU gated experts.
    [T, H] -> [T, H]."""

    def __init__(self, config) -> None:
        e, h, i = config.num_local_experts, config.hidden_size, config.intermediate_size
        act = MoeActivation("gelu")
        super().__init__(e, config.num_experts_per_tok, h, i, renormalize=True, activation=act)
        self.router_cap = config.router_logit_softcapping or None

    def select_experts(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return route(soft_cap(self.gate(x), self.router_cap), self.top_k, self.renormalize)


class Grok1DecoderLayer(nn.Module):
    def __init__(self, config, rope: RotaryEmbedding) -> None:
        super().__init__()
        d, eps = config.hidden_size, config.rms_norm_eps
        cap = config.attn_logit_softcapping or None
        # scores scaled by query_pre_attn_scalar^-0.5: head_dim^-0.5 (no such field here)
        self.attn = GemmaAttention(config, None, rope, qk_norm=False, soft_cap=cap)
        self.attn_output_multiplier = float(config.attn_output_multiplier)
        self.moe_block = Grok1MoE(config)
        self.pre_attn_norm = RMSNorm(d, eps)
        self.post_attn_norm = RMSNorm(d, eps)
        self.pre_moe_norm = RMSNorm(d, eps)
        self.post_moe_norm = RMSNorm(d, eps)

    def forward(
        self,
        positions: torch.Tensor,  # [T]
        x: torch.Tensor,  # [T, D]
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        md: AttentionMetadata,
    ) -> torch.Tensor:
        attn = self.attn(positions, self.pre_attn_norm(x), kv_cache, md)
        x = x + self.post_attn_norm(attn * self.attn_output_multiplier)
        return x + self.post_moe_norm(self.moe_block(self.pre_moe_norm(x)))


class Grok1Model(nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        d = config.hidden_size
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, d)
        self.embedding_multiplier_scale = float(config.embedding_multiplier_scale)
        rope = get_rope(config, config.head_dim, is_neox_style=True)  # shared by the layers
        self.layers, self.stage = make_layers(
            config.num_hidden_layers, lambda i: Grok1DecoderLayer(config, rope)
        )
        self.norm = RMSNorm(d, config.rms_norm_eps)

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:  # [T] -> [T, D]
        return self.embed_tokens(input_ids) * self.embedding_multiplier_scale

    def forward(self, input_ids, positions, kv_caches, md, hidden=None) -> torch.Tensor:
        # hidden: the previous stage's output or input embeddings
        x = self.embed_input_ids(input_ids) if hidden is None else hidden
        for layer, kv_cache in zip(self.stage.layers(self.layers), kv_caches, strict=True):
            x = layer(positions, x, kv_cache, md)
        return self.norm(x) if self.stage.is_last else x


class Grok1ForCausalLM(CausalLMBase):
    tie_default = True
    ignored_weights = ("rotary_emb.inv_freq",)

    def __init__(self, config) -> None:
        super().__init__(config, Grok1Model(config))
        self.output_multiplier_scale = float(config.output_multiplier_scale)
        experts = expert_rules(config.num_local_experts, "linear", "linear_v", "linear_1")
        self.stacked_params = (*experts, *QKV_PROJ_RULES)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [N, D] -> [N, V] fp32
        return super().compute_logits(hidden) * self.output_multiplier_scale

    def rename_weight(self, name: str) -> str:
        return name[: -len(".scale")] + ".weight" if name.endswith("norm.scale") else name
