"""Muse Glimmer / Muse Spark text decoders (`MuseGlimmerTextForCausalLM`, model_type
"muse_glimmer_text"; `MuseSparkTextForCausalLM`, "muse_spark_text"): the language models of
transformers' `MuseGlimmerForConditionalGeneration` / `MuseSparkForConditionalGeneration`,
served text-only (models/text_wrappers.py), as transformers 5.25 runs them.

    embedding  the token row RMS-normalized without a weight (eps rms_norm_eps); the
               wrapper's image / video (/ audio) placeholder ids embed as id 0 (the ids the
               copy of the config carries)
    attention  GQA over head_dim; q and k RMS-normalized per head without a weight, q times
               qk_scale_factor (here folded into the softmax scale qk_scale_factor /
               sqrt(head_dim)); NeoX rope from rope_parameters on the layers whose
               layer_rope_theta is non-zero (HF reads only whether it is zero: every rope
               layer uses the global rope_theta), none where it is 0; the window on the
               layer_types "sliding_attention" layers. The output (Spark: RMS-normalized per
               head without a weight first) times sigmoid(gate_proj(x)), then o_proj
    layer      Glimmer: x += post_norm(attn(input_norm(x))); x += post_ff_norm(mlp(pre_ff_norm
               (x))), four (1 + w) RMSNorms (the post ones with post_norm_eps). Spark: the
               post-attention norm has no weight, the post-feedforward norm scales by (1 + w)
               before normalizing, and each add is a learned residual gate: with
               w = gate / residual_gate_temperature, x = sqrt(max(sigmoid(-w) * (1 +
               sigmoid(w)), 1e-3)) * x + sigmoid(w) * branch, in float32
    mlp        gated (Glimmer's `hidden_activation`, Spark's `hidden_act`); Spark's
               mlp_layer_types "sparse" layers: a sigmoid router on x (float32, logits times
               output_multiplier; top num_experts_per_tok of sigmoid + e_score_correction_bias,
               unbiased weights renormalized, times routed_scaling_factor), x pooled to
               moe_hidden_size (pre_expert_proj, a (1 + w) norm), gated SiLU experts at that
               width each followed by the shared `post_expert_norm` before its weight, then
               post_expert_proj back to hidden_size
    logits     the final RMSNorm (weight multiplied in float32), lm_head, times
               output_multiplier, then soft-capped: T * tanh(logits / T),
               T = final_logit_softcapping

Refused by name: layer_types other than full / sliding attention, sliding layers without a
sliding_window, mlp_layer_types other than dense / sparse, per-layer lists of the wrong length,
a partial rotary factor, a final_logit_softcapping of 0 / None (HF divides by it), experts of
another activation than SiLU. Tensor parallelism: heads split as Llama's; Spark's pooling
projections and router are replicated, its experts split their intermediate dim and the routes
are all-reduced before their norm.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from paged_engine.layers.activation import ActAndMul, SiluAndMul, get_act_fn
from paged_engine.layers.attention import Attention
from paged_engine.layers.deepseek_moe import DeepseekRouter, grouped_topk
from paged_engine.layers.embedding import VocabParallelEmbedding
from paged_engine.layers.linear import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
)
from paged_engine.layers.norm import GemmaRMSNorm, RMSNorm, UnitRMSNorm
from paged_engine.layers.rotary import RotaryEmbedding, get_rope, rope_config
from paged_engine.models.ergo import RouteNormedExperts
from paged_engine.models.llama import llama_head_dim
from paged_engine.models.utils import (
    QKV_PROJ_RULES,
    CausalLMBase,
    cfg_get,
    layer_sliding_window,
    make_layers,
    soft_cap,
)

_LAYER_TYPES = ("full_attention", "sliding_attention")
_MLP_TYPES = ("dense", "sparse")
_MEDIA_IDS = ("image_token_id", "video_token_id", "audio_token_id")


class MuseRMSNorm(RMSNorm):
    """x / rms(x) * weight in float32, rounded once (HF's final norm)."""

    round_before_weight = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., D]
        if self.kernel is not None:
            return self.kernel(x, self.weight, self.eps, 0.0)
        y = torch.rms_norm(x.float(), self.weight.shape, None, self.eps)
        return (y * self.weight.float()).to(x.dtype)


