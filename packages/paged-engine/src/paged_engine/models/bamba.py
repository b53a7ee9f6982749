"""IBM Bamba (`BambaForCausalLM`: Bamba-9B v1 / v2): Mamba2 layers (layers/mamba2.py) among
grouped-query attention layers, `attn_layer_indices` listing the attention ones (transformers'
BambaConfig turns it into `layers_block_type`, aliased as `layer_types`: "linear_attention" /
"full_attention", or "mamba" / "attention" in transformers 4). Granite 4.0-H's layout
(models/granitemoehybrid.py) without its multipliers and MoE:

    x += mixer(rmsnorm(x));  x += down(silu(gate(h)) * up(h)),  h = rmsnorm(x)

The attention is Llama's with partial rope (`partial_rotary_factor`, which BambaConfig fixes at
0.5), optional q/k/v/o biases (`attention_bias`); the MLP Llama's (`mlp_bias`). The mixer is
Granite 4.0-H's (width mamba_expand * hidden_size, `mamba_conv_bias`, `mamba_proj_bias` on
in_proj and out_proj, `time_step_limit` on prompt tokens, RMSNorm over groups of
y * silu(z)). Checkpoints name the MLP `feed_forward`, its norm `pre_ff_layernorm` and the final
norm `final_layernorm`, as Falcon-H1's do. Only the attention layers hold paged KV
(models/hybrid.py).
"""

from __future__ import annotations

import torch
from torch import nn

from paged_engine.layers.mamba2 import Mamba2Mixer
from paged_engine.layers.norm import RMSNorm
from paged_engine.layers.rotary import RotaryEmbedding, get_rope
from paged_engine.models.falcon_h1 import FalconH1ForCausalLM
from paged_engine.models.granitemoehybrid import mamba_spec
from paged_engine.models.hybrid import LINEAR_LAYER_TYPES, HybridModel, layer_types
from paged_engine.models.llama import LlamaAttention, LlamaForCausalLM, LlamaMLP, llama_head_dim
from paged_engine.models.utils import cfg_get


class BambaDecoderLayer(nn.Module):
    def __init__(
        self, config, layer_idx: int, flags: dict[str, bool], rope: RotaryEmbedding
    ) -> None:
        super().__init__()
        self.is_linear = layer_types(config)[layer_idx] in LINEAR_LAYER_TYPES
        if self.is_linear:
            inner = int(config.mamba_expand * config.hidden_size)
            self.mamba = Mamba2Mixer(mamba_spec(config, inner, "Bamba's Mamba2", 1e-5))
        else:
            self.self_attn = LlamaAttention(config, layer_idx, flags, rope)
        self.feed_forward = LlamaMLP(config, flags["mlp_bias"])
        eps = cfg_get(config, "rms_norm_eps", 1e-5)
        self.input_layernorm = RMSNorm(config.hidden_size, eps)
        self.pre_ff_layernorm = RMSNorm(config.hidden_size, eps)

    def forward(self, positions, x, kv_cache, md) -> torch.Tensor:  # x: [T, D]
        h = self.input_layernorm(x)
        x = x + (
            self.mamba(h, md) if self.is_linear else self.self_attn(positions, h, kv_cache, md)
        )
        return x + self.feed_forward(self.pre_ff_layernorm(x))


class BambaForCausalLM(LlamaForCausalLM):
    """Llama's checkpoint rules (q/k/v and gate/up stacking, biases from the config) over the
    hybrid stack."""

    def __init__(self, config) -> None:
        flags = self.layer_flags(config)
        rope = get_rope(config, llama_head_dim(config))
        inner = HybridModel(
            config,
            lambda i: BambaDecoderLayer(config, i, flags, rope),
            RMSNorm(config.hidden_size, cfg_get(config, "rms_norm_eps", 1e-5)),
            rope,
        )
        super(LlamaForCausalLM, self).__init__(config, inner)

    # model.final_layernorm -> model.norm, as Falcon-H1's checkpoints name it
    rename_weight = FalconH1ForCausalLM.rename_weight
