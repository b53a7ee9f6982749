"""Poolside Laguna (`LagunaForCausalLM`, model_type "laguna": Laguna-XS.2) and JetBrains Mellum 2
(`MellumForCausalLM`, model_type "mellum": Mellum2-12B-A2.5B), which transformers builds on
Laguna's stack.

Laguna is K-EXAONE's pre-norm MoE decoder (models/exaone_moe.py: x += attn(norm(x));
x += mlp(norm(x)), Llama's RMSNorm) with, as transformers runs it:

    attention  Qwen3's (per-head q / k RMSNorms before RoPE) with AFMoE's window on the
               config.layer_types "sliding_attention" layers (the last `sliding_window` keys),
               but every layer rotates (AFMoE's global layers are NoPE), each with the rope of
               its layer type: rope_parameters holds one per type (by default the full layers
               rotate half of each head, partial_rotary_factor 0.5, with theta 500000, the
               sliding ones all of it with theta 10000). Layer i has
               num_attention_heads_per_layer[i] query heads (the KV heads and head_dim are
               shared). The attention output is scaled by softplus(g_proj(x)) (in float32)
               before o_proj, not AFMoE's sigmoid: one gate a head (`gating` True or
               "per-head"), else one a channel ("per-element", and whatever else transformers
               reads as not per-head)
    mlp        config.mlp_layer_types: "dense" a gated SiLU MLP of intermediate_size; "sparse"
               DeepSeek-V3's MoE (layers/deepseek_moe.py) with one group: logits in float32,
               soft-capped c * tanh(logits / c) first when moe_router_logit_softcapping c > 0,
               s = sigmoid(logits), the top num_experts_per_tok of s + e_score_correction_bias,
               their s renormalized, times moe_routed_scaling_factor, plus one shared expert of
               shared_expert_intermediate_size

Mellum is the same stack with Qwen3-MoE's layers (models/qwen3_moe.py): ungated attention with
num_attention_heads on every layer (a window on the sliding layers, a rope per layer type), and
Qwen3-MoE's softmax top-k experts (renormalized when norm_topk_prob) with no shared expert on
the "sparse" layers of mlp_layer_types (all of them by default).

Refused by name: Laguna's moe_apply_router_weight_on_input=True (transformers refuses it too);
a Mellum partial_rotary_factor below 1 (transformers' Mellum rotates whole heads with cos / sin
tables of the partial width: it cannot run one). Checkpoints name Laguna's experts
`mlp.experts.M.{gate,up,down}_proj` (transformers 5's fused `mlp.experts.gate_up_proj` /
`down_proj` load too), its balance bias `mlp.experts.e_score_correction_bias` (HF holds it as
`mlp.gate.e_score_correction_bias`: both load) and its shared expert `mlp.shared_expert.*`
(HF: `mlp.shared_experts.*`); Mellum's multi-token-prediction layer (`mtp.*`) is skipped.
"""

from __future__ import annotations

import copy
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from paged_engine.layers.deepseek_moe import DeepseekMoe, DeepseekRouter, grouped_topk
from paged_engine.layers.embedding import VocabParallelEmbedding
from paged_engine.layers.linear import ColumnParallelLinear
from paged_engine.layers.norm import RMSNorm
from paged_engine.layers.rotary import RotaryEmbedding, get_rope, rope_config
from paged_engine.models.exaone_moe import ExaoneMoeForCausalLM, is_sparse_layer
from paged_engine.models.gemma2 import gemma_layer_types
from paged_engine.models.llama import (
    LlamaAttention,
    LlamaMLP,
    LlamaModel,
    keeps_stream_apart,
    llama_head_dim,
)
from paged_engine.models.mixtral import MoeDecoderLayer, check_silu, expert_rules, num_experts
from paged_engine.models.qwen3_moe import Qwen3MoeForCausalLM
from paged_engine.models.utils import CausalLMBase, cfg_get, make_layers, soft_cap


