"""Liquid AI's LFM2 (`Lfm2ForCausalLM`: LFM2-350M / 700M / 1.2B / 2.6B) and LFM2-MoE
(`Lfm2MoeForCausalLM`: LFM2-8B-A1B): hybrid stacks of gated short convolutions
(layers/short_conv.py) and grouped-query attention layers, `config.layer_types` saying which
("conv" / "full_attention").

    x += mixer(operator_norm(x));  x += feed_forward(ffn_norm(x));  final norm (`embedding_norm`)

The attention layers: RoPE after a per-head RMSNorm of q and k (`q_layernorm` / `k_layernorm`),
no biases. The feed-forward: a gated SiLU MLP w2(silu(w1 x) * w3 x), whose width LFM2 adjusts
from `intermediate_size` when `block_auto_adjust_ff_dim` (2/3 of it, times
`block_ffn_dim_multiplier`, rounded up to a multiple of `block_multiple_of`). LFM2-MoE keeps that
MLP (unadjusted) in its first `num_dense_layers` layers and a sparse block in the others: scores
s = sigmoid(x @ W_g^T) in the model dtype, the k experts of the largest s + expert_bias (a float32
balance bias, when `use_expert_bias`), weighted by their unbiased s, divided by their sum (+ 1e-6)
when `norm_topk_prob`, times `routed_scaling_factor`.

LFM3 (`Lfm3ForCausalLM`: LFM3-1.7B) adds "sliding_attention" layers (the last `sliding_window`
keys, the default rope of their type) beside "full_attention" ones (their own rope: proportional
RoPE over part of each head, Gemma 4's), a per-head output gate on attention (sigmoid(g_proj x)
times each head's output, `use_attention_gate`), and norms after each mixer and feed-forward
(`use_sandwich_norm`); its feed-forward is the plain gated MLP of intermediate_size.

Only the attention layers hold paged KV (models/hybrid.py); the conv layers carry their conv
window per sequence. Embeddings are tied by default. Checkpoints load under HF's names; experts
per expert (`feed_forward.experts.M.{w1,w3,w2}`) or fused (transformers 5's `gate_up_proj` /
`down_proj`).
"""

from __future__ import annotations

import torch
from torch import nn

from paged_engine.distributed.communication import tp_all_reduce
from paged_engine.layers.activation import SiluAndMul
from paged_engine.layers.deepseek_moe import DeepseekRouter
from paged_engine.layers.fused_moe import FusedMoE
from paged_engine.layers.linear import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    RowParallelLinear,
)
from paged_engine.layers.norm import RMSNorm
from paged_engine.layers.rotary import RotaryEmbedding, get_rope
from paged_engine.layers.short_conv import ShortConv
from paged_engine.models.hybrid import HybridModel, layer_types
from paged_engine.models.llama import LlamaAttention, llama_head_dim
from paged_engine.models.mixtral import expert_rules
from paged_engine.models.utils import QKV_PROJ_RULES, CausalLMBase, StackedRule, cfg_get

LAYER_TYPES = ("conv", "full_attention")

# checkpoint name fragment -> ours
_RENAMES = (
    ("model.embedding_norm.", "model.norm."),
    (".self_attn.out_proj.", ".self_attn.o_proj."),
    (".self_attn.q_layernorm.", ".self_attn.q_norm."),
    (".self_attn.k_layernorm.", ".self_attn.k_norm."),
    (".feed_forward.w2.", ".feed_forward.down_proj."),
    (".feed_forward.expert_bias", ".feed_forward.gate.e_score_correction_bias"),
)
# the dense MLP's w1 (gate) and w3 (up) into gate_up_proj; experts' names never match these
_MLP_RULES: tuple[StackedRule, ...] = (
    (".feed_forward.gate_up_proj.", ".feed_forward.w1.", 0),
    (".feed_forward.gate_up_proj.", ".feed_forward.w3.", 1),
)


def lfm2_intermediate_size(config) -> int:
    """The dense MLP's width: `intermediate_size`, adjusted as LFM2 does when
    `block_auto_adjust_ff_dim` (LFM2-MoE's config has no such field: unadjusted)."""
    size = int(config.intermediate_size)
    if not getattr(config, "block_auto_adjust_ff_dim", False):
        return size
    size = int(2 * size / 3)
    multiplier = getattr(config, "block_ffn_dim_multiplier", None)
    if multiplier is not None:
        size = int(multiplier * size)
        multiple = int(config.block_multiple_of)
        size = multiple * -(-size // multiple)
    return size


class Lfm2MLP(nn.Module):
    """w2(silu(w1 x) * w3 x), w1 | w3 fused as gate_up_proj: [T, D] -> [T, D]."""

    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        sizes = [intermediate_size, intermediate_size]
        self.gate_up_proj = MergedColumnParallelLinear(hidden_size, sizes, bias=False)
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size, bias=False)
        self.act_fn = SiluAndMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_up_proj(x)))


