"""The language model of StepFun Step 3.7 (`Step3p7ForConditionalGeneration`, text_config
model_type "step3p5": Step-3.7-Flash), served text-only through models/text_wrappers.py.

transformers builds its text model on Laguna's stack (models/laguna.py: a rope per layer
type, each with its partial_rotary_factor, Qwen3-style per-head q / k norms before the rope, a
window on the "sliding_attention" layers, an output gate before o_proj, "dense" / "sparse"
MLPs by mlp_layer_types, DeepSeek-V3's sigmoid router over one group) with these differences,
each as transformers runs it:

    norms      every RMSNorm is Gemma's, x / rms(x) * (1 + w) in float32 (the layer norms,
               the final norm, the q / k head norms)
    heads      the sliding layers have num_sliding_attention_heads query heads, the others
               num_attention_heads (transformers' per_layer_config); KV heads are shared
    scores     scaled by query_pre_attn_scalar^-0.5 (head_dim by default)
    gate       sigmoid(g_proj(x)) in the model dtype, one a head (`gating` True or "per-head";
               transformers' per-channel gate cannot broadcast onto its heads: refused)
    router     the top num_experts_per_tok of sigmoid(logits) + e_score_correction_bias, their
               sigmoid scores always renormalized, times moe_router_scaling_factor, plus one
               shared expert of share_expert_dim
    clamps     layer i's routed experts clamp at swiglu_limits[i], its dense MLP or shared
               expert at swiglu_limits_shared[i] (0 / None / no list: no clamp), after the
               SiLU: min(silu(gate), L) * clamp(up, -L, L)

The checkpoint's multi-token-prediction layers (`layers.N`, N >= num_hidden_layers) are
skipped, as transformers skips them. The release's names (what transformers 5.25 saves, by
its conversion mapping) load: `moe.gate` / `moe.router_bias` (the router and its bias),
`share_expert.`, and the experts stacked per layer, `moe.{gate,up,down}_proj.weight`
[E, I, H] / [E, H, I]; so do transformers' in-memory ones (`mlp.experts.gate_up_proj` ...).
transformers' config sets query_pre_attn_scalar to head_dim where unset and hidden_act to SiLU
always (the release's "swigluoai" is the clamped SwiGLU above).

Refused by name: use_bidirectional_attention, layer types other than full / sliding
("minimax_m3_sparse": transformers' Step 3.7 builds no mask for them), a sliding layer without
sliding_window, a per-channel gate.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from paged_engine.layers.activation import ClampedSiluAndMul
from paged_engine.layers.deepseek_moe import DeepseekMoe, SharedExpertsMLP
from paged_engine.layers.norm import GemmaRMSNorm, RMSNorm
from paged_engine.layers.rotary import RotaryEmbedding
from paged_engine.models.exaone_moe import is_sparse_layer
from paged_engine.models.glm5_next import with_activation
from paged_engine.models.laguna import LagunaAttention, LagunaForCausalLM
from paged_engine.models.llama import LlamaMLP
from paged_engine.models.mixtral import num_experts

_LAYER_TYPES = ("full_attention", "sliding_attention")
# the release's names -> transformers' (its conversion mapping), then ours
_RELEASE_RENAMES = (
    (".moe.gate.weight", ".mlp.gate.weight"),
    (".moe.router_bias", ".mlp.gate.e_score_correction_bias"),
    (".share_expert.", ".mlp.shared_experts."),
)
_STACKED = {".moe.gate_proj.weight": "gate_proj", ".moe.up_proj.weight": "up_proj"}
_STACKED_DOWN = ".moe.down_proj.weight"


class Step3p7Attention(LagunaAttention):
    """Laguna's attention with Gemma head norms, a sigmoid gate and query_pre_attn_scalar."""

    def __init__(self, config, layer_idx: int, flags, rope: RotaryEmbedding) -> None:
        super().__init__(config, layer_idx, flags, rope)
        eps = float(config.rms_norm_eps)
        self.q_norm = GemmaRMSNorm(self.head_dim, eps)
        self.k_norm = GemmaRMSNorm(self.head_dim, eps)
        scalar = getattr(config, "query_pre_attn_scalar", None) or self.head_dim
        self.attn.scale = float(scalar) ** -0.5

    def output_gate(self, g: torch.Tensor) -> torch.Tensor:
        return torch.sigmoid(g)