class SparkCenteredRMSNorm(GemmaRMSNorm):
    """Spark's (1 + w) norm: 1 + w rounds in the weight's dtype before the float32 product."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., D]
        if self.kernel is not None:
            return super().forward(x)
        y = torch.rms_norm(x.float(), self.weight.shape, None, self.eps)
        return (y * (1.0 + self.weight).float()).to(x.dtype)


class InputScaledRMSNorm(nn.Module):
    """Spark's norm(x * (1 + w)): the scale first (rounded to x's dtype), then x / rms(x)."""

    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(hidden_size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., D]
        scaled = (x.float() * (1.0 + self.weight).float()).to(x.dtype)
        return torch.rms_norm(scaled.float(), (x.shape[-1],), None, self.eps).to(x.dtype)


class ResidualGate(nn.Module):
    """Spark's learned mix of the stream x and a branch h, `gate` [D] float32."""

    def __init__(self, hidden_size: int, temperature: float) -> None:
        super().__init__()
        self.gate = nn.Parameter(torch.empty(hidden_size, dtype=torch.float32))
        self.temperature = temperature

    def forward(self, x: torch.Tensor, h: torch.Tensor) -> torch.Tensor:  # [T, D] each
        w = self.gate.float() / self.temperature
        beta = torch.sigmoid(w)
        alpha = torch.sqrt(torch.clamp(torch.sigmoid(-w) * (1.0 + beta), min=1e-3))
        return (alpha * x + beta * h).to(x.dtype)


class MuseAttention(nn.Module):
    def __init__(self, config, layer_idx: int, rope: RotaryEmbedding | None, o_norm: bool):
        super().__init__()
        hidden, heads = config.hidden_size, config.num_attention_heads
        kv_heads = cfg_get(config, "num_key_value_heads", heads)
        d = self.head_dim = llama_head_dim(config)
        bias = bool(getattr(config, "attention_bias", False))
        self.qkv_proj = QKVParallelLinear(hidden, d, heads, kv_heads, bias=bias)
        local, local_kv = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
        self.sizes = [local * d, local_kv * d, local_kv * d]
        self.gate_proj = ColumnParallelLinear(hidden, heads * d, False)  # this rank's heads
        self.o_proj = RowParallelLinear(heads * d, hidden, bias)
        eps = float(cfg_get(config, "rms_norm_eps", 1e-6))
        self.qk_norm = UnitRMSNorm(eps)
        self.o_norm = UnitRMSNorm(eps) if o_norm else None
        self.rotary_emb = rope  # None: a NoPE layer
        scale = float(config.qk_scale_factor) * d**-0.5  # q's factor folded in
        window = layer_sliding_window(config, layer_idx)
        self.attn = Attention(local, d, local_kv, scale, sliding_window=window)

    def forward(self, positions, x, kv_cache, md) -> torch.Tensor:  # x: [T, D]
        t, d = x.shape[0], self.head_dim
        q, k, v = self.qkv_proj(x).split(self.sizes, dim=-1)
        q = self.qk_norm(q.reshape(t, -1, d)).reshape(t, -1)
        k = self.qk_norm(k.reshape(t, -1, d)).reshape(t, -1)
        if self.rotary_emb is not None:
            q, k = self.rotary_emb(positions, q, k)
        out = self.attn(q, k, v, kv_cache, md)  # [T, H*D]
        if self.o_norm is not None:
            out = self.o_norm(out.view(t, -1, d)).reshape(t, -1)
        return self.o_proj(out * torch.sigmoid(self.gate_proj(x)))


