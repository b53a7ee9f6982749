"""MiniMax-01 (`MiniMaxForCausalLM`, model_type "minimax": MiniMax-Text-01, MiniMax-M1; and the
releases' own `MiniMaxText01ForCausalLM` / `MiniMaxM1ForCausalLM` configs): a hybrid stack of
lightning attention layers (layers/lightning_attention.py) and Mixtral's attention layers
(`config.layer_types`: "linear_attention" / "full_attention"; 7 : 1 in the releases; every
attention layer slides when the config has a sliding_window), a Mixtral MoE in every layer,
each piece as transformers runs it.

The layer is post-norm on its residuals: each sublayer's residual is the *normalized* input,
and both terms are weighted,

    h = input_layernorm(x);           x = alpha_attn * h + beta_attn * attn(h)
    h = post_attention_layernorm(x);  x = alpha_mlp * h + beta_mlp * moe(h)

with (alpha, beta) = (linear_attn_*_factor) on lightning layers, (full_attn_*_factor) on
attention layers and (mlp_*_factor) around the MoE (softmax router, top-k renormalized). The
attention layers rotate with RoPE, over the first `rotary_dim` channels of each head where the
config names one (the releases' 64 of 128, as vLLM and MiniMax's code do; transformers' MiniMax
rotates the whole head and its configs name no rotary_dim). Only they hold a paged KV cache;
the lightning layers carry a [D, D] matrix per head and sequence (worker/recurrent_state.py).

The releases' configs (their own model code) say the same in other names: `attn_type_list`
(0 lightning, 1 attention), `layernorm_{linear_attention,full_attention,mlp}_{alpha,beta}`,
`postnorm` (True in the releases; False, the usual pre-norm residual, is refused by name, as
is `shared_intermediate_size` > 0 and a per-layer `num_local_experts` list); models/hybrid.py
reads `attn_type_list` as layer types, `minimax_config` the factors (on a copy). Checkpoint
names: Mixtral's (`block_sparse_moe.experts.M.w1/w3/w2`) or transformers 5's fused experts;
transformers' decay buffers are recomputed.
"""

from __future__ import annotations

import copy

import torch
from torch import nn

from paged_engine.layers.lightning_attention import DECAY_BUFFERS, LightningAttention
from paged_engine.layers.norm import RMSNorm
from paged_engine.layers.rotary import RotaryEmbedding, get_rope
from paged_engine.models.hybrid import LINEAR_LAYER_TYPES, HybridModel, layer_types
from paged_engine.models.llama import LlamaAttention, llama_head_dim
from paged_engine.models.mixtral import MixtralForCausalLM, check_silu, expert_rules, num_experts
from paged_engine.models.utils import CausalLMBase, cfg_get

# The releases' config names -> transformers' (each a weight of the layer's residual sums).
_FACTOR_NAMES = {
    "linear_attn_alpha_factor": "layernorm_linear_attention_alpha",
    "linear_attn_beta_factor": "layernorm_linear_attention_beta",
    "full_attn_alpha_factor": "layernorm_full_attention_alpha",
    "full_attn_beta_factor": "layernorm_full_attention_beta",
    "mlp_alpha_factor": "layernorm_mlp_alpha",
    "mlp_beta_factor": "layernorm_mlp_beta",
}


def minimax_config(config):
    """`config` in transformers' names (a copy when the releases' names had to be read);
    ValueError naming what this model does not run."""
    if getattr(config, "layer_types", None) or not getattr(config, "attn_type_list", None):
        return config  # transformers' names (models/hybrid.py reads attn_type_list itself)
    if not getattr(config, "postnorm", False):
        raise ValueError(
            "MiniMax with postnorm=False (pre-norm residuals) is not supported: the released "
            "models set postnorm=True"
        )
    shared = getattr(config, "shared_intermediate_size", 0) or 0
    if (max(shared) if isinstance(shared, list) else shared) > 0:
        raise ValueError("MiniMax's shared_intermediate_size > 0 (a shared MLP) is not supported")
    if isinstance(getattr(config, "num_local_experts", None), list):
        raise ValueError("MiniMax with a num_local_experts list (per layer) is not supported")
    config = copy.copy(config)
    for ours, theirs in _FACTOR_NAMES.items():
        setattr(config, ours, float(getattr(config, theirs, 1.0)))
    return config


class MiniMaxDecoderLayer(nn.Module):
    def __init__(
        self, config, layer_idx: int, flags: dict[str, bool], rope: RotaryEmbedding, mlp
    ) -> None:
        super().__init__()
        self.is_linear = layer_types(config)[layer_idx] in LINEAR_LAYER_TYPES
        kind = "linear_attn" if self.is_linear else "full_attn"
        if self.is_linear:
            self.self_attn = LightningAttention(config, layer_idx, llama_head_dim(config))
        else:
            self.self_attn = LlamaAttention(config, layer_idx, flags, rope)
            # every attention layer slides where the config has a window (its layer_types say
            # "full_attention", which layer_sliding_window reads as no window)
            window = getattr(config, "sliding_window", None)
            self.self_attn.attn.sliding_window = int(window) if window else None
        self.mlp = mlp
        eps = cfg_get(config, "rms_norm_eps", 1e-5)
        self.input_layernorm = RMSNorm(config.hidden_size, eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps)
        self.attn_alpha = float(cfg_get(config, f"{kind}_alpha_factor", 1.0))
        self.attn_beta = float(cfg_get(config, f"{kind}_beta_factor", 1.0))
        self.mlp_alpha = float(cfg_get(config, "mlp_alpha_factor", 1.0))
        self.mlp_beta = float(cfg_get(config, "mlp_beta_factor", 1.0))

    def forward(self, positions, x, kv_cache, md) -> torch.Tensor:  # x: [T, D]
        h = self.input_layernorm(x)
        a = self.self_attn(h, md) if self.is_linear else self.self_attn(positions, h, kv_cache, md)
        x = h * self.attn_alpha + a * self.attn_beta
        h = self.post_attention_layernorm(x)
        return h * self.mlp_alpha + self.mlp(h) * self.mlp_beta


class MiniMaxForCausalLM(MixtralForCausalLM):
    ignored_weights = (*MixtralForCausalLM.ignored_weights, *DECAY_BUFFERS)

    def __init__(self, config) -> None:
        config = minimax_config(config)
        check_silu(config, type(self).__name__)
        cls = type(self)
        # no attention biases: config_ignored.py sets attention_bias, which HF's never reads
        flags = cls.layer_flags(config)
        head_dim = llama_head_dim(config)
        rotary_dim = getattr(config, "rotary_dim", None)
        partial = getattr(config, "partial_rotary_factor", None)
        if rotary_dim is not None and int(rotary_dim) != head_dim and partial is None:
            config = copy.copy(config)
            config.partial_rotary_factor = int(rotary_dim) / head_dim
        rope = get_rope(config, head_dim)
        eps = cfg_get(config, "rms_norm_eps", 1e-5)
        inner = HybridModel(
            config,
            lambda i: MiniMaxDecoderLayer(config, i, flags, rope, cls.build_mlp(config, i)),
            RMSNorm(config.hidden_size, eps),
            rope,
        )
        CausalLMBase.__init__(self, config, inner)
        rules = expert_rules(num_experts(config), *self.expert_names)
        self.stacked_params = (*rules, *cls.stacked_params)
