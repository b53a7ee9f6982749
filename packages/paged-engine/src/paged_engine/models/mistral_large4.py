"""Mistral Large 4 (`MistralLarge4TextForCausalLM`, model_type "mistral_large4_text": the
language model of `MistralLarge4ForConditionalGeneration`, served text-only through
models/text_wrappers.py). GLM-5's DeepSeek Sparse Attention stack (models/deepseek_v32.py:
absorbed MLA, an indexer on "full" layers whose choice "shared" layers reuse, `mlp_layer_types`)
with these differences, each as transformers runs it:

    queries    no q bottleneck: q_proj [H * qk_head_dim, hidden] straight from x
    scaling    after rope, each head's query times scale_h * log(position + 1) + bias_h (the
               `softmax_scaling` module, in the query's dtype); we scale the absorbed query
               [W_UK^T q_nope, rope(q_pe)] alike, which scales the head's scores alike
    LeRoPE     one learned `rotary_emb.alpha` [qk_rope_head_dim / 2]: inv_freq * exp(alpha)
               (float32) before the angles; (even, odd) pairs on MLA and indexer alike; HF's
               default rope is YaRN with attention_factor 1.0 (read from rope_parameters)
    NoPE       `no_rope_layers[i] == 0`: no rotary part at all; q's and W_UK's
               qk_nope_head_dim + qk_rope_head_dim dims are all "nope", the latent row is the
               kv_lora_rank entries alone, and that layer's indexer rotates nothing
    indexer    its queries come from x: wq_b(LayerNorm(x)) (eps 1e-6, with bias), times the
               same kind of per-head log-position scaling (its own scale / bias); keys, weights
               and the choice as GLM-5's (interleaved rope on the first qk_rope_head_dim dims)
    norms      kv_a_layernorm at rms_norm_eps (DeepSeek's MLA keeps 1e-6)
    router     Mistral 4's grouped softmax router in float32 (float32 weight), its top-k
               weights always renormalized, times routed_scaling_factor; shared experts
    logits     tanh soft-capped at `final_logit_softcapping` (the wrapper's, from this config;
               30.0 when the config has none, as transformers defaults it)

Refused by name: `kv_source_layers` other than each layer its own (cross-layer latent KV
sharing), `no_rope_layers` shorter than num_hidden_layers, and what GLM-5 refuses (CUDA graphs,
speculative_config method "mtp", pipeline stages that start on a shared indexer layer).
"""

from __future__ import annotations

import re
from typing import Any

import torch
from torch import nn

from paged_engine.distributed.parallel_state import get_tp_rank, get_tp_size
from paged_engine.layers.deepseek_moe import DeepseekMoe, num_routed_experts
from paged_engine.layers.norm import LayerNorm, RMSNorm
from paged_engine.layers.rotary import (
    RotaryEmbedding,
    context_len_or,
    get_rope,
    rope_config,
    scaled_inv_freq,
)
from paged_engine.models.deepseek_v2 import DeepseekDecoderLayer
from paged_engine.models.deepseek_v32 import (
    Choices,
    DsaAttention,
    DsaIndexer,
    GlmMoeDsaForCausalLM,
    indexer_types,
)
from paged_engine.models.kimi_linear import NoRope
from paged_engine.models.llama import LlamaMLP
from paged_engine.models.utils import soft_cap

# Mistral's native checkpoint names (the release's; transformers saves them too) -> ours
_NATIVE_TOP = ("tok_embeddings.", "layers.", "norm.", "output.", "lerope.")
_NATIVE_RENAMES = (
    (r"^tok_embeddings\.", "model.embed_tokens."),
    (r"^layers\.", "model.layers."),
    (r"^norm\.", "model.norm."),
    (r"^output\.", "lm_head."),
    (r"^lerope\.alpha", "model.rotary_emb.alpha"),
    (r"\.attention\.", ".self_attn."),
    (r"\.wq\.", ".q_proj."),
    (r"\.wkv_a_with_mqa\.", ".kv_a_proj_with_mqa."),
    (r"\.wkv_b\.", ".kv_b_proj."),
    (r"\.wo\.", ".o_proj."),
    (r"\.attention_norm\.", ".input_layernorm."),
    (r"\.ffn_norm\.", ".post_attention_layernorm."),
    (r"\.kv_a_norm\.", ".kv_a_layernorm."),
    (r"\.feed_forward\.", ".mlp."),
    (r"\.gate\.", ".mlp.gate."),
    (r"\.experts\.", ".mlp.experts."),
    (r"\.shared_experts\.", ".mlp.shared_experts."),
    (r"\.ssmax_scaling\.s$", ".softmax_scaling.scale"),
    (r"\.ssmax_scaling\.b$", ".softmax_scaling.bias"),
    (r"\.w1\.", ".gate_proj."),
    (r"\.w2\.", ".down_proj."),
    (r"\.w3\.", ".up_proj."),
)