class MuseMLP(nn.Module):
    def __init__(self, hidden: int, inter: int, act: str, field: str) -> None:
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(hidden, [inter, inter], False)
        self.down_proj = RowParallelLinear(inter, hidden, False)
        silu = act in ("silu", "swish")
        self.act_fn = SiluAndMul() if silu else ActAndMul(get_act_fn(act, field))

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, D]
        return self.down_proj(self.act_fn(self.gate_up_proj(x)))


class SparkRouter(DeepseekRouter):
    """sigmoid(output_multiplier * x @ W^T) routing with the balance bias (float32)."""

    def __init__(self, config) -> None:
        super().__init__(
            int(config.num_local_experts),
            config.hidden_size,
            int(config.num_experts_per_tok),
            scale=float(config.routed_scaling_factor),
        )
        self.multiplier = float(config.output_multiplier)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = F.linear(x.float(), self.weight) * self.multiplier
        bias = self.e_score_correction_bias
        return grouped_topk(logits, self.top_k, correction_bias=bias, scale=self.scale)


class SparkExperts(RouteNormedExperts):
    """Gated SiLU experts at moe_hidden_size, each route's output normed before its weight."""

    def __init__(self, config) -> None:
        width = int(config.moe_hidden_size)
        super().__init__(int(config.num_local_experts), width, int(config.moe_intermediate_size))
        self.post_expert_norm = InputScaledRMSNorm(width, float(config.post_norm_eps))

    def route_norm(self, y: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        return self.post_expert_norm(y)  # one norm for every expert ([N, moe_hidden_size])


class SparkMoe(nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        hidden, width = config.hidden_size, int(config.moe_hidden_size)
        self.gate = SparkRouter(config)
        self.pre_expert_proj = ColumnParallelLinear(hidden, width, False, 0, 1)  # replicated
        self.pre_expert_norm = SparkCenteredRMSNorm(width, float(config.rms_norm_eps))
        self.experts = SparkExperts(config)
        self.post_expert_proj = ColumnParallelLinear(width, hidden, False, 0, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, D]
        weights, ids = self.gate(x)
        pooled = self.pre_expert_norm(self.pre_expert_proj(x))
        return self.post_expert_proj(self.experts.routes(pooled, weights, ids))


class MuseDecoderLayer(nn.Module):
    def __init__(self, config, layer_idx: int, rope: RotaryEmbedding | None, spark: bool):
        super().__init__()
        d = config.hidden_size
        eps, post_eps = float(config.rms_norm_eps), float(config.post_norm_eps)
        self.self_attn = MuseAttention(config, layer_idx, rope, o_norm=spark)
        self.spark = spark
        if not spark:
            act = cfg_get(config, "hidden_activation", "silu")
            self.mlp = MuseMLP(d, config.intermediate_size, act, "hidden_activation")
            self.input_layernorm = GemmaRMSNorm(d, eps)
            self.post_attention_layernorm = GemmaRMSNorm(d, post_eps)
            self.pre_feedforward_layernorm = GemmaRMSNorm(d, eps)
            self.post_feedforward_layernorm = GemmaRMSNorm(d, post_eps)
            return
        if config.mlp_layer_types[layer_idx] == "sparse":
            self.mlp = SparkMoe(config)
        else:
            act = cfg_get(config, "hidden_act", "silu")
            self.mlp = MuseMLP(d, config.intermediate_size, act, "hidden_act")
        self.input_layernorm = SparkCenteredRMSNorm(d, eps)
        self.post_attention_layernorm = UnitRMSNorm(post_eps)
        self.pre_feedforward_layernorm = SparkCenteredRMSNorm(d, eps)
        self.post_feedforward_layernorm = InputScaledRMSNorm(d, post_eps)
        temperature = float(config.residual_gate_temperature)
        self.post_attention_residual_gate = ResidualGate(d, temperature)
        self.post_feedforward_residual_gate = ResidualGate(d, temperature)

    def forward(self, positions, x, kv_cache, md) -> torch.Tensor:  # x: [T, D]
        h = self.self_attn(positions, self.input_layernorm(x), kv_cache, md)
        h = self.post_attention_layernorm(h)
        x = self.post_attention_residual_gate(x, h) if self.spark else x + h
        h = self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))
        return self.post_feedforward_residual_gate(x, h) if self.spark else x + h