class LayerTypeRopeModel(LlamaModel):
    """Llama's stack (embedding, pre-norm layers, final norm) with one rope per
    config.layer_types type, from rope_parameters' entry for it (or `build_rope(type)`):
    `build_layer(i, rope)` gets layer i's. Each rope is one instance shared by its type's
    layers (`ropes`)."""

    def __init__(
        self,
        config,
        build_layer: Callable[[int, RotaryEmbedding], nn.Module],
        build_rope: Callable[[str], RotaryEmbedding] | None = None,
    ) -> None:
        nn.Module.__init__(self)  # LlamaModel's fields, its single rope replaced by `ropes`
        types = gemma_layer_types(config, every=1)  # (HF's default: every layer full)
        if build_rope is None:
            head_dim = llama_head_dim(config)
            ropes = {t: get_rope(config, head_dim, layer_type=t) for t in dict.fromkeys(types)}
        else:
            ropes = {t: build_rope(t) for t in dict.fromkeys(types)}
        self.ropes = nn.ModuleList(ropes.values())
        self.rotary_emb = self.ropes[0]  # LlamaModel.forward marks its tables; `forward` the rest
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        self.embedding_multiplier = None
        self.layers, self.stage = make_layers(
            config.num_hidden_layers, lambda i: build_layer(i, ropes[types[i]])
        )
        self.norm = RMSNorm(config.hidden_size, cfg_get(config, "rms_norm_eps", 1e-6))
        self.stream_apart = keeps_stream_apart(self.stage.layers(self.layers))

    def forward(self, input_ids, positions, kv_caches, md, hidden=None) -> torch.Tensor:
        for rope in self.ropes[1:]:
            rope.begin_forward(positions)
        return super().forward(input_ids, positions, kv_caches, md, hidden)


class LagunaAttention(LlamaAttention):
    """Qwen3's attention (a window on sliding layers) with `num_heads` query heads and a
    softplus output gate before o_proj: [T, H] per head, or [T, H * D] per channel."""

    def __init__(
        self, config, layer_idx: int, flags: dict[str, bool], rope: RotaryEmbedding
    ) -> None:
        num_heads = int(config.num_attention_heads_per_layer[layer_idx])
        view = copy.copy(config)  # Llama's attention reads its head count from the config
        view.num_attention_heads = num_heads
        super().__init__(view, layer_idx, flags, rope)
        gating = getattr(config, "gating", True)
        self.gate_per_head = gating is True or gating == "per-head"
        width = num_heads if self.gate_per_head else num_heads * self.head_dim
        self.g_proj = ColumnParallelLinear(config.hidden_size, width, bias=False)

    def forward(self, positions, x, kv_cache, md) -> torch.Tensor:  # x: [T, D]
        t, d = x.shape[0], self.head_dim
        qkv = self.qkv_proj(x)
        heads, kv_heads = self.q_size // d, self.kv_size // d
        write = self.attn.fused_kv_write(kv_cache, md)  # (None: the attention writes K/V)
        norms = (self.q_norm, self.k_norm)
        rotated = self.rotary_emb.rotate_qkv_(positions, qkv, heads, kv_heads, *norms, write)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        if not rotated:  # (else one kernel normed and rotated q and k in place, and wrote K/V)
            q = self.q_norm(q.reshape(t, -1, d)).reshape(t, -1)
            k = self.k_norm(k.reshape(t, -1, d)).reshape(t, -1)
            q, k = self.rotary_emb(positions, q, k)
        out = self.attn(q, k, v, kv_cache, md, kv_written=rotated and write is not None)
        gate = self.output_gate(self.g_proj(x)).to(out.dtype)
        if self.gate_per_head:
            out = (out.view(t, -1, d) * gate.unsqueeze(-1)).view(t, -1)
        else:
            out = out * gate
        return self.o_proj(out)

    def output_gate(self, g: torch.Tensor) -> torch.Tensor:
        """The gate's activation on g_proj(x): softplus in float32 (Step 3.7's: a sigmoid)."""
        return F.softplus(g.float())


class SoftCappedRouter(DeepseekRouter):
    """DeepSeek-V3's router with one group and Laguna's tanh soft-cap on the float32 logits
    before the sigmoid."""

    def __init__(self, num_experts: int, hidden_size: int, top_k: int, *, scale: float, cap: float):
        super().__init__(num_experts, hidden_size, top_k, scale=scale)
        self.cap = cap

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = soft_cap(F.linear(x.float(), self.weight), self.cap)
        return grouped_topk(
            logits, self.top_k, correction_bias=self.e_score_correction_bias, scale=self.scale
        )


