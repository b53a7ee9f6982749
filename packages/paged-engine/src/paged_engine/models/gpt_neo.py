"""GPT-Neo (`GPTNeoForCausalLM`: EleutherAI gpt-neo-125m / 1.3B / 2.7B and fine-tunes).

GPT-2's decoder (models/gpt2.py: learned absolute positions, pre-LayerNorms, a GELU (tanh)
`c_fc` / `c_proj` MLP with biases, tied head) with its own attention:

    projections  separate `q_proj` / `k_proj` / `v_proj` without biases, `out_proj` with one
    scores       not scaled by 1 / sqrt(head_dim) (transformers computes q.k in float32, scale 1)
    layers       `attention_types` alternates global layers and local ones, which attend to
                 the last `window_size` tokens (the query's own included): a sliding window
"""

from __future__ import annotations

import copy

import torch
from torch import nn

from paged_engine.layers.attention import Attention
from paged_engine.layers.linear import QKVParallelLinear, RowParallelLinear
from paged_engine.layers.norm import LayerNorm
from paged_engine.models.gpt2 import GPT2MLP, GPT2Model
from paged_engine.models.utils import QKV_PROJ_RULES, CausalLMBase, cfg_get


class GPTNeoSelfAttention(nn.Module):
    def __init__(self, config, window: int | None) -> None:
        super().__init__()
        d, heads = config.hidden_size, config.num_attention_heads
        head_dim = d // heads
        self.qkv_proj = QKVParallelLinear(d, head_dim, heads, heads, bias=False)
        self.out_proj = RowParallelLinear(d, d, bias=True)
        local = self.qkv_proj.num_heads
        self.attn = Attention(local, head_dim, local, 1.0, sliding_window=window)

    def forward(self, x, kv_cache, md) -> torch.Tensor:  # x: [T, D]
        q, k, v = self.qkv_proj(x).chunk(3, dim=-1)
        return self.out_proj(self.attn(q, k, v, kv_cache, md))


class GPTNeoAttention(nn.Module):
    """Only a name level: checkpoints hold the projections under `attn.attention.`."""

    def __init__(self, config, window: int | None) -> None:
        super().__init__()
        self.attention = GPTNeoSelfAttention(config, window)

    def forward(self, x, kv_cache, md) -> torch.Tensor:
        return self.attention(x, kv_cache, md)


class GPTNeoBlock(nn.Module):
    def __init__(self, config, window: int | None) -> None:
        super().__init__()
        eps = cfg_get(config, "layer_norm_epsilon", 1e-5)
        self.ln_1 = LayerNorm(config.hidden_size, eps=eps)
        self.attn = GPTNeoAttention(config, window)
        self.ln_2 = LayerNorm(config.hidden_size, eps=eps)
        view = copy.copy(config)  # GPT-2's MLP reads its width as n_inner
        view.n_inner = cfg_get(config, "intermediate_size", 4 * config.hidden_size)
        self.mlp = GPT2MLP(view)

    def forward(self, x, kv_cache, md) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x), kv_cache, md)
        return x + self.mlp(self.ln_2(x))


def gpt_neo_model(config) -> GPT2Model:
    """GPT-2's stack around GPT-Neo's blocks, each global or local by `attention_layers`."""
    kinds = list(config.attention_layers)
    bad = sorted(set(kinds) - {"global", "local"})
    if bad or len(kinds) != config.num_hidden_layers:
        raise ValueError(
            f"GPT-Neo attention_types must give 'global' / 'local' for each of the "
            f"{config.num_hidden_layers} layers, got {kinds}"
        )
    window = int(config.window_size)
    return GPT2Model(config, lambda i: GPTNeoBlock(config, window if kinds[i] == "local" else None))


class GPTNeoForCausalLM(CausalLMBase):
    inner_name = "transformer"
    embed_path = "transformer.wte"
    tie_default = True
    stacked_params = QKV_PROJ_RULES
    ignored_weights = (".attn.attention.bias", ".attn.attention.masked_bias")  # HF's masks

    def __init__(self, config) -> None:
        super().__init__(config, gpt_neo_model(config))