class Lfm2MoeBlock(nn.Module):
    """LFM2-MoE's sparse feed-forward (the module docstring's routing): a replicated router
    (`gate`, its expert bias as the router's e_score_correction_bias), FusedMoE experts split
    by their intermediate dim, one all-reduce. [T, H] -> [T, H]."""

    def __init__(self, config) -> None:
        super().__init__()
        num_experts = int(config.num_experts)
        # routing in the model dtype as HF's (float32=False); renormalized and scaled below
        self.gate = DeepseekRouter(
            num_experts,
            config.hidden_size,
            int(config.num_experts_per_tok),
            correction_bias=bool(getattr(config, "use_expert_bias", True)),
            renormalize=False,
            float32=False,
        )
        self.experts = FusedMoE(num_experts, config.hidden_size, int(config.moe_intermediate_size))
        self.renormalize = bool(getattr(config, "norm_topk_prob", True))
        self.scale = float(cfg_get(config, "routed_scaling_factor", 1.0))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = self.gate(x)  # [T, k] float32
        if self.renormalize:  # HF's epsilon, not DeepSeek's
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-6)
        if self.scale != 1.0:
            weights = weights * self.scale
        out = self.experts(x, weights, ids)
        return tp_all_reduce(out) if self.experts.tp_size > 1 else out


class Lfm2DecoderLayer(nn.Module):
    def __init__(
        self,
        config,
        layer_idx: int,
        flags: dict[str, bool],
        rope: RotaryEmbedding | None,
        feed_forward: nn.Module,
        attention_cls: type[LlamaAttention] = LlamaAttention,
        sandwich: bool = False,
    ) -> None:
        """`rope`: the one of this layer's type (None for a conv layer); `sandwich`: norms after
        the mixer and the feed-forward too (LFM3's)."""
        super().__init__()
        eps = float(cfg_get(config, "norm_eps", 1e-5))
        d = config.hidden_size
        self.is_conv = layer_types(config)[layer_idx] == "conv"
        if self.is_conv:
            kernel = int(cfg_get(config, "conv_L_cache", 3))
            bias = bool(getattr(config, "conv_bias", False))
            self.conv = ShortConv(d, kernel, bias)
        else:
            self.self_attn = attention_cls(config, layer_idx, flags, rope)
            # the q / k norms take LFM2's norm_eps (LlamaAttention reads rms_norm_eps)
            self.self_attn.q_norm.eps = self.self_attn.k_norm.eps = eps
        self.feed_forward = feed_forward
        self.operator_norm = RMSNorm(d, eps)
        self.ffn_norm = RMSNorm(d, eps)
        self.post_operator_norm = RMSNorm(d, eps) if sandwich else None
        self.post_ffn_norm = RMSNorm(d, eps) if sandwich else None

    def forward(self, positions, x, kv_cache, md) -> torch.Tensor:  # x: [T, D]
        h = self.operator_norm(x)
        h = self.conv(h, md) if self.is_conv else self.self_attn(positions, h, kv_cache, md)
        if self.post_operator_norm is not None:
            h = self.post_operator_norm(h)
        x = x + h
        h = self.feed_forward(self.ffn_norm(x))
        if self.post_ffn_norm is not None:
            h = self.post_ffn_norm(h)
        return x + h