def laguna_moe(config) -> DeepseekMoe:
    """Laguna's sparse MLP (module docstring): routed experts of moe_intermediate_size, one
    shared expert of shared_expert_intermediate_size."""
    experts, top_k = num_experts(config), int(config.num_experts_per_tok)
    scale = float(cfg_get(config, "moe_routed_scaling_factor", 1.0))
    moe = DeepseekMoe(
        experts,
        top_k,
        config.hidden_size,
        int(config.moe_intermediate_size),
        int(cfg_get(config, "shared_expert_intermediate_size", 0)),
        routed_scaling_factor=scale,
    )
    cap = float(cfg_get(config, "moe_router_logit_softcapping", 0.0))
    if cap > 0:
        moe.gate = SoftCappedRouter(experts, config.hidden_size, top_k, scale=scale, cap=cap)
    return moe


class LagunaForCausalLM(ExaoneMoeForCausalLM):
    """K-EXAONE's class hooks (attention, MLP per layer; `mtp.*` skipped) over a stack with a
    rope per layer type."""

    # the release's names (transformers 5 maps them at load, and saves them back)
    renames = (
        (".mlp.experts.e_score_correction_bias", ".mlp.gate.e_score_correction_bias"),
        (".mlp.shared_expert.", ".mlp.shared_experts."),
    )

    def __init__(self, config) -> None:
        cls = type(self)
        check_silu(config, cls.__name__)
        cls.check_config(config)
        flags = cls.layer_flags(config)

        def build(i: int, rope: RotaryEmbedding) -> MoeDecoderLayer:
            attention = cls.build_attention(config, i, flags, rope)
            return MoeDecoderLayer(config, i, flags, None, cls.build_mlp(config, i), attention)

        head_dim, view = llama_head_dim(config), per_type_rope_view(config)
        inner = LayerTypeRopeModel(config, build, lambda t: get_rope(view, head_dim, layer_type=t))
        CausalLMBase.__init__(self, config, inner)
        # Expert rules first: the dense rules' ".gate_proj" would also match an expert's name.
        rules = expert_rules(num_experts(config), *self.expert_names)
        self.stacked_params = (*rules, *cls.stacked_params)

    @classmethod
    def check_config(cls, config) -> None:
        if getattr(config, "moe_apply_router_weight_on_input", False):
            raise ValueError(
                "config.moe_apply_router_weight_on_input=True is not supported (transformers' "
                "Laguna does not run it either)"
            )

    @classmethod
    def layer_flags(cls, config) -> dict[str, bool]:
        return Qwen3MoeForCausalLM.layer_flags(config)  # q / k norms, windows by layer_types

    @classmethod
    def build_attention(cls, config, layer_idx: int, flags, rope: RotaryEmbedding) -> nn.Module:
        return LagunaAttention(config, layer_idx, flags, rope)

    @classmethod
    def build_mlp(cls, config, layer_idx: int) -> nn.Module:
        if not is_sparse_layer(config, layer_idx):
            return LlamaMLP(config, bias=False)
        return laguna_moe(config)

    def rename_weight(self, name: str) -> str:
        return CausalLMBase.rename_weight(self, name)  # `renames`


def per_type_rope_view(config):
    """`config` for rope_config: HF's Laguna / Mellum read partial_rotary_factor from each
    rope_parameters[layer_type] alone (default 1), never from the config's top level."""
    view = copy.copy(config)
    view.partial_rotary_factor = None
    return view


class MellumForCausalLM(LagunaForCausalLM):
    @classmethod
    def check_config(cls, config) -> None:
        for t in dict.fromkeys(gemma_layer_types(config, every=1)):
            partial = rope_config(per_type_rope_view(config), t)[2]
            if partial != 1.0:
                raise ValueError(
                    f"config.rope_parameters[{t!r}].partial_rotary_factor={partial} is not "
                    "supported (transformers' Mellum rotates whole heads)"
                )

    @classmethod
    def build_attention(cls, config, layer_idx: int, flags, rope: RotaryEmbedding) -> nn.Module:
        return LlamaAttention(config, layer_idx, flags, rope)

    @classmethod
    def build_mlp(cls, config, layer_idx: int) -> nn.Module:
        if not is_sparse_layer(config, layer_idx):
            return LlamaMLP(config, bias=False)
        return Qwen3MoeForCausalLM.sparse_block(config)
