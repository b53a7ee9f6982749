"""AI21 Jamba (`JambaForCausalLM`: Jamba-v0.1, AI21-Jamba-Mini / -Large 1.5 to 1.7): Mamba (v1)
layers (layers/mamba.py) among grouped-query attention layers, the attention ones every
`attn_layer_period` layers from `attn_layer_offset` (transformers' JambaConfig turns that into
`layers_block_type`, "mamba" / "attention", and in transformers 5 `layer_types`,
"linear_attention" / "full_attention"):

    x += mixer(input_layernorm(x));  x += feed_forward(pre_ff_layernorm(x));  final norm

The mixer is Mamba's with Jamba's weighted RMSNorms on dt, B and C (`dt_layernorm`,
`b_layernorm`, `c_layernorm`, eps `rms_norm_eps`), width `mamba_expand * hidden_size`, dt rank
`mamba_dt_rank` ("auto": ceil(hidden / 16)), `mamba_conv_bias` on the conv, `mamba_proj_bias`
on in_proj and out_proj. The attention has no positional encoding and no biases. The
feed-forward is a gated SiLU MLP of `intermediate_size`, except every `expert_layer_period`
layers from `expert_layer_offset` where it is a sparse block of `num_experts` such MLPs (none
when num_experts is 1): softmax over all the router's logits, the k largest probabilities kept
as they are (not renormalized).

Only the attention layers hold paged KV (models/hybrid.py); the Mamba layers carry their conv
window and state per sequence. Embeddings are untied by default. Checkpoints load under HF's
names (`final_layernorm`, the sparse block's `router`); experts per expert
(`feed_forward.experts.M.{gate_proj,up_proj,down_proj}`: the released checkpoints' and what
transformers 5 saves) or fused (`gate_up_proj` / `down_proj`, transformers 5's in-memory layout).
"""

from __future__ import annotations

import torch
from torch import nn

from paged_engine.layers.fused_moe import SparseMoeBlock
from paged_engine.layers.mamba import MambaMixer, MambaSpec
from paged_engine.layers.norm import RMSNorm
from paged_engine.models.hybrid import LINEAR_LAYER_TYPES, HybridModel, layer_types
from paged_engine.models.llama import LlamaAttention, LlamaForCausalLM, LlamaMLP
from paged_engine.models.mixtral import check_silu, expert_rules, num_experts
from paged_engine.models.utils import CausalLMBase, cfg_get

# checkpoint name fragment -> ours
_RENAMES = (
    ("model.final_layernorm.", "model.norm."),
    (".feed_forward.router.", ".feed_forward.gate."),
)


def jamba_mamba_spec(config) -> MambaSpec:
    """The Mamba layers' mixer from a JambaConfig."""
    rank = cfg_get(config, "mamba_dt_rank", "auto")
    rank = -(-config.hidden_size // 16) if rank == "auto" else int(rank)
    return MambaSpec(
        hidden_size=config.hidden_size,
        intermediate_size=int(config.mamba_expand * config.hidden_size),
        state_size=int(config.mamba_d_state),
        time_step_rank=rank,
        conv_kernel=int(config.mamba_d_conv),
        conv_bias=bool(cfg_get(config, "mamba_conv_bias", True)),
        proj_bias=bool(cfg_get(config, "mamba_proj_bias", False)),
        inner_norms="weighted",
        inner_norm_eps=float(cfg_get(config, "rms_norm_eps", 1e-6)),
        activation=cfg_get(config, "hidden_act", "silu"),
    )


def layer_num_experts(config, layer_idx: int) -> int:
    """Layer `layer_idx`'s expert count: num_experts on the expert layers, else 1 (dense)."""
    period = int(cfg_get(config, "expert_layer_period", 2))
    offset = int(cfg_get(config, "expert_layer_offset", 1))
    return num_experts(config) if layer_idx % period == offset else 1


class JambaDecoderLayer(nn.Module):
    def __init__(self, config, layer_idx: int, flags: dict[str, bool]) -> None:
        super().__init__()
        self.is_mamba = layer_types(config)[layer_idx] in LINEAR_LAYER_TYPES
        if self.is_mamba:
            self.mamba = MambaMixer(jamba_mamba_spec(config))
        else:
            self.self_attn = LlamaAttention(config, layer_idx, flags, None)  # no rope
        experts = layer_num_experts(config, layer_idx)
        if experts > 1:
            self.feed_forward: nn.Module = SparseMoeBlock(
                experts,
                int(config.num_experts_per_tok),
                config.hidden_size,
                int(config.intermediate_size),
                renormalize=False,
            )
        else:
            self.feed_forward = LlamaMLP(config, bias=False)
        eps = cfg_get(config, "rms_norm_eps", 1e-6)
        self.input_layernorm = RMSNorm(config.hidden_size, eps)
        self.pre_ff_layernorm = RMSNorm(config.hidden_size, eps)

    def forward(self, positions, x, kv_cache, md) -> torch.Tensor:  # x: [T, D]
        h = self.input_layernorm(x)
        x = x + (self.mamba(h, md) if self.is_mamba else self.self_attn(positions, h, kv_cache, md))
        return x + self.feed_forward(self.pre_ff_layernorm(x))


class JambaForCausalLM(CausalLMBase):
    renames = _RENAMES
    # q/k/v into qkv_proj, the dense MLPs' gate/up into gate_up_proj
    stacked_params = LlamaForCausalLM.stacked_params

    def __init__(self, config) -> None:
        check_silu(config, type(self).__name__)
        flags = {"qkv_bias": False, "o_bias": False, "qk_norm": False, "mlp_bias": False}
        flags["sliding"] = False
        inner = HybridModel(
            config,
            lambda i: JambaDecoderLayer(config, i, flags),
            RMSNorm(config.hidden_size, cfg_get(config, "rms_norm_eps", 1e-6)),
            None,
        )
        super().__init__(config, inner)
        count = num_experts(config)
        if count > 1:  # expert rules first: the dense rules' ".gate_proj" is in experts' names
            rules = expert_rules(count, "gate_proj", "up_proj", "down_proj")
            self.stacked_params = (*rules, *type(self).stacked_params)