class MuseModel(nn.Module):
    def __init__(self, config, spark: bool) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        eps = float(cfg_get(config, "rms_norm_eps", 1e-6))
        self.embed_norm = UnitRMSNorm(eps)
        media = [int(v) for k in _MEDIA_IDS if (v := getattr(config, k, None)) is not None]
        self.register_buffer("media_ids", torch.tensor(media, dtype=torch.long), persistent=False)
        rope = get_rope(config, llama_head_dim(config))
        self.rotary_emb = rope
        thetas = config.layer_rope_theta

        def build(i: int) -> nn.Module:
            return MuseDecoderLayer(config, i, rope if thetas[i] else None, spark)

        self.layers, self.stage = make_layers(config.num_hidden_layers, build)
        self.norm = MuseRMSNorm(config.hidden_size, eps)

    def forward(self, input_ids, positions, kv_caches, md, hidden=None) -> torch.Tensor:
        if hidden is None:
            ids = input_ids.masked_fill(torch.isin(input_ids, self.media_ids), 0)
            x = self.embed_norm(self.embed_tokens(ids))  # [T, D]
        else:  # a later pipeline stage's input, or embeddings given as the prompt
            x = hidden
        for layer, kv_cache in zip(self.stage.layers(self.layers), kv_caches, strict=True):
            x = layer(positions, x, kv_cache, md)
        return self.norm(x) if self.stage.is_last else x


def check_muse_config(config, name: str, spark: bool) -> None:
    """ValueError naming what this implementation (or HF) cannot run."""
    n = int(config.num_hidden_layers)
    lists = ["layer_types", "layer_rope_theta"] + (["mlp_layer_types"] if spark else [])
    for key in lists:
        value = getattr(config, key, None)
        if value is None or len(value) != n:
            raise ValueError(f"{name}: config.{key} needs one entry a layer ({n}), got {value!r}")
    checked = [("layer_types", _LAYER_TYPES)] + ([("mlp_layer_types", _MLP_TYPES)] if spark else [])
    for key, allowed in checked:
        bad = sorted({t for t in getattr(config, key) if t not in allowed})
        if bad:
            raise ValueError(f"{name}: config.{key} {bad} not supported (only {list(allowed)})")
    if "sliding_attention" in config.layer_types and not getattr(config, "sliding_window", None):
        raise ValueError(f"{name}: sliding_attention layers need config.sliding_window")
    if rope_config(config)[2] != 1.0:
        raise ValueError(f"{name}: a partial_rotary_factor is not supported")
    if not getattr(config, "final_logit_softcapping", None):
        raise ValueError(f"{name}: config.final_logit_softcapping must be a positive number")
    if spark and "sparse" in config.mlp_layer_types:
        act = cfg_get(config, "hidden_act", "silu")
        if act not in ("silu", "swish"):
            raise ValueError(f"{name}: experts support hidden_act='silu' only, got {act!r}")


class MuseGlimmerTextForCausalLM(CausalLMBase):
    stacked_params = (
        *QKV_PROJ_RULES,
        (".mlp.gate_up_proj", ".mlp.gate_proj", 0),  # not self_attn.gate_proj
        (".mlp.gate_up_proj", ".mlp.up_proj", 1),
    )
    ignored_weights = ("rotary_emb.inv_freq",)
    spark = False

    def __init__(self, config) -> None:
        check_muse_config(config, type(self).__name__, self.spark)
        super().__init__(config, MuseModel(config, self.spark))
        self.output_multiplier = float(config.output_multiplier)
        self.softcap = float(config.final_logit_softcapping)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [N, D] -> [N, V] fp32
        return soft_cap(super().compute_logits(hidden) * self.output_multiplier, self.softcap)


class MuseSparkTextForCausalLM(MuseGlimmerTextForCausalLM):
    spark = True
