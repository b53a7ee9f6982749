"""GLM-5.3-Flash's language model (`Glm5NextForConditionalGeneration` served text-only: our
`Glm5NextTextForCausalLM`, HF's `Glm5NextTextModel` plus `lm_head`), model_type
"glm5_next_text".

Kimi Linear's hybrid (models/kimi_linear.py: KDA layers among NoPE MLA layers, DeepSeek-V3's
MoE after dense layers) with these differences, each as transformers runs it:

    streams    DeepSeek-V4's manifold-constrained hyper-connections
               (models/hyper_connections.py; `attn_hc` / `ffn_hc` per layer) carry hc_mult
               residual streams [T, N, D], the embedding copied into each; the final collapse
               is their plain mean (no `hc_head` weights), then the norm
    linear     `linear_attention` layers: KDA whose forget gate is bounded below by
               `linear_lower_bound` (layers/glm5_next_attention.py)
    MLA        `indexed_attention` layers: MLA with qk_rope_head_dim 0 (HF refuses any other),
               its latent norms at rms_norm_eps (not DeepSeek's fixed 1e-6), softmax scale
               qk_nope_head_dim^-0.5; a DSA indexer (kpool-compressed keys, `indexer_types`
               full / shared) keeps index_topk tokens a query
    SwiGLU     the dense MLPs, the shared expert and the routed experts clamp the gate to
               <= swiglu_limit and the up projection to [-swiglu_limit, swiglu_limit]

The indexer: while a sequence holds at most index_topk tokens its choice keeps every visible
complete pool and (index_kpool_always_select_tail) the incomplete tail, i.e. all of a query's
causal keys, so the MLA layers attend densely. We serve exactly that range: max_model_len must
not exceed index_topk (the release: 2048), and the indexer's weights are not loaded.

The clamped routed experts run grouped in torch (`ActExperts`), eagerly: CUDA graphs are
refused when captured (enforce_eager=True). Refused by name: max_model_len > index_topk,
index_kpool_always_select_tail=False (the tail would be dropped even in short sequences),
qk_rope_head_dim > 0, pipeline parallelism (the streams), a hidden_act other than SiLU. The
checkpoint's MTP layer (index num_hidden_layers) is skipped.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from paged_engine.distributed.parallel_state import get_parallel_state
from paged_engine.layers.activation import ClampedSiluAndMul
from paged_engine.layers.attention import AttentionMetadata
from paged_engine.layers.deepseek_moe import DeepseekMoe, num_routed_experts
from paged_engine.layers.fused_moe import ActExperts
from paged_engine.layers.glm5_next_attention import Glm5NextDeltaAttention
from paged_engine.layers.kda import KDA_CONV_RULES
from paged_engine.layers.norm import RMSNorm
from paged_engine.layers.rotary import context_len_or
from paged_engine.models.hybrid import LINEAR_LAYER_TYPES, HybridModel, layer_types
from paged_engine.models.hyper_connections import HyperConnection
from paged_engine.models.kimi_linear import NopeMlaAttention
from paged_engine.models.llama import LlamaMLP, stage_input
from paged_engine.models.mixtral import check_silu, expert_rules
from paged_engine.models.utils import CausalLMBase

INDEXER = ".self_attn.indexer."  # the DSA indexer's weights: not needed within index_topk


def with_activation(
    moe: DeepseekMoe, routed: nn.Module | None, shared: nn.Module | None
) -> DeepseekMoe:
    """`moe` with its routed experts' and shared experts' activations replaced (None: kept;
    the routed experts then run grouped in torch, `ActExperts`)."""
    if routed is not None:
        e = moe.experts
        moe.experts = ActExperts(routed, e.num_experts, e.hidden_size, e.intermediate_size,
                                 e.tp_rank, e.tp_size)  # fmt: skip
    if shared is not None and moe.shared_experts is not None:
        moe.shared_experts.act_fn = shared
    return moe


def clamped_mlp(config, layer_idx: int) -> nn.Module:
    """`mlp_layer_types[i]`: "dense" (a SwiGLU MLP) or "sparse" (DeepSeek-V3's MoE), both with
    the swiglu_limit clamp."""
    kinds = list(config.mlp_layer_types)
    if len(kinds) != config.num_hidden_layers or kinds[layer_idx] not in ("dense", "sparse"):
        raise ValueError(f"mlp_layer_types must be 'dense' / 'sparse' a layer, got {kinds}")
    act = ClampedSiluAndMul(float(config.swiglu_limit))
    if kinds[layer_idx] == "dense":
        mlp = LlamaMLP(config, bias=False)
        mlp.act_fn = act
        return mlp
    return with_activation(DeepseekMoe.from_config(config), act, act)


class Glm5NextMlaAttention(NopeMlaAttention):
    """NoPE MLA (qk_rope_head_dim 0) whose latent norms use rms_norm_eps."""

    def __init__(self, config) -> None:
        if int(config.qk_rope_head_dim):
            raise ValueError(f"qk_rope_head_dim={config.qk_rope_head_dim}: GLM-5 MLA is NoPE (0)")
        super().__init__(config)
        eps = float(config.rms_norm_eps)
        self.q_a_layernorm = RMSNorm(int(config.q_lora_rank), eps)
        self.kv_a_layernorm = RMSNorm(self.rank, eps)


def check_indexer(config) -> None:
    """The DSA indexer keeps every causal key of any sequence we serve (module docstring)."""
    if not config.index_kpool_always_select_tail:
        raise ValueError(
            "index_kpool_always_select_tail=False is not supported (the DSA indexer drops the "
            "incomplete pool)"
        )
    max_len = context_len_or(int(config.max_position_embeddings))
    if max_len > int(config.index_topk):
        raise ValueError(
            f"max_model_len={max_len} exceeds index_topk={config.index_topk}: the DSA indexer's "
            "sparse selection is not supported; serve with max_model_len <= index_topk"
        )


class Glm5NextDecoderLayer(nn.Module):
    """`attn_hc` -> norm -> KDA or MLA, `ffn_hc` -> norm -> MLP; streams [T, N, D]."""

    def __init__(self, config, layer_idx: int) -> None:
        super().__init__()
        self.is_linear = layer_types(config)[layer_idx] in LINEAR_LAYER_TYPES
        if self.is_linear:
            self.self_attn = Glm5NextDeltaAttention(config, layer_idx, config.linear_lower_bound)
        else:
            self.self_attn = Glm5NextMlaAttention(config)
        self.mlp = clamped_mlp(config, layer_idx)
        eps = float(config.rms_norm_eps)
        self.input_layernorm = RMSNorm(config.hidden_size, eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps)
        self.attn_hc = HyperConnection(config)
        self.ffn_hc = HyperConnection(config)

    def forward(self, positions, streams, kv_cache, md: AttentionMetadata) -> torch.Tensor:
        dtype = streams.dtype
        post, comb, x = self.attn_hc(streams)
        h = self.input_layernorm(x)
        h = self.self_attn(h, md) if self.is_linear else self.self_attn(positions, h, kv_cache, md)
        streams = post.to(dtype).unsqueeze(-1) * h.unsqueeze(1) + torch.matmul(
            comb.to(dtype).transpose(-1, -2), streams
        )
        post, comb, x = self.ffn_hc(streams)
        h = self.mlp(self.post_attention_layernorm(x))
        return post.to(dtype).unsqueeze(-1) * h.unsqueeze(1) + torch.matmul(
            comb.to(dtype).transpose(-1, -2), streams
        )


class Glm5NextModel(HybridModel):
    """HybridModel's stack over hc_mult streams: copied in, averaged out before the norm."""

    def __init__(self, config) -> None:
        if get_parallel_state().pp_size > 1:
            raise ValueError(
                "GLM-5.3-Flash does not support pipeline parallelism (its hyper-connection "
                "streams stay on one stage)"
            )
        norm = RMSNorm(config.hidden_size, float(config.rms_norm_eps))
        super().__init__(config, lambda i: Glm5NextDecoderLayer(config, i), norm, None)
        self.streams = int(config.hc_mult)

    def forward(self, input_ids, positions, kv_caches, md, hidden=None) -> torch.Tensor:
        x = stage_input(self, input_ids, hidden)  # [T, D]
        streams = x.unsqueeze(1).expand(-1, self.streams, -1).contiguous()
        for layer, i in zip(self.layers, self.kv_index, strict=True):
            streams = layer(positions, streams, kv_caches[i] if i >= 0 else None, md)
        return self.norm(streams.mean(dim=1))


class Glm5NextTextForCausalLM(CausalLMBase):
    stacked_params = (
        *KDA_CONV_RULES,
        (".gate_up_proj", ".gate_proj", 0),
        (".gate_up_proj", ".up_proj", 1),
    )
    # The release's names (hc_attn_fn, ...) and transformers' in-memory ones (attn_hc.fn) load.
    renames = (
        (".hc_attn_", ".attn_hc."),
        (".hc_ffn_", ".ffn_hc."),
        (".self_attn.forget_gate.", ".self_attn."),
    )

    def __init__(self, config) -> None:
        check_silu(config, type(self).__name__)
        check_indexer(config)
        super().__init__(config, Glm5NextModel(config))
        # Expert rules first: the dense and shared MLPs' ".gate_proj" also matches an expert's.
        rules = expert_rules(num_routed_experts(config), "gate_proj", "up_proj", "down_proj")
        self.stacked_params = (*rules, *type(self).stacked_params)

    def load_weights(
        self, weights: Iterable[tuple[str, torch.Tensor]], strict: bool = True
    ) -> set[str]:
        kept = ((n, w) for n, w in weights if INDEXER not in n)
        return super().load_weights(kept, strict)