class _Overrides:
    """`base` config with some fields replaced (a NoPE layer's dims, the indexer's input)."""

    def __init__(self, base: Any, **fields: Any) -> None:
        self.__dict__.update(fields)
        self._base = base

    def __getattr__(self, name: str) -> Any:
        return getattr(self._base, name)


def rope_layers(config) -> list[bool]:
    """Whether each layer rotates (`no_rope_layers`: 1 rope, 0 NoPE; all rope without)."""
    n = int(config.num_hidden_layers)
    flags = getattr(config, "no_rope_layers", None)
    if flags is None:
        return [True] * n
    if len(flags) < n:
        raise ValueError(f"no_rope_layers needs an entry a layer ({n}), got {list(flags)}")
    return [bool(f) for f in flags[:n]]


def check_kv_sources(config) -> None:
    sources = getattr(config, "kv_source_layers", None)
    n = int(config.num_hidden_layers)
    if sources is not None and list(sources) != list(range(n)):
        raise ValueError(
            f"kv_source_layers={list(sources)}: layers reading another layer's latent KV "
            "cache (Mistral Large 4's KV sharing) are not supported"
        )


def lerope(config) -> RotaryEmbedding:
    """The shared rope over qk_rope_head_dim (even, odd) pairs with a learned `alpha`: loading
    it rebuilds the cos / sin tables from inv_freq * exp(alpha) (module docstring)."""
    rope = get_rope(config, int(config.qk_rope_head_dim), is_neox_style=False)
    theta, scaling, _ = rope_config(config)
    max_position = int(config.max_position_embeddings)
    ctx = context_len_or(0) or None  # as get_rope reads it
    ctx = None if ctx is None else min(ctx, max_position)
    inv_freq, factor = scaled_inv_freq(rope.rotary_dim, theta, scaling, max_position, ctx)
    rope.alpha = nn.Parameter(torch.zeros(rope.rotary_dim // 2, dtype=torch.float32))

    def load_alpha(param: nn.Parameter, w: torch.Tensor) -> None:
        alpha = w.float().to(inv_freq.device)
        param.data.copy_(alpha)
        positions = torch.arange(rope.cos.shape[0], dtype=torch.float32)
        freqs = torch.outer(positions, inv_freq * alpha.exp())  # [P, rotary_dim / 2]
        rope.cos.copy_(freqs.cos() * factor)
        rope.sin.copy_(freqs.sin() * factor)

    rope.alpha.weight_loader = load_alpha
    return rope


class SoftmaxScaling(nn.Module):
    """`*SoftmaxScaling`: q [T, H, W] times scale_h * log(position + 1) + bias_h, in q's dtype.
    `tp`: this rank's heads of the checkpoint's (the attention's), else all (the indexer's)."""

    def __init__(self, num_heads: int, tp: bool) -> None:
        super().__init__()
        self.rank, self.size = (get_tp_rank(), get_tp_size()) if tp else (0, 1)
        self.scale = nn.Parameter(torch.empty(num_heads // self.size))
        self.bias = nn.Parameter(torch.empty(num_heads // self.size))
        self.scale.weight_loader = self.bias.weight_loader = self._load

    def _load(self, param: nn.Parameter, w: torch.Tensor) -> None:
        param.data.copy_(w.view(self.size, -1)[self.rank])

    def forward(self, positions: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
        log_pos = (positions + 1).float().log().to(q.dtype)  # [T]
        factor = self.scale.to(q.dtype) * log_pos[:, None] + self.bias.to(q.dtype)  # [T, H]
        return q * factor.unsqueeze(-1)


class MistralLarge4Indexer(DsaIndexer):
    """GLM-5's indexer whose queries are wq_b(LayerNorm(x)), scaled by position per head."""

    def __init__(self, config, rope: RotaryEmbedding, neox: bool) -> None:
        super().__init__(_Overrides(config, q_lora_rank=config.hidden_size), rope, neox)
        self.q_input_norm = LayerNorm(int(config.hidden_size), eps=1e-6)
        self.softmax_scaling = SoftmaxScaling(self.heads, tp=False)

    def forward(self, positions, x, q_resid) -> tuple[torch.Tensor, torch.Tensor]:
        keys, qw = super().forward(positions, x, self.q_input_norm(x))
        t, n = x.shape[0], self.heads * self.dim
        q = self.softmax_scaling(positions, qw[:, :n].view(t, self.heads, self.dim))
        return keys, torch.cat((q.reshape(t, n), qw[:, n:]), dim=-1)


class MistralLarge4Attention(DsaAttention):
    """DSA's MLA with q_proj, per-head log-position query scaling, RMS eps rms_norm_eps on
    the latent; `use_rope` False: a NoPE layer (module docstring)."""

    indexer_cls = MistralLarge4Indexer
    needs_q_bottleneck = False  # queries come from q_proj, the indexer's from x

    def __init__(
        self,
        config,
        rope: RotaryEmbedding,
        full: bool,
        choices: Choices,
        neox_index_rope: bool,
        use_rope: bool = True,
    ) -> None:
        if not use_rope:  # every qk dim is "nope"; no rotary key in the latent row
            nope = int(config.qk_nope_head_dim) + int(config.qk_rope_head_dim)
            config = _Overrides(config, qk_rope_head_dim=0, qk_nope_head_dim=nope)
            rope = NoRope(rope.cos.shape[0])  # type: ignore[assignment]
        super().__init__(config, rope, full, choices, neox_index_rope)
        self.kv_a_layernorm = RMSNorm(self.rank, float(config.rms_norm_eps))
        self.softmax_scaling = SoftmaxScaling(int(config.num_attention_heads), tp=True)

    def scale_queries(self, positions: torch.Tensor, q_full: torch.Tensor) -> torch.Tensor:
        t = q_full.shape[0]
        return self.softmax_scaling(positions, q_full.view(t, self.heads, -1)).view(t, -1)


class MistralLarge4TextForCausalLM(GlmMoeDsaForCausalLM):
    """GLM-5's DSA stack with Mistral Large 4's attention, LeRoPE, NoPE layers, router and
    soft-capped logits (module docstring)."""

    dsa_attention_cls = MistralLarge4Attention

    def __init__(self, config) -> None:
        check_kv_sources(config)
        use_rope = rope_layers(config)
        super().__init__(config)
        types = indexer_types(config)
        rope = self.model.rotary_emb
        for i, layer in enumerate(self.model.layers):
            if isinstance(layer, DeepseekDecoderLayer) and not use_rope[i]:
                choices = layer.self_attn.attn.choices  # the model's one dict
                layer.self_attn = MistralLarge4Attention(
                    config, rope, types[i] == "full", choices, self.neox_index_rope, False
                )
        self.final_soft_cap = float(getattr(config, "final_logit_softcapping", None) or 30.0)

    def rename_weight(self, name: str) -> str:
        """Mistral's native names (what transformers saves) -> ours; others as GLM-5's."""
        if name.startswith(_NATIVE_TOP):
            for theirs, ours in _NATIVE_RENAMES:
                name = re.sub(theirs, ours, name, count=1)
        return super().rename_weight(name)

    @classmethod
    def build_rope(cls, config) -> RotaryEmbedding:
        return lerope(config)

    @classmethod
    def build_mlp(cls, config, layer_idx: int) -> nn.Module:
        types = getattr(config, "mlp_layer_types", None)
        if types is not None and types[layer_idx] == "dense":
            return LlamaMLP(config, bias=False)
        if types is None and layer_idx < int(getattr(config, "first_k_dense_replace", 0) or 0):
            return LlamaMLP(config, bias=False)
        inter = int(config.moe_intermediate_size)
        return DeepseekMoe(
            num_experts=num_routed_experts(config),
            top_k=int(config.num_experts_per_tok),
            hidden_size=int(config.hidden_size),
            intermediate_size=inter,
            shared_intermediate_size=inter * int(getattr(config, "n_shared_experts", 0) or 0),
            n_group=int(getattr(config, "n_group", None) or 1),
            topk_group=int(getattr(config, "topk_group", None) or 1),
            sigmoid=False,
            correction_bias=False,
            renormalize=True,
            routed_scaling_factor=float(getattr(config, "routed_scaling_factor", None) or 1.0),
            group_score="top2_sum",
            router_float32=True,
        )

    @classmethod
    def kv_cache_layout(cls, config) -> list[tuple[int, int]]:
        """[c | rope(k_pe) (rope layers) | indexer key (full layers)] a layer."""
        rank, rope, index = (int(config.kv_lora_rank), int(config.qk_rope_head_dim),
                             int(config.index_head_dim))  # fmt: skip
        return [
            (1, rank + (rope if r else 0) + (index if t == "full" else 0))
            for r, t in zip(rope_layers(config), indexer_types(config), strict=True)
        ]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [N, D] -> [N, V] fp32
        return soft_cap(super().compute_logits(hidden), self.final_soft_cap)