class Lfm2ForCausalLM(CausalLMBase):
    renames = _RENAMES
    stacked_params = (*QKV_PROJ_RULES, *_MLP_RULES)
    ignored_weights = ("rotary_emb.inv_freq", "pos_emb.inv_freq")
    tie_default = True
    family, kinds = "LFM2", LAYER_TYPES  # the layer_types it builds
    attention_cls: type[LlamaAttention] = LlamaAttention

    def __init__(self, config) -> None:
        cls = type(self)
        types = layer_types(config)
        if any(t not in cls.kinds for t in types):
            raise ValueError(f"{cls.family} layer_types must be among {cls.kinds}, got {types!r}")
        # LFM3's attention reads attention_bias; LFM2's never does (config_ignored.py)
        bias = bool(getattr(config, "attention_bias", False))
        flags = {"qkv_bias": bias, "o_bias": bias, "qk_norm": True, "mlp_bias": False}
        flags["sliding"] = "sliding_attention" in cls.kinds  # windows by layer_types
        ropes = cls.build_ropes(config, types)  # attention layer type -> its rope
        build, sandwich = cls.build_feed_forward, cls.sandwich_norms(config)

        def layer(i: int) -> Lfm2DecoderLayer:
            rope = ropes.get(types[i])
            return Lfm2DecoderLayer(
                config, i, flags, rope, build(config, i), cls.attention_cls, sandwich
            )

        inner = HybridModel(
            config,
            layer,
            RMSNorm(config.hidden_size, float(cfg_get(config, "norm_eps", 1e-5))),
            next(iter(ropes.values())) if len(ropes) == 1 else None,  # the ropes are per type
        )
        super().__init__(config, inner)

    @classmethod
    def build_ropes(cls, config, types: list[str]) -> dict[str, RotaryEmbedding]:
        return {"full_attention": get_rope(config, llama_head_dim(config))}

    @classmethod
    def sandwich_norms(cls, config) -> bool:
        return False

    @classmethod
    def build_feed_forward(cls, config, layer_idx: int) -> nn.Module:
        return Lfm2MLP(config.hidden_size, lfm2_intermediate_size(config))


class Lfm2MoeForCausalLM(Lfm2ForCausalLM):
    def __init__(self, config) -> None:
        super().__init__(config)
        # per-expert names first (".experts.M.w1." holds no ".feed_forward.w1." anyway)
        rules = expert_rules(int(config.num_experts), "w1", "w3", "w2")
        self.stacked_params = (*rules, *type(self).stacked_params)

    @classmethod
    def build_feed_forward(cls, config, layer_idx: int) -> nn.Module:
        if layer_idx < int(cfg_get(config, "num_dense_layers", 2)):
            return Lfm2MLP(config.hidden_size, lfm2_intermediate_size(config))
        return Lfm2MoeBlock(config)


LFM3_LAYER_TYPES = ("conv", "sliding_attention", "full_attention")


class Lfm3Attention(LlamaAttention):
    """LFM2's attention (per-head q / k norms, RoPE) with a window on sliding layers and a
    per-head sigmoid gate on the output."""

    def __init__(self, config, layer_idx: int, flags, rope: RotaryEmbedding) -> None:
        super().__init__(config, layer_idx, flags, rope)
        heads = config.num_attention_heads
        gated = bool(getattr(config, "use_attention_gate", True))
        self.g_proj = ColumnParallelLinear(config.hidden_size, heads, bias=False) if gated else None

    def forward(self, positions, x, kv_cache, md) -> torch.Tensor:  # x: [T, D]
        t, d = x.shape[0], self.head_dim
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = self.q_norm(q.reshape(t, -1, d)).reshape(t, -1)
        k = self.k_norm(k.reshape(t, -1, d)).reshape(t, -1)
        q, k = self.rotary_emb(positions, q, k)
        out = self.attn(q, k, v, kv_cache, md)
        if self.g_proj is not None:  # one gate a head
            out = (out.view(t, -1, d) * torch.sigmoid(self.g_proj(x)).unsqueeze(-1)).view(t, -1)
        return self.o_proj(out)


class Lfm3ForCausalLM(Lfm2ForCausalLM):
    # the release names the head gate `gate_proj` (transformers holds it as g_proj)
    renames = (*_RENAMES, (".self_attn.gate_proj.", ".self_attn.g_proj."))
    family, kinds = "LFM3", LFM3_LAYER_TYPES
    attention_cls = Lfm3Attention

    @classmethod
    def build_ropes(cls, config, types: list[str]) -> dict[str, RotaryEmbedding]:
        from paged_engine.models.gemma4 import _rope  # "default" and "proportional" per type

        head_dim = llama_head_dim(config)
        return {t: _rope(config, t, head_dim) for t in set(types) if t != "conv"}

    @classmethod
    def sandwich_norms(cls, config) -> bool:
        return bool(getattr(config, "use_sandwich_norm", True))

    @classmethod
    def build_feed_forward(cls, config, layer_idx: int) -> nn.Module:
        return Lfm2MLP(config.hidden_size, config.intermediate_size)  # not adjusted
