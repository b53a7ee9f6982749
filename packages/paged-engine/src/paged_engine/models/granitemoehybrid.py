"""IBM Granite 4.0 hybrids (`GraniteMoeHybridForCausalLM`: granite-4.0-h-small / -tiny / -micro,
and their dense-attention siblings): Mamba2 layers (layers/mamba2.py) among attention layers,
`config.layer_types` saying which ("mamba" / "linear_attention" or "attention" /
"full_attention"), with Granite's four multipliers (models/granite.py).

    x += m * mixer(norm(x));  x += m * (moe(h) + shared_mlp(h)),  h = norm(x)

The MoE is Granite MoE's (softmax over the k largest router logits; experts of
`intermediate_size`, fused `block_sparse_moe.input_linear` / `output_linear` checkpoints), the
shared MLP a gated SiLU MLP of `shared_intermediate_size` that every token goes through (the only
MLP when `num_local_experts` is 0). Attention layers use `attention_multiplier` as their scale and
rotate with RoPE only when `position_embedding_type` is "rope" (Granite 4.0-H uses none). Only
the attention layers hold paged KV (models/hybrid.py).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from paged_engine.distributed.communication import tp_all_reduce
from paged_engine.layers.deepseek_moe import SharedExpertsMLP
from paged_engine.layers.linear_mixer import check_mixer
from paged_engine.layers.mamba2 import Mamba2Mixer, Mamba2Spec
from paged_engine.layers.norm import RMSNorm
from paged_engine.layers.rotary import RotaryEmbedding, get_rope
from paged_engine.models.granite import granite_multiplier
from paged_engine.models.granitemoe import GraniteMoeForCausalLM, rename_granite_moe
from paged_engine.models.granitemoeshared import rename_shared_mlp, split_shared_input_linear
from paged_engine.models.hybrid import LINEAR_LAYER_TYPES, HybridModel, layer_types
from paged_engine.models.llama import LlamaAttention, llama_head_dim
from paged_engine.models.mixtral import check_silu
from paged_engine.models.qwen2_moe import SharedExpertMoeBlock
from paged_engine.models.utils import CausalLMBase, cfg_get


def mamba_spec(config, inner: int, label: str, eps: float, **options) -> Mamba2Spec:
    """A Mamba2Spec from the mamba_* config fields Granite 4.0-H and Falcon-H1 share: `inner`
    the mixer's width, mamba_d_head "auto" (or absent) = inner / heads, rms_norm_eps defaulting
    to `eps`; `options` the spec's optional fields."""
    heads = int(config.mamba_n_heads)
    d_head = getattr(config, "mamba_d_head", "auto")
    head_dim = inner // heads if d_head in (None, "auto") else int(d_head)
    if heads * head_dim != inner:
        raise ValueError(
            f"mamba_n_heads={heads} x mamba_d_head={head_dim} must equal the mixer's width {inner}"
        )
    check_mixer(label, getattr(config, "hidden_act", "silu"), 1)
    return Mamba2Spec(
        hidden_size=config.hidden_size,
        num_heads=heads,
        head_dim=head_dim,
        num_groups=int(config.mamba_n_groups),
        state_size=int(config.mamba_d_state),
        conv_kernel=int(config.mamba_d_conv),
        conv_bias=bool(getattr(config, "mamba_conv_bias", True)),
        proj_bias=bool(getattr(config, "mamba_proj_bias", False)),
        eps=float(cfg_get(config, "rms_norm_eps", eps)),
        dt_limit=tuple(getattr(config, "time_step_limit", None) or (0.0, float("inf"))),
        **options,
    )


def granite_mamba2(config) -> Mamba2Spec:
    """Granite 4.0-H's mixer: width mamba_expand * hidden_size."""
    inner = int(config.mamba_expand * config.hidden_size)
    return mamba_spec(config, inner, "GraniteMoeHybrid's Mamba2", 1e-6)


class SharedMLP(nn.Module):
    """A dense model's only MLP, named as the MoE block's shared expert (one checkpoint layout)."""

    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.shared_expert = SharedExpertsMLP(hidden_size, intermediate_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.shared_expert(x)  # this rank's partial sum
        return tp_all_reduce(out) if self.shared_expert.down_proj.tp_size > 1 else out


class GraniteMoeHybridDecoderLayer(nn.Module):
    def __init__(
        self, config, layer_idx: int, flags: dict[str, bool], rope: RotaryEmbedding | None
    ) -> None:
        super().__init__()
        self.is_linear = layer_types(config)[layer_idx] in LINEAR_LAYER_TYPES
        if self.is_linear:
            self.mamba = Mamba2Mixer(granite_mamba2(config))
        else:
            self.self_attn = LlamaAttention(config, layer_idx, flags, rope)
            self.self_attn.attn.scale = granite_multiplier(config, "attention_multiplier")
        shared = int(config.shared_intermediate_size)
        if int(cfg_get(config, "num_local_experts", 0)) > 0:
            self.mlp: nn.Module = SharedExpertMoeBlock(
                int(config.num_local_experts),
                config.num_experts_per_tok,
                config.hidden_size,
                config.intermediate_size,
                shared,
                renormalize=True,  # softmax over the k chosen logits
                gated=False,
            )
        else:
            self.mlp = SharedMLP(config.hidden_size, shared)
        eps = cfg_get(config, "rms_norm_eps", 1e-6)
        self.input_layernorm = RMSNorm(config.hidden_size, eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps)
        self.residual_multiplier = granite_multiplier(config, "residual_multiplier")

    def forward(self, positions, x, kv_cache, md) -> torch.Tensor:  # x: [T, D]
        m = self.residual_multiplier
        h = self.input_layernorm(x)
        h = self.mamba(h, md) if self.is_linear else self.self_attn(positions, h, kv_cache, md)
        x = x + h * m
        return x + self.mlp(self.post_attention_layernorm(x)) * m


class GraniteMoeHybridForCausalLM(CausalLMBase):
    stacked_params = GraniteMoeForCausalLM.stacked_params
    ignored_weights = ("rotary_emb.inv_freq",)

    def __init__(self, config) -> None:
        check_silu(config, type(self).__name__)
        bias = bool(getattr(config, "attention_bias", False))
        flags = {"qkv_bias": bias, "o_bias": bias, "qk_norm": False, "mlp_bias": False}
        flags["sliding"] = False
        use_rope = getattr(config, "position_embedding_type", None) == "rope"
        rope = get_rope(config, llama_head_dim(config)) if use_rope else None
        eps = cfg_get(config, "rms_norm_eps", 1e-6)
        inner = HybridModel(
            config,
            lambda i: GraniteMoeHybridDecoderLayer(config, i, flags, rope),
            RMSNorm(config.hidden_size, eps),
            rope,
            embedding_multiplier=granite_multiplier(config, "embedding_multiplier"),
        )
        super().__init__(config, inner)
        self.logits_scaling = granite_multiplier(config, "logits_scaling")

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [N, D] -> [N, V] fp32
        return super().compute_logits(hidden) / self.logits_scaling

    def rename_weight(self, name: str) -> str:
        # the MoE's and the shared MLP's names, as Granite MoE (+ shared) checkpoints have them
        return rename_shared_mlp(name) or rename_granite_moe(name)

    def convert_weight(self, name: str, w: torch.Tensor) -> Iterable[tuple[str, torch.Tensor]]:
        return split_shared_input_linear(name, w)