def _clamp(limits, layer_idx: int) -> ClampedSiluAndMul | None:
    """Layer i's after-SiLU clamp, None where its limit is 0 / None or there is no list."""
    limit = (limits or [None] * (layer_idx + 1))[layer_idx]
    return ClampedSiluAndMul(float(limit), after_silu=True) if limit else None


def step3p7_mlp(config, layer_idx: int) -> nn.Module:
    """Layer i's dense MLP or MoE block (module docstring), clamped as configured."""
    bias = bool(getattr(config, "mlp_bias", False))
    shared_clamp = _clamp(config.swiglu_limits_shared, layer_idx)
    if not is_sparse_layer(config, layer_idx):
        mlp = LlamaMLP(config, bias=bias)
        if shared_clamp is not None:
            mlp.act_fn = shared_clamp
        return mlp
    h, shared = int(config.hidden_size), int(config.share_expert_dim)
    moe = DeepseekMoe(
        num_experts(config),
        int(config.num_experts_per_tok),
        h,
        int(config.moe_intermediate_size),
        shared,
        routed_scaling_factor=float(config.moe_router_scaling_factor),
    )
    if bias and moe.shared_experts is not None:  # the routed experts have none
        moe.shared_experts = SharedExpertsMLP(h, shared, bias=True)
    return with_activation(moe, _clamp(config.swiglu_limits, layer_idx), shared_clamp)


class Step3p7TextForCausalLM(LagunaForCausalLM):
    """Laguna's stack with Step 3.7's norms, heads, gate, router and clamps."""

    renames = (*_RELEASE_RENAMES, *LagunaForCausalLM.renames)

    def __init__(self, config) -> None:
        heads, sliding = int(config.num_attention_heads), config.num_sliding_attention_heads
        sliding = int(sliding or heads)
        types = list(config.layer_types)
        # Laguna's attention reads its layer's head count from this list
        config.num_attention_heads_per_layer = [
            sliding if t == "sliding_attention" else heads for t in types
        ]
        super().__init__(config)
        eps = float(config.rms_norm_eps)
        model = self.model
        for layer in model.stage.layers(model.layers):  # this pipeline stage's
            layer.input_layernorm = GemmaRMSNorm(config.hidden_size, eps)
            layer.post_attention_layernorm = GemmaRMSNorm(config.hidden_size, eps)
        model.norm = GemmaRMSNorm(config.hidden_size, eps)
        assert not any(type(m) is RMSNorm for m in model.modules())  # every norm is Gemma's

    @classmethod
    def check_config(cls, config) -> None:
        if getattr(config, "use_bidirectional_attention", False):
            raise ValueError(
                "use_bidirectional_attention=True is not supported (a decoder served causally)"
            )
        types = list(config.layer_types)
        other = sorted({t for t in types if t not in _LAYER_TYPES})
        if other:
            raise ValueError(
                f"layer_types {other} are not supported (transformers' Step 3.7 runs only "
                f"{list(_LAYER_TYPES)} layers)"
            )
        if "sliding_attention" in types and not getattr(config, "sliding_window", None):
            raise ValueError("sliding_attention layers need a sliding_window (it is unset)")
        gating = getattr(config, "gating", True)
        if not (gating is True or gating == "per-head"):
            raise ValueError(
                f"gating={gating!r} is not supported (transformers' per-channel gate cannot "
                "broadcast onto its heads; Step 3.7 gates per head)"
            )

    @classmethod
    def build_attention(cls, config, layer_idx: int, flags, rope: RotaryEmbedding) -> nn.Module:
        return Step3p7Attention(config, layer_idx, flags, rope)

    @classmethod
    def build_mlp(cls, config, layer_idx: int) -> nn.Module:
        return step3p7_mlp(config, layer_idx)

    def convert_weight(self, name: str, w: torch.Tensor) -> Iterable[tuple[str, torch.Tensor]]:
        """The release's per-layer expert stacks -> each expert's matrices."""
        for suffix, ours in _STACKED.items():
            if name.endswith(suffix):
                base = name[: -len(suffix)] + ".mlp.experts"
                return ((f"{base}.{m}.{ours}.weight", w[m]) for m in range(w.shape[0]))
        if name.endswith(_STACKED_DOWN):
            base = name[: -len(_STACKED_DOWN)] + ".mlp.experts"
            return ((f"{base}.{m}.down_proj.weight", w[m]) for m in range(w.shape[0]))
        return super().convert_weight(name, w)
